"""The package's import graph: stages import downward only, and nothing imports in a circle.

Layers, bottom to top: ir, ops → runtime → capture → sim → pass_api → passes → the user-facing
modules (optimize, simulate, plan, ab, report, explain, whatif, models) → entry points (cli,
backend, pytest plugin, the package itself). A module may import its own layer or any lower one.
Imports of fxdream modules inside functions are not allowed: they are how a cycle hides."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import networkx as nx
import pytest

import fxdream
import fxdream.models
import fxdream.passes

LAYERS = (
    ("ir", ("fxdream.ir",)),
    ("ops", ("fxdream.ops",)),
    ("runtime", ("fxdream.runtime",)),
    ("capture", ("fxdream.capturing",)),
    ("sim", ("fxdream.sim",)),
    ("pass_api", ("fxdream.pass_api",)),
    ("passes", ("fxdream.passes",)),
    ("api", ("fxdream.report", "fxdream.numerics", "fxdream.measure", "fxdream.memory_check", "fxdream.pass_registry",
             "fxdream.pass_runner", "fxdream.pass_rows", "fxdream.eager_check", "fxdream.plan", "fxdream.simulation",
             "fxdream.optimized_module", "fxdream.build", "fxdream.explain",
             "fxdream.ab", "fxdream.whatif", "fxdream.models")),
    ("entry", ("fxdream.cli", "fxdream.cli_arguments", "fxdream.__main__", "fxdream.backend",
               "fxdream.pytest_plugin", "fxdream")),
)


def layer_of(module: str) -> int:
    """The rank of the longest layer prefix that names ``module`` (``fxdream`` itself is the top)."""
    best, rank = -1, None
    for i, (_name, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    if rank is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return rank


def package_modules() -> dict[str, pathlib.Path]:
    """Every module of the installed package (fxdream, with passes and models) → its file."""
    modules = {}
    for package, path in (("fxdream", fxdream.__path__[0]), ("fxdream.passes", fxdream.passes.__path__[0]),
                          ("fxdream.models", fxdream.models.__path__[0])):
        root = pathlib.Path(path)
        for file in root.rglob("*.py"):
            parts = [package, *file.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            if name.startswith(("fxdream.passes", "fxdream.models")) and package == "fxdream":
                continue  # the source tree keeps them beside fxdream/, not inside it
            modules[name] = file
    return modules


def imported_modules(name: str, file: pathlib.Path, modules: dict) -> tuple[set[str], list[str]]:
    """(fxdream modules ``name`` imports, imports of fxdream modules made inside a function)."""
    tree = ast.parse(file.read_text())
    package = name if file.name == "__init__.py" else name.rsplit(".", 1)[0]
    in_functions = {id(node) for function in ast.walk(tree)
                    if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for node in ast.walk(function)}
    found, inside = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                found.add(target)
                if id(node) in in_functions:
                    inside.append(f"{name} imports {target} inside a function (line {node.lineno})")
    return found, inside


@pytest.fixture(scope="module")
def import_graph():
    modules = package_modules()
    graph, inside = nx.DiGraph(), []
    for name, file in modules.items():
        graph.add_node(name)
        targets, hidden = imported_modules(name, file, modules)
        inside += hidden
        graph.add_edges_from((name, target) for target in targets)
    return graph, inside


def test_the_graph_covers_every_stage(import_graph):
    graph, _ = import_graph
    for stage in ("fxdream.ir.nodes", "fxdream.ops.fused_conv", "fxdream.runtime.cuda_graph_runner",
                  "fxdream.capturing.session", "fxdream.sim.lower", "fxdream.passes.reinplace", "fxdream.build",
                  "fxdream.whatif.core", "fxdream.models.resnet", "fxdream.cli"):
        assert stage in graph, stage
    assert graph.has_edge("fxdream.capturing.session", "fxdream.ir.nodes")


def test_no_import_cycles(import_graph):
    graph, _ = import_graph
    cycles = [sorted(component) for component in nx.strongly_connected_components(graph) if len(component) > 1]
    assert cycles == []


def test_no_upward_imports(import_graph):
    graph, _ = import_graph
    upward = [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
              for a, b in graph.edges if layer_of(b) > layer_of(a)]
    assert upward == []


def test_no_fxdream_imports_inside_functions(import_graph):
    _, inside = import_graph
    assert inside == []


def test_the_layer_rule_catches_an_upward_import():
    assert layer_of("fxdream.sim.lower") < layer_of("fxdream.build")
    assert layer_of("fxdream.ir.nodes") < layer_of("fxdream.ops.rnn") < layer_of("fxdream.runtime.streams")
    assert layer_of("fxdream") == len(LAYERS) - 1
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("fxdream_other.module")


def test_the_documented_dotted_names_work_after_import_fxdream_alone():
    """README names ``fxdream.explain.crossover`` and ``fxdream.whatif.*``: a fresh interpreter
    (this process imported the submodules already) reaches them after ``import fxdream``."""
    code = "import fxdream; fxdream.explain.crossover; fxdream.whatif.amp; fxdream.models.build"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
