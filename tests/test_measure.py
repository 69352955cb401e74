"""The timing schedule: what runs when decides what a measurement is biased by."""
import pytest

from fxdream.measure import time_interleaved


def _logging_runners(names, log):
    return {name: (lambda name=name: log.append(name)) for name in names}


def test_every_runner_takes_every_position_and_each_block_starts_with_an_untimed_call():
    # in A/A runs the block right after eager's measured 2-7 % slower than the same module elsewhere
    log = []
    result = time_interleaved(_logging_runners("abc", log), rounds=2, block=2, warmup=1, progress=False)
    warmup, rounds = log[:3], log[3:]
    assert warmup == ["a", "b", "c"]
    blocks = ["".join(rounds[i:i + 3]) for i in range(0, len(rounds), 3)]  # untimed call + block of 2
    assert blocks == ["aaa", "bbb", "ccc", "bbb", "ccc", "aaa", "ccc", "aaa", "bbb"]
    assert {m.rounds for m in result.values()} == {3}  # 2 rounded up to a multiple of the 3 runners


def test_two_runners_alternate_which_goes_first():
    log = []
    time_interleaved(_logging_runners("ab", log), rounds=2, block=1, warmup=0, progress=False)
    assert log == ["a", "a", "b", "b", "b", "b", "a", "a"]


@pytest.mark.parametrize("kwargs", [dict(rounds=0), dict(block=0)])
def test_bad_rounds_or_block_are_named(kwargs):
    with pytest.raises(ValueError, match="rounds and block must be >= 1"):
        time_interleaved({"a": lambda: None}, progress=False, **kwargs)
