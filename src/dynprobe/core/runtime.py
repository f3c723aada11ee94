"""The runtime of one session: it makes the services (the process table, patching, module
tracking, the data path, thread and process life, the stop loop, detach) and the mechanisms
(trap probes, the optimizer, return probes, the function tracer), and gives each what it asks
for: every mechanism and service names what it needs in a protocol next to its code
(`OptimizerEngine`, `PatcherEngine`, ...), and this class meets them all, mostly by handing the
question to the service that owns the answer. Nothing imports it but the session
(core/session.py), which holds the public API over it.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections import Counter
from collections.abc import Callable

from dynprobe.actions.model import Program
from dynprobe.arch.x86_64 import SLOT_SIZE, Regs
from dynprobe.arch.x86_64.codegen.asm import Unsupported
from dynprobe.core.datapath import DataPath
from dynprobe.core.delivery import Delivery
from dynprobe.core.detach import Detacher
from dynprobe.core.engine import Mechanism
from dynprobe.core.ftrace import Tracing
from dynprobe.core.lifecycle import Lifecycle
from dynprobe.core.loop import StopLoop
from dynprobe.core.modules import Modules
from dynprobe.core.optimizer import Optimizer, new_thread_areas
from dynprobe.core.patching import Patcher
from dynprobe.core.probe import Hit, Probe, ProbeEvent, Site
from dynprobe.core.processes import ProcessTable, exe_of
from dynprobe.core.returns import ReturnProbes
from dynprobe.core.stackmaps import STACK_SLOTS, StackMaps
from dynprobe.core.stacks import Stack, walk
from dynprobe.core.traced import TracedProcess
from dynprobe.core.traps import Traps
from dynprobe.core.upcalls import Upcalls
from dynprobe.errors import OptimizeRefusal, ProcessError
from dynprobe.ptrace import syscalls as sc
from dynprobe.ptrace.guardian import Guardian
from dynprobe.ptrace.process import Tracee
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.areas import ThreadAreas
from dynprobe.spec.fetch import FetchContext
from dynprobe.symbols.maps import Mapping
from dynprobe.symbols.resolve import Location


class Runtime:
    """The services and mechanisms of one session, wired together."""

    def __init__(self, tracee: Tracee, *, follow_fork: bool, warn: Callable[[str], None]) -> None:
        self.follow_fork = follow_fork
        self.optimize = True  # False: every probe stays a trap
        self.probes: list[Probe] = []
        self.stats = {"stops": 0, "fixups": 0}
        self.warn = warn
        self._failed: set[Probe] = set()  # probes whose handler raised (see handler_failed)
        self.guardian = Guardian()
        journal = self.guardian.journal
        journal.on_full = lambda: warn(
            f"more than {journal.capacity:,} code changes: if dynprobe dies, its guardian will not put back the rest"
        )
        self.processes = ProcessTable(tracee.pid, journal)
        self.delivery = Delivery(self)
        self.data = DataPath(self)
        self.probe_by_index = self.data.probe_by_index  # (asked at every return an upcall serves)
        self.optimizer = Optimizer(self)
        self.returns = ReturnProbes(self)
        self.tracing = Tracing(self)
        self.upcalls = Upcalls(self)
        self.stackmaps = StackMaps(self)
        self.mechanisms: tuple[Mechanism, ...] = (
            self.optimizer, self.returns, self.tracing, self.upcalls, self.stackmaps,
        )  # fmt: skip
        self.traps = Traps(self)
        self.patcher = Patcher(self)
        self.modules = Modules(self)
        self.lifecycle = Lifecycle(self)
        self.loop = StopLoop(self)
        self.detacher = Detacher(self)
        try:
            proc = TracedProcess(tracee, exe_of(tracee.pid))
            self.processes.add(proc)
            self.patcher.install_rescue(proc)
            self.modules.sync_process(proc)
        except BaseException:
            self.guardian.dismiss()
            raise

    def shut_down(self, *, kill: bool) -> None:
        """Let every process go (`kill`: a spawned command that never ran is killed instead: it
        has not executed a single instruction of its own), stop the consumer, and end the
        guardian, or hand it what a detach that could not finish left."""
        try:
            self.upcalls.stop()  # (no handler runs while the processes are let go or killed)
            if kill:
                self._kill_all()
            else:
                self.detacher.detach_all()
        finally:
            self.upcalls.close()
            self.data.stop_consumer()
            if self.guardian.journal.empty:
                self.guardian.dismiss()
            else:
                self.guardian.hand_over()  # it does what it can

    def _kill_all(self) -> None:
        for proc in self.processes:
            self.guardian.journal.forget(proc.pid)
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(proc.pid, sc.WALL)
            proc.tracee.close_memory()
        self.processes.clear()

    def request_stop(self) -> None:
        self.loop.stop_requested = True
        if self.upcalls.in_server():  # (a handler: later hits wait for the next run, as at traps)
            self.upcalls.hold()
            self.loop.wake()

    def handler_failed(self, probe: Probe, error: BaseException) -> None:
        if probe not in self._failed:
            self._failed.add(probe)
            self.warn(f"{probe.name}: its handler raised {type(error).__name__}: {error} (reported once)")

    def wake_loop(self) -> None:
        self.loop.wake()

    # --- processes and threads ------------------------------------------------------------------
    def process(self, pid: int) -> TracedProcess | None:
        return self.processes.process(pid)

    def process_of(self, tid: int) -> TracedProcess | None:
        return self.processes.process_of(tid)

    def traced_processes(self) -> list[TracedProcess]:
        return self.processes.traced()

    def world_stopped(self, proc: TracedProcess) -> contextlib.AbstractContextManager[int | None]:
        return self.processes.world_stopped(proc)

    def maps_of(self, pid: int) -> list[Mapping]:
        return self.modules.maps_of(pid)

    # --- code -----------------------------------------------------------------------------------
    def allocate_slot(self, proc: TracedProcess, near: int, size: int = SLOT_SIZE) -> int | None:
        return self.patcher.allocate_slot(proc, near, size)

    def give_slot(self, proc: TracedProcess, site: Site) -> bool:
        return self.patcher.give_slot(proc, site)

    def slot_at_hit(self, proc: TracedProcess, site: Site) -> bool:
        return self.patcher.slot_at_hit(proc, site)

    def add_internal_site(
        self, proc: TracedProcess, location: Location, addr: int, callback: Callable[[int, Regs], None],
        *, rescue_wait: bool = False,
    ) -> None:  # fmt: skip
        self.patcher.add_internal_site(proc, location, addr, callback, rescue_wait=rescue_wait)

    def arm_site(self, proc: TracedProcess, site: Site) -> None:
        self.patcher.set_armed(proc, site, True)

    def rescue_knows(self, proc: TracedProcess, site: Site) -> None:
        self.patcher.rescue_knows(proc, site)

    def in_own_code(self, proc: TracedProcess, rip: int) -> bool:
        """In a detour, return-probe or tracer code: a thread there needs its thread area."""
        return (
            self.optimizer.in_detour(proc, rip)
            or (proc.returns is not None and proc.returns.owns(rip))
            or self.tracing.owns(proc, rip)
            or any(s.actions is not None and rip in s.actions for s in proc.sites.values())
        )

    def program_for(self, proc: TracedProcess, probe: Probe, site: Site) -> Program:
        """What the probe runs in `proc`'s detour at `site` (or as a trap site's actions)."""
        if probe.is_return:
            return self.returns.entry_program(proc, probe, site.addr)
        if not probe.stack_frames:
            return probe.program(proc.pid)
        program = self.stackmaps.program(proc, probe, probe.program(proc.pid))
        if isinstance(program, OptimizeRefusal):
            raise Unsupported(program)
        return program

    def return_program(self, proc: TracedProcess, probe: Probe) -> Program | OptimizeRefusal:
        """What a return probe's return code runs in `proc`."""
        program = probe.program(proc.pid)
        return self.stackmaps.program(proc, probe, program, at_return=True) if probe.stack_frames else program

    def act_in_tracer(
        self, probe: Probe, proc: TracedProcess, tid: int, address: int, context: FetchContext,
        caller: int | None = None,
    ) -> None:  # fmt: skip
        """What the probe's detour or return code does, done at a stop (core/traps.py)."""
        self.traps.act_in_tracer(probe, proc, tid, address, context, caller)

    # --- thread areas and records ---------------------------------------------------------------
    @property
    def layout(self) -> L.AreaLayout:
        return self.data.layout

    @property
    def flight_recorder(self) -> bool:
        return self.data.flight_recorder

    def new_areas(self, proc: TracedProcess) -> ThreadAreas:
        areas = new_thread_areas(proc, self)
        proc.rseq_offset_at = self.modules.rseq_offset_at(proc)
        self.data.adopt(areas)
        return areas

    def ensure_thread_areas(self, proc: TracedProcess) -> bool:
        """Every stopped thread of `proc` has its thread area (False: the target uses GS)."""
        self.data.ensure_consumer()
        return self.optimizer.ensure_areas(proc)

    def give_area(self, proc: TracedProcess, tid: int) -> None:
        self.optimizer.give_area(proc, tid)

    def thread_rips(self, proc: TracedProcess) -> list[int]:
        return self.optimizer.every_place(self.optimizer.thread_rips(proc))

    def rseq_offset_at(self, proc: TracedProcess) -> int | None:
        return self.modules.rseq_offset_at(proc)

    def action_refusal(self, probe: Probe) -> OptimizeRefusal | None:
        return self.data.action_refusal(probe)

    def records(self) -> bool:
        return self.data.records()

    def reserve_index(self) -> int:
        """A counters-and-records index for something that is not a probe (a function tracer)."""
        return self.data.register(None)

    def counters_of_index(self, index: int) -> tuple[int, int, int]:
        return self.data.counters(index)

    def keep_event(self, event: ProbeEvent) -> None:
        """An event served at a stop, for the next delivery (core/traps.py)."""
        self.delivery.keep(event)

    # --- time and names -------------------------------------------------------------------------
    def read_tsc(self) -> int:
        return int(self.data.clock.read())

    def tsc_to_ns(self, ticks: int) -> int:
        return self.data.clock.ticks_to_ns(ticks)

    def tsc_mult(self) -> int:
        """ns = ticks * tsc_mult >> 32, for $latency computed in the target."""
        return self.data.clock.mult

    def clock_tick_ns(self) -> float:
        """The typical (median) step between two readings of the time-stamp counter back to
        back, in ns: time stamps closer than that may read the same."""
        return float(self.data.clock.tick_ns)

    def clock(self) -> dict[str, float]:
        return self.data.clock.params()

    def comm_of(self, pid: int, tid: int, *, fresh: bool = False) -> str:
        return self.data.comm_of(pid, tid, fresh=fresh)

    def symbolizer(self, pid: int) -> Callable[[int], str | None]:
        return self.modules.symbolizer(pid)

    def symbol_resolver(self, site: Site) -> Callable[[str], int | None]:
        return self.modules.symbol_resolver(site)

    def symbol_resolver_for(self, probe: Probe, proc: TracedProcess) -> Callable[[str], int | None]:
        return self.modules.symbol_resolver_for(probe, proc)

    def fetch_context(self, proc: TracedProcess, tid: int, regs: Regs, probe: Probe) -> FetchContext:
        return self.modules.fetch_context(proc, tid, regs, probe)

    # --- what a probe asks of its owner (core/probe.py's ProbeOwner) ----------------------------
    def counters_of(self, probe: Probe) -> tuple[int, int, int]:
        """(hits, missed, lost) counted in the target's thread areas."""
        return self.data.counters(probe.index)

    def histogram_of(self, probe: Probe) -> list[int]:
        return self.data.histogram_of(probe)

    @staticmethod
    def is_optimized(probe: Probe) -> bool:
        """Whether a site of the probe is a jump now, or was when its process ended."""
        return bool(probe.jumps)

    def trap_reason_of(self, probe: Probe) -> OptimizeRefusal | None:
        if probe.jumps:
            return None
        for proc in self.processes:
            for site in proc.sites.values():
                if probe in site.probes and site.refusal is not None:
                    return site.refusal
        return probe.refusal

    def stack_of(self, hit: Hit, max_frames: int) -> Stack:
        proc = self.processes.process(hit.pid)
        if proc is None:
            raise ProcessError(f"pid {hit.pid} has ended: its stacks are read while a handler runs")
        return self._walk(proc, hit.tid, hit.regs, hit.probe, site=hit.address, max_frames=max_frames)

    def trampoline_made(self, proc: TracedProcess) -> None:
        self.stackmaps.trampoline_made(proc)

    def stack_at(self, pid: int, address: int) -> Stack | None:
        return self.stackmaps.stack_at(pid, address)

    def stacks_of(self, probe: Probe, *, sums: bool = False) -> Counter[Stack]:
        counted = self.stackmaps.stacks_of(probe, sums=sums)
        counted.update(probe.trap_stack_sums if sums else probe.trap_stacks)  # (update: sums may be negative)
        return counted

    def count_stack(self, probe: Probe, proc: TracedProcess, tid: int, regs: Regs, site: int, value: int) -> Stack:
        """A hit counted by its stack at a stop (the probe's actions not run in the target),
        `value` summed by stack (a count with a value)."""
        stack = self._walk(proc, tid, regs, probe, site=site, max_frames=probe.stack_frames)
        if stack in probe.trap_stacks or len(probe.trap_stacks) < STACK_SLOTS:  # (bounded as the target's table)
            probe.trap_stacks[stack] += 1
            probe.trap_stack_sums[stack] += value
        else:
            probe.trap_missed += 1
        return stack

    def _walk(self, proc: TracedProcess, tid: int, regs: Regs, probe: Probe, *, site: int, max_frames: int) -> Stack:
        """The stack of thread `tid` at a hit of `probe` at `site` (its registers `regs`)."""
        function = probe.location.function
        at_entry = int(regs.rip) == site and function is not None and function.addr == probe.location.vaddr
        return walk(regs, self.modules.maps_of(proc.pid), proc.tracee.read, real_return=self.returns.real_return(
            proc, tid), max_frames=max_frames, at_entry=at_entry)  # fmt: skip

    def addresses_of(self, probe: Probe) -> list[int]:
        return [a for p in self.processes for a, s in p.sites.items() if probe in s.probes and (s.armed or s.optimized)]

    def sync_probe(self, probe: Probe) -> None:
        self.upcalls.on_tracing_thread("enabling or disabling a probe", lambda: self._sync_probe(probe))

    def _sync_probe(self, probe: Probe) -> None:
        for proc in self.processes:
            for site in proc.sites.values():
                if probe in site.probes:
                    self.patcher.set_armed(proc, site, site.wanted)

    def remove_probe(self, probe: Probe) -> None:
        self.upcalls.on_tracing_thread("removing a probe", lambda: self._remove_probe(probe))

    def _remove_probe(self, probe: Probe) -> None:
        probe.removed = True
        probe.enabled = False
        if probe in self.probes:
            self.probes.remove(probe)
        for proc in self.processes:
            for addr, site in list(proc.sites.items()):
                if probe in site.probes:
                    site.probes.remove(probe)
                    if not site.probes and site.internal is None:
                        self.patcher.drop_site(proc, addr)
                    else:
                        self.patcher.set_armed(proc, site, site.wanted)
