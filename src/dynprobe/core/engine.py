"""What the mechanisms (core/optimizer.py, returns.py, ftrace.py) may ask of the session that
runs them: the services every one uses, as a protocol the session (core/session.py) meets. Each
mechanism adds what it needs of its own in a protocol next to its code (`OptimizerEngine`,
`ReturnsEngine`, `TracingEngine`), so that none of them imports the session, and a reader sees
at the top of each what it reaches for."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from dynprobe.core.traced import TracedProcess
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.areas import ThreadAreas


class Engine(Protocol):
    @property
    def layout(self) -> L.AreaLayout:
        """The thread areas' layout, fixed once the first area is made."""

    def warn(self, message: str) -> None:
        """Tell the user (once per message)."""

    def allocate_slot(self, proc: TracedProcess, near: int, size: int = ...) -> int | None:
        """`size` bytes of executable memory within reach of `near` in `proc` (None: none)."""

    def world_stopped(self, proc: TracedProcess) -> AbstractContextManager[int | None]:
        """Every thread of `proc` stopped for the block: a stopped thread's tid (None if none is left)."""

    def new_areas(self, proc: TracedProcess) -> ThreadAreas:
        """The thread areas of `proc`, made."""
