"""Replay's formatting of calls with no callee: numpy's byte gathers give the lines a format per
line would (uftrace's duration column), for any durations, names and depths; replay by numpy and
event by event alike; report's and flame's compiled walk against an event-at-a-time model."""

from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dynprobe.output import callgraph
from dynprobe.output.callgraph import (
    _ENTRY,
    _EXIT,
    _LEAF,
    EXIT,
    FunctionTime,
    Profile,
    _OpenCalls,
    _Texts,
    duration,
    profile,
)  # fmt: skip
from dynprobe.output.callwalk import NO_CALL
from dynprobe.ringbuf.layout import DATA_END, TRACE_DATA
from dynprobe.tracefile import record_dtype, write_info
from dynprobe.traces import Trace

NAMES = ["main", "f", "a_longer_name", "x" * 40]
HEAD = " [  1234] | "


def one_by_one(kinds: list[int], funcs: list[int], levels: list[int], spent: list[int]) -> str:
    texts = {_ENTRY: "{}() {{", _EXIT: "}} /* {} */", _LEAF: "{}();"}
    return "\n".join(
        (" " * 11 if k == _ENTRY else duration(ns)) + HEAD + "  " * level + texts[k].format(NAMES[f])
        for k, f, level, ns in zip(kinds, funcs, levels, spent, strict=True)
    )


LINE = st.tuples(
    st.sampled_from([_ENTRY, _EXIT, _LEAF]), st.integers(0, 3), st.integers(0, 6), st.integers(-5_000, 3_000_000_000)
)


@given(st.lists(LINE, min_size=1, max_size=200), st.booleans())
def test_lines_laid_out_by_numpy_are_the_formatted_lines(lines: list[tuple[int, int, int, int]], short: bool) -> None:
    kinds, funcs, levels, spent = (list(c) for c in zip(*lines, strict=True))
    if short:
        spent = [ns % 1_000_000 for ns in spent]  # the numpy digits only
    texts = _Texts(lambda f: NAMES[f] + "()", lambda f: NAMES[f])
    got = texts.lines(np.array(kinds), np.array(funcs, dtype=np.uint32), np.array(levels), np.array(spent), HEAD)
    assert got == one_by_one(kinds, funcs, levels, spent)


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


def _random_trace(directory: Path, seed: int, left: float = 0.05, *, frames: bool = True, odd: bool = False) -> None:
    """One thread's calls: nested calls, long runs of calls with no callee; a share `left` of
    the calls left without an exit (longjmp), their frames reused (`frames` False: a format 1
    trace, no frames). `odd`: also exits of calls never entered, and exits that name another
    function than their entry."""
    rng = random.Random(seed)
    records: list[tuple[int, int, int]] = []  # (kind | frame << 1, function, time)
    t = 0

    def call(depth: int, frame: int) -> None:
        nonlocal t
        func = rng.randrange(4)
        records.append(((frame + 1) << 1, func, t))
        t += rng.randrange(1, 50)
        if odd and rng.random() < 0.05:
            records.append(((60 << 1) | 1, rng.randrange(4), t))  # (no call uses frame 60)
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
        if rng.random() >= left:  # else left (longjmp): its frame is reused by the next call there
            records.append((((frame + 1) << 1) | 1, rng.randrange(4) if odd and rng.random() < 0.05 else func, t))

    for _ in range(60):
        call(0, 0)
    if not frames:
        records = [(kind & 1, func, t) for kind, func, t in records]
    _write_trace(directory, records)


def _write_trace(
    directory: Path, records: list[tuple[int, int, int]], names: list[str] | str = "abcd", tsc0: int = 0
) -> None:
    """A trace of one thread's records (kind | frame << 1, function of `names`, time stamp: in
    ns from `tsc0`)."""
    data = np.zeros(len(records), dtype=record_dtype(16))
    data["kind"] = [r[0] for r in records]
    data["func"] = [r[1] for r in records]
    data["tsc"] = [r[2] for r in records]
    with open(directory / "events.raw", "wb") as f:
        for chunk in np.array_split(data, 7):  # chunks cut anywhere, runs across them
            f.write(np.array([(1 | 7 << 32, len(chunk))], dtype="<u8,<u8").tobytes())
            f.write(chunk.tobytes())
    write_info(str(directory), {"functions": [[n, "x", 0, 1] for n in names], "record_size": 16,
                                "clock": {"tsc0": tsc0, "ns0": 0, "scale": 1.0}, "threads": {"7": "app"},
                                "pid": 1, "command": ["/bin/app"]})  # fmt: skip


@pytest.mark.parametrize("leaves", [2, 20])
def test_recursion_counts_in_the_total_of_its_outermost_call_only(tmp_path: Path, leaves: int) -> None:
    """a(0..100) { a(10..90) { a(20..80) { `leaves` calls of a and of b, 1 ns each } } }: a's
    total is its outermost call's 100 ns, as uftrace reports it, not 100 + 80 + 60 + leaves / 2;
    its average is over every call. (20 leaves: numpy sums the run.)"""
    records = [(1 << 1, 0, 0), (2 << 1, 0, 10), (3 << 1, 0, 20)]
    for i in range(leaves):
        func = i % 2
        records += [(4 << 1, func, 30 + 2 * i), (4 << 1 | 1, func, 31 + 2 * i)]
    records += [(3 << 1 | 1, 0, 80), (2 << 1 | 1, 0, 90), (1 << 1 | 1, 0, 100)]
    _write_trace(tmp_path, records)
    got = profile(Trace(str(tmp_path)))
    a, b = got.functions[0], got.functions[1]
    calls = 3 + leaves // 2
    assert (a.calls, a.total, a.spent, a.average) == (calls, 100, 240 + leaves // 2, (240 + leaves // 2) // calls)
    assert a.self_time == 20 + 20 + (60 - leaves) + leaves // 2
    assert (b.calls, b.total, b.self_time) == (leaves // 2, leaves // 2, leaves // 2)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("threshold", [0, 30])
@pytest.mark.parametrize("left", [0.0, 0.05], ids=["nested", "longjmp"])
@pytest.mark.parametrize("span", [1 << 15, 37], ids=["whole", "spans"])
def test_replay_in_one_go_is_replay_one_event_at_a_time(
    tmp_path: Path, seed: int, threshold: int, left: float, span: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plainly nested events, laid out by numpy (in spans cut anywhere): the same lines as
    event by event (where longjmp leaves calls, numpy gives way)."""
    _random_trace(tmp_path, seed, left)
    monkeypatch.setattr(callgraph, "_PLAIN_SPAN", span)
    plain = callgraph._plain_segment
    laid_out = []
    monkeypatch.setattr(callgraph, "_plain_segment", lambda *a: laid_out.append(plain(*a)) or laid_out[-1])
    fast = io.StringIO()
    callgraph.replay(Trace(str(tmp_path)), fast, threshold)
    assert left or (laid_out and all(segment is not None for segment in laid_out))  # numpy did it all
    monkeypatch.setattr(callgraph, "_PLAIN_FROM", 1 << 40)
    slow = io.StringIO()
    callgraph.replay(Trace(str(tmp_path)), slow, threshold)
    assert fast.getvalue() == slow.getvalue() and fast.getvalue().count("\n") > 20


def event_by_event(trace: Trace, folded: bool, threshold: int) -> Profile:
    """What the compiled walk must give, in Python: replay's stack of open calls (the same rules
    of frames and longjmp), one event at a time."""
    times: dict[int, list[int]] = {}  # function -> FunctionTime's fields, in order
    result = Profile()
    stacks: dict[int, _OpenCalls] = {}
    for chunk in trace.chunks():
        stack = stacks.setdefault(chunk.tid, _OpenCalls())
        columns = (chunk.kind.tolist(), chunk.func.tolist(), chunk.time_ns.tolist(), chunk.frame.tolist())
        for kind, func, t, frame in zip(*columns, strict=True):
            if kind != EXIT:
                stack.push(func, t, frame)
                continue
            call = stack.close(func, frame)
            if call is None or func >= len(trace.functions):
                continue
            spent, own = t - call[1], t - call[1] - call[3]
            if stack.calls:
                stack.calls[-1][3] += spent
            if spent < threshold:
                continue
            calls, total, self_time, all_spent, shortest, longest, least_self, most_self = times.setdefault(
                func, [0, 0, 0, 0, NO_CALL, 0, NO_CALL, 0]
            )
            total += spent if not stack.opened.get(func) else 0
            times[func] = [calls + 1, total, self_time + own, all_spent + spent, min(shortest, spent),
                           max(longest, spent), min(least_self, own), max(most_self, own)]  # fmt: skip
            if folded:
                path = (*(c[0] for c in stack.calls), func)
                result.folded[path] = result.folded.get(path, 0) + own
    result.functions = {func: FunctionTime(*fields) for func, fields in times.items()}
    result.folded = {path: ns for path, ns in result.folded.items() if ns}
    return result


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("threshold", [0, 30])
@pytest.mark.parametrize("left", [0.0, 0.05], ids=["nested", "longjmp"])
@pytest.mark.parametrize("frames", [True, False], ids=["frames", "format-1"])
@pytest.mark.parametrize("odd", [False, True], ids=["paired", "odd-exits"])
@pytest.mark.parametrize("folded", [False, True], ids=["report", "flame"])
def test_the_compiled_walk_gives_the_profile_of_one_event_at_a_time(
    tmp_path: Path, seed: int, threshold: int, left: float, frames: bool, odd: bool, folded: bool
) -> None:
    """Calls, totals with recursion counted once, self and extreme times, callees' time carried
    to calls still open, calls left by longjmp, exits matched by frame or (format 1, no frames)
    by function, exits of calls not open, self time per call path: output/callwalk.c's profile
    is the Python one's."""
    _random_trace(tmp_path, seed, left, frames=frames, odd=odd)
    trace = Trace(str(tmp_path))
    walked = profile(trace, folded, threshold)
    expected = event_by_event(trace, folded, threshold)
    assert walked.functions == expected.functions and sum(ft.calls for ft in walked.functions.values()) > 10
    assert walked.folded == expected.folded and (len(walked.folded) > 10) == folded


@pytest.mark.parametrize("seed", range(3))
def test_chunks_are_read_in_bounded_pieces_with_the_same_result(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk holds up to a ring's worth of records (1 GiB): read in pieces of READ_RECORDS,
    replay and report are what a whole chunk at a time gives, and memory stays flat."""
    from dynprobe import tracefile

    _random_trace(tmp_path, seed)
    whole_text, whole = io.StringIO(), profile(Trace(str(tmp_path)))
    callgraph.replay(Trace(str(tmp_path)), whole_text, 0)
    monkeypatch.setattr(tracefile, "READ_RECORDS", 10)
    trace = Trace(str(tmp_path))
    assert max(len(chunk.kind) for chunk in trace.chunks()) == 10
    pieces_text = io.StringIO()
    callgraph.replay(Trace(str(tmp_path)), pieces_text, 0)
    assert profile(Trace(str(tmp_path))).functions == whole.functions
    assert pieces_text.getvalue() == whole_text.getvalue() and whole_text.getvalue().count("\n") > 100
    # a chunk cut short: every record it holds, then where it stopped
    written = sum(len(chunk.kind) for chunk in trace.chunks())
    data = (tmp_path / "events.raw").read_bytes()
    (tmp_path / "events.raw").write_bytes(data[: len(data) - 16 * 3])
    cut = Trace(str(tmp_path))
    assert sum(len(chunk.kind) for chunk in cut.chunks()) == written - 3
    assert cut.truncated_at is not None and cut.truncated_at > 0


def test_a_thread_s_time_never_goes_back(tmp_path: Path) -> None:
    """Time stamps are not ordered (no fence), and a thread may move to a CPU whose counter is a
    little behind: read back, a thread's events never go back in time (across chunks too), so
    no call lasts less than 0."""
    records = [(1 << 1, 0, 100), (2 << 1, 1, 150), (2 << 1 | 1, 1, 140), (1 << 1 | 1, 0, 300)]
    records += [(1 << 1, 2, 290), (1 << 1 | 1, 2, 320)] * 4  # across the 7 chunks _write_trace cuts
    _write_trace(tmp_path, records)
    times = [t for chunk in Trace(str(tmp_path)).chunks() for t in chunk.time_ns.tolist()]
    assert times == [100, 150, 150, 300, 300] + [320] * 7
    out = io.StringIO()
    callgraph.replay(Trace(str(tmp_path)), out)
    assert "   0.000 us [     7] |   b();" in out.getvalue().splitlines()


def _write_values_trace(directory: Path) -> list[str]:
    """One thread: main calls add(i, i + 1) = 2i + 1 and echo("hello world") 30 times, their
    values in data records after their entries and exits (as the tracer writes them), in
    chunks cut between calls; returns the lines replay must show under main."""
    records: list[tuple[int, int, int]] = [(1 << 1, 0, 1)]  # (kind, function or bytes | flags, time or value)
    shown, t = [], 10
    for i in range(30):
        records += [(2 << 1, 1, t), (TRACE_DATA | 0, 8, i), (TRACE_DATA | 1, 8, i + 1)]
        records += [(2 << 1 | 1, 1, t + 5), (TRACE_DATA | 0, 8, 2 * i + 1)]
        text = int.from_bytes(b"hello wo", "little"), int.from_bytes(b"rld", "little")
        records += [(2 << 1, 2, t + 6), (TRACE_DATA | 0, 8, text[0]), (TRACE_DATA | 0, 3 | DATA_END, text[1])]
        records += [(2 << 1 | 1, 2, t + 9)]
        shown += [f"add({i}, {i + 1}) = {2 * i + 1};", 'echo("hello world");']
        t += 10
    records.append((1 << 1 | 1, 0, t))
    data = np.zeros(len(records), dtype=record_dtype(16))
    data["kind"], data["func"], data["tsc"] = (np.array([r[k] for r in records], dtype=np.uint64) for k in range(3))
    calls = [i for i, r in enumerate(records) if not r[0] & TRACE_DATA]
    with open(directory / "events.raw", "wb") as f:
        for chunk in np.split(data, calls[5::17]):  # chunks the reader joins again
            f.write(np.array([(1 | 7 << 32, len(chunk))], dtype="<u8,<u8").tobytes())
            f.write(chunk.tobytes())
    captures = {"1": [["arg1/d64%rdi", "arg2/d64%rsi"], ["retval/d64"]], "2": [["arg1/s%rdi"], []]}
    write_info(str(directory), {"functions": [[n, "x", 0, 1] for n in ("main", "add", "echo")], "record_size": 16,
                                "clock": {"tsc0": 0, "ns0": 0, "scale": 1.0}, "captures": captures})  # fmt: skip
    return shown


def test_recorded_values_show_whatever_the_chunks_and_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Data records belong to the call's record before them: replay shows them across chunks
    joined into one batch, and across the bounded pieces a chunk is read in (a call's data
    records never parted from it)."""
    from dynprobe import tracefile

    shown = _write_values_trace(tmp_path)
    for pieces in (tracefile.READ_RECORDS, *range(2, 10)):
        monkeypatch.setattr(tracefile, "READ_RECORDS", pieces)
        out = io.StringIO()
        callgraph.replay(Trace(str(tmp_path)), out)
        lines = [line.split("| ", 1)[1].strip() for line in out.getvalue().splitlines()[1:]]
        assert lines == ["main() {", *shown, "} /* main */"], pieces


@pytest.mark.parametrize(
    ("text", "fields"),
    [
        ("none", ()), ("tid,duration", ("duration", "tid")), ("+elapsed", ("duration", "tid", "elapsed")),
        ("module,time,addr", ("addr", "time", "module")),
    ],
)  # fmt: skip
def test_replay_fields_are_uftrace_s_in_its_order(text: str, fields: tuple[str, ...]) -> None:
    assert callgraph.parse_fields(text) == fields


@pytest.mark.parametrize("text", ["", "+", "tid,bogus", "duration,,x"])
def test_replay_fields_that_are_not_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a field") as info:
        callgraph.parse_fields(text)
    assert str(info.value).endswith("module, or none)")  # every field named, and `none`


def test_report_sorted_by_name_and_by_any_field(tmp_path: Path) -> None:
    """-s name (or func): by function name; -s FIELD: largest first."""
    _random_trace(tmp_path, 0)
    by_name, by_calls = io.StringIO(), io.StringIO()
    callgraph.report(Trace(str(tmp_path)), by_name, "name")
    callgraph.report(Trace(str(tmp_path)), by_calls, "calls", fields=("call",))
    names = [line.split()[-1] for line in by_name.getvalue().splitlines()[2:]]
    assert names == sorted(names) == ["a", "b", "c", "d"]
    calls = [int(line.split()[0]) for line in by_calls.getvalue().splitlines()[2:]]
    assert calls == sorted(calls, reverse=True) and sum(calls) > 100


def test_a_flight_recorder_s_snapshots_are_not_paired_across_their_gap(tmp_path: Path) -> None:
    """Snapshot 1 ends inside `a` (frame 1); snapshot 2 starts with the exit of a `b` in the same
    frame (a's exit and b's entry gave way): the exit is not a's, a is left open at the gap,
    and b's durations are those of its calls in snapshot 2 alone."""
    snapshots = [[(1 << 1, 0, 10)], [(1 << 1 | 1, 1, 5000), (1 << 1, 1, 6000), (1 << 1 | 1, 1, 6010)]]
    with open(tmp_path / "events.raw", "wb") as f:
        for records in snapshots:
            data = np.zeros(len(records), dtype=record_dtype(16))
            data["kind"], data["func"], data["tsc"] = zip(*records, strict=True)
            f.write(np.array([(1 | 7 << 32, len(records))], dtype="<u8,<u8").tobytes() + data.tobytes())
    write_info(str(tmp_path), {"functions": [[n, "x", 0, 1] for n in "ab"], "record_size": 16, "flight_recorder": True,
                               "clock": {"tsc0": 0, "ns0": 0, "scale": 1.0}})  # fmt: skip
    out = io.StringIO()
    callgraph.replay(Trace(str(tmp_path)), out)
    assert [line.split("| ", 1)[1] for line in out.getvalue().splitlines()[1:]] == ["a() {", "b();"]
    assert "0.010 us" in out.getvalue().splitlines()[2]
    times = profile(Trace(str(tmp_path))).functions
    assert 0 not in times and (times[1].calls, times[1].total) == (1, 10)
