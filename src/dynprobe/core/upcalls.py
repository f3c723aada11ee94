"""Upcalls: Python pre- and post-handlers served without a ptrace stop (`Session.upcalls`).

A site whose enabled probes all have Python handlers takes a jump, like an optimized probe,
to an upcall detour (arch/x86_64/codegen/upcall.py): the thread saves its registers in its
thread area's frame, asks, rings its process's doorbell and waits. Here, a server thread sleeps
on every process's doorbell (futex_waitv, the GIL let go), runs the handlers of each thread that
asks on a `Hit` whose registers are the frame's (a copy, written back: a handler's register
writes are what the thread resumes with), sets where the thread goes on (the relocated copy of
the site's instruction, or where a handler that returned True sent it) and answers. Memory
reads and writes go through /proc/PID/mem, as at a stop.

Handlers run in the server thread, one at a time. What needs the tracing thread (placing,
enabling, disabling or removing probes, closing the session) is refused there with a clear
error; `session.stop()` works. Whatever a handler raises is reported once (`warnings`) and the
thread goes on.

A thread never waits for a tracer that is gone: each doorbell page has a GONE word, which a
detach sets (after answering every thread that asks), and so does the guardian, first, when
dynprobe dies (the undo journal knows where it is): a waiting thread looks at it after every
timed wait and goes on without its handlers.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from dynprobe.arch.x86_64 import Regs
from dynprobe.core.probe import Hit, Probe, Site
from dynprobe.core.processes import ProcessTable
from dynprobe.core.traced import TracedProcess
from dynprobe.debug import debug as _debug
from dynprobe.errors import ProcessError, SessionError, SharedMemoryRefused
from dynprobe.ptrace import syscalls as sc
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.areas import AreaRef, Pool
from dynprobe.spec.fetch import FetchContext
from dynprobe.symbols.maps import Mapping
from dynprobe.threads import place, start_without_signals

WAIT = 0.05  # seconds the server sleeps at most between two looks at whether it should stop
MAX_DOORBELLS = 128  # futex_waitv's most (FUTEX_WAITV_MAX): processes served at once
_STATE = L.UPCALL_STATE // 8


class UpcallsEngine(Protocol):
    """What upcalls ask of the runtime (core/runtime.py)."""

    processes: ProcessTable

    def fetch_context(self, proc: TracedProcess, tid: int, regs: Regs, probe: Probe) -> FetchContext: ...
    def warn(self, message: str) -> None: ...


@dataclass(eq=False)
class Doorbell:
    """A process's doorbell page: its address there, and our mapping of it."""

    addr: int
    view: mmap.mmap
    ring: int  # our address of its RING word

    @classmethod
    def over(cls, addr: int, view: mmap.mmap) -> Doorbell:
        return cls(addr, view, ctypes.addressof(ctypes.c_char.from_buffer(view)) + L.DOORBELL_RING)

    def rung(self) -> int:
        return int.from_bytes(self.view[L.DOORBELL_RING : L.DOORBELL_RING + 4], "little")

    def gone(self) -> None:
        """No answer will come: a thread that asks goes on unheard."""
        self.view[L.DOORBELL_GONE : L.DOORBELL_GONE + 8] = (1).to_bytes(8, "little")

    def awake(self, on: bool) -> None:
        """Whether the server looks for requests now (a thread that asks need not wake it)."""
        self.view[L.DOORBELL_AWAKE : L.DOORBELL_AWAKE + 8] = int(on).to_bytes(8, "little")


class Upcalls:
    """The doorbells of the traced processes and the thread that answers them."""

    def __init__(self, engine: UpcallsEngine) -> None:
        self.engine = engine
        self._enabled = False
        self._bells: dict[TracedProcess, Doorbell] = {}  # (a fork child shares its parent's)
        self._lock = threading.Lock()  # the server reads _bells, the tracing thread changes it
        self._pools: weakref.WeakKeyDictionary[Pool, int] = weakref.WeakKeyDictionary()  # (see _address)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._reported: set[Probe] = set()
        # Where the server runs: during a run, on the CPU where it wakes the target's threads
        # (core/loop.py): a thread that asks sleeps at once, and the wake-ups on one CPU cost
        # least on this kind of VM (measured: `make bench`'s upcall row)
        self._cpus: set[int] | None = None

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        if on and not sc.has_futex_waitv():
            raise SessionError("upcalls need futex_waitv (Linux 5.16 or later): Python handlers stay traps here")
        self._enabled = on

    def serves(self, probes: list[Probe]) -> bool:
        """Whether a site whose enabled probes are `probes` is served by upcalls: every one a
        probe with Python pre- or post-handlers (return probes stay traps for now)."""
        return (
            self._enabled
            and bool(probes)
            and all((p.pre or p.post) is not None and p.action is None and not p.is_return for p in probes)
        )

    def in_server(self) -> bool:
        return threading.current_thread() is self._thread

    def check_not_in_server(self, what: str) -> None:
        if self.in_server():
            raise SessionError(
                f"{what} from a handler served by an upcall is not possible yet: set session.upcalls = False"
            )

    # --- the doorbells --------------------------------------------------------------------------
    def doorbell(self, proc: TracedProcess, tid: int) -> int:
        """Where `proc`'s doorbell page is (made on first use, through stopped thread `tid`;
        the server starts with the first). SharedMemoryRefused past MAX_DOORBELLS at once."""
        with self._lock:
            bell = self._bells.get(proc)
            if bell is not None:
                return bell.addr
            if len(self._distinct()) >= MAX_DOORBELLS:
                raise SharedMemoryRefused(f"more than {MAX_DOORBELLS} processes ask at once")
        stub = proc.slots.stub()
        if stub is None:
            raise ProcessError(f"no code of ours in pid {proc.pid} to map a doorbell from")
        addr, view = proc.tracee.map_shared(tid, stub, L.PAGE)
        if proc.tracee.journal is not None:  # should dynprobe die, the guardian sets GONE
            proc.tracee.journal.record_doorbell(proc.pid, addr + L.DOORBELL_GONE)
        with self._lock:
            bell = self._bells[proc] = Doorbell.over(addr, view)
        if self._thread is None:
            self._stopping.clear()
            self._thread = start_without_signals(self._serve, "dynprobe-upcalls")
        return bell.addr

    def _distinct(self) -> list[Doorbell]:
        """Every doorbell once (a fork child shares its parent's), of processes still traced."""
        for proc in [p for p in self._bells if p.status is not None]:
            del self._bells[proc]  # (ended: its page went with it)
        return list({id(b): b for b in self._bells.values()}.values())

    def forked(self, parent: TracedProcess, child: TracedProcess, tid: int, *, vfork: bool) -> None:
        with self._lock:
            bell = self._bells.get(parent)
            if bell is not None:  # the same page, mapped shared: the child's asks ring it too
                self._bells[child] = bell

    def let_go(self, child: TracedProcess) -> None:
        with self._lock:
            self._bells.pop(child, None)

    def forget_image(self, proc: TracedProcess) -> None:
        with self._lock:
            self._bells.pop(proc, None)  # (the exec took the mapping with the old image)

    def execed(self, proc: TracedProcess, maps: list[Mapping]) -> None:
        """(A new program's sites are optimized as they are armed.)"""

    def modules_changed(self, proc: TracedProcess, maps: list[Mapping]) -> None:
        """(Probes in libraries just mapped are optimized as they are armed.)"""

    # --- serving --------------------------------------------------------------------------------
    def _serve(self) -> None:
        """Answer requests until stopped. Should it fail, every thread goes on unheard from then."""
        if self._cpus is not None:
            os.sched_setaffinity(0, self._cpus)
        try:
            while not self._stopping.is_set():
                with self._lock:
                    bells = self._distinct()
                for tid, area in list(self._asking()):
                    self._answer(tid, area)
                for bell in bells:
                    bell.awake(False)
                seen = [(bell.ring, bell.rung()) for bell in bells]
                if not any(True for _ in self._asking()):  # (one asked before the doorbells were quiet)
                    if seen:
                        sc.futex_waitv(seen, WAIT)
                    else:
                        self._stopping.wait(WAIT)
                for bell in bells:
                    bell.awake(True)
        except BaseException as exc:
            self.engine.warn(f"the upcall server failed ({type(exc).__name__}: {exc}): handlers no longer run")
            with self._lock:
                for bell in self._distinct():
                    bell.gone()
            for tid, area in list(self._asking()):
                self._answer(tid, area, handlers=False)

    def _asking(self, only: TracedProcess | None = None) -> Iterator[tuple[int, AreaRef]]:
        """The threads that ask now (of `only`, if given): tid and area, once each (a vfork
        child's areas are its parent's)."""
        seen: set[int] = set()
        for proc in [only] if only is not None else self.engine.processes:
            areas = proc.areas
            if areas is None or proc not in self._bells:
                continue
            for tid, area in areas.live():
                if area.cells[_STATE] & 0xFFFFFFFF == L.UPCALL_REQUEST and id(area) not in seen:
                    seen.add(id(area))
                    yield tid, area

    def _answer(self, tid: int, area: AreaRef, *, handlers: bool = True) -> None:
        """Run the handlers on the thread's frame (a copy, written back: a handler may keep its
        hit), set where it goes on, and answer it: whatever happens, it is answered. The
        handlers of a process we do not follow (a vfork child) do not run."""
        if area.cells[_STATE] & 0xFFFFFFFF != L.UPCALL_REQUEST:
            return  # (answered meanwhile)
        view, at = area.pool.view, area.offset + L.UPCALL_FRAME
        regs = Regs.from_buffer_copy(view, at)
        region = int(area.cells[L.UPCALL_REGION // 8])
        site_addr = int(area.cells[L.UPCALL_SITE // 8])
        asked_at = int(regs.rip)  # the site (before its instruction) or the next one (after)
        proc = self.engine.processes.process_of(tid)
        site = proc.sites.get(site_addr) if proc is not None else None
        target = asked_at
        try:
            if handlers and proc is not None and proc.follow and site is not None:
                target = self._run_handlers(proc, tid, site, regs, post=asked_at != site_addr) or asked_at
        finally:
            # On in the asking detour's copy of the region (there as long as a thread is in the
            # detour); an address the handler chose, as it is.
            resume = site.upcall_resume if site is not None else None
            if not resume or resume.get(site_addr) != region:
                resume = {site_addr: region}  # (a detour made before the site's last one)
            regs.rip = resume.get(target, target)
            view[at : at + ctypes.sizeof(Regs)] = bytes(regs)
            area.cells[_STATE] = L.UPCALL_ANSWERED
            sc.futex_wake(self._address(area) + L.UPCALL_STATE)

    def _address(self, area: AreaRef) -> int:
        """Where `area` is in our memory (its pool's address found once)."""
        base = self._pools.get(area.pool)
        if base is None:
            base = self._pools[area.pool] = ctypes.addressof(ctypes.c_char.from_buffer(area.pool.view))
        return base + area.offset

    def _run_handlers(self, proc: TracedProcess, tid: int, site: Site, regs: Regs, *, post: bool) -> int | None:
        """The site's pre-handlers (`post`: its post-handlers, the instruction done), in order, on
        the frame; where the thread goes on if a pre-handler returned True (it moved it: the
        instruction and the post-handlers are skipped) or a post-handler moved it, else None.
        A hit is counted at its first upcall."""
        now = time.monotonic()
        probes = [p for p in site.probes if p.enabled]
        count_here = not post or not any(p.pre is not None for p in probes)  # (no upcall before)
        asked_at = int(regs.rip)
        for probe in probes:
            if count_here:
                probe.trap_hits += 1
            handler = probe.post if post else probe.pre
            if handler is None:
                continue

            def context(probe: Probe = probe) -> FetchContext:
                return self.engine.fetch_context(proc, tid, regs, probe)

            try:
                moved = handler(Hit(probe, proc.pid, tid, regs, site.addr, now, context))
            except BaseException as exc:  # (the thread goes on whatever a handler does: sys.exit too)
                if probe not in self._reported:
                    self._reported.add(probe)
                    self.engine.warn(f"{probe.name}: its handler raised {type(exc).__name__}: {exc} (reported once)")
                continue
            if moved and not post:
                return int(regs.rip)
        return int(regs.rip) if post and int(regs.rip) != asked_at else None

    def place(self, cpus: set[int]) -> None:
        """Run on these CPUs."""
        self._cpus = cpus
        place(self._thread, cpus)

    def stop(self) -> None:
        """The server thread ends (after the handler it runs, if any)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stopping.set()
            thread.join()

    def close(self) -> None:
        """Our mappings of the doorbells go (the session has let every process go)."""
        with self._lock:
            for bell in {id(b): b for b in self._bells.values()}.values():
                bell.view.close()
            self._bells.clear()

    def let_go_all(self, proc: TracedProcess) -> None:
        """At detach (the server stopped, the world too): every thread of `proc` that asks is
        answered without its handlers, and no later one waits (GONE set)."""
        for tid, area in list(self._asking(proc)):
            self._answer(tid, area, handlers=False)
        bell = self._bells.get(proc)
        if bell is not None:
            bell.gone()
            _debug(f"pid {proc.pid}: no more upcalls")
