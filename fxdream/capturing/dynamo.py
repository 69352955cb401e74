"""fxdream's dealings with dynamo: compiling a model with a capture backend, reading the
graph breaks it saw, and the headline of its errors. Private dynamo APIs used here are each
isolated in a try or a small function."""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import traceback
from typing import Callable

import torch


class _CaptureFallbackWarnings(logging.Filter):
    """Drops dynamo's warning that a capture backend of fxdream's failed on a graph, to which
    dynamo answers with a graph break ("Backend compiler exception"): an op whose output size
    follows values (``nonzero`` under a boolean-mask assignment) fails every capture so, the
    break is in the build's report with its reason, and the warning's advice (report an issue
    to the backend's authors) is not for the user."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("Backend compiler exception" in message and "fxdream.capturing" in message)


logging.getLogger("torch._dynamo.exc").addFilter(_CaptureFallbackWarnings())


class _MetaKernelErrors(logging.Filter):
    """Drops fake tensors' log of an op whose meta kernel raised (a wrong input shape: ~300 lines
    of traceback at ERROR): the same error is raised, and the capture's error names it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta for")


@contextlib.contextmanager
def meta_kernel_errors_unlogged():
    """While a capture of fxdream's runs: ``_MetaKernelErrors`` on torch's fake-tensor logger."""
    logger, quiet = logging.getLogger("torch._subclasses.fake_tensor"), _MetaKernelErrors()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


RAISED_RECOMPILE_LIMIT = 64
_LIMIT_NAME = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


def recompile_limit_notes(session) -> list[str]:
    """A note for each function ``session``'s graphs were compiled from whose dynamo cache is at
    the limit fxdream's calls run with: dynamo runs the calls no compiled graph matches eagerly
    from then on, silently. Read from the cache itself (whatever dynamo's logging shows)."""
    limit, notes = _calls_recompile_limit(), []
    for code in dict.fromkeys(r.code for r in session.records if r.code is not None):
        if len(_cache_entries(code)) >= limit:
            notes.append(f"dynamo's cache for '{code.co_name}' ({code.co_filename}:{code.co_firstlineno}) holds "
                         f"{limit} compilations, its limit: calls whose input shapes (or the values its guards "
                         f"check) match none of them run eagerly from now on (each new shape compiles a graph of "
                         f"its own: pad inputs to a few sizes, or raise torch._dynamo.config.{_LIMIT_NAME})")
    return notes


def compile_with(model: torch.nn.Module, session: Callable) -> Callable:
    """torch.compile with static shapes (one capture per input shape, as CUDA graphs need);
    ``session`` is the backend (a ``CaptureSession``: it takes the notes said here). Its calls
    run with dynamo's recompile limit at least ``RAISED_RECOMPILE_LIMIT``: one graph per input
    shape reaches dynamo's default (8) soon (the last batch of an epoch, sequence lengths), and
    past it dynamo runs new shapes eagerly; the process's own limit is left as it is."""
    limit = _recompile_limit()
    code = _compiled_code(model)
    if code is not None and len(_cache_entries(code)) >= limit:
        # each optimize() is a new backend: with the cache full, dynamo would run this one eagerly, silently
        torch._dynamo.eval_frame.remove_from_cache(code)  # private, isolated
        own = _forward_code(model)
        shared = "" if code is own else " (a frame every torch.nn module shares)"
        session.notes.append(f"dynamo's cache for {type(model).__name__}.forward{shared} was full ({limit} "
                             f"compilations earlier in this process); cleared it to capture this one")
    full = [resume for resume in _resume_functions(model) if len(_cache_entries(resume)) >= limit]
    for resume in full:  # the code after a graph break, compiled once per build too
        torch._dynamo.eval_frame.remove_from_cache(resume)  # private, isolated
    if full:
        session.notes.append(f"dynamo's cache for {len(full)} function(s) resuming {type(model).__name__}.forward "
                             f"after a graph break was full ({limit} compilations earlier in this process); "
                             f"cleared to capture this one")
    _clear_skip_marks(model, code)
    return compiled_through(model, session)


def _resume_functions(model: torch.nn.Module) -> list:
    """The code objects dynamo made to resume the model's own functions after a graph break."""
    try:  # private, isolated
        from torch._dynamo.convert_frame import input_codes
        files = _model_files(model)
        return [code for ref in list(input_codes.seen) if (code := ref()) is not None
                and code.co_name.startswith("torch_dynamo_resume_in_") and code.co_filename in files]
    except Exception:
        return []


def _model_files(model: torch.nn.Module) -> set[str]:
    """The source files of the model's own modules' forwards (not torch's)."""
    torch_dir = os.path.dirname(torch.__file__)
    return {code.co_filename for m in model.modules()
            if (code := getattr(type(m).forward, "__code__", None)) is not None
            and not code.co_filename.startswith(torch_dir)}


def compiled_through(function: Callable, session: Callable) -> Callable:
    """``torch.compile(function)`` with ``session`` as its backend and static shapes, each call
    with dynamo's recompile limit raised to ``RAISED_RECOMPILE_LIMIT`` where it is lower, and
    put back after (~2 µs a call); a full cache is said by ``recompile_limit_notes``."""
    compiled = torch.compile(function, backend=session, dynamic=False)
    config = torch._dynamo.config

    def call(*args, **kwargs):
        limit = getattr(config, _LIMIT_NAME)
        if limit >= RAISED_RECOMPILE_LIMIT:
            return compiled(*args, **kwargs)
        setattr(config, _LIMIT_NAME, RAISED_RECOMPILE_LIMIT)
        try:
            return compiled(*args, **kwargs)
        finally:
            setattr(config, _LIMIT_NAME, limit)
    return call


@contextlib.contextmanager
def dynamo_state_kept():
    """What dynamo learns about the user's code while fxdream captures it stays with the build:
    the sizes it saw per code object (its automatic-dynamic profile, which would make the user's
    own later ``torch.compile`` of the same class compile for dynamic shapes, and run slower) and
    the recompile limit raised for the build's own compilations. Private state, isolated here."""
    try:
        from torch._dynamo import pgo
        saved = copy.deepcopy(pgo._CODE_STATE)
    except Exception:  # another torch: nothing to keep
        pgo = saved = None
    config = torch._dynamo.config
    limit = getattr(config, _LIMIT_NAME)
    try:
        yield
    finally:
        setattr(config, _LIMIT_NAME, limit)
        if pgo is not None:
            pgo._CODE_STATE = saved


def _clear_skip_marks(model: torch.nn.Module, compiled_code=None) -> None:
    """Dynamo marks a function it gave up on (an RNN in training, a break in a loop), and the
    resume functions after a break, to be skipped for the rest of the process: a later capture
    of the same class (inference, where it would trace) would get less or nothing, silently. Every
    such function from the files of the model's own (not torch's) modules goes back to the
    default, so dynamo tries again; so does ``compiled_code``, the frame this compilation enters
    (``_compiled_code``: for torch.nn's own modules one wrapper they all share, which a build of
    an ``nn.LSTM`` in training would leave skipped for every torch.nn module built after it)."""
    try:  # private, isolated
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.convert_frame import input_codes
        from torch._dynamo.types import FrameAction, FrameExecStrategy
        files = _model_files(model)
        for ref in list(input_codes.seen):
            code = ref()
            if code is not None and (code.co_filename in files or code is compiled_code):
                set_code_exec_strategy(code, FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT))
    except Exception:
        pass


def compiling_code():
    """The code object whose frame dynamo is compiling (inside a backend call), else None."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator  # private, isolated
        return InstructionTranslator.current_tx().f_code
    except Exception:
        return None


def _compiled_code(model: torch.nn.Module):
    """The code object whose cache holds ``torch.compile(model)``'s compilations: its forward's,
    or, for torch's own modules (``nn.Linear``: dynamo wraps them in a frame it can capture),
    that wrapper's, which every such module in the process shares."""
    forward = _forward_code(model)
    try:  # private, isolated
        from torch._dynamo import external_utils, trace_rules
        if torch._dynamo.config.wrap_top_frame or trace_rules.check(model.forward):
            return external_utils.wrap_inline(model).__code__
    except Exception:
        pass
    return forward


def _forward_code(model: torch.nn.Module):
    """The code object of ``model``'s class's forward; None where it has none (a TorchScript
    module's forward is a descriptor that raises when read from the class)."""
    try:
        return getattr(type(model).forward, "__code__", None)
    except AttributeError:
        return None


def _cache_entries(code) -> list:
    try:
        return torch._dynamo.eval_frame._debug_get_cache_entry_list(code)  # private, isolated
    except Exception:
        return []


def _calls_recompile_limit() -> int:
    """The recompile limit fxdream's calls run with (``compiled_through``): the process's, raised
    to ``RAISED_RECOMPILE_LIMIT``."""
    return max(getattr(torch._dynamo.config, _LIMIT_NAME), RAISED_RECOMPILE_LIMIT)


def _recompile_limit() -> int:
    """The cache entries at which a build clears a function's cache (``compile_with``): the
    calls' limit. Every optimize() call is a distinct backend, and dynamo counts one cache entry
    per backend against a per-function limit after which it silently runs eager."""
    return _calls_recompile_limit()


_SKIPPED = "\0skipped\0"  # marks a reason dynamo gave for running a whole function eagerly
WHOLE_FUNCTION = " (dynamo ran the function it was tracing there eagerly)"


def graph_break_counts() -> dict[str, int]:
    """Dynamo's graph-break reasons seen so far in this process (private counters, isolated
    here): breaks it resumed after, and ("unimplemented") breaks where it gave up on the whole
    function (in a loop, at an RNN module), which it does not count as graph breaks."""
    from torch._dynamo.utils import counters
    return {**counters["graph_break"], **{_SKIPPED + r: n for r, n in counters["unimplemented"].items()}}


def new_graph_breaks(before: dict[str, int]) -> tuple[str, ...]:
    """The breaks seen since ``before``, each once, in order: a reason dynamo counted both as a
    break and as giving up on the whole function is listed as the latter."""
    after = graph_break_counts()
    new = [reason for reason, n in after.items() if n > before.get(reason, 0)]
    whole = {_first_line(r[len(_SKIPPED):]) for r in new if r.startswith(_SKIPPED)}
    return tuple(dict.fromkeys(  # distinct, in order
        _first_line(reason[len(_SKIPPED):]) + WHOLE_FUNCTION if reason.startswith(_SKIPPED) else _first_line(reason)
        for reason in new if reason.startswith(_SKIPPED) or _first_line(reason) not in whole))


def _first_line(reason: str) -> str:
    """Dynamo's headline, its one-line explanation, and where in the user's code it happened."""
    lines = [ln.strip() for ln in reason.strip().splitlines() if ln.strip()]
    if not lines:
        return reason
    text = lines[0]
    detail = next((ln for ln in lines[1:] if ln.startswith("Explanation:")), "")
    if detail:
        text += " — " + detail[len("Explanation:"):].strip()
    if "from user code:" in lines:
        where = lines[lines.index("from user code:") + 1:][:1]
        text += "" if not where else f" (at {where[0]})"
    return _ADDRESS.sub("", text)  # the same break reads the same in every build


_ADDRESS = re.compile(r" object at 0x[0-9a-fA-F]+")  # an object's repr names its memory address


def raised_compiling(error: BaseException) -> bool:
    """Whether ``error`` came from dynamo compiling a frame (its own exceptions, and any other
    raised inside its frame conversion, such as an assertion while it builds guards), not from
    running what it compiled."""
    if isinstance(error, torch._dynamo.exc.TorchDynamoException):
        return True
    frames = traceback.extract_tb(error.__traceback__)
    return any(f.filename.endswith(os.path.join("_dynamo", "convert_frame.py")) for f in frames)


def describe_error(error: BaseException) -> str:
    inner = getattr(error, "inner_exception", None)  # BackendCompilerFailed: the backend's own error
    if inner is not None:
        return f"{type(error).__name__} in fxdream's backend: {type(inner).__name__}: {_first_line(str(inner))}"
    return f"{type(error).__name__}: {_first_line(str(error))}"
