"""The stop loop: the one wait for the tracees' stops (every ptrace call happens on the thread that
runs it), with its hot path, a hit on one of our int3s served without building an event; the
optimizer's batches flushed when due; and the ways a wait ends early from elsewhere (a signal's
handler, `request_stop`, a time limit), which must work on a target that never stops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Protocol

from dynprobe.arch.x86_64 import Regs
from dynprobe.core.datapath import DataPath
from dynprobe.core.ftrace import Tracing
from dynprobe.core.lifecycle import Lifecycle
from dynprobe.core.optimizer import Optimizer
from dynprobe.core.probe import Probe, Site
from dynprobe.core.processes import ProcessTable
from dynprobe.core.traced import TracedProcess
from dynprobe.core.traps import Traps
from dynprobe.core.upcalls import Upcalls
from dynprobe.debug import debug as _debug
from dynprobe.ptrace import syscalls as sc
from dynprobe.ptrace.events import WAIT_SLICE, decode_status, peek_stop, sigchld_blocked, take_stop
from dynprobe.ptrace.procfs import thread_cpu
from dynprobe.threads import start_without_signals

_SIGTRAP_STOP = (signal.SIGTRAP << 8) | 0x7F  # waitpid status of a plain SIGTRAP signal-delivery-stop
_WAKE_SIGNAL = signal.SIGURG  # what wakes the main thread from its wait for a stop (see _wakeable; ignored by default)


class LoopEngine(Protocol):
    """What the stop loop asks of the runtime (core/runtime.py)."""

    processes: ProcessTable
    lifecycle: Lifecycle
    traps: Traps
    optimizer: Optimizer
    data: DataPath
    tracing: Tracing
    upcalls: Upcalls
    probes: list[Probe]


class StopLoop:
    """Runs the target, serving its stops, until it ends or is asked to stop."""

    def __init__(self, engine: LoopEngine) -> None:
        self.engine = engine
        self.pin_tracer = True  # see _tracer_pinned
        self.in_run = False  # see _running
        self.stop_requested = False
        self._interrupted = False  # interrupt_wait was called, maybe before run() began
        self._waiting = False  # in a blocking wait for a stop (see _wakeable)
        self._wait_until: float | None = None  # when that wait's time limit passes (time.monotonic)
        self._waker_on = False  # the main thread's run: its waits are woken by a thread (_wakeable)
        self._main: int | None = None  # that thread's ident, while so

    def run(self, timeout: float | None) -> bool:
        """Serve stops until every traced process has exited (True), or `timeout` seconds
        passed or a stop was asked for (False)."""
        engine, processes = self.engine, self.engine.processes
        self.stop_requested = False
        if self._interrupted:  # (a signal that came before this run: it ends this one)
            self.stop_requested, self._interrupted = True, False
        deadline = None if timeout is None else time.monotonic() + timeout
        if any(p.action is not None for p in engine.probes) or engine.tracing.tracers:
            engine.data.ensure_consumer().start()  # before the tracer pins itself: it runs elsewhere
        optimizer, pending = engine.optimizer, processes.pending
        upcalls = engine.upcalls
        with self._tracer_pinned(), self._running(), self._wakeable(), upcalls.taking_jobs():
            optimizer.flush()  # everything placed so far, before the target runs on
            processes.start()
            while processes and not self.stop_requested:
                try:
                    if upcalls.has_jobs():
                        upcalls.run_jobs()
                    due = optimizer.due_in()
                    if due == 0:
                        optimizer.flush()
                        continue
                    if not pending:
                        wait = due
                        if deadline is not None:
                            left = deadline - time.monotonic()
                            if left <= 0:
                                break  # the deadline passed
                            wait = left if due is None else min(due, left)
                        stop = self._next_stop(wait)
                        if stop is None:
                            continue  # a time limit came first
                        if self._serve_breakpoint(*stop):
                            if engine.data.consumer is not None:
                                engine.data.consumer.drain_if_due()
                            continue
                    if not pending:
                        break  # no tracee left at all (ECHILD)
                    engine.lifecycle.handle(pending.popleft())
                except ProcessLookupError as exc:
                    # ESRCH: the thread died under us (SIGKILL wakes a stopped tracee, a process
                    # exits during a remote syscall); its exit event follows, or was kept aside
                    # by the remote syscall that met it, and settles the bookkeeping.
                    _debug(f"thread gone while handled: {exc}")
                    processes.requeue_exits()
            self._interrupted = False  # (a signal this run took: it ended this one only)
        return not processes

    def _serve_breakpoint(self, pid: int, status: int) -> bool:
        """The hot path: if the stop is a thread of ours hitting one of our int3s, serve it
        without building an Event. False (the stop queued) for anything else."""
        processes = self.engine.processes
        if pid == -1:
            processes.clear()  # ECHILD: nothing left to wait for
            return False
        if status == _SIGTRAP_STOP:
            proc = processes.owner.get(pid)
            if proc is not None and pid not in proc.stepping:
                regs = sc.get_regs(pid)
                site = proc.sites.get(regs.rip - 1)
                state = proc.tracee.threads.get(pid)
                if site is not None and site.armed and state is not None:
                    state.stopped = True
                    state.in_event_stop = False
                    state.at_trap = site.addr
                    if self.engine.optimizer.due_in() == 0:
                        fresh = self._flushed_at_trap(proc, pid, site)
                        if fresh is None:
                            return True
                        regs = fresh
                    self.engine.traps.hit(proc, pid, site, regs)  # (its resume takes the stop)
                    return True
                if state is not None and (site is not None or (regs.rip - 1) in proc.retired):
                    state.stopped = True
                    if self.engine.traps.past_trap(proc, pid, regs, site):
                        return True
        taken = take_stop(pid)
        if taken is not None:
            processes.pending.append(decode_status(pid, taken))
        return False

    def _flushed_at_trap(self, proc: TracedProcess, tid: int, site: Site) -> Regs | None:
        """A batch of sites is due while `tid` stops at the int3 of `site`: optimized now, the
        thread still at the int3, which the optimizer knows to send through a jump that replaces
        it. Served first, the thread would resume through code that goes on inside the site's
        bytes (a trap's actions, a return probe's entry stamp), and no site a thread is about to
        run may be patched: a site hit often would stay a trap. None if the thread went on (at
        the site: its jump now, or its int3 again where a remote syscall of the flush put it
        back), else its registers now (the flush may have given it a thread area)."""
        self.engine.optimizer.flush(at_int3=tid)
        regs = sc.get_regs(tid)
        if site.armed and regs.rip != site.addr:
            return regs
        regs.rip = site.addr
        proc.set_trap_regs(tid, regs)
        proc.resume_trapped(tid)
        return None

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        """While `run()` serves stops: a handler then runs with its thread in the middle of
        being served (its registers read, to be written back), so nothing it calls may stop the
        world and change threads' registers under it (an optimization gives threads their GS
        base): that waits for the loop."""
        self.in_run = True
        try:
            yield
        finally:
            self.in_run = False

    @contextlib.contextmanager
    def _tracer_pinned(self) -> Iterator[None]:
        """While `run()` runs, the tracer stays on one CPU and resumed target threads wake up on it.

        A trap stop wakes the tracer and PTRACE_CONT wakes the target; when they are on different
        CPUs, each wake-up of an idle vCPU costs tens of microseconds on this kind of VM (measured
        ~200 us per hit, against ~20 us on one CPU), and the scheduler does not bring them
        together by itself. Pinning the target would change what it observes (nproc, thread-pool
        sizes), so only the wake-up is placed (Tracee.resume); the target's own mask is back
        before it runs an instruction."""
        allowed = os.sched_getaffinity(0)
        if not self.pin_tracer or len(allowed) < 2:
            yield
            return
        processes, data = self.engine.processes, self.engine.data
        cpu = thread_cpu(processes.main_pid, processes.main_pid)
        if cpu not in allowed:
            cpu = min(allowed)
        os.sched_setaffinity(0, {cpu})
        processes.home_cpu = cpu
        if data.consumer is not None:
            data.consumer.place(allowed - {cpu})  # draining rings never competes with the target
        self.engine.upcalls.place(allowed - {cpu}, spin=True)
        for proc in processes:
            proc.tracee.home_cpu = cpu
        try:
            yield
        finally:
            processes.home_cpu = None
            for proc in processes:
                proc.tracee.home_cpu = None
            os.sched_setaffinity(0, allowed)
            if data.consumer is not None:  # (made during the run, maybe: its thread took our CPU)
                data.consumer.place(allowed)
            self.engine.upcalls.place(allowed, spin=len(allowed) > 1)

    def _next_stop(self, timeout: float | None) -> tuple[int, int] | None:
        """The next (pid, status) of any tracee, (-1, 0) when none is left, or None when `timeout`
        seconds passed first, or a slice of it (`run()` waits again). The stop is only seen
        here, not taken (`peek_stop`): `_serve_breakpoint` serves an int3 hit, whose resume
        takes it, and takes any other stop.

        The main thread waits in waitid, woken by the waker at its time limit (see _wakeable),
        never by SIGCHLD: another thread of the Python program may take a SIGCHLD (the kernel
        gives a process's signal to any thread that does not block it) and leave this one
        asleep. Another thread's run has no waker, nor a wait with no tracee running (nothing
        for the waker to interrupt): it sleeps in sigtimedwait for SIGCHLD, in slices that bound
        what a SIGCHLD taken elsewhere costs, and how long a handler's call for the loop
        (core/upcalls.py) waits, where no stop may come."""
        if self._waker_on and (timeout is None or next(self.engine.processes.running_tids(), None) is not None):
            self._wait_until = None if timeout is None else time.monotonic() + timeout
            self._waiting = True  # (see _wakeable)
            try:
                return peek_stop(block=True)
            finally:
                self._waiting = False
                self._wait_until = None
        with sigchld_blocked():
            stop = peek_stop(block=False)
            if stop is None:
                signal.sigtimedwait([signal.SIGCHLD], WAIT_SLICE if timeout is None else min(timeout, WAIT_SLICE))
                stop = peek_stop(block=False)
        return stop

    @contextlib.contextmanager
    def _wakeable(self) -> Iterator[None]:
        """While `run()` runs in the main thread, a thread sends _WAKE_SIGNAL to it while it
        waits for a stop: every WAIT_SLICE, and at the wait's time limit. The wait returns with
        EINTR and Python runs the signal handlers due: a handler runs between bytecodes, so
        that of a signal caught just before the wait (a Ctrl-C) would otherwise run only once
        the wait ended, never on a target that never stops. `_woken` then interrupts a running
        tracee when a stop was asked for (a signal's handler, `request_stop`) or the time limit
        has passed, which ends the wait (Python itself would wait again). Nothing is added to
        serving a stop."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(_WAKE_SIGNAL, self._woken)
        main, done = threading.get_ident(), threading.Event()

        def until_the_next_poke() -> float:
            until = self._wait_until
            return WAIT_SLICE if until is None else min(WAIT_SLICE, max(until - time.monotonic(), 0.001))

        def wake_while_waiting() -> None:
            while not done.wait(until_the_next_poke()):
                if self._waiting:
                    with contextlib.suppress(OSError):
                        signal.pthread_kill(main, _WAKE_SIGNAL)

        waker = start_without_signals(wake_while_waiting, "dynprobe-waker")
        self._waker_on = True
        self._main = main
        try:
            yield
        finally:
            self._main = None
            self._waker_on = False
            done.set()
            waker.join()
            signal.signal(_WAKE_SIGNAL, previous)

    def _woken(self, signum: int, frame: FrameType | None) -> None:
        until = self._wait_until
        due = self.stop_requested or self.engine.upcalls.has_jobs()
        if self._waiting and (due or (until is not None and time.monotonic() >= until)):
            self.engine.processes.interrupt_running()

    def wake(self) -> None:
        """End the wait for a stop soon, from any thread (a handler's call for the loop to
        make, core/upcalls.py): at once in the main thread's run, else within a wait's slice."""
        main = self._main
        if main is not None and self._waiting:
            with contextlib.suppress(OSError):
                signal.pthread_kill(main, _WAKE_SIGNAL)

    def interrupt_wait(self) -> None:
        """Make `run()` return promptly (from a signal handler): never raises (an exception in
        the middle of waitpid could lose an event); sets a flag and PTRACE_INTERRUPTs a running
        tracee so the wait for a stop ends (see _wakeable)."""
        self._interrupted = self.stop_requested = True
        self.engine.processes.interrupt_running()
