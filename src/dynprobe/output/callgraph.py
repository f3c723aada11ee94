"""What a trace directory says, read in one pass over its chunks: the call graph of each thread
(`replay`, uftrace's layout), time per function (`report`), the call paths merged in one tree
(`graph`), folded stacks for flame graphs (`dump --flame`; the timelines of `dump --chrome` and
`--perfetto` are output/timeline.py's). Each keeps per thread only the stack of open calls
(`graph`: its tree of call paths). `report`'s and the flame graph's walk is compiled
(output/callwalk.py).

One concept in one module: its length is the numpy path for spans of `replay` that nest
plainly, kept beside the event-at-a-time path it must agree with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TextIO

import numpy as np

from dynprobe.output.callfilter import CallFilter, FrameStack, all_masks, chunks_of, either, finish_time
from dynprobe.output.callwalk import STATS, CallWalk
from dynprobe.tracefile import Chunk, Note, TraceFile

EXIT = 1


def duration(ns: int) -> str:
    """uftrace's duration column: `   0.084 us`, `  46.382 us`, `   1.250 ms`, `   2.000  s`."""
    if ns < 1_000_000:
        return f"{ns / 1000:8.3f} us"
    if ns < 1_000_000_000:
        return f"{ns / 1_000_000:8.3f} ms"
    return f"{ns / 1_000_000_000:8.3f}  s"


_BATCH = 1 << 16  # events: a thread's chunks read one after another are worked on together


def batches(trace: TraceFile, filters: CallFilter | None) -> Iterator[Chunk]:
    """The trace's chunks (filtered: output/callfilter.py), those of one thread that follow each
    other joined (up to _BATCH events): the consumer drains small chunks, and numpy's work is
    per call, not per event."""
    held: list[Chunk] = []

    def joined() -> Chunk:
        if len(held) == 1:
            return held[0]
        first = held[0]
        kind, frame, func, time_ns = (
            np.concatenate([getattr(c, name) for c in held]) for name in ("kind", "frame", "func", "time_ns")
        )
        if all(c.note is None for c in held):
            return Chunk(first.pid, first.tid, kind, frame, func, time_ns, gap=first.gap)
        notes: list[Note] = []
        parts = []
        for c in held:
            note = c.note if c.note is not None else np.full(len(c.kind), -1, np.int32)
            parts.append(np.where(note >= 0, note + len(notes), -1))
            notes += c.notes
        return Chunk(first.pid, first.tid, kind, frame, func, time_ns, note=np.concatenate(parts), notes=notes,
                     gap=first.gap)  # fmt: skip

    events = 0
    for chunk in chunks_of(trace, filters):
        if held and (chunk.tid != held[0].tid or events >= _BATCH or chunk.inherited or held[0].inherited or chunk.gap):
            yield joined()
            held, events = [], 0
        held.append(chunk)
        events += len(chunk.kind)
    if held:
        yield joined()


class _OpenCalls:
    """One thread's open calls, outermost first: function, entry time, frame, time in callees.

    A frame (tracefile.Chunk.frame) is reused only once its call is over: an entry in a frame
    still open, or an exit of a frame below the top, shows that the calls from there up were left
    by longjmp or an exception; they are dropped. Calls without a frame (format 1) are matched
    by function. `opened` counts the open calls of each function: a call adds to its function's
    total only when no other call of it is open (recursion is counted once, as uftrace does)."""

    __slots__ = ("at", "calls", "opened")

    def __init__(self) -> None:
        self.calls: list[list[int]] = []  # [function, entry time, frame, time in callees]
        self.at: dict[int, int] = {}  # frame -> its depth
        self.opened: dict[int, int] = {}  # function -> its open calls

    def __len__(self) -> int:
        return len(self.calls)

    def forget(self, frame: int) -> None:
        """A call enters `frame`: whatever still held it is over."""
        depth = self.at.get(frame)
        if depth is not None:
            self.cut(depth)

    def push(self, func: int, t: int, frame: int) -> None:
        if frame:
            self.forget(frame)
            self.at[frame] = len(self.calls)
        self.calls.append([func, t, frame, 0])
        self.opened[func] = self.opened.get(func, 0) + 1

    def inherit(self, chunk: Chunk) -> None:
        """Open the calls a forked child's thread began inside (Chunk.inherited)."""
        for func, t, frame in zip(chunk.func.tolist(), chunk.time_ns.tolist(), chunk.frame.tolist(), strict=True):
            self.push(func, t, frame)

    def cut(self, depth: int) -> None:
        for call in self.calls[depth:]:
            self.at.pop(call[2], None)
            self.opened[call[0]] -= 1
        del self.calls[depth:]

    def close(self, func: int, frame: int) -> list[int] | None:
        """The call an exit ends, taken off with the calls above it; None when it is not open
        (entered before the trace began, or its entry was not recorded)."""
        if frame:
            depth = self.at.get(frame)
            if depth is None:
                return None
        else:
            depth = len(self.calls) - 1
            while depth >= 0 and self.calls[depth][0] != func:
                depth -= 1
            if depth < 0:
                self.cut(0)
                return None
        call = self.calls[depth]
        self.cut(depth)
        return call


_ENTRY, _EXIT, _LEAF = 0, EXIT, 2  # a replay line's kind
_DELTAS = np.array([1, -1, 0])  # by kind: what it does to the depth
_PLAIN_FROM = 64  # events, from which numpy works out their nesting (fewer: one by one)
_PLAIN_SPAN = 1 << 13  # events numpy works on at a time: a span with a longjmp goes one by one
_BLANK = -(1 << 62)  # a duration column left empty (an entry's line)


def _columns(spent: np.ndarray) -> np.ndarray:
    """uftrace's duration column, 11 bytes a line: numpy's digits below 1 ms (`%8.3f us` of
    ns / 1000: three integer digits, three decimals), `duration()` for the rest, blank for
    _BLANK."""
    columns = np.full((len(spent), 11), ord(" "), dtype=np.uint8)
    columns[:, 4], columns[:, 9], columns[:, 10] = ord("."), ord("u"), ord("s")
    us, frac = np.divmod(spent, 1000)
    digit = ord("0")
    columns[:, 1] = np.where(us >= 100, digit + us // 100 % 10, ord(" "))
    columns[:, 2] = np.where(us >= 10, digit + us // 10 % 10, ord(" "))
    columns[:, 3] = digit + us % 10
    columns[:, 5] = digit + frac // 100
    columns[:, 6] = digit + frac // 10 % 10
    columns[:, 7] = digit + frac % 10
    columns[spent == _BLANK] = ord(" ")
    other = np.flatnonzero(((spent >= 1_000_000) | (spent < 0)) & (spent != _BLANK))
    if len(other):
        formatted = "".join(duration(ns) for ns in spent[other].tolist()).encode()
        columns[other] = np.frombuffer(formatted, dtype=np.uint8).reshape(len(other), 11)
    return columns


class _Texts:
    """Each function's line texts (`name();`, `name() {`, `} /* name */`, with the newline) laid
    end to end, for numpy to gather: lines are put together by byte copies, not formats."""

    def __init__(self, name: Callable[[int], str], bare: Callable[[int], str]) -> None:
        self.name, self.bare = name, bare
        self.known = 0
        self.data = np.zeros(0, dtype=np.uint8)
        self.start = np.zeros((3, 0), dtype=np.int64)
        self.length = np.zeros((3, 0), dtype=np.int64)

    def _cover(self, top: int) -> None:
        texts = [
            [f"{self.name(f)} {{\n" for f in range(top + 1)],  # _ENTRY
            [f"}} /* {self.bare(f)} */\n" for f in range(top + 1)],  # _EXIT
            [f"{self.name(f)};\n" for f in range(top + 1)],  # _LEAF
        ]
        encoded = [t.encode() for kind in texts for t in kind]
        length = np.array([len(e) for e in encoded], dtype=np.int64)
        self.length = length.reshape(3, top + 1)
        self.start = (np.cumsum(length) - length).reshape(3, top + 1)
        self.data = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        self.known = top + 1

    def lines(self, kinds: np.ndarray, funcs: np.ndarray, levels: np.ndarray, spent: np.ndarray, head: str) -> str:
        """The lines (without the last newline): duration column, `head`, two spaces a level,
        the text of each kind for each function."""
        funcs = funcs.astype(np.int64)
        if int(funcs.max()) >= self.known:
            self._cover(int(funcs.max()))
        lead = np.frombuffer(head.encode(), dtype=np.uint8)
        fixed = 11 + len(lead)
        texts = self.length[kinds, funcs]
        columns = _columns(np.where(kinds == _ENTRY, _BLANK, spent))
        if (levels == levels[0]).all() and (texts == texts[0]).all():  # one shape (often): a matrix
            indent, width = fixed + 2 * int(levels[0]), int(texts[0])
            matrix = np.full((len(funcs), indent + width), ord(" "), dtype=np.uint8)
            matrix[:, :11] = columns
            matrix[:, 11:fixed] = lead
            matrix[:, indent:] = self.data[self.start[kinds, funcs][:, None] + np.arange(width)]
            return matrix.ravel()[:-1].tobytes().decode()
        line_len = fixed + 2 * levels + texts
        ends = np.cumsum(line_len)
        starts = ends - line_len
        flat = np.full(int(ends[-1]), ord(" "), dtype=np.uint8)
        flat[starts[:, None] + np.arange(11)] = columns
        flat[starts[:, None] + np.arange(11, fixed)] = lead
        line = np.repeat(np.arange(len(funcs)), texts)
        within = np.arange(len(line)) - np.repeat(np.cumsum(texts) - texts, texts)
        flat[(ends - texts)[line] + within] = self.data[self.start[kinds, funcs][line] + within]
        return flat[:-1].tobytes().decode()


@dataclass
class _Segment:
    """Events of one thread whose call structure numpy could work out (see _plain_segment)."""

    items: np.ndarray  # positions of the lines' events (a call with no callee: its entry)
    kinds: np.ndarray  # _ENTRY, _EXIT, _LEAF
    levels: np.ndarray  # indentation
    spent: np.ndarray  # ns (exits, leaves)
    closed_to: int  # the open calls carried in that are left
    opened: list[list[int]]  # calls left open, outermost first: [function, entry time, frame]
    by_level: np.ndarray  # indices (in items) of the entries and exits, by level, then in order


def _stable_order(values: np.ndarray) -> np.ndarray:
    """np.argsort(values, kind="stable"), as a radix sort when the values fit 16 bits (~10x
    faster than the merge sort of wider ones: most of a segment's time)."""
    if len(values) and int(values.min()) >= 0 and int(values.max()) < 1 << 16:
        values = values.astype(np.uint16)
    return np.argsort(values, kind="stable")


def _plain_segment(kind: np.ndarray, func: np.ndarray, time: np.ndarray, frame: np.ndarray,
                   stack: _OpenCalls) -> _Segment | None:  # fmt: skip
    """The lines of a run of events that nest plainly: every exit ends the innermost open call
    (same frame and function) and no call enters a frame still open (no longjmp, no exception,
    no call entered before the trace). None when they do not: they go one by one."""
    n = len(kind)
    if not n or not frame.all():
        return None
    exits = kind == EXIT
    identity = func.astype(np.int64) << 16 | frame  # function and frame: an exit's are its entry's
    pair = np.zeros(n, dtype=bool)
    pair[:-1] = ~exits[:-1] & exits[1:] & (identity[:-1] == identity[1:])
    second = np.zeros(n, dtype=bool)
    second[1:] = pair[:-1]
    items = np.flatnonzero(~second)
    kinds = exits[items].astype(np.int64)  # (_ENTRY 0, _EXIT 1)
    kinds[pair[items]] = _LEAF
    delta = _DELTAS[kinds]
    depth = len(stack) + np.cumsum(delta) - delta  # before each item
    levels = np.where(kinds == _EXIT, depth - 1, depth)
    if len(levels) and levels.min() < 0:
        return None
    # Entries and exits, level by level, in order: entry, exit, entry, ... (an exit first at a
    # level below the carried depth: it ends a carried call). Each exit: its entry's frame.
    calls = np.flatnonzero(kinds != _LEAF)
    order = calls[_stable_order(levels[calls])]
    lv, kd = levels[order], kinds[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = lv[1:] != lv[:-1]
    # (Levels come from the running depth: at each level entries and exits alternate, and a
    # level's first is an exit exactly when the level is one carried in. Nothing to check.)
    at = items[order]
    later = ~first & (kd == _EXIT)
    entry_at = at[np.flatnonzero(later) - 1]
    if (identity[at[later]] != identity[entry_at]).any():
        return None
    spent = np.zeros(len(items), dtype=np.int64)
    spent[order[later]] = time[at[later]] - time[entry_at]
    outer = first & (kd == _EXIT)  # ends a carried call
    for o in np.flatnonzero(outer).tolist():
        call = stack.calls[int(lv[o])]
        if call[2] != int(frame[at[o]]) or call[0] != int(func[at[o]]):
            return None
        spent[order[o]] = int(time[at[o]]) - call[1]
    leaves = kinds == _LEAF
    leaf_at = items[leaves]
    spent[leaves] = time[leaf_at + 1] - time[leaf_at]
    # No call may enter a frame still open. A thread's frames are its shadow stack's entries: when
    # each call's frame is its level plus one offset, carried calls' too (the common case), none
    # can. Else: per frame, opens and closes must alternate.
    carried_frames = np.array([c[2] for c in stack.calls], dtype=np.int64)
    item_frames = frame[items].astype(np.int64)
    opens = kinds != _EXIT
    shift = item_frames[opens] - levels[opens]
    offset = int(shift[0]) if len(shift) else None
    frames_follow_levels = (
        offset is not None and (shift == offset).all() and (carried_frames - np.arange(len(stack)) == offset).all()
    )
    if not frames_follow_levels and not _frames_alternate(carried_frames, item_frames, kinds, delta=delta):
        return None
    exits_at = levels[kinds == _EXIT]
    closed_to = min(int(exits_at.min()), len(stack)) if len(exits_at) else len(stack)
    last = np.ones(len(order), dtype=bool)
    last[:-1] = lv[:-1] != lv[1:]
    left_open = order[last & (kd == _ENTRY)]  # by level: outermost first
    opened = [[int(func[i]), int(time[i]), int(frame[i])] for i in items[left_open].tolist()]
    return _Segment(items, kinds, levels, spent, closed_to, opened, order)


def _frames_alternate(carried_frames: np.ndarray, item_frames: np.ndarray, kinds: np.ndarray, *,
                      delta: np.ndarray) -> bool:  # fmt: skip
    """Whether, per frame, calls open and close in turn (carried calls open first) and no call
    with no callee runs in a frame still open. Only frames some call opens can be open: the
    others' calls have no callee."""
    opening = np.zeros(1 << 16, dtype=bool)  # (frames are 15 bits)
    opening[carried_frames] = True
    opening[item_frames[kinds == _ENTRY]] = True
    relevant = opening[item_frames]
    f_items = np.concatenate((carried_frames, item_frames[relevant]))
    f_step = np.concatenate((np.ones(len(carried_frames), dtype=np.int64), delta[relevant]))
    f_leaf = np.concatenate((np.zeros(len(carried_frames), dtype=bool), kinds[relevant] == _LEAF))
    by_frame = _stable_order(f_items)
    fr, step, leaf = f_items[by_frame], f_step[by_frame], f_leaf[by_frame]
    running = np.cumsum(step)
    starts = np.ones(len(fr), dtype=bool)
    starts[1:] = fr[1:] != fr[:-1]
    state = running - (running - step)[starts][np.cumsum(starts) - 1]  # the frame's open calls after
    return not (((state != 0) & (state != 1)).any() or (leaf & (state != 0)).any())


# uftrace's replay -f fields, in the order they are shown: name -> (header, width)
FIELDS = {
    "duration": (" DURATION ", 10), "tid": ("   TID   ", 8), "addr": ("   ADDRESS  ", 12),
    "time": ("     TIMESTAMP    ", 18), "delta": (" TIMEDELTA", 10), "elapsed": ("  ELAPSED ", 10),
    "task": ("      TASK NAME", 15), "module": ("     MODULE NAME", 16),
}  # fmt: skip
DEFAULT_FIELDS = ("duration", "tid")


def parse_fields(text: str) -> tuple[str, ...]:
    """replay's -f: 'none', or as `chosen_fields` ('time,tid', '+elapsed')."""
    return () if text == "none" else chosen_fields(text, tuple(FIELDS), DEFAULT_FIELDS, also=", or none")


def chosen_fields(text: str, known: tuple[str, ...], defaults: tuple[str, ...], *, also: str = "") -> tuple[str, ...]:
    """uftrace's -f: fields comma-separated, or '+' and fields added to the `defaults`; in the
    order of `known`. ValueError for a field that is not one (its message lists `known`, then
    `also`)."""
    added = text.startswith("+")
    given = [f for f in text.removeprefix("+").split(",") if f]
    unknown = [f for f in given if f not in known]
    if unknown or not given:
        raise ValueError(f"not a field: {', '.join(unknown) or text!r} (fields: {', '.join(known)}{also})")
    chosen = set(given) | (set(defaults) if added else set())
    return tuple(f for f in known if f in chosen)


class _Columns:
    """The fields of replay's lines before the call (uftrace's -f), each a space then its value
    in its width, then " | "."""

    def __init__(self, trace: TraceFile, fields: tuple[str, ...]) -> None:
        self.trace, self.fields = trace, fields
        self.first = trace.first_ns() if {"elapsed"} & set(fields) else 0
        self.last: dict[int, int] = {}  # tid -> the time of its last line (delta)
        self.width = sum(1 + FIELDS[f][1] for f in fields)

    def header(self) -> str:
        """uftrace's: each field's heading where its values start (after the space before them;
        a longer heading runs into the next space), '#' first."""
        if not self.fields:
            return ""
        line = [" "] * (self.width + 3)
        at = 1
        for name in self.fields:
            heading, width = FIELDS[name]
            line[at : at + len(heading)] = heading
            at += width + 1
        line[0] = "#"
        return "".join(line[: self.width + 3]) + "FUNCTION\n"

    def prefix(self, tid: int, func: int, t: int, spent: int | None, *, backtrace: bool = False) -> str:
        if not self.fields:
            return ""
        values = []
        entry = self.trace.info["functions"][func] if func < len(self.trace.functions) else []
        for column in self.fields:
            if column == "duration":
                values.append(" backtrace" if backtrace else duration(spent)[1:] if spent is not None else " " * 10)
            elif column == "tid":
                values.append(f"[{tid:>6}]")
            elif column == "addr":
                address = entry[2] if len(entry) > 2 and isinstance(entry[2], int) else 0
                values.append(f"{address:>12x}")
            elif column == "time":
                values.append(f"{t // 1_000_000_000:>8}.{t % 1_000_000_000:09}")
            elif column in ("delta", "elapsed"):
                since = t - (self.last.get(tid, t) if column == "delta" else self.first)
                values.append(duration(since)[1:] if since > 0 else " " * 10)
            elif column == "task":
                values.append(self.trace.threads.get(tid, str(tid))[:15].rjust(15))
            else:  # module
                module = str(entry[1]) if len(entry) > 1 else "[unknown]"
                values.append(module[:16].rjust(16))
        if not backtrace:
            self.last[tid] = t
        return "".join(" " + v for v in values) + " | "


def replay(
    trace: TraceFile, out: TextIO, threshold_ns: int = 0, filters: CallFilter | None = None,
    fields: tuple[str, ...] = DEFAULT_FIELDS, values: bool = True,
) -> int:  # fmt: skip
    """The call graph, one line per call (a call with no callee) or per entry and exit:

        # DURATION     TID     FUNCTION
                    [  1234] | main() {
           1.234 us [  1234] |   leaf();
           5.000 us [  1234] | } /* main */

    Calls left without an exit (longjmp, an exception) close with the frame that returns; calls
    with no callee shorter than `threshold_ns` are left out. `fields`: the columns before the
    call (uftrace's -f); `values`: the arguments and return values calls recorded."""
    columns = _Columns(trace, fields)
    out.write(columns.header())
    plain = fields == DEFAULT_FIELDS  # (numpy lays out the default lines; others go one at a time)
    masks = all_masks(trace, filters)
    names = [trace.call_text(f) for f in range(len(trace.functions))]
    stacks: dict[int, _OpenCalls] = {}
    # tid -> an entry not printed yet (a leaf if its exit is next): function, time, frame, arguments
    pending: dict[int, tuple[int, int, int, str]] = {}
    count = 0

    def name(func: int, note: str = "") -> str:
        """A call as an entry shows it: with the arguments it recorded, if any."""
        if note:
            return trace.name(func) + note
        return names[func] if func < len(names) else trace.call_text(func)

    def flush(tid: int) -> None:
        """The entry of `tid` not printed yet: an open call's (its exit is not in the trace)."""
        waiting = pending.pop(tid, None)
        if waiting is not None:
            entry = columns.prefix(tid, waiting[0], waiting[1], None)
            out.write(f"{entry}{'  ' * len(stacks[tid])}{name(waiting[0], waiting[3])} {{\n")
            stacks[tid].push(*waiting[:3])

    texts = _Texts(name, trace.name)
    for chunk in batches(trace, filters):
        tid = chunk.tid
        stack = stacks.setdefault(tid, _OpenCalls())
        if chunk.inherited:  # a forked child goes on inside its parent's calls, not shown again
            stack.inherit(chunk)
            continue
        if chunk.gap:  # a flight recorder's snapshot: the calls open before it are left
            flush(tid)
            stack.cut(0)
        waiting = pending.pop(tid, None)
        head = f" [{tid:>6}] | "
        lines: list[str] = []
        kinds, funcs, times, frames = chunk.kind, chunk.func, chunk.time_ns, chunk.frame
        i, n = 0, len(kinds)
        plain_from = 0 if plain else n  # a span that does not nest plainly goes one event at a time
        while i < n:
            if waiting is None and i >= plain_from and n - i >= _PLAIN_FROM:
                # Spans of events that nest plainly (most): laid out by numpy in one go.
                end = min(n, i + _PLAIN_SPAN)
                if kinds.item(end - 1) != EXIT:
                    end -= 1  # an entry and its exit, a call with no callee, stay together
                part = slice(i, end)
                noted = chunk.note is not None and bool((chunk.note[part] >= 0).any())  # (one at a time)
                segment = None if noted else _plain_segment(kinds[part], funcs[part], times[part], frames[part], stack)
                if segment is None:
                    plain_from = end
                else:
                    keep = (segment.kinds != _LEAF) | (segment.spent >= threshold_ns)
                    if keep.any():
                        at = segment.items[keep]
                        lines.append(texts.lines(segment.kinds[keep], funcs[part][at], segment.levels[keep],
                                                 segment.spent[keep], head))  # fmt: skip
                        count += int(keep.sum()) - 1  # lines of one item of `lines`
                    stack.cut(segment.closed_to)
                    for opened in segment.opened:
                        stack.push(*opened)
                    i = end
                    continue
            kind, func, t, frame = kinds.item(i), funcs.item(i), times.item(i), frames.item(i)
            note = trace.call_note(chunk, i)
            recorded = note.values if values else ""
            i += 1
            if kind != EXIT:
                if waiting is not None:
                    entry = columns.prefix(tid, waiting[0], waiting[1], None)
                    lines.append(f"{entry}{'  ' * len(stack)}{name(waiting[0], waiting[3])} {{")
                    stack.push(*waiting[:3])
                if frame:
                    stack.forget(frame)
                if note.callers is not None:  # as uftrace's backtrace trigger shows it
                    lines += [f"{columns.prefix(tid, f, t, None, backtrace=True)}/* [{n:>2}] {trace.name(f)} */"
                              for n, f in enumerate(note.callers)]  # fmt: skip
                waiting = (func, t, frame, recorded)
                continue
            if waiting is not None:
                if waiting[0] == func and waiting[2] == frame:
                    spent = t - waiting[1]
                    if spent >= threshold_ns:
                        leaf = columns.prefix(tid, func, waiting[1], spent)
                        lines.append(f"{leaf}{'  ' * len(stack)}{name(func, waiting[3])}{recorded};")
                    waiting = None
                    continue
                entry = columns.prefix(tid, waiting[0], waiting[1], None)
                lines.append(f"{entry}{'  ' * len(stack)}{name(waiting[0], waiting[3])} {{")
                stack.push(*waiting[:3])
                waiting = None
            call = stack.close(func, frame)
            if call is not None:
                returned = f"{recorded};" if recorded else ""
                ending = columns.prefix(tid, func, t, t - call[1])
                lines.append(f"{ending}{'  ' * len(stack)}}}{returned} /* {trace.name(func)} */")
        if waiting is not None:
            pending[tid] = waiting
        if lines:
            out.write("\n".join(lines) + "\n")
            count += len(lines)
    for tid in list(pending):
        flush(tid)
    finish = either(masks, "finish")
    if finish is not None and finish_time(trace, finish) is not None:  # as uftrace says where it stopped
        out.write("\ndynprobe stopped tracing with remaining functions\n" + "=" * 49 + "\n")
        for tid, stack in stacks.items():
            if len(stack):
                out.write(f"task: {tid}\n")
                out.write("".join(f"[{n}] {trace.name(c[0])}\n" for n, c in reversed(list(enumerate(stack.calls)))))
        out.write("\n")
    return count


@dataclass
class FunctionTime:
    calls: int = 0
    total: int = 0  # ns, callees included; a recursive call's only in its outermost call
    self_time: int = 0  # ns, callees excluded
    spent: int = 0  # ns, the sum of every call's duration (recursive calls' too): for averages
    shortest: int = 0  # ns, of one call: callees included
    longest: int = 0
    least_self: int = 0  # ns, of one call: callees excluded
    most_self: int = 0

    @property
    def average(self) -> int:
        return self.spent // max(self.calls, 1)

    @property
    def self_average(self) -> int:
        return self.self_time // max(self.calls, 1)


@dataclass
class Profile:
    """Per function: calls, total and self time; folded stacks (self time per call path)."""

    functions: dict[int, FunctionTime] = field(default_factory=dict)
    folded: dict[tuple[int, ...], int] = field(default_factory=dict)
    events: int = 0


def profile(
    trace: TraceFile, folded: bool = False, threshold_ns: int = 0, filters: CallFilter | None = None
) -> Profile:
    """Per function its calls and times (`folded`: and self time per call path), in one pass by
    the compiled walk (output/callwalk.py). Calls shorter than `threshold_ns` are not counted
    (their time still is their caller's)."""
    events = 0
    with CallWalk(len(trace.functions), threshold_ns=threshold_ns, folded=folded) as walk:
        for chunk in chunks_of(trace, filters):
            if chunk.inherited:
                walk.feed(chunk, entries_only=True)
                continue
            if chunk.gap:  # a flight recorder's snapshot: the calls open before it are left
                walk.forget(chunk.tid)
            events += len(chunk.kind)
            walk.feed(chunk)
        result = Profile(folded=walk.paths() if folded else {}, events=events)
        stats = walk.stats
    for func in np.flatnonzero(stats[0]).tolist():
        result.functions[func] = FunctionTime(**dict(zip(STATS, stats[:, func].tolist(), strict=True)))
    return result


# uftrace's report -f fields: name -> (heading, the value of a function's times)
REPORT_FIELDS: dict[str, tuple[str, Callable[[FunctionTime], int]]] = {
    "total": ("Total time", lambda ft: ft.total), "total-avg": ("Total avg", lambda ft: ft.average),
    "total-min": ("Total min", lambda ft: ft.shortest), "total-max": ("Total max", lambda ft: ft.longest),
    "self": ("Self time", lambda ft: ft.self_time), "self-avg": ("Self avg", lambda ft: ft.self_average),
    "self-min": ("Self min", lambda ft: ft.least_self), "self-max": ("Self max", lambda ft: ft.most_self),
    "call": ("Calls", lambda ft: ft.calls),
}  # fmt: skip
DEFAULT_REPORT_FIELDS = ("total", "self", "call")


def parse_report_fields(text: str) -> tuple[str, ...]:
    """report's -f, as `chosen_fields` ('total,self-max,call', '+total-avg')."""
    return chosen_fields(text, tuple(REPORT_FIELDS), DEFAULT_REPORT_FIELDS)


# -s: any report field, and the names dynprobe took before (calls, avg, name)
SORT_KEYS = [*REPORT_FIELDS, "calls", "avg", "func", "name"]


def report(
    trace: TraceFile, out: TextIO, sort: str = "total", threshold_ns: int = 0, filters: CallFilter | None = None,
    fields: tuple[str, ...] = DEFAULT_REPORT_FIELDS,
) -> None:  # fmt: skip
    """Per function, uftrace's report: its `fields` (total time, self time, calls by default),
    sorted by `sort` (a field, largest first, or the function's name)."""
    prof = profile(trace, threshold_ns=threshold_ns, filters=filters)
    key = {"calls": "call", "avg": "total-avg"}.get(sort, sort)
    if key in ("func", "name"):
        rows = sorted(prof.functions.items(), key=lambda kv: trace.name(kv[0]))
    else:
        rows = sorted(prof.functions.items(), key=lambda kv: -REPORT_FIELDS[key][1](kv[1]))
    out.write("".join(f"  {REPORT_FIELDS[f][0]:>10}" for f in fields) + "  Function\n")
    out.write("".join(f"  {'=' * 10}" for _ in fields) + f"  {'=' * 20}\n")
    for func, ft in rows:
        values = (REPORT_FIELDS[f][1](ft) for f in fields)
        cells = (f"{v:>10}" if f == "call" else duration(v)[1:] for f, v in zip(fields, values, strict=True))
        out.write("".join(f"  {c}" for c in cells) + f"  {trace.name(func)}\n")


def dump_flame(trace: TraceFile, out: TextIO, filters: CallFilter | None = None) -> None:
    """Folded stacks (`main;parse;read_token 1234`, self time in ns) for flamegraph.pl, speedscope."""
    for path, ns in sorted(profile(trace, folded=True, filters=filters).folded.items()):
        if ns > 0:
            out.write(";".join(trace.name(f) for f in path) + f" {ns}\n")


@dataclass
class _Node:
    """A call path of `graph`: its function, calls, their total time, when it was first called,
    callees."""

    func: int
    first: int
    calls: int = 0
    time: int = 0
    children: dict[int, _Node] = field(default_factory=dict)

    def child(self, func: int, t: int) -> _Node:
        node = self.children.get(func)
        if node is None:
            node = self.children[func] = _Node(func, t)
        node.first = min(node.first, t)  # (threads are read one after another)
        return node


def graph(trace: TraceFile, out: TextIO, function: str | None = None, filters: CallFilter | None = None) -> int:
    """uftrace's `graph`: the call paths of every thread merged in one tree, each with its calls
    and total time, callees in the order they were first called; under a `function`, only its
    calls' paths, after the paths that led to it (its backtraces). Returns how many calls of
    the root (`function`, or the program: 1) there were."""
    root = _Node(-1, 0)
    traces: dict[tuple[int, ...], list[int]] = {}  # backtrace -> [hits, time]
    targets = {f for f in range(len(trace.functions)) if trace.name(f) == function} if function else set()
    # Per thread, its open calls: [function, frame, entry time, node (None: outside `function`),
    # backtrace (of a call of `function`)], and the time of its last event
    stacks: dict[int, FrameStack] = {}
    last: dict[int, int] = {}
    for chunk in batches(trace, filters):
        if chunk.gap:  # a flight recorder's snapshot: the calls open before it are left
            stacks.pop(chunk.tid, None)
        stack = stacks.setdefault(chunk.tid, FrameStack())
        for kind, func, t, frame in zip(chunk.kind.tolist(), chunk.func.tolist(), chunk.time_ns.tolist(),
                                        chunk.frame.tolist(), strict=True):  # fmt: skip
            if kind != EXIT:
                if frame in stack.at:  # a frame entered again: the calls that held it were left
                    stack.cut(stack.at[frame])
                caller = stack.calls[-1][3] if stack.calls else (None if function else root)
                node, path = None, None
                if caller is not None:
                    node = caller.child(func, t)
                elif func in targets:
                    node, path = root, (*(call[0] for call in stack.calls), func)
                    traces.setdefault(path, [0, 0])[0] += 0 if chunk.inherited else 1
                if node is not None and not chunk.inherited:
                    node.calls += 1
                stack.push([func, frame, t, node, path])
                continue
            at = stack.find(func, frame)
            if at is None:
                continue
            _, _, began, node, path = stack.calls[at]
            stack.cut(at)
            if node is not None:
                node.time += t - began
            if path is not None:
                traces[path][1] += t - began
        if len(chunk.time_ns):
            last[chunk.tid] = int(chunk.time_ns[-1])
    for tid, stack in stacks.items():  # calls still running when the trace ended
        for _, _, began, node, _ in stack.calls:
            if node is not None:
                node.time += last.get(tid, began) - began
    if function is None:
        root.calls, root.time = 1, sum(c.time for c in root.children.values())
    name = function or trace.program
    if function is not None and not root.calls:
        return 0
    out.write(f"# Function Call Graph for '{name}'\n")
    if traces:
        out.write("=============== BACKTRACE ===============\n")
        for number, (path, (hits, spent)) in enumerate(traces.items()):
            out.write(f" backtrace #{number}: hit {hits}, time {duration(spent)[1:]}\n")
            out.writelines(f"   [{depth}] {trace.name(f)}\n" for depth, f in enumerate(path))
        out.write("\n")
    out.write("========== FUNCTION CALL GRAPH ==========\n# TOTAL TIME   FUNCTION\n")
    _graph_lines(out, root, name, trace)
    out.write("\n")
    return root.calls


def _graph_lines(out: TextIO, root: _Node, root_name: str, trace: TraceFile) -> None:
    """The tree as uftrace draws it: a node with several callees marks its column with `|`, each
    of them drawn with `+-` and a blank line between them; a single callee stays in its caller's
    column."""
    marks: list[bool] = []

    def columns(indent: int, line: bool) -> str:
        last = max((i for i in range(indent) if marks[i]), default=-1) if line else -1
        return "".join(
            (" | " if marks[i] else "   ") if not line or i < last else (" +-" if i == last else "---")
            for i in range(indent)
        )

    def draw(node: _Node, name: str, indent: int, line: bool, last_of_several: bool) -> None:
        out.write(f" {duration(node.time)} : {columns(indent, line)}({node.calls}) {name}\n")
        start = indent
        if len(node.children) > 1:
            while len(marks) <= indent:
                marks.append(False)
            marks[indent] = True
            indent += 1
        if last_of_several and start > 0:
            marks[start - 1] = False
        children = sorted(node.children.values(), key=lambda child: child.first)
        for i, child in enumerate(children):
            draw(child, trace.name(child.func), indent, len(children) > 1, len(children) > 1 and i == len(children) - 1)
            if i < len(children) - 1:
                out.write(f" {' ' * 11} : {columns(indent, False)}\n")
        if start < len(marks):
            marks[start] = False

    marks.extend([False] * 64)
    draw(root, root_name, 0, len(root.children) > 1, False)
