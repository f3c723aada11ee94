"""Replay's formatting of calls with no callee: numpy's byte gathers give the lines a format per
line would (uftrace's duration column), for any durations, names and depths."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from dynprobe.output.callgraph import _NamePool, _OpenCalls, duration

NAMES = ["main()", "f()", "a_longer_name()", "x" * 40 + "()"]


def one_by_one(spent: list[int], called: list[int], prefix: str) -> str:
    return "\n".join(f"{duration(ns)}{prefix}{NAMES[f]};" for ns, f in zip(spent, called, strict=True))


@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3_000_000_000)), min_size=1, max_size=200),
    st.integers(0, 5),
    st.booleans(),
)
def test_calls_format_like_a_line_at_a_time(calls: list[tuple[int, int]], depth: int, short: bool) -> None:
    called = [f if not short else 1 for f, _ in calls]  # one name length: the matrix path
    spent = [ns % 1_000_000 if short else ns for _, ns in calls]
    prefix = " [  1234] | " + "  " * depth
    pool = _NamePool(lambda f: NAMES[f])
    got = pool.calls(np.array(spent, dtype=np.int64), np.array(called, dtype=np.uint32), prefix)
    assert got == one_by_one(spent, called, prefix)


def test_many_calls_of_mixed_names_below_a_millisecond() -> None:
    rng = np.random.default_rng(7)
    spent = rng.integers(0, 1_000_000, 5000)
    called = rng.integers(0, 4, 5000).astype(np.uint32)
    got = _NamePool(lambda f: NAMES[f]).calls(spent, called, " [     7] |   ")
    assert got == one_by_one(spent.tolist(), called.tolist(), " [     7] |   ")


def test_open_calls_drop_what_a_reused_frame_left() -> None:
    stack = _OpenCalls()
    stack.push(0, 10, 1)  # main
    stack.push(1, 20, 2)  # dive, then longjmp back to main: dive's frame is free again
    stack.push(1, 30, 3)
    stack.push(2, 40, 2)  # another call in frame 2: the two dives are over
    assert [c[0] for c in stack.calls] == [0, 2] and stack.at == {1: 0, 2: 1}
    assert stack.close(1, 3) is None  # not open: nothing changes
    assert len(stack) == 2
    assert stack.close(0, 1) == [0, 10, 1, 0]  # main's exit closes what is above it too
    assert len(stack) == 0 and stack.at == {}


def test_open_calls_without_frames_match_by_function() -> None:
    """Format 1 traces: an exit closes the innermost open call of its function."""
    stack = _OpenCalls()
    for func, t in ((0, 1), (1, 2), (2, 3)):
        stack.push(func, t, 0)
    assert stack.close(1, 0) == [1, 2, 0, 0] and [c[0] for c in stack.calls] == [0]
    assert stack.close(5, 0) is None and len(stack) == 0  # entered before the trace: all dropped
