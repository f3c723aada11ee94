"""Thread and process life: what the stop loop does with a stop that is not a hit on one of our
int3s (core/loop.py serves those): a thread born (clone) or ended, a process forked (followed,
or let go without our int3s) or exec'd (everything of the old image forgotten, the probes placed
again), and signals: ours (a trap, a single step, a fault in a detour's fetch) served, the
program's own passed on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
from typing import Protocol

from dynprobe.core.datapath import DataPath
from dynprobe.core.engine import Mechanism
from dynprobe.core.modules import Modules
from dynprobe.core.optimizer import Optimizer
from dynprobe.core.patching import Patcher
from dynprobe.core.processes import ProcessTable, exe_of
from dynprobe.core.traced import TracedProcess
from dynprobe.core.traps import Traps
from dynprobe.debug import ENABLED as DEBUG
from dynprobe.debug import debug as _debug
from dynprobe.ptrace import syscalls as sc
from dynprobe.ptrace.events import Event, EventKind, wait_event
from dynprobe.ptrace.process import EVENT_STOPS, ThreadState, Tracee
from dynprobe.symbols import files
from dynprobe.symbols.maps import read_maps

FAULT_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGTRAP}
_ENDED = (EventKind.EXITED, EventKind.KILLED)


class LifecycleEngine(Protocol):
    """What thread and process life asks of the runtime (core/runtime.py)."""

    processes: ProcessTable
    patcher: Patcher
    modules: Modules
    data: DataPath
    optimizer: Optimizer
    traps: Traps
    mechanisms: tuple[Mechanism, ...]  # told of forks and execs, in this order
    follow_fork: bool
    stats: dict[str, int]


class Lifecycle:
    """Handles the stops of thread and process life, and signals."""

    def __init__(self, engine: LifecycleEngine) -> None:
        self.engine = engine

    def handle(self, event: Event) -> None:
        processes = self.engine.processes
        proc = processes.owner.get(event.tid)
        if proc is None:
            if event.kind in _ENDED:
                processes.exited_unknown.add(event.tid)  # a thread whose clone event we have not seen
            else:
                processes.orphans[event.tid] = event
            return
        tracee = proc.tracee
        state = tracee.threads.get(event.tid)
        if state is None:
            state = tracee.threads[event.tid] = ThreadState(event.tid)
        state.stopped = event.kind not in _ENDED
        state.in_event_stop = event.kind in EVENT_STOPS
        kind = event.kind
        if state.stopped and kind is not EventKind.EXEC:  # (an exec: the areas went with the old image)
            self.engine.optimizer.thread_stopped(proc, event.tid)
        if kind in _ENDED:
            self._on_exit(proc, event)
        elif kind == EventKind.SIGNAL:
            self._on_signal(proc, event)
        elif kind == EventKind.STOP:
            tracee.resume(event.tid)
        elif kind == EventKind.GROUP_STOP:
            try:
                sc.listen(event.tid)
            except ProcessLookupError:
                pass
            except OSError:
                # EIO: no longer in its group-stop (a process stopped by job control when we
                # attached, whose thread then ran a remote syscall for us, which ends in our
                # int3's signal stop): that signal becomes the stop signal again.
                tracee.resume(event.tid, event.sig)
            state.stopped = False
        elif kind == EventKind.CLONE:
            processes.adopt_thread(proc, event.msg)
            tracee.resume(event.tid)
        elif kind in (EventKind.FORK, EventKind.VFORK):
            self._on_fork(proc, event)
        elif kind == EventKind.EXEC:
            self._on_exec(proc)
        else:  # VFORK_DONE
            tracee.resume(event.tid)

    def _on_exit(self, proc: TracedProcess, event: Event) -> None:
        """A thread ended. The process is gone once its last thread's exit is collected: not at
        the leader's (the leader may pthread_exit while others run, and in a group exit the
        tracer still has to reap every thread, or it stays a zombie the parent waits on forever)."""
        processes = self.engine.processes
        proc.tracee.threads.pop(event.tid, None)
        proc.stepping.pop(event.tid, None)
        processes.owner.pop(event.tid, None)
        if proc.areas is not None:
            proc.areas.retire(event.tid)
        status = event.code if event.kind == EventKind.EXITED else 128 + event.sig
        if event.tid == proc.pid or proc.leader_status is not None:
            proc.leader_status = status  # in a group exit every thread ends with the group's status
        if proc.leader_status is None:
            return
        for tid in [t for t in proc.tracee.threads if not os.path.exists(f"/proc/{proc.pid}/task/{t}")]:
            proc.tracee.threads.pop(tid)  # reaped already: nothing more will come from it
            processes.owner.pop(tid, None)
        if proc.tracee.threads:
            return
        proc.status = proc.leader_status
        if proc.pid == processes.main_pid:
            processes.exit_status = proc.status
        processes.journal.forget(proc.pid)
        proc.tracee.close_memory()
        processes.drop(proc)
        self.engine.data.release(proc)

    def _on_fork(self, parent: TracedProcess, event: Event) -> None:
        engine, processes = self.engine, self.engine.processes
        child_pid = event.msg
        vfork = event.kind == EventKind.VFORK
        child = TracedProcess(Tracee(child_pid, [child_pid]), parent.exe, follow=engine.follow_fork)
        child.sites = {a: dataclasses.replace(s, probes=list(s.probes)) for a, s in parent.sites.items()}
        child.moving = set(parent.moving)
        engine.modules.forked(parent, child)
        child.slots.inherit(parent.slots)
        child.rescue = parent.rescue  # its handler and its page (shared memory) came with the fork
        child.fixups = dict(parent.fixups)
        child.dirty = list(parent.dirty)
        if vfork:
            child.areas = parent.areas  # one address space: its thread takes an area of the parent's pools
        else:
            processes.journal.inherit(parent.pid, child_pid)
            child.gs_inherited = parent.areas is not None or parent.gs_inherited
        for mechanism in engine.mechanisms:
            mechanism.forked(parent, child, event.tid, vfork=vfork)
        processes.add(child)
        orphan = processes.orphans.pop(child_pid, None)
        if not engine.follow_fork and not vfork:
            # A copy of our int3s is in the child: take them out before it runs a single instruction.
            if orphan is None:
                while True:
                    ev = wait_event(child_pid)
                    if ev is None or ev.kind in (EventKind.STOP, EventKind.SIGNAL, *_ENDED):
                        orphan = ev
                        break
            if orphan is not None and orphan.kind not in _ENDED:
                for mechanism in engine.mechanisms:
                    mechanism.let_go(child)
                engine.patcher.take_out_int3s(child)
                engine.patcher.uninstall_rescue(child, child_pid)
                with contextlib.suppress(OSError):
                    sc.detach(child_pid, orphan.sig if orphan.kind == EventKind.SIGNAL else 0)
            processes.journal.forget(child_pid)
            child.tracee.close_memory()
            processes.drop(child)
        elif orphan is not None:
            # Followed, or a vfork child: it shares our memory (vfork) or has its own copy of the
            # armed probes (fork); either way it is served like any traced process.
            processes.pending.append(orphan)
        parent.tracee.resume(event.tid)

    def _on_exec(self, proc: TracedProcess) -> None:
        engine, processes = self.engine, self.engine.processes
        pid = proc.pid
        # (A non-leader thread that exec'd took the leader's tid: its exec stop is reported as
        # the pid's, and every other thread is gone.)
        for tid in list(proc.tracee.threads):
            if tid != pid:
                proc.tracee.threads.pop(tid)
                processes.owner.pop(tid, None)
        # A fresh state: nothing of the thread whose tid the exec'ing one took (stopped at a trap
        # of the old image, say) carries over.
        proc.tracee.threads[pid] = ThreadState(pid, in_event_stop=True)
        proc.sites.clear()
        proc.moving.clear()
        proc.stepping.clear()
        proc.retired.clear()
        proc.comms.clear()
        proc.slots.forget()
        processes.journal.forget(pid)
        engine.data.release(proc)
        proc.areas = None
        proc.gs_inherited = False
        proc.areas_refused = None
        proc.fixups.clear()
        proc.dirty.clear()
        for mechanism in engine.mechanisms:
            mechanism.forget_image(proc)
        proc.loader_hook = None
        proc.needed = None
        if not proc.follow:
            # An unfollowed vfork child leaves our shared memory: let it go.
            with contextlib.suppress(OSError):
                sc.detach(pid)
            processes.drop(proc)
            return
        proc.tracee.open_memory()
        proc.exe = exe_of(pid)
        proc.rescue = None  # the exec took the handler and its page with the old image
        engine.patcher.install_rescue(proc)
        engine.modules.sync_process(proc)
        with files.unchanged(), proc.tracee.batched():
            maps = read_maps(pid)
            for mechanism in engine.mechanisms:
                mechanism.execed(proc, maps)
        proc.tracee.resume(pid)

    def _on_signal(self, proc: TracedProcess, event: Event) -> None:
        traps = self.engine.traps
        tid, sig = event.tid, event.sig
        step = proc.stepping.get(tid)
        if proc.fixups and sig in (signal.SIGSEGV, signal.SIGBUS) and step is None:
            regs = sc.get_regs(tid)
            fixup = proc.fixups.get(int(regs.rip))
            if fixup is not None:
                # A fetch in a detour read a bad address: the value is marked faulted, the
                # target never sees the signal (the kernel's exception table, in user space).
                regs.rip = fixup
                sc.set_regs(tid, regs)
                self.engine.stats["fixups"] += 1
                proc.tracee.resume(tid)
                return
        if sig == signal.SIGTRAP:
            if step is None:
                # Our int3s are told apart by address (as the kernel's uprobes do): a thread at
                # site+1 of an armed site executed it. No GETSIGINFO on this hot path.
                regs = sc.get_regs(tid)
                site = proc.sites.get(regs.rip - 1)
                if site is not None and site.armed:
                    traps.hit(proc, tid, site, regs)
                    return
                if traps.past_trap(proc, tid, regs, site):
                    return
            elif sc.get_siginfo(tid).si_code != sc.SI_KERNEL:
                traps.finish_step(proc, tid, step)
                return
        if step is not None:
            if sig in FAULT_SIGNALS:  # the instruction itself faulted in its slot
                proc.stepping.pop(tid)
                traps.deliver_fault(proc, tid, sig)
                return
            step.held_signals.append(sig)  # asynchronous: deliver once the step is done
            proc.tracee.resume(tid, 0, step=True)
            return
        if sig in FAULT_SIGNALS:
            if DEBUG:
                info, regs = sc.get_siginfo(tid), sc.get_regs(tid)
                _debug(f"{signal.Signals(sig).name} of the target's own: tid {tid} rip {regs.rip:#x} rsp {regs.rsp:#x}"
                       f" code {info.si_code:#x} address {info.si_addr:#x}")  # fmt: skip
            traps.deliver_fault(proc, tid, sig)
            return
        proc.tracee.resume(tid, sig)
