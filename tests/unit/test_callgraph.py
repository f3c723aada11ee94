"""Replay's formatting of calls with no callee: numpy's byte gathers give the lines a format per
line would (uftrace's duration column), for any durations, names and depths."""

from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynprobe.output import callgraph
from dynprobe.output.callgraph import _NamePool, _OpenCalls, duration, profile
from dynprobe.tracefile import Trace, record_dtype, write_info

NAMES = ["main()", "f()", "a_longer_name()", "x" * 40 + "()"]


def one_by_one(spent: list[int], called: list[int], prefix: str) -> str:
    return "\n".join(f"{duration(ns)}{prefix}{NAMES[f]};" for ns, f in zip(spent, called, strict=True))


@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(-5_000, 3_000_000_000)), min_size=1, max_size=200),
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


def _random_trace(directory: Path, seed: int) -> None:
    """One thread's calls: nested calls, long runs of calls with no callee, frames reused."""
    rng = random.Random(seed)
    records: list[tuple[int, int, int]] = []  # (kind | frame << 1, function, time)
    t = 0

    def call(depth: int, frame: int) -> None:
        nonlocal t
        func = rng.randrange(4)
        records.append(((frame + 1) << 1, func, t))
        t += rng.randrange(1, 50)
        if depth < 4:
            for _ in range(rng.randrange(3)):
                if rng.random() < 0.5:
                    for _ in range(rng.randrange(30)):  # a run of calls with no callee
                        f = rng.randrange(4)
                        records.append(((frame + 2) << 1, f, t))
                        t += rng.randrange(1, 20)
                        records.append((((frame + 2) << 1) | 1, f, t))
                else:
                    call(depth + 1, frame + 1)
        t += rng.randrange(1, 50)
        if rng.random() < 0.95:  # else left (longjmp): its frame is reused by the next call there
            records.append((((frame + 1) << 1) | 1, func, t))

    for _ in range(20):
        call(0, 0)
    data = np.zeros(len(records), dtype=record_dtype(16))
    data["kind"] = [r[0] for r in records]
    data["func"] = [r[1] for r in records]
    data["tsc"] = [r[2] for r in records]
    with open(directory / "events.raw", "wb") as f:
        for chunk in np.array_split(data, 7):  # chunks cut anywhere, runs across them
            f.write(np.array([(1 | 7 << 32, len(chunk))], dtype="<u8,<u8").tobytes())
            f.write(chunk.tobytes())
    write_info(str(directory), {"functions": [[n, "x", 0, 1] for n in "abcd"], "record_size": 16,
                                "clock": {"tsc0": 0, "ns0": 0, "scale": 1.0}})  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("threshold", [0, 30])
def test_summed_runs_give_the_profile_of_one_event_at_a_time(
    tmp_path: Path, seed: int, threshold: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _random_trace(tmp_path, seed)
    summed = profile(Trace(str(tmp_path)), folded=True, threshold_ns=threshold)
    monkeypatch.setattr(callgraph, "_SUMMED_RUN", 1 << 40)
    one_by_one = profile(Trace(str(tmp_path)), folded=True, threshold_ns=threshold)
    assert summed.functions == one_by_one.functions and summed.folded == one_by_one.folded
    assert sum(ft.calls for ft in summed.functions.values()) > (10 if threshold else 100)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("threshold", [0, 30])
def test_replay_of_runs_in_one_go_is_replay_one_event_at_a_time(
    tmp_path: Path, seed: int, threshold: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _random_trace(tmp_path, seed)
    fast = io.StringIO()
    callgraph.replay(Trace(str(tmp_path)), fast, threshold)
    monkeypatch.setattr(callgraph, "_leaf_runs", lambda kinds, funcs: np.zeros(len(kinds), dtype=np.int64))
    slow = io.StringIO()
    callgraph.replay(Trace(str(tmp_path)), slow, threshold)
    assert fast.getvalue() == slow.getvalue() and fast.getvalue().count("\n") > 20
