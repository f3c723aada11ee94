"""The process table: every traced process and thread, the stops collected and not yet handled,
and stopping the world. A thread's stop is seen by whoever waits for it first; what is not handled
at once is queued here (`pending`) or kept on its thread (`ThreadState.deferred`), so that the
stop loop (core/loop.py), a world stop and a detach never lose one another's events. Nothing
here knows a mechanism.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator

from dynprobe.core.traced import TracedProcess
from dynprobe.debug import debug as _debug
from dynprobe.errors import ProcessError
from dynprobe.ptrace import syscalls as sc
from dynprobe.ptrace.events import (
    WAIT_SLICE,
    Event,
    EventKind,
    in_tracing_stop,
    poll_event,
    sigchld_blocked,
    wait_event,
)
from dynprobe.ptrace.journal import Journal
from dynprobe.ptrace.process import EVENT_STOPS, ThreadState, tracer_of
from dynprobe.ptrace.procfs import list_threads
from dynprobe.symbols.maps import root_of

_ENDED = (EventKind.EXITED, EventKind.KILLED)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block is done, then take effect: a Ctrl-C (often the
    second one) must not cut a detach short, or the target keeps int3s and jumps of a tracer that
    is gone. (Python runs handlers in the main thread whichever thread the signal reached: the
    handlers are replaced, not the signals blocked.) Only from the main thread, where handlers
    can be set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in held}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)


def exe_of(pid: int) -> str:
    """The executable of `pid`, as we reach it (through its root)."""
    try:
        return root_of(pid) + os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
    except OSError as exc:
        raise ProcessError(f"cannot read the executable of pid {pid}: {exc.strerror}") from exc


def traced_by_us(proc: TracedProcess) -> list[int]:
    """Threads of `proc` that /proc says we trace, whatever our bookkeeping believes."""
    me = os.getpid()
    try:
        return [t for t in list_threads(proc.pid) if tracer_of(proc.pid, t) == me]
    except ProcessError:
        return []


def state_from_stop(tid: int, event: Event | None) -> ThreadState:
    """A stopped thread's state, keeping the stop's event unless it needs no handling."""
    state = ThreadState(tid)
    if event is not None and event.kind not in (EventKind.STOP, *_ENDED):
        state.deferred.append(event)
    return state


class ProcessTable:
    """The traced processes of a session and the owner of each thread."""

    def __init__(self, main_pid: int, journal: Journal) -> None:
        self.main_pid = main_pid
        self.journal = journal  # the guardian's: every process writes its changes there
        self.by_pid: dict[int, TracedProcess] = {}
        self.owner: dict[int, TracedProcess] = {}  # tid -> its process
        self.orphans: dict[int, Event] = {}  # stops of threads whose clone event has not come yet
        self.exited_unknown: set[int] = set()  # threads that ended before their clone event came
        self.pending: deque[Event] = deque()  # events collected, to be handled by the stop loop
        self.exit_status: int | None = None  # of the main process, once it ended
        self.home_cpu: int | None = None  # where the tracer is pinned while it runs (core/loop.py)
        self.started = False  # the threads were let go once (a spawned command ran)
        self.closed = False

    def add(self, proc: TracedProcess) -> None:
        proc.tracee.home_cpu = self.home_cpu
        proc.tracee.journal = self.journal
        self.by_pid[proc.pid] = proc
        for tid in proc.tracee.threads:
            self.owner[tid] = proc

    def drop(self, proc: TracedProcess) -> None:
        """Forget a process we no longer trace (its threads' ownership too)."""
        self.by_pid.pop(proc.pid, None)
        for tid in [t for t, p in self.owner.items() if p is proc]:
            del self.owner[tid]

    def clear(self) -> None:
        self.by_pid.clear()
        self.owner.clear()

    def process(self, pid: int) -> TracedProcess | None:
        return self.by_pid.get(pid)

    def process_of(self, tid: int) -> TracedProcess | None:
        """The traced process a thread belongs to."""
        return self.owner.get(tid)

    def main(self) -> TracedProcess | None:
        """The process probes are placed in: the command's, or any left once it ended."""
        return self.by_pid.get(self.main_pid) or next(iter(self.by_pid.values()), None)

    def traced(self) -> list[TracedProcess]:
        """The followed processes still alive."""
        return [p for p in self.by_pid.values() if p.follow and p.status is None]

    def __iter__(self) -> Iterator[TracedProcess]:
        return iter(list(self.by_pid.values()))

    def __bool__(self) -> bool:
        return bool(self.by_pid)

    # --- threads --------------------------------------------------------------------------------
    def adopt_thread(self, proc: TracedProcess, tid: int) -> None:
        """A thread `proc` cloned (its clone event came)."""
        if tid in self.exited_unknown:
            self.exited_unknown.discard(tid)  # born and gone before its clone event reached us
            return
        self.owner[tid] = proc
        orphan = self.orphans.pop(tid, None)
        if orphan is not None:
            self.pending.append(orphan)
        # Already known when attach saw the thread before its creator's clone event. Otherwise
        # the thread counts as running until its first stop is collected: it may sit in that
        # stop already, but a stop nobody has waited for is not ours to use. Remote syscalls
        # run in it would swallow the stop's event, and nothing would ever resume the thread.
        proc.tracee.threads.setdefault(tid, ThreadState(tid, stopped=orphan is not None))

    def adopt_unseen_threads(self, proc: TracedProcess) -> None:
        """Threads born while we worked, whose clone event we have not matched yet: PTRACE_O_TRACECLONE
        attached them, so they sit in their first stop and must be let go too."""
        for tid in traced_by_us(proc):
            if tid in proc.tracee.threads:
                continue
            event = self.orphans.pop(tid, None)
            for queued in [e for e in self.pending if e.tid == tid]:
                self.pending.remove(queued)
                event = event or queued
            if event is None:
                event = self.note_exit(wait_event(tid))  # its first stop is imminent: it is born stopped
            proc.tracee.threads[tid] = state_from_stop(tid, event)

    def running_tids(self) -> Iterator[int]:
        return (t for p in self.by_pid.values() for t, s in p.tracee.threads.items() if not s.stopped)

    def interrupt_running(self) -> None:
        """PTRACE_INTERRUPT a running tracee (one is enough to end a wait for any stop)."""
        for tid in self.running_tids():
            try:
                sc.interrupt(tid)
            except OSError:
                continue
            return

    def start(self) -> None:
        """Let every thread go, the first time."""
        if self.started:
            return
        self.started = True
        for proc in list(self.by_pid.values()):
            for state in list(proc.tracee.threads.values()):
                self.release(proc, state)

    def release(self, proc: TracedProcess, state: ThreadState) -> None:
        """Resume a stopped thread, or queue the events it collected while the world was stopped."""
        if state.deferred:
            self.pending.extend(state.deferred)
            state.deferred = []
        elif state.stopped:
            proc.tracee.resume(state.tid)

    def requeue_exits(self) -> None:
        """Exit events a remote syscall met, handled as they come."""
        for proc in self.by_pid.values():
            for state in proc.tracee.threads.values():
                exits = [e for e in state.deferred if e.kind in _ENDED]
                if exits:
                    state.deferred = [e for e in state.deferred if e not in exits]
                    self.pending.extend(exits)

    def note_exit(self, event: Event | None) -> Event | None:
        """The command's end, reaped while we let it go (a detach waits for stops and may get
        it): its status is here alone, for `exit_status`."""
        if event is not None and event.tid == self.main_pid and event.kind in _ENDED:
            self.exit_status = event.code if event.kind == EventKind.EXITED else 128 + event.sig
        return event

    def wait_stop(self, tid: int, timeout: float) -> Event | None:
        """The next stop of `tid`, polling up to `timeout` seconds (None if it does not come:
        then it is stopped already, its event taken earlier)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            event = poll_event(tid)
            if event is not None:
                return self.note_exit(event)
            if in_tracing_stop(tid, tid):
                time.sleep(0.001)
                return self.note_exit(poll_event(tid))
            time.sleep(0.0005)
        return None

    # --- stopping the world ---------------------------------------------------------------------
    @contextlib.contextmanager
    def world_stopped(self, proc: TracedProcess) -> Iterator[int | None]:
        """Every thread of `proc` stopped; yields one tid usable for remote syscalls, or None
        when there is nothing to work on: the process is going away, or it has exec'd (what we
        know of its memory is of the old image; its exec event, handled next, starts over).
        A Ctrl-C meanwhile takes effect after the block: its changes to the target (a jump
        written, its site not yet known) must not be cut short."""
        with signals_held():
            interrupted = self.stop_all(proc)
            try:
                gone = proc.tracee.image_gone()
                yield None if gone else next((t for t, s in proc.tracee.threads.items() if s.stopped), None)
            finally:
                if self.started and not self.closed:
                    for t in interrupted:
                        state = proc.tracee.threads.get(t)
                        if state is not None:
                            self.release(proc, state)

    def stop_all(self, proc: TracedProcess) -> list[int]:
        """Interrupt every running thread of `proc` and wait until each has stopped. Events of
        other threads seen meanwhile are queued; those of interrupted threads are kept on them."""
        running = [t for t, s in proc.tracee.threads.items() if not s.stopped]
        for tid in running:
            try:
                sc.interrupt(tid)
            except ProcessLookupError as exc:
                _debug(f"stop_all: interrupt {tid}: {exc}")
        waiting = set(running)
        quiet_slices = 0
        with sigchld_blocked():
            while waiting:
                # Each thread's own stop, never another's: a thread being served at a trap
                # keeps its stop until its resume (see peek_stop).
                event = next((e for e in map(poll_event, list(waiting)) if e is not None), None)
                if event is None:
                    signal.sigtimedwait([signal.SIGCHLD], WAIT_SLICE)
                    quiet_slices += 1
                    if quiet_slices >= 4:
                        # /proc says a thread is in a tracing stop: its event is taken now (the
                        # stop may be the one that just ended the slice), or it was taken
                        # earlier (a stop is reported once) and /proc is all there is.
                        for tid in [t for t in waiting if in_tracing_stop(proc.pid, t)]:
                            waiting.discard(tid)
                            late = poll_event(tid)
                            if late is not None:
                                self._took_stop(proc, late)
                            else:
                                proc.tracee.threads[tid].stopped = True
                        # Rarely, a running thread does not stop for its interrupt (seen once in
                        # thousands of stop-the-worlds): ask again, it is idempotent.
                        for tid in waiting:
                            _debug(f"stop_all: thread {tid} did not stop; interrupting it again")
                            with contextlib.suppress(ProcessLookupError):
                                sc.interrupt(tid)
                        quiet_slices = 0
                    continue
                quiet_slices = 0
                waiting.discard(event.tid)
                self._took_stop(proc, event)
        return running

    def _took_stop(self, proc: TracedProcess, event: Event) -> None:
        """The stop (or end) of a thread `stop_all` interrupted: kept on the thread, the stop
        at one of our int3s rewound to the site."""
        if event.kind in _ENDED:
            self.pending.append(event)
            return
        state = proc.tracee.threads[event.tid]
        state.stopped = True
        state.in_event_stop = event.kind in EVENT_STOPS
        if event.kind != EventKind.STOP and not _rewound(proc, event):
            state.deferred.append(event)


def _rewound(proc: TracedProcess, event: Event) -> bool:
    """A taken stop at one of our int3s becomes a plain stop at the site: the thread hits it
    again when it runs on (and should dynprobe die first, it runs the site, not the middle of
    its instruction: a taken stop is resumed with no signal)."""
    if event.kind != EventKind.SIGNAL or event.sig != signal.SIGTRAP:
        return False
    try:
        regs = sc.get_regs(event.tid)
        site = proc.sites.get(int(regs.rip) - 1)
        if site is None or not (site.armed or site.optimized):
            return False
        regs.rip = site.addr
        sc.set_regs(event.tid, regs)
    except OSError:
        return False
    return True
