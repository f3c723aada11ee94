"""uftrace's filters over the calls of a trace, as `replay`, `report` and `dump` read it:
`-F FUNC` keeps FUNC's calls and every call under them, `-N FUNC` drops FUNC's calls and every
call under them, `-D N` keeps calls nested at most N deep, counted from the nearest -F call
(each starts the count anew, as in uftrace) or else from the outermost call.
They act on each thread's entries and exits in order, following its open calls by frame as the
call graph does: a frame entered again ends the calls a longjmp or an exception left open.
`record -F/-N/-D` keeps them in the trace's info.json; the readers apply them (and any given
when reading), as uftrace applies filters at record time or at replay time alike."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from dynprobe.symbols.demangle import Demangle, display
from dynprobe.symbols.patterns import MatchKind, NamePattern
from dynprobe.tracefile import Chunk, Trace

EXIT = 1


@dataclass(frozen=True)
class CallFilter:
    include: tuple[NamePattern, ...] = ()
    exclude: tuple[NamePattern, ...] = ()
    depth: int | None = None

    def __bool__(self) -> bool:
        return bool(self.include or self.exclude or self.depth is not None)

    def to_info(self) -> dict[str, object]:
        """What a trace's info.json keeps of it."""
        kinds = {p.kind.value for p in self.include + self.exclude} or {MatchKind.REGEX.value}
        return {"include": [p.text for p in self.include], "exclude": [p.text for p in self.exclude],
                "match": kinds.pop(), "depth": self.depth}  # fmt: skip

    @classmethod
    def of_trace(cls, trace: Trace) -> CallFilter:
        """The filters a trace was recorded with (none if it has none, or they do not read)."""
        saved = trace.info.get("filters")
        if not isinstance(saved, dict):
            return cls()
        kind = MatchKind(saved.get("match")) if saved.get("match") in ("regex", "glob") else MatchKind.REGEX

        def texts(key: str) -> list[str]:
            value = saved.get(key)
            return [t for t in value if isinstance(t, str)] if isinstance(value, list) else []

        depth = saved.get("depth")
        return cls(
            tuple(NamePattern(t, kind) for t in texts("include")),
            tuple(NamePattern(t, kind) for t in texts("exclude")),
            depth if isinstance(depth, int) and not isinstance(depth, bool) and depth > 0 else None,
        )


def _matching(patterns: Sequence[NamePattern], functions: list[list[object]]) -> list[bool]:
    """Per function id of a trace: whether one of `patterns` names it (by its symbol, or as
    demangled)."""
    result = []
    for entry in functions:
        name, module = str(entry[0]), str(entry[1])
        names = {name, display(name, Demangle.SIMPLE), display(name, Demangle.FULL)}
        result.append(any(p.matches(names, module) for p in patterns))
    return result


class _Thread:
    """One thread's open calls, outermost first: [function, frame, inside an -F call, inside an
    -N call, its depth as -D counts it (0 if not kept), kept]."""

    __slots__ = ("at", "calls")

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.at: dict[int, int] = {}  # frame -> its index in calls

    def cut(self, depth: int) -> None:
        for call in self.calls[depth:]:
            self.at.pop(call[1], None)
        del self.calls[depth:]


def chunks_of(trace: Trace, readers: CallFilter | None = None) -> Iterator[Chunk]:
    """The trace's chunks as filtered when recorded, then by a reader's filters (`-F` within
    what the recording kept)."""
    chunks = trace.chunks()
    for calls in (CallFilter.of_trace(trace), readers):
        if calls:
            chunks = _filtered(chunks, trace.info.get("functions", []), calls)
    return chunks


def _filtered(chunks: Iterator[Chunk], functions: list[list[object]], calls: CallFilter) -> Iterator[Chunk]:
    """`chunks` with only the events of the calls `calls` keeps."""
    include = _matching(calls.include, functions) if calls.include else None
    exclude = _matching(calls.exclude, functions)
    deepest = calls.depth if calls.depth is not None else 1 << 62
    threads: dict[int, _Thread] = {}
    for chunk in chunks:
        thread = threads.setdefault(chunk.tid, _Thread())
        open_calls, at = thread.calls, thread.at
        keep = []
        for kind, func, frame in zip(chunk.kind.tolist(), chunk.func.tolist(), chunk.frame.tolist(), strict=True):
            if kind != EXIT:
                if frame and frame in at:  # a frame entered again: what held it was left
                    thread.cut(at[frame])
                parent = open_calls[-1] if open_calls else None
                matched = include is not None and include[func]
                inside = include is None or matched or (parent is not None and parent[2] == 1)
                dropped = exclude[func] or (parent is not None and parent[3] == 1)
                depth = parent[4] if parent is not None and not matched else 0  # an -F call: counted anew
                kept = inside and not dropped and depth < deepest
                if frame:
                    at[frame] = len(open_calls)
                open_calls.append([func, frame, int(inside), int(dropped), depth + kept, int(kept)])
                keep.append(kept)
                continue
            if frame:
                index = at.get(frame)
            else:  # a trace without frames: the innermost open call of the function
                index = next((i for i in range(len(open_calls) - 1, -1, -1) if open_calls[i][0] == func), None)
            if index is None:  # entered before the trace began
                keep.append(include is None and not exclude[func] and calls.depth is None)
                continue
            keep.append(open_calls[index][5] == 1)
            thread.cut(index)
        mask = np.array(keep, dtype=bool)
        if mask.all():
            yield chunk
        elif mask.any():
            yield Chunk(
                chunk.pid, chunk.tid, chunk.kind[mask], chunk.frame[mask], chunk.func[mask], chunk.time_ns[mask]
            )
