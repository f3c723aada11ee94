"""Upcalls: Python handlers served without a ptrace stop (`Session.upcalls`).

A site whose enabled probes all have Python handlers takes a jump, like an optimized probe,
to an upcall detour (arch/x86_64/codegen/upcall.py): the thread saves its registers in its
thread area's frame, asks, rings its process's doorbell and waits. Here, a server thread runs
the handlers of each thread that asks on a `Hit` whose registers are the frame's (a copy:
what a handler changed is written back, and is what the thread resumes with; rip only where a
pre-handler that returned True, or a post-handler, sent it) and answers. Its steps that are
only loads and stores on shared memory are C (core/upcalls.c). Memory reads and writes go
through /proc/PID/mem, as at a stop. A return probe's entry and return are upcalls too: the
detour keeps the shadow stack, as an optimized return probe's does, and core/returns.py runs
the handlers (`entered`, `on_return`).

Waking a sleeping thread costs more than a ptrace stop on this kind of VM, so neither side
sleeps while hits come often: the server runs on another CPU than the threads that ask, and
after each look looks at the doorbells for SPIN before it sleeps on them (futex_waitv, the GIL
let go); a thread that asked looks for its answer as long (the doorbell's SPIN ticks) before it
sleeps on its state, and is woken only if it said it sleeps. A thread that asks on the server's
CPU sleeps at once, and the server moves away from it.

Handlers run in the server thread, one at a time. What needs the tracing thread (placing,
enabling, disabling or removing probes) is handed to the stop loop, which runs it between two
stops while the handler waits for it (`on_tracing_thread`): only while `run()` runs, and
at once in the main thread's run (elsewhere the loop has no waker: within 50 ms). Closing
or detaching the session from a handler is refused; after `session.stop()` from one, no thread
is answered until the next run (as trap hits wait for it). Whatever a handler raises is
reported once (`warnings`) and the thread goes on.

A thread never waits for a tracer that is gone: each doorbell page has a GONE word, which a
detach sets (after answering every thread that asks), and so does the guardian, first, when
dynprobe dies (the undo journal knows where it is): a waiting thread looks at it after every
timed wait and goes on without its handlers.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from dynprobe.arch.x86_64 import Regs
from dynprobe.core import _upcalls as native
from dynprobe.core.probe import Hit, Probe, Site, call_handler
from dynprobe.core.processes import ProcessTable
from dynprobe.core.returns import ReturnProbes
from dynprobe.core.traced import TracedProcess
from dynprobe.debug import debug as _debug
from dynprobe.errors import OptimizeRefusal, ProcessError, SessionError, SharedMemoryRefused
from dynprobe.frozen import frozen
from dynprobe.ptrace import syscalls as sc
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.areas import ThreadAreas
from dynprobe.spec.fetch import FetchContext
from dynprobe.symbols.maps import Mapping
from dynprobe.threads import place, start_without_signals

if TYPE_CHECKING:
    from concurrent.futures import Future

WAIT = 0.05  # seconds the server sleeps at most between two looks at whether it should stop
# Seconds each side looks for the other before it sleeps, when they run on different CPUs: a
# thread for its answer, the server for the next request after its last.
SPIN = 100e-6
MOVE_EVERY = 0.01  # seconds between two moves of the server away from a thread that asks on its CPU
MAX_DOORBELLS = 128  # futex_waitv's most (FUTEX_WAITV_MAX): processes served at once
_STATE = L.UPCALL_STATE // 8
_RING = L.DOORBELL_RING // 8
_REGION, _SITE, _CPU, _SLEEPING = (at // 8 for at in (L.UPCALL_REGION, L.UPCALL_SITE, L.UPCALL_CPU, L.UPCALL_SLEEPING))
NATIVE_LAYOUT = {  # what core/upcalls.c is told (`native.set_layout`)
    "state": _STATE,
    "sleeping": _SLEEPING,
    "cpu": _CPU,
    "request": L.UPCALL_REQUEST,
    "answered": L.UPCALL_ANSWERED,
    "frame": L.UPCALL_FRAME,
    "prefetch_to": L.UPCALL_STATE,  # (the frame's lines but the last, which holds the state)
    "spin_ns": int(SPIN * 1e9),
}
native.set_layout(**NATIVE_LAYOUT)
_NONE_RANG = -1  # (native.next_request: no doorbell rang within the time given)
_REQUEST = L.UPCALL_REQUEST


class UpcallsEngine(Protocol):
    """What upcalls ask of the runtime (core/runtime.py)."""

    processes: ProcessTable

    def fetch_context(self, proc: TracedProcess, tid: int, regs: Regs, probe: Probe) -> FetchContext: ...
    def warn(self, message: str) -> None: ...
    def handler_failed(self, probe: Probe, error: BaseException) -> None: ...
    def tsc_mult(self) -> int: ...
    def wake_loop(self) -> None: ...

    @property
    def returns(self) -> ReturnProbes: ...


@dataclass(eq=False)
class Doorbell:
    """A process's doorbell page: its address there, and our mapping of it."""

    addr: int
    view: mmap.mmap
    ring: int  # our address of its RING word
    words: memoryview  # the page as i64s

    @classmethod
    def over(cls, addr: int, view: mmap.mmap) -> Doorbell:
        ring = ctypes.addressof(ctypes.c_char.from_buffer(view)) + L.DOORBELL_RING
        return cls(addr, view, ring, memoryview(view).cast("q"))

    def rung(self) -> int:
        return self.words[_RING] & 0xFFFFFFFF

    def gone(self) -> None:
        """No answer will come: a thread that asks goes on unheard."""
        self.words[L.DOORBELL_GONE // 8] = 1

    def awake(self, on: bool) -> None:
        """Whether the server looks for requests now (a thread that asks need not wake it)."""
        self.words[L.DOORBELL_AWAKE // 8] = on

    def on_cpu(self, cpu: int) -> None:
        """The CPU the server runs on: a thread that asks there does not spin."""
        self.words[L.DOORBELL_CPU // 8] = cpu

    def spin(self, ticks: int) -> None:
        """How long a thread that asked looks for its answer before it sleeps."""
        self.words[L.DOORBELL_SPIN // 8] = ticks

    def foreign(self) -> bool:
        """Whether a thread came by with a GS base that is not ours (it could not ask)."""
        return self.words[L.DOORBELL_FOREIGN // 8] != 0

    def close(self) -> None:
        self.words.release()
        self.view.close()


T = TypeVar("T")


@frozen(slots=True)
class Asker:
    """A thread that may ask, with what answering it takes, found once."""

    tid: int
    proc: TracedProcess | None
    cells: memoryview  # its area as u64s
    context: Callable[[Hit], FetchContext]  # what its hits' fetches read, made from the hit if asked


class Upcalls:
    """The doorbells of the traced processes and the thread that answers them."""

    def __init__(self, engine: UpcallsEngine) -> None:
        self.engine = engine
        self._returns, self._failed = engine.returns, engine.handler_failed  # (asked at every hit)
        self._enabled = sc.has_futex_waitv()  # (else Python handlers stay at traps)
        self._bells: dict[TracedProcess, Doorbell] = {}  # (a fork child shares its parent's)
        self._version = 0  # of _bells: the server looks at them again when it changes
        self._lock = threading.Lock()  # the server reads _bells, the tracing thread changes it
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # Where the server runs (during a run, off the CPU where the target's threads wake up,
        # core/loop.py), and whether it and the threads that ask look for each other (SPIN)
        # before they sleep: not when they may share a CPU, where it would only delay the other.
        self._cpus: set[int] | None = None
        self._allowed = os.sched_getaffinity(0)
        self._spin = len(self._allowed) > 1
        self._cpu = -1  # where the server runs
        # The one CPU the server is placed on, if one: what the doorbells say from the placing
        # on (where the scheduler has it at a look may lag behind)
        self._placed_on: int | None = None
        self._moved_at = 0.0  # when the server last left a CPU to a thread that asks there
        self._bells_served: list[Doorbell] = []  # the doorbells the server looks at
        # Calls handlers ask the tracing thread to make, and their outcome (under _lock)
        self._jobs: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._taking_jobs = False  # while run() runs
        self._serving = threading.Event()  # clear: a handler stopped the run, the next one goes on
        self._serving.set()

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
        probe with Python pre- or post-handlers, or a return probe with Python handlers."""
        return (
            self._enabled
            and bool(probes)
            and all(p.action is None and (p.is_return or (p.pre or p.post) is not None) for p in probes)
        )

    @staticmethod
    def asks_before(probes: list[Probe]) -> bool:
        """Whether a site's thread asks before its instruction: a pre-handler, or a return
        probe's entry handler, runs there (a return probe with none takes its shadow entry in
        the detour, and asks only at the return)."""
        return any(p.pre is not None or (p.is_return and p.on_entry is not None) for p in probes)

    def in_server(self) -> bool:
        return threading.current_thread() is self._thread

    def check_not_in_server(self, what: str) -> None:
        if self.in_server():
            raise SessionError(
                f"{what} from a handler served by an upcall is not possible: set session.upcalls = False"
            )

    def on_tracing_thread(self, what: str, call: Callable[[], T]) -> T:
        """`call()` made by the tracing thread (where ptrace may be used): at once if this is it;
        from a handler the server runs, by the stop loop between two stops, the handler (and
        the thread that asked) waiting for it. SessionError if `run()` is not running."""
        if not self.in_server():
            return call()
        from concurrent.futures import Future  # (only a handler's asking needs it: not at start-up)

        outcome: Future[T] = Future()
        with self._lock:
            if not self._taking_jobs:
                raise SessionError(f"{what} from a handler served by an upcall needs session.run() to be running")
            self._jobs.append((call, outcome))
        self.engine.wake_loop()
        return outcome.result()

    def hold(self) -> None:
        """A handler stopped the run: the threads that ask from now on wait for the next run
        (as a trap hit does), or for the detach."""
        self._serving.clear()

    def has_jobs(self) -> bool:
        return bool(self._jobs)

    def run_jobs(self) -> None:
        """Make the calls handlers asked for (the tracing thread, between two stops)."""
        while self._jobs:
            with self._lock:
                jobs, self._jobs = self._jobs, []
            for call, outcome in jobs:
                try:
                    outcome.set_result(call())
                except BaseException as exc:  # (the handler gets it)
                    outcome.set_exception(exc)

    @contextlib.contextmanager
    def taking_jobs(self) -> Iterator[None]:
        """While `run()` runs: handlers may hand calls to it (made before it returns)."""
        with self._lock:
            self._taking_jobs = True
        self._serving.set()
        try:
            yield
        finally:
            with self._lock:
                self._taking_jobs = False
            self.run_jobs()

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
            self._version += 1
            bell.spin(self._spin_ticks())
            bell.on_cpu(self._cpu)
        if self._thread is None:
            self._stopping.clear()
            self._thread = start_without_signals(self._serve, "dynprobe-upcalls")
        return bell.addr

    def _distinct(self) -> list[Doorbell]:
        """Every doorbell once (a fork child shares its parent's), of processes still traced."""
        self._tell_foreign()  # (before those of ended processes go)
        for proc in [p for p in self._bells if p.status is not None]:
            del self._bells[proc]  # (ended: its page went with it)
            self._version += 1
        return list({id(b): b for b in self._bells.values()}.values())

    def forked(self, parent: TracedProcess, child: TracedProcess, tid: int, *, vfork: bool) -> None:
        with self._lock:
            bell = self._bells.get(parent)
            if bell is not None:  # the same page, mapped shared: the child's asks ring it too
                self._bells[child] = bell
                self._version += 1

    def let_go(self, child: TracedProcess) -> None:
        with self._lock:
            self._bells.pop(child, None)
            self._version += 1

    def forget_image(self, proc: TracedProcess) -> None:
        with self._lock:
            self._bells.pop(proc, None)  # (the exec took the mapping with the old image)
            self._version += 1

    def execed(self, proc: TracedProcess, maps: list[Mapping]) -> None:
        """(A new program's sites are optimized as they are armed.)"""

    def modules_changed(self, proc: TracedProcess, maps: list[Mapping]) -> None:
        """(Probes in libraries just mapped are optimized as they are armed.)"""

    # --- serving --------------------------------------------------------------------------------
    def _serve(self) -> None:
        """Answer requests until stopped. Should it fail, every thread goes on unheard from then."""
        if self._cpus is not None:
            os.sched_setaffinity(0, self._cpus)
        bells: list[Doorbell] = []  # (kept here while the server waits on their words)
        askers: list[Asker] = []
        seen: tuple[int, ...] = ()  # the versions of the doorbells and the thread areas they are of
        try:
            while not self._stopping.is_set():
                if not self._serving.is_set():
                    self._serving.wait(WAIT)
                    continue
                # per doorbell, our address of its RING word and the value there before the look
                # (a request after the look rings it again)
                watched = array("Q", [word for bell in bells for word in (bell.ring, bell.rung())])
                try:
                    if (self._version, ThreadAreas.changes) != seen:  # (a thread or process came or went)
                        seen = (self._version, ThreadAreas.changes)
                        with self._lock:
                            bells = self._bells_served = self._distinct()
                        for bell in bells:  # (one made as the server moved may hold its old CPU)
                            bell.on_cpu(self._cpu)
                        askers = list(self._areas())
                        continue
                    for asker in askers:
                        if (self._version, ThreadAreas.changes) != seen:  # (an area given to another thread)
                            break
                        if asker.cells[_STATE] & 0xFFFFFFFF == _REQUEST and self._serving.is_set():
                            self._answer(asker)
                    self._look_at_cpu(bells)
                    if self._spin and self._spin_serving(bells, watched, askers, seen):
                        continue
                except ValueError:  # (a process ended meanwhile: its areas' memory is let go under us)
                    seen = ()
                    continue
                self._tell_foreign()
                for bell in bells:
                    bell.awake(False)
                waits = [(bell.ring, bell.rung()) for bell in bells]
                if not any(True for _ in self._asking()):  # (one asked before the doorbells were quiet)
                    if waits:
                        sc.futex_waitv(waits, WAIT)
                    else:
                        self._stopping.wait(WAIT)
                for bell in bells:
                    bell.awake(True)
        except BaseException as exc:
            self.engine.warn(f"the upcall server failed ({type(exc).__name__}: {exc}): handlers no longer run")
            with self._lock:
                for bell in self._distinct():
                    bell.gone()
            for asker in list(self._asking()):
                self._answer(asker, handlers=False)

    def _tell_foreign(self) -> None:
        """A process whose threads came by with a GS base of their own (the program set it after
        its areas were given): its upcalls go unheard from then on; say so, once, and its new
        probes stay traps (GS_IN_USE)."""
        for proc, bell in list(self._bells.items()):
            if proc.areas_refused is None and bell.foreign():
                proc.areas_refused = OptimizeRefusal.GS_IN_USE
                self.engine.warn(
                    f"pid {proc.pid} set its own GS base: its Python handlers served without a stop no longer run"
                    " (session.upcalls = False serves them at traps)"
                )

    def _make_room(self, cpu: int) -> None:
        """A thread asked on the server's CPU, where neither can spin for the other: the
        server moves to another (at most every MOVE_EVERY seconds: threads that ask on every
        CPU would keep it moving)."""
        others = self._allowed - {cpu}
        now = time.monotonic()
        if others and now - self._moved_at >= MOVE_EVERY:
            self._moved_at = now
            self.place(others, spin=self._spin)
            self._look_at_cpu(self._bells_served)  # (at once: the server may answer from its spin for long)

    def _look_at_cpu(self, bells: list[Doorbell]) -> None:
        """The doorbells say where the server runs now (threads that ask there do not spin)."""
        cpu = self._placed_on if self._placed_on is not None else sc.current_cpu()
        if cpu != self._cpu:
            self._cpu = cpu
            for bell in bells:
                bell.on_cpu(cpu)

    def _spin_serving(self, bells: list[Doorbell], watched: array[int], askers: list[Asker],
                      seen: tuple[int, ...]) -> bool:  # fmt: skip
        """Answer the threads that ask as their doorbells ring (`bells`; per doorbell in
        `watched`, our address of its RING word and the value there before the last look at the
        threads), one thread after the other in turn, until none has rung for SPIN seconds
        (False: time to sleep), or the server has its world to look at again (True: threads or
        doorbells that came or went, looked at before each answer and on every ring; a run
        held; the server to stop). The wait and the looks are core/upcalls.c's: the wait lets
        the GIL go."""
        serving, stopping = self._serving, self._stopping
        version, changes = seen
        areas = [asker.cells for asker in askers]
        answered = 0  # since the last look at where the server runs
        start = 0
        while True:
            at = native.next_request(watched, areas, start)
            if self._version != version or ThreadAreas.changes != changes:  # (an area given to another thread)
                return True
            if at == _NONE_RANG:
                if not answered:
                    return False
                answered = 0  # (a run of answers over: where the server runs now is looked at)
                self._look_at_cpu(bells)
                if stopping.is_set():
                    return True
                continue
            if at >= 0:
                if not serving.is_set():
                    return True
                self._answer(askers[at])
                start = at + 1
            # (a ring no known thread asked for counts too: the doorbell is the target's to ring)
            answered += 1
            if answered % 64 == 0:
                if stopping.is_set():
                    return True
                self._look_at_cpu(bells)

    def _areas(self, only: TracedProcess | None = None) -> Iterator[Asker]:
        """The threads of the processes with doorbells (of `only`, if given), once each (a vfork
        child's areas are its parent's)."""
        seen: set[int] = set()
        for proc in [only] if only is not None else self.engine.processes:
            areas = proc.areas
            if areas is None or proc not in self._bells:
                continue
            for tid, area in areas.live():
                if id(area) not in seen:
                    seen.add(id(area))
                    owner = self.engine.processes.process_of(tid)
                    yield Asker(tid, owner, area.cells, functools.partial(self._context, owner))

    def _asking(self, only: TracedProcess | None = None) -> Iterator[Asker]:
        """The threads that ask now (of `only`, if given)."""
        for asker in self._areas(only):
            if asker.cells[_STATE] & 0xFFFFFFFF == _REQUEST:
                yield asker

    def _context(self, proc: TracedProcess | None, hit: Hit) -> FetchContext:
        assert proc is not None  # (the handlers of a thread of no process followed do not run)
        return self.engine.fetch_context(proc, hit.tid, hit.regs, hit.probe)

    def _answer(self, asker: Asker, *, handlers: bool = True) -> None:
        """Run the handlers of the thread that asks on a copy of its frame, write back what they
        changed (at a return, the return value alone: a handler may keep its hit), and answer
        the thread: whatever happens, it is answered. The handlers of a process we do not follow
        (a vfork child) do not run."""
        cells, proc = asker.cells, asker.proc
        changed: Regs | None = None  # (the frame as the handlers left it, written back with the answer)
        try:
            if handlers and proc is not None and proc.follow:
                regs = Regs.from_buffer_copy(cells, L.UPCALL_FRAME)
                site_addr = cells[_SITE]
                site = proc.sites.get(site_addr)
                if site is not None:
                    asked_at = regs.rip  # (the site, or the next instruction: after it)
                    moved = self._run_handlers(proc, asker, site, regs, post=asked_at != site_addr)
                    if moved is None:
                        regs.rip = asked_at  # (a pre-handler moves the thread by returning True alone)
                    else:  # (in the asking detour's copy of the region, if there)
                        resume = site.upcall_resume or {}
                        if resume.get(site_addr) != cells[_REGION]:  # (a detour made before the site's last one)
                            resume = {site_addr: cells[_REGION]}
                        regs.rip = resume.get(moved, moved)
                    changed = regs
                elif proc.returns is not None and site_addr == proc.returns.upcall_stub:
                    self._returns.on_return(proc, asker.tid, regs, cells=cells)  # (it writes back the return value)
        finally:
            if native.answer(cells, self._cpu, changed) and self._spin:
                self._make_room(self._cpu)

    def _run_handlers(self, proc: TracedProcess, asker: Asker, site: Site, regs: Regs, *, post: bool) -> int | None:
        """The site's pre-handlers and return probes' entry handlers (`post`: its post-handlers,
        the instruction done), in order, on the frame, each of an enabled probe as the handlers
        before it left it; where the thread goes on if a pre-handler returned True (it moved it:
        the instruction and the post-handlers are skipped) or a post-handler moved it, else
        None. A hit is counted at its first upcall (a return probe's, at its return)."""
        now, tid, pid, addr, context = time.monotonic(), asker.tid, proc.pid, site.addr, asker.context
        probes = tuple(site.probes)  # (as they are now: a handler may place more)
        count_here = not post or not self.asks_before([p for p in probes if p.enabled])
        asked_at = regs.rip
        for probe in probes:
            if not probe.enabled:
                continue
            if probe.is_return:
                if not post:
                    self._returns.entered(proc, Hit(probe, pid, tid, regs, addr, now, context), asker.cells)
                continue
            if count_here:
                probe.trap_hits += 1
            handler = probe.post if post else probe.pre
            if handler is not None:
                hit = Hit(probe, pid, tid, regs, addr, now, context)
                if call_handler(handler, hit, self._failed, anything=True) and not post:
                    return int(regs.rip)
        return int(regs.rip) if post and regs.rip != asked_at else None

    def place(self, cpus: set[int], *, spin: bool) -> None:
        """Run on these CPUs; `spin`: whether the server and the threads that ask look for each
        other before they sleep (not where they may share a CPU)."""
        self._cpus = cpus
        self._spin = spin
        self._placed_on = next(iter(cpus)) if len(cpus) == 1 else None
        place(self._thread, cpus)
        with self._lock:
            for bell in self._distinct():
                bell.spin(self._spin_ticks())

    def _spin_ticks(self) -> int:
        return (int(SPIN * 1e9) << 32) // self.engine.tsc_mult() if self._spin else 0

    def stop(self) -> None:
        """The server thread ends (after the handler it runs, if any: until then it is still the
        server, and what it asks is refused)."""
        thread = self._thread
        with self._lock:  # (a handler waiting for the loop waits no more: the session detaches)
            self._taking_jobs = False
            jobs, self._jobs = self._jobs, []
        for _, outcome in jobs:
            outcome.set_exception(SessionError("the session detached meanwhile"))
        if thread is not None:
            self._stopping.set()
            self._serving.set()  # (held: it looks at _stopping at once)
            thread.join()
        self._thread = None
        self._tell_foreign()

    def close(self) -> None:
        """Our mappings of the doorbells go (the session has let every process go); while a
        server still runs (its stop was cut short), with the last reference to them, never
        under its wait, which reads them by address."""
        with self._lock:
            if self._thread is None:
                for bell in {id(b): b for b in self._bells.values()}.values():
                    bell.close()
            self._bells.clear()
            self._version += 1

    def let_go_all(self, proc: TracedProcess) -> None:
        """At detach (the server stopped, the world too): every thread of `proc` that asks is
        answered without its handlers, and no later one waits (GONE set)."""
        for asker in list(self._asking(proc)):
            self._answer(asker, handlers=False)
        bell = self._bells.get(proc)
        if bell is not None:
            bell.gone()
            _debug(f"pid {proc.pid}: no more upcalls")
