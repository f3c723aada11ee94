"""The Python API for reading traces: `dynprobe.Trace("dynprobe.data")`, a trace directory
(tracefile.TraceFile) with its events and its profile, as `replay` and `report` see them."""

from __future__ import annotations

from collections.abc import Iterator

from dynprobe.frozen import frozen
from dynprobe.output.callfilter import chunks_of
from dynprobe.output.callgraph import FunctionTime, profile
from dynprobe.tracefile import TraceFile


@frozen
class TraceEvent:
    """One entry or exit of a trace, for scripts (`Trace.events()`)."""

    pid: int
    tid: int
    time_ns: int  # CLOCK_MONOTONIC
    exit: bool
    function: str


class Trace(TraceFile):
    """A trace directory, checked (see TraceFile): `events()`, `profile()`."""

    def events(self) -> Iterator[TraceEvent]:
        """Every entry and exit the trace's recorded filters keep, a thread's in time order
        (threads one after another, as the trace holds them), read in chunks: a trace larger
        than memory is fine."""
        for chunk in chunks_of(self):
            for kind, func, t in zip(chunk.kind.tolist(), chunk.func.tolist(), chunk.time_ns.tolist(), strict=True):
                yield TraceEvent(chunk.pid, chunk.tid, t, bool(kind), self.name(func))

    def profile(self, threshold_ns: int = 0) -> list[tuple[str, FunctionTime]]:
        """What `dynprobe report` shows: per function its calls, total time (a recursion once),
        self time and average, longest total first; calls shorter than `threshold_ns` left out."""
        times = profile(self, threshold_ns=threshold_ns).functions
        return sorted(((self.name(f), ft) for f, ft in times.items()), key=lambda item: -item[1].total)
