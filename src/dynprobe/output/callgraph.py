"""What a trace directory says, read in one pass over its chunks: the call graph of each thread
(`replay`, uftrace's layout), time per function (`report`), Chrome/Perfetto JSON and folded
stacks for flame graphs (`dump`). Each keeps per thread only the stack of open calls.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TextIO

from dynprobe.tracefile import Trace

EXIT = 1


def duration(ns: int) -> str:
    """uftrace's duration column: `   0.084 us`, `  46.382 us`, `   1.250 ms`, `   2.000  s`."""
    for unit, scale in ((" s", 10**9), ("ms", 10**6)):
        if ns >= scale:
            return f"{ns / scale:8.3f} {unit}"
    return f"{ns / 1000:8.3f} us"


def _events(trace: Trace) -> Iterator[tuple[int, int, int, int]]:
    """(tid, kind, function, time ns) in the order recorded (per thread: in time order)."""
    for chunk in trace.chunks():
        tid = chunk.tid
        for kind, func, t in zip(chunk.kind.tolist(), chunk.func.tolist(), chunk.time_ns.tolist(), strict=True):
            yield tid, kind, func, t


def replay(trace: Trace, out: TextIO) -> int:
    """The call graph, one line per call (a call with no callee) or per entry and exit:

    # DURATION     TID     FUNCTION
                [  1234] | main() {
       1.234 us [  1234] |   leaf();
       5.000 us [  1234] | } /* main */
    """
    out.write("# DURATION     TID     FUNCTION\n")
    stacks: dict[int, list[tuple[int, int]]] = {}  # tid -> open calls (function, entry time)
    pending: dict[int, tuple[int, int]] = {}  # tid -> an entry not printed yet (a leaf, if its exit is next)
    blank = " " * 11
    lines = 0

    def open_line(tid: int, func: int) -> None:
        out.write(f"{blank} [{tid:>6}] | {'  ' * len(stacks[tid])}{trace.name(func)}() {{\n")

    for tid, kind, func, t in _events(trace):
        stack = stacks.setdefault(tid, [])
        waiting = pending.pop(tid, None)
        if kind != EXIT:
            if waiting is not None:
                open_line(tid, waiting[0])
                stack.append(waiting)
            pending[tid] = (func, t)
            continue
        if waiting is not None and waiting[0] == func:
            out.write(f"{duration(t - waiting[1])} [{tid:>6}] | {'  ' * len(stack)}{trace.name(func)}();\n")
            lines += 1
            continue
        if waiting is not None:
            open_line(tid, waiting[0])
            stack.append(waiting)
        # Calls left without an exit (longjmp, an exception) close with the frame that returns.
        while stack and stack[-1][0] != func:
            stack.pop()
        if stack:
            entry = stack.pop()
            out.write(f"{duration(t - entry[1])} [{tid:>6}] | {'  ' * len(stack)}}} /* {trace.name(func)} */\n")
            lines += 1
    for tid, waiting in pending.items():
        out.write(f"{blank} [{tid:>6}] | {'  ' * len(stacks[tid])}{trace.name(waiting[0])}() {{\n")
    return lines


@dataclass
class FunctionTime:
    calls: int = 0
    total: int = 0  # ns, callees included
    self_time: int = 0  # ns, callees excluded


@dataclass
class _Frame:
    func: int
    entry: int
    children: int = 0


@dataclass
class Profile:
    """Per function: calls, total and self time; folded stacks (self time per call path)."""

    functions: dict[int, FunctionTime] = field(default_factory=dict)
    folded: dict[tuple[int, ...], int] = field(default_factory=dict)
    events: int = 0


def profile(trace: Trace, folded: bool = False) -> Profile:
    result = Profile()
    stacks: dict[int, list[_Frame]] = {}
    times = result.functions
    for tid, kind, func, t in _events(trace):
        result.events += 1
        stack = stacks.get(tid)
        if stack is None:
            stack = stacks[tid] = []
        if kind != EXIT:
            stack.append(_Frame(func, t))
            continue
        while stack and stack[-1].func != func:
            stack.pop()  # left by longjmp or an exception
        if not stack:
            continue  # it was entered before the trace began
        path = tuple(f.func for f in stack) if folded else ()
        frame = stack.pop()
        spent = t - frame.entry
        own = spent - frame.children
        entry = times.get(func)
        if entry is None:
            entry = times[func] = FunctionTime()
        entry.calls += 1
        entry.total += spent
        entry.self_time += own
        if stack:
            stack[-1].children += spent
        if folded:
            result.folded[path] = result.folded.get(path, 0) + own
    return result


SORT_KEYS = {
    "total": lambda ft: -ft.total,
    "self": lambda ft: -ft.self_time,
    "calls": lambda ft: -ft.calls,
    "avg": lambda ft: -(ft.total // max(ft.calls, 1)),
}


def report(trace: Trace, out: TextIO, sort: str = "total") -> None:
    prof = profile(trace)
    rows = sorted(
        prof.functions.items(), key=lambda kv: trace.name(kv[0]) if sort == "name" else SORT_KEYS[sort](kv[1])
    )
    out.write(f"  {'Total time':>12}   {'Self time':>12}   {'Calls':>10}   {'Average':>12}   Function\n")
    out.write(f"  {'=' * 12}   {'=' * 12}   {'=' * 10}   {'=' * 12}   {'=' * 20}\n")
    for func, ft in rows:
        out.write(
            f"  {duration(ft.total):>12}   {duration(ft.self_time):>12}   {ft.calls:>10}   "
            f"{duration(ft.total // max(ft.calls, 1)):>12}   {trace.name(func)}\n"
        )


def dump_chrome(trace: Trace, out: TextIO) -> None:
    """Trace Event Format (Perfetto UI, chrome://tracing): B/E pairs in microseconds."""
    out.write('{"displayTimeUnit":"ns","traceEvents":[')
    first = True
    for tid, kind, func, t in _events(trace):
        pid = trace.info.get("pid", 0)
        event = {"name": trace.name(func), "ph": "E" if kind == EXIT else "B", "ts": t / 1000, "pid": pid, "tid": tid}
        out.write(("" if first else ",\n") + json.dumps(event, separators=(",", ":")))
        first = False
    for tid, name in trace.threads.items():
        meta = {"name": "thread_name", "ph": "M", "pid": trace.info.get("pid", 0), "tid": tid, "args": {"name": name}}
        out.write(("" if first else ",\n") + json.dumps(meta, separators=(",", ":")))
        first = False
    out.write("]}\n")


def dump_flame(trace: Trace, out: TextIO) -> None:
    """Folded stacks (`main;parse;read_token 1234`, self time in ns) for flamegraph.pl, speedscope."""
    for path, ns in sorted(profile(trace, folded=True).folded.items()):
        if ns > 0:
            out.write(";".join(trace.name(f) for f in path) + f" {ns}\n")
