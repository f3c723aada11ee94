"""uftrace's filters over the calls of a trace, as `replay`, `report` and `dump` read it:
`-F FUNC` keeps FUNC's calls and every call under them, `-N FUNC` drops FUNC's calls and every
call under them, `-D N` keeps calls nested at most N deep, counted from the nearest -F call
(each starts the count anew, as in uftrace) or else from the outermost call.
They act on each thread's entries and exits in order, following its open calls by frame as the
call graph does: a frame entered again ends the calls a longjmp or an exception left open.
`record -F/-N/-D` keeps them in the trace's info.json; the readers apply them (and any given
when reading), as uftrace applies filters at record time or at replay time alike."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import field
from typing import Any

import numpy as np

from dynprobe.frozen import frozen
from dynprobe.symbols.demangle import Demangle, display
from dynprobe.symbols.patterns import NamePattern
from dynprobe.tracefile import Chunk, Note, TraceFile

EXIT = 1


@frozen
class Masks:
    """A filter resolved against a trace's function table: per function id, whether -F (None:
    no -F, every call is under one), -N, -C and the trace_on and trace_off triggers name it;
    the depth, and the depth triggers (function id -> depth)."""

    include: list[bool] | None
    exclude: list[bool]
    depth: int | None
    callers: list[bool] | None = None  # -C (None: none given)
    depths: dict[int, int] = field(default_factory=dict)
    on: list[bool] | None = None
    off: list[bool] | None = None
    disabled: bool = False  # tracing starts off (until a trace_on)
    backtrace: list[bool] | None = None  # replay shows the calls a call of these is under
    finish: list[bool] | None = None  # the trace ends at the first call of one of these

    @property
    def subtrees(self) -> bool:
        """Whether -F, -N, -D or triggers leave anything out."""
        return (self.include is not None or any(self.exclude) or self.depth is not None or bool(self.depths)
                or self.on is not None or self.off is not None or self.disabled)  # fmt: skip


@frozen
class Trigger:
    """uftrace's -T FUNC@ACTIONS, those that act on what is shown: depth=N (calls under FUNC at
    most N deep), trace_on and trace_off (showing starts or stops at FUNC's entry), backtrace
    and finish."""

    pattern: NamePattern
    depth: int | None = None
    trace_on: bool = False
    trace_off: bool = False
    backtrace: bool = False  # replay shows the calls FUNC's calls are under, as comments
    finish: bool = False  # the trace ends at FUNC's first call (every thread's, from then on)


@frozen
class CallFilter:
    include: tuple[NamePattern, ...] = ()
    exclude: tuple[NamePattern, ...] = ()
    depth: int | None = None
    callers: tuple[NamePattern, ...] = ()
    # A reader's -r: the events from, to (ns since the trace's first event; None: open-ended)
    time_range: tuple[int | None, int | None] | None = None
    triggers: tuple[Trigger, ...] = ()
    disabled: bool = False

    def __bool__(self) -> bool:
        return bool(self.include or self.exclude or self.depth is not None or self.callers or self.time_range
                    or self.triggers or self.disabled)  # fmt: skip

    @property
    def depth_from_outermost(self) -> bool:
        """Whether -D counts from a thread's outermost call alone (as the target can count it):
        no -F, no depth trigger starts the count anew."""
        return not self.include and all(t.depth is None for t in self.triggers)

    def masks(self, functions: list[list[object]]) -> Masks:
        depths: dict[int, int] = {}
        for trigger in self.triggers:
            if trigger.depth is not None:
                depths.update((f, trigger.depth) for f, named in enumerate(_matching([trigger.pattern], functions))
                              if named)  # fmt: skip
        on = [t.pattern for t in self.triggers if t.trace_on]
        off = [t.pattern for t in self.triggers if t.trace_off]
        backtrace = [t.pattern for t in self.triggers if t.backtrace]
        finish = [t.pattern for t in self.triggers if t.finish]
        return Masks(
            _named(self.include, functions), _matching(self.exclude, functions), self.depth,
            _named(self.callers, functions), depths, _named(on, functions), _named(off, functions), self.disabled,
            _named(backtrace, functions), _named(finish, functions),
        )  # fmt: skip

    def to_info(self, functions: list[list[object]]) -> dict[str, object]:
        """What a trace's info.json keeps of it: the function ids it names (a reader never runs
        a regular expression a trace file gives it)."""
        masks = self.masks(functions)
        return {
            "include": _ids(masks.include), "exclude": _ids(masks.exclude), "depth": self.depth,
            "callers": _ids(masks.callers), "depths": [[f, d] for f, d in masks.depths.items()],
            "on": _ids(masks.on), "off": _ids(masks.off), "disabled": self.disabled,
            "backtrace": _ids(masks.backtrace), "finish": _ids(masks.finish),
        }  # fmt: skip


def _named(patterns: Sequence[NamePattern], functions: list[list[object]]) -> list[bool] | None:
    """Per function id, whether one of `patterns` names it; None when there are no patterns."""
    return _matching(patterns, functions) if patterns else None


def _ids(mask: list[bool] | None) -> list[int] | None:
    return None if mask is None else [i for i, named in enumerate(mask) if named]


def recorded_masks(trace: TraceFile) -> Masks | None:
    """The filters a trace was recorded with (None if none, or if they do not read as record
    writes them)."""
    saved = trace.info.get("filters")
    if not isinstance(saved, dict):
        return None
    count = len(trace.info.get("functions", []))

    def mask(key: str) -> list[bool] | None:
        ids = saved.get(key)
        if not isinstance(ids, list):
            return None
        named = [False] * count
        for i in ids:
            if isinstance(i, int) and 0 <= i < count:
                named[i] = True
        return named

    def positive(value: object) -> int | None:
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    pairs = saved.get("depths")
    depths = {}
    for pair in pairs if isinstance(pairs, list) else []:
        if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int) and 0 <= pair[0] < count:
            depth = positive(pair[1])
            if depth is not None:
                depths[pair[0]] = depth
    return Masks(mask("include"), mask("exclude") or [False] * count, positive(saved.get("depth")), mask("callers"),
                 depths, mask("on"), mask("off"), saved.get("disabled") is True, mask("backtrace"),
                 mask("finish"))  # fmt: skip


def _matching(patterns: Sequence[NamePattern], functions: list[list[object]]) -> list[bool]:
    """Per function id of a trace: whether one of `patterns` names it (by its symbol, or as
    demangled)."""
    result = []
    for entry in functions:
        name, module = str(entry[0]), str(entry[1]) if len(entry) > 1 else ""
        plt = len(entry) > 4 and entry[4] is True
        names = {name, display(name, Demangle.SIMPLE), display(name, Demangle.FULL)}
        result.append(any(p.matches(names, module, plt=plt) for p in patterns))
    return result


class FrameStack:
    """One thread's open calls, outermost first, each a list whose first two items are its
    function and its frame (the rest is the reader's), and where each frame's call is. A frame
    entered again ends the calls that held it (left by longjmp or an exception)."""

    __slots__ = ("at", "calls")

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []
        self.at: dict[int, int] = {}  # frame -> its index in calls

    def push(self, call: list[Any]) -> None:
        frame = call[1]
        if frame:
            if frame in self.at:
                self.cut(self.at[frame])
            self.at[frame] = len(self.calls)
        self.calls.append(call)

    def find(self, func: int, frame: int) -> int | None:
        """The open call an exit of `func` in `frame` ends (None: entered before the trace
        began); a trace without frames: the innermost open call of `func`."""
        if frame:
            return self.at.get(frame)
        return next((i for i in range(len(self.calls) - 1, -1, -1) if self.calls[i][0] == func), None)

    def cut(self, depth: int) -> None:
        for call in self.calls[depth:]:
            self.at.pop(call[1], None)
        del self.calls[depth:]


def all_masks(trace: TraceFile, readers: CallFilter | None) -> list[Masks]:
    """The filters a trace was recorded with, then a reader's, resolved against its functions."""
    functions = trace.info.get("functions", [])
    return [m for m in (recorded_masks(trace), readers.masks(functions) if readers else None) if m is not None]


def either(masks: list[Masks], name: str) -> list[bool] | None:
    """Per function id, whether any of `masks` names it in its field `name` (None: none does)."""
    named = [getattr(m, name) for m in masks if getattr(m, name) is not None]
    return [any(column) for column in zip(*named, strict=True)] if named else None


def chunks_of(trace: TraceFile, readers: CallFilter | None = None) -> Iterator[Chunk]:
    """The trace's chunks as filtered when recorded, then by a reader's filters (`-F` within
    what the recording kept)."""
    chunks = trace.chunks()
    masks = all_masks(trace, readers)
    finish = either(masks, "finish")
    end = finish_time(trace, finish) if finish is not None else None
    if end is not None:
        chunks = _within(chunks, 0, (None, end))
    backtrace = either(masks, "backtrace")
    if backtrace is not None:
        chunks = _backtraces(chunks, backtrace)
    for mask in masks:
        if mask.subtrees:
            chunks = _filtered(chunks, mask)
        if mask.callers is not None:
            chunks = _callers(chunks, mask.callers)
    if readers is not None and readers.time_range is not None:
        chunks = _within(chunks, trace.first_ns(), readers.time_range)
    return chunks


def finish_time(trace: TraceFile, finish: list[bool]) -> int | None:
    """When the first call of a `finish` function began (None: none was called): uftrace's
    finish trigger ends the trace there, in every thread. (A pass over the trace of its own.)"""
    named = np.array(finish, dtype=bool)
    first = None
    for chunk in trace.chunks():
        entries = chunk.time_ns[(chunk.kind != EXIT) & named[chunk.func]]
        if len(entries) and (first is None or int(entries.min()) < first):
            first = int(entries.min())
    return first


def _within(chunks: Iterator[Chunk], began: int, time_range: tuple[int | None, int | None]) -> Iterator[Chunk]:
    """The events of `chunks` in `time_range` (ns since `began`, either end open): a call that
    began before it shows its return only, one that ends after it its entry only."""
    start, stop = time_range
    for chunk in chunks:
        since = chunk.time_ns - began
        mask = np.ones(len(since), dtype=bool)
        if start is not None:
            mask &= since >= start
        if stop is not None:
            mask &= since <= stop
        yield from _masked(chunk, mask)


def _backtraces(chunks: Iterator[Chunk], marked: list[bool]) -> Iterator[Chunk]:
    """Each entry of a `marked` function (a backtrace trigger's) noted with the calls it is
    under: all of them, shown or not, as uftrace's backtrace walks the thread's stack."""
    threads: dict[int, FrameStack] = {}
    for chunk in chunks:
        if chunk.gap:  # (the calls open before a flight recorder's gap are left)
            threads.pop(chunk.tid, None)
        thread = threads.setdefault(chunk.tid, FrameStack())
        note, notes = chunk.note, chunk.notes
        for i, (kind, func, frame) in enumerate(zip(chunk.kind.tolist(), chunk.func.tolist(), chunk.frame.tolist(),
                                                    strict=True)):  # fmt: skip
            if kind == EXIT:
                index = thread.find(func, frame)
                if index is not None:
                    thread.cut(index)
                continue
            if frame in thread.at:  # a frame entered again: what held it was left
                thread.cut(thread.at[frame])
            if marked[func]:
                if notes is chunk.notes:  # (the chunk's own are left as they are)
                    note = chunk.note.copy() if chunk.note is not None else np.full(len(chunk.kind), -1, np.int32)
                    notes = list(chunk.notes)
                assert note is not None
                values = notes[note[i]].values if note[i] >= 0 else ""
                note[i] = len(notes)
                notes.append(Note(values, tuple(call[0] for call in thread.calls)))
            thread.push([func, frame])
        yield chunk if notes is chunk.notes else dataclasses.replace(chunk, note=note, notes=notes)


def _callers(chunks: Iterator[Chunk], targets: list[bool]) -> Iterator[Chunk]:
    """Only the calls of `targets` functions and the calls on the way to them (uftrace's -C): a
    call's entry is held back until a target is called under it; a target's other callees are
    left out."""
    threads: dict[int, FrameStack] = {}
    for chunk in chunks:
        if chunk.gap:  # (the calls open before a flight recorder's gap are left)
            threads.pop(chunk.tid, None)
        thread = threads.setdefault(chunk.tid, FrameStack())
        kept: list[tuple[int, int, int, int, int]] = []  # (kind, frame, function, time, note)
        notes = chunk.note.tolist() if chunk.note is not None else [-1] * len(chunk.kind)
        for kind, func, frame, t, note in zip(chunk.kind.tolist(), chunk.func.tolist(), chunk.frame.tolist(),
                                              chunk.time_ns.tolist(), notes, strict=True):  # fmt: skip
            if kind != EXIT:
                thread.push([func, frame, t, 0, note])  # [function, frame, entry time, shown, note]
                if targets[func]:  # it and the calls it is under that are not shown yet
                    for call in thread.calls:
                        if not call[3]:
                            kept.append((0, call[1], call[0], call[2], call[4]))
                            call[3] = 1
                continue
            index = thread.find(func, frame)
            if index is None:
                continue
            if thread.calls[index][3]:
                kept.append((EXIT, frame, func, t, note))
            thread.cut(index)
        if kept:
            kind_, frame_, func_, time_, note_ = (np.array(column) for column in zip(*kept, strict=True))
            yield Chunk(chunk.pid, chunk.tid, kind_.astype(np.uint16), frame_.astype(np.uint16),
                        func_.astype(np.uint32), time_.astype(np.int64), chunk.inherited,
                        note_.astype(np.int32) if chunk.note is not None else None, chunk.notes, chunk.gap)  # fmt: skip


def _filtered(chunks: Iterator[Chunk], masks: Masks) -> Iterator[Chunk]:
    """`chunks` with only the events of the calls `masks` keep. Showing that starts again (a
    trace_on) first opens, silently, the kept calls it starts inside (an inherited chunk):
    their returns show at their depth, as in uftrace."""
    include, exclude, on, off = masks.include, masks.exclude, masks.on, masks.off
    deepest = masks.depth if masks.depth is not None else 1 << 62
    threads: dict[int, FrameStack] = {}
    showing: dict[int, bool] = {}
    for chunk in chunks:
        if chunk.gap:  # (the calls open before a flight recorder's gap are left)
            threads.pop(chunk.tid, None)
        thread = threads.setdefault(chunk.tid, FrameStack())
        shown = showing.setdefault(chunk.tid, not masks.disabled)
        keep: list[bool] = []
        start = 0  # of the part of the chunk not yet given out
        columns = (chunk.kind.tolist(), chunk.func.tolist(), chunk.frame.tolist(), chunk.time_ns.tolist())
        for i, (kind, func, frame, t) in enumerate(zip(*columns, strict=True)):
            if kind != EXIT:
                if frame in thread.at:  # a frame entered again: what held it was left
                    thread.cut(thread.at[frame])
                if off is not None and off[func]:
                    shown = False
                elif on is not None and on[func] and not shown:
                    shown = True
                    yield from _part(chunk, keep, start, i)
                    keep, start = [], i
                    opened = [call for call in thread.calls if call[5]]
                    if opened:
                        yield _opened(chunk, opened)
                # [function, frame, inside an -F call, inside an -N call, how many levels deeper
                # calls may be kept (-D, depth triggers), kept, entry time]
                parent = thread.calls[-1] if thread.calls else None
                matched = include is not None and include[func]
                inside = include is None or matched or (parent is not None and parent[2] == 1)
                dropped = exclude[func] or (parent is not None and parent[3] == 1)
                levels = masks.depths.get(func, deepest if matched or parent is None else parent[4])
                kept = inside and not dropped and levels >= 1
                thread.push([func, frame, int(inside), int(dropped), levels - kept, int(kept), t])
                keep.append(kept and shown)
                continue
            index = thread.find(func, frame)
            if index is None:  # entered before the trace began
                keep.append(shown and include is None and not exclude[func] and masks.depth is None)
                continue
            keep.append(shown and thread.calls[index][5] == 1)
            thread.cut(index)
        showing[chunk.tid] = shown
        yield from _part(chunk, keep, start, len(chunk.kind))


def _part(chunk: Chunk, keep: list[bool], start: int, end: int) -> Iterator[Chunk]:
    """The events `keep` says of chunk[start:end]."""
    mask = np.zeros(len(chunk.kind), dtype=bool)
    mask[start:end] = keep
    return _masked(chunk, mask)


def _masked(chunk: Chunk, mask: np.ndarray) -> Iterator[Chunk]:
    """The events of `chunk` where `mask` holds (the chunk itself if all, nothing if none)."""
    if mask.all():
        yield chunk
    elif mask.any():
        note = chunk.note[mask] if chunk.note is not None else None
        yield Chunk(chunk.pid, chunk.tid, chunk.kind[mask], chunk.frame[mask], chunk.func[mask],
                    chunk.time_ns[mask], chunk.inherited, note, chunk.notes, chunk.gap)  # fmt: skip


def _opened(chunk: Chunk, calls: list[list[int]]) -> Chunk:
    """The entries of `calls` (open calls of _filtered), as an inherited chunk: opened unseen."""
    n = len(calls)
    return Chunk(chunk.pid, chunk.tid, np.zeros(n, np.uint16), np.array([c[1] for c in calls], np.uint16),
                 np.array([c[0] for c in calls], np.uint32), np.array([c[6] for c in calls], np.int64),
                 inherited=True)  # fmt: skip
