"""The two sides of a mechanism (core/traps.py, optimizer.py, returns.py, ftrace.py):

- `Engine`: what every mechanism may ask of the runtime that runs it (core/runtime.py), the
  services they all use. Each mechanism adds what it needs of its own in a protocol next to its
  code (`OptimizerEngine`, `ReturnsEngine`, ...), so that none imports the runtime, and a reader
  sees at the top of each what it reaches for.
- `Mechanism`: what the runtime tells a mechanism of the life of a traced process (a fork, an
  exec, libraries mapped), so that the services that see those events (core/lifecycle.py,
  modules.py) call none of them by name.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from dynprobe.core.probe import Probe
from dynprobe.core.traced import TracedProcess
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.areas import ThreadAreas
from dynprobe.symbols.maps import Mapping


class Engine(Protocol):
    @property
    def layout(self) -> L.AreaLayout:
        """The thread areas' layout, fixed once the first area is made."""

    def warn(self, message: str) -> None:
        """Tell the user (once per message)."""

    def handler_failed(self, probe: Probe, error: BaseException) -> None:
        """A Python handler of `probe` raised `error`: tell the user (once per probe)."""

    def allocate_slot(self, proc: TracedProcess, near: int, size: int = ...) -> int | None:
        """`size` bytes of executable memory within reach of `near` in `proc` (None: none)."""

    def world_stopped(self, proc: TracedProcess) -> AbstractContextManager[int | None]:
        """Every thread of `proc` stopped for the block: a stopped thread's tid (None if none is left)."""

    def new_areas(self, proc: TracedProcess) -> ThreadAreas:
        """The thread areas of `proc`, made."""


class Mechanism(Protocol):
    """Hooks of process life, called in the order the runtime lists its mechanisms. A hook does
    nothing in a process where the mechanism has installed nothing."""

    def forked(self, parent: TracedProcess, child: TracedProcess, tid: int, *, vfork: bool) -> None:
        """Thread `tid` of `parent` forked `child`, which has a copy of its memory (a vfork: the
        same memory) with what the mechanism installed there."""

    def let_go(self, child: TracedProcess) -> None:
        """A fork child that is not followed is let go: what it inherited of ours comes out."""

    def forget_image(self, proc: TracedProcess) -> None:
        """`proc` exec'd: what the mechanism installed went with the old program."""

    def execed(self, proc: TracedProcess, maps: list[Mapping]) -> None:
        """`proc` runs its new program, with the probes placed again: install what the mechanism
        keeps in every traced process (its one thread stopped at the exec, its writes batched)."""

    def modules_changed(self, proc: TracedProcess, maps: list[Mapping]) -> None:
        """The loader mapped or unmapped libraries of `proc` (`maps`: as they are now)."""
