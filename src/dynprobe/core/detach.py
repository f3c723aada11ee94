"""Detach: every byte dynprobe wrote put back, every thread moved out of our traps, slots and
detours, and let go in a state a tracer's death leaves harmless, with the signals it is due. The
order of the steps is the point of this module: the mechanisms take their code out first (with
the world stopped, no thread enters it again), threads inside it are walked out, and the rescue
handler goes last, once no thread can take a SIGTRAP of ours.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Protocol

from dynprobe.arch.x86_64 import FLAG_TF, Regs
from dynprobe.core.datapath import DataPath
from dynprobe.core.ftrace import Tracing
from dynprobe.core.lifecycle import FAULT_SIGNALS
from dynprobe.core.optimizer import Optimizer
from dynprobe.core.patching import Patcher
from dynprobe.core.processes import ProcessTable, state_from_stop, traced_by_us
from dynprobe.core.returns import ReturnProbes
from dynprobe.core.traced import TracedProcess
from dynprobe.core.traps import Traps
from dynprobe.core.upcalls import Upcalls
from dynprobe.debug import debug as _debug
from dynprobe.errors import ProcessError
from dynprobe.ptrace import syscalls as sc
from dynprobe.ptrace.events import EventKind, wait_event
from dynprobe.ptrace.process import EVENT_STOPS, TRACE_OPTIONS, ThreadState
from dynprobe.ptrace.procfs import runs_no_code_to_take, sigtrap_pending

_TRACE_CHILDREN = sc.PTRACE_O_TRACECLONE | sc.PTRACE_O_TRACEFORK | sc.PTRACE_O_TRACEVFORK | sc.PTRACE_O_TRACEVFORKDONE
_ENDED = (EventKind.EXITED, EventKind.KILLED)


def _in_sigtrap_stop(tid: int) -> bool:
    """Whether stopped thread `tid` is in the signal-delivery stop of a SIGTRAP (an int3, a
    single step), which a dying tracer lets go on to take that signal when not yet taken."""
    try:
        info = sc.get_siginfo(tid)
    except OSError:
        return False
    return (
        int(info.si_signo) == signal.SIGTRAP
        and int(info.si_code) >> 8 == 0
        and int(info.si_code) != signal.SIGTRAP | 0x80
    )


def _in_syscall_stop(tid: int) -> bool:
    """Whether stopped thread `tid` is at a system-call stop (where our remote syscalls end)."""
    try:
        return int(sc.get_siginfo(tid).si_code) == signal.SIGTRAP | 0x80
    except OSError:
        return False


class DetachEngine(Protocol):
    """What a detach asks of the runtime (core/runtime.py)."""

    processes: ProcessTable
    patcher: Patcher
    data: DataPath
    optimizer: Optimizer
    returns: ReturnProbes
    tracing: Tracing
    traps: Traps
    upcalls: Upcalls

    def in_own_code(self, proc: TracedProcess, rip: int) -> bool: ...


class Detacher:
    """Lets the traced processes go."""

    def __init__(self, engine: DetachEngine) -> None:
        self.engine = engine

    def detach_all(self) -> None:
        """Restore every byte written, move threads out of slots and traps, and let all go."""
        processes = self.engine.processes
        self.engine.upcalls.stop()  # (no handler runs while the processes are let go)
        for proc in processes:
            try:
                self._detach_process(proc)
            except (ProcessError, OSError) as exc:
                _debug(f"detach of {proc.pid}: {exc}")
        processes.clear()

    def _detach_process(self, proc: TracedProcess) -> None:
        """Let one process go. Each step stands alone: a thread that fails (it died under us) must
        not keep the others attached, and the /proc sweep at the end always runs."""
        engine, processes = self.engine, self.engine.processes
        try:
            processes.stop_all(proc)
            # Events that arrived for this process but were not handled yet belong to its threads.
            for event in [e for e in processes.pending if processes.owner.get(e.tid) is proc]:
                processes.pending.remove(event)
                processes.note_exit(event)
                state = proc.tracee.threads.get(event.tid)
                if state is not None:
                    state.deferred.append(event)
            for tid, state in proc.tracee.threads.items():
                if state.stopped:
                    self._deliver_held_signal(proc, tid, state)
            processes.adopt_unseen_threads(proc)
            engine.upcalls.let_go_all(proc)  # (threads that ask go on unheard; none waits later)
            engine.optimizer.restore_all(proc)
            engine.tracing.restore(proc)
            if proc.areas is not None:
                proc.areas.publish_held()
                engine.data.end_waits(proc.areas)
            engine.returns.before_detach(proc)
            self._leave_detours(proc)
            self._reset_thread_areas(proc, keep=engine.returns.keep_areas_at_detach(proc))
            engine.patcher.take_out_int3s(proc)
            # Every thread made ready to go while the rescue handler still stands: after it is
            # gone, a killed dynprobe must leave no thread a SIGTRAP of ours.
            due: dict[int, int] = {}
            for tid, state in list(proc.tracee.threads.items()):
                _debug(
                    f"detach: thread {tid} stopped={state.stopped} stepped={state.stepped} deferred={state.deferred}"
                )
                try:
                    sig = self._settle_thread(proc, tid, state) if state.stopped else None
                except OSError as exc:
                    _debug(f"detach: thread {tid}: {exc}")
                    continue
                if sig is not None:
                    due[tid] = sig
            if due:
                engine.patcher.uninstall_rescue(proc, next(iter(due)))
            for tid, sig in due.items():
                try:
                    self._detach_thread(proc, tid, sig)
                except OSError as exc:
                    _debug(f"detach: thread {tid}: {exc}")
        finally:
            self._detach_stragglers(proc)
            proc.tracee.close_memory()

    def _detach_stragglers(self, proc: TracedProcess) -> None:
        """Whatever our bookkeeping believes, no thread may stay traced by us after detach: it
        would sit in a ptrace stop for as long as this process lives. /proc has the last word."""
        for _ in range(3):
            left = traced_by_us(proc)
            if not left:
                return
            for tid in left:
                with contextlib.suppress(OSError):
                    sc.interrupt(tid)
                event = self.engine.processes.wait_stop(tid, timeout=1.0)
                _debug(f"detach: thread {tid} of {proc.pid} was still traced; its stop: {event}")
                try:
                    state = proc.tracee.threads[tid] = state_from_stop(tid, event)
                    sig = self._settle_thread(proc, tid, state)
                    if sig is not None:
                        self._detach_thread(proc, tid, sig)
                except OSError as exc:
                    _debug(f"detach: thread {tid}: {exc}")

    def _deliver_held_signal(self, proc: TracedProcess, tid: int, state: ThreadState) -> None:
        """A thread stopped with a signal for the program (a terminal's SIGINT) takes it now,
        before dynprobe's last system calls run in it: resumed from that stop without it, the
        signal would be lost, and a system call it interrupted (pause) restarted instead of
        failing with EINTR. A single step with the signal sets up its handler as the kernel
        would and stops before the handler's first instruction (or the signal ends the
        process); a signal whose taking would run the program's code is left to the detach."""
        held = [e for e in state.deferred if e.kind == EventKind.SIGNAL and e.sig not in FAULT_SIGNALS]
        if not held or not runs_no_code_to_take(proc.pid, tid, held[-1].sig):
            return
        try:
            if sc.get_siginfo(tid).si_signo != held[-1].sig:
                return  # no longer in that signal's stop: the detach delivers what it can
            rip = int(sc.get_regs(tid).rip)
            if (rip - 1) in proc.sites or self.engine.traps.slot_site(proc, rip) or self.engine.in_own_code(proc, rip):
                return  # (its handler would return where the detach is about to move it from)
            sc.singlestep(tid, held[-1].sig)
            state.stepped = True
        except OSError as exc:
            _debug(f"detach: thread {tid}: signal {held[-1].sig} not delivered ahead: {exc}")
            return
        state.deferred.remove(held[-1])
        event = self.engine.processes.wait_stop(tid, timeout=1.0)
        if event is not None and event.kind == EventKind.SIGNAL and event.sig != signal.SIGTRAP:
            state.deferred.append(event)  # another signal came meanwhile: the detach delivers it
        elif event is not None and event.kind in _ENDED:
            self.engine.processes.pending.append(event)  # the signal ended it (its default action)

    def _leave_detours(self, proc: TracedProcess) -> None:
        """A thread inside a detour runs to its end one instruction at a time, so no thread needs
        a detour or its thread area once we are gone (a fetch that faults meanwhile goes to its
        fix-up; other signals are kept for the detach to deliver)."""
        for tid, state in list(proc.tracee.threads.items()):
            if not state.stopped:
                continue
            try:
                before = sc.get_regs(tid)
                rip = int(before.rip)
                # (a detour is straight code, one bounded string loop, and a wait for room in a
                # full ring, which end_waits made or ended)
                for _ in range(100_000):
                    if not self.engine.in_own_code(proc, rip):
                        break
                    sc.singlestep(tid, 0)
                    state.stepped = True
                    event = self.engine.processes.note_exit(wait_event(tid))
                    if event is None or event.kind in _ENDED:
                        proc.tracee.threads.pop(tid, None)
                        break
                    regs = sc.get_regs(tid)
                    if event.kind == EventKind.SIGNAL and event.sig in (signal.SIGSEGV, signal.SIGBUS):
                        fixup = proc.fixups.get(int(regs.rip))
                        if fixup is not None:
                            regs.rip = fixup
                            sc.set_regs(tid, regs)
                            rip = fixup
                            continue
                    if not (event.kind == EventKind.SIGNAL and event.sig == signal.SIGTRAP):
                        state.deferred.append(event)
                    rip = int(regs.rip)
                if state.stepped and tid in proc.tracee.threads:
                    self._untrapped(tid, before)
            except OSError as exc:
                _debug(f"detach: thread {tid} could not leave its detour: {exc}")

    @staticmethod
    def _untrapped(tid: int, before: Regs) -> None:
        """A thread stepped through a detour's pushfq saved our trap flag with its flags, and its
        popfq put it back as the program's own: taken out, unless the thread had it before."""
        regs = sc.get_regs(tid)
        if regs.eflags & FLAG_TF and not before.eflags & FLAG_TF:
            regs.eflags &= ~FLAG_TF
            sc.set_regs(tid, regs)

    def _reset_thread_areas(self, proc: TracedProcess, keep: set[int]) -> None:
        """GS bases back to 0 (as we found them), except for a thread still running a detour,
        which needs its area until it is out, and the threads in `keep` (frames that still
        return through the trampoline). The memory stays mapped in the target."""
        if proc.areas is None:
            return
        for tid, state in proc.tracee.threads.items():
            if not state.stopped or not proc.areas.owns(tid) or tid in keep:
                continue
            try:
                regs = sc.get_regs(tid)
                if not self.engine.in_own_code(proc, int(regs.rip)):
                    regs.gs_base = 0
                    sc.set_regs(tid, regs)
            except OSError:
                continue

    def _settle_thread(self, proc: TracedProcess, tid: int, state: ThreadState) -> int | None:
        """Make stopped thread `tid` ready to be let go: off our sites and slots, and in a stop
        that a killed dynprobe leaves harmless. Returns the signal its detach delivers (None:
        it is gone)."""
        if not any(e.kind == EventKind.SIGNAL and e.sig == signal.SIGTRAP for e in state.deferred) and (
            sigtrap_pending(proc.pid, tid)
        ):
            # It executed our int3 just as our PTRACE_INTERRUPT came: the interrupt stop is reported
            # before pending signals, so the SIGTRAP still waits in its queue. Detached now, it
            # would take that SIGTRAP with no tracer and die of it. Let it report the trap first.
            with contextlib.suppress(OSError):
                sc.cont(tid)
            event = self.engine.processes.wait_stop(tid, timeout=1.0)
            _debug(f"detach: thread {tid} had a SIGTRAP pending; reported as {event}")
            if event is not None and event.kind == EventKind.SIGNAL:
                state.deferred.append(event)
        try:
            regs = sc.get_regs(tid)
        except OSError as exc:
            _debug(f"detach: thread {tid}: no registers ({exc}); deferred {state.deferred}")
            return None
        # Only a SIGTRAP stop we saw counts: GETSIGINFO of a PTRACE_INTERRUPT stop also reads as
        # SIGTRAP/SI_KERNEL, and a thread interrupted at site+1 (after an emulated push) must not
        # be rewound.
        signals = [e.sig for e in state.deferred if e.kind == EventKind.SIGNAL]
        trapped = signal.SIGTRAP in signals
        sig = next((s for s in reversed(signals) if s != signal.SIGTRAP), 0)
        rip = int(regs.rip)
        step = proc.stepping.pop(tid, None)
        site = self.engine.traps.slot_site(proc, rip) or (step.site if step else None)
        if site is not None and site.in_slot(rip):
            regs.rip = site.original_rip(rip)
            proc.set_trap_regs(tid, regs)
        elif trapped and (rip - 1) in proc.sites:
            regs.rip = rip - 1  # stopped on our int3, now gone: run the original instruction
            proc.set_trap_regs(tid, regs)
        elif trapped and step is None and not sig:
            sig = signal.SIGTRAP  # the target's own trap: it is due to it
        if step is not None and step.held_signals:
            sig = step.held_signals[0]
        state.deferred = [e for e in state.deferred if e.kind != EventKind.SIGNAL]  # (in `sig` now)
        if sig != signal.SIGTRAP and (state.stepped or _in_sigtrap_stop(tid)):
            return self._park(proc, tid, state, sig)
        return sig

    def _park(self, proc: TracedProcess, tid: int, state: ThreadState, sig: int) -> int | None:
        """Move a thread out of a stop that a dying dynprobe would leave with a SIGTRAP (an int3
        stop not taken yet, the trap flag of a single step): resumed with the signal it is due,
        and interrupted at once, it waits in an interrupt stop, which a tracer's death or the
        detach ends as is. Threads and processes it creates meanwhile are not traced. Returns
        the signal its detach delivers: that of a signal stop reached instead (None: gone)."""
        with contextlib.suppress(OSError):
            sc.set_options(tid, TRACE_OPTIONS & ~_TRACE_CHILDREN)
        proc.resume_trapped(tid, sig)
        with contextlib.suppress(OSError):
            sc.interrupt(tid)
        event = self.engine.processes.wait_stop(tid, timeout=1.0)
        if event is None or event.kind in _ENDED:
            if event is not None:
                self.engine.processes.pending.append(event)
            proc.tracee.threads.pop(tid, None)
            return None
        state.stopped = True
        state.in_event_stop = event.kind in EVENT_STOPS
        return event.sig if event.kind == EventKind.SIGNAL else 0

    @staticmethod
    def _detach_thread(proc: TracedProcess, tid: int, sig: int) -> None:
        """Let settled thread `tid` go with signal `sig`, and the signals it reported since (a
        pending one the remote system call that took the rescue handler out made it take)."""
        state = proc.tracee.threads.get(tid)
        later = [e.sig for e in state.deferred if e.kind == EventKind.SIGNAL and e.sig != signal.SIGTRAP] if (
            state is not None
        ) else []  # fmt: skip
        if later and not sig:
            sig = later.pop()
        for other in later:  # (queued again: the detach delivers one)
            with contextlib.suppress(OSError):
                sc.tgkill(proc.pid, tid, other)
        if (
            sig
            and sig not in FAULT_SIGNALS
            and state is not None
            and state.interrupted is not None
            and _in_syscall_stop(tid)
        ):
            # A signal that came while our system call ran in it: sent on from this stop (as
            # the kernel does from a system-call stop), with the registers of the call it
            # interrupted, so that its handler's return restarts it or fails it with EINTR.
            sc.set_regs(tid, state.interrupted)
        _debug(f"detach: thread {tid} let go with signal {sig}")
        with contextlib.suppress(OSError):
            sc.detach(tid, sig)
