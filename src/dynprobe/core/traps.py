"""Trap probes: a hit on an int3 of ours, served in the stopped thread (the kprobes handler).

The probes of the site run in order: return probes take their entry (core/returns.py), actions
(count, hist, record) run in the target as the thread resumes when they can (the site's action
code, then the instruction from its slot) or here at the stop, Python pre-handlers get a `Hit`.
Then the instruction: emulated on the registers (`emulate`), run from its out-of-line slot with
no stop after it (boost), or single-stepped there (a post-handler, or the program's own trap
flag) and finished at the step's stop (`finish_step`). Faults in a slot are delivered as if at
the site (`deliver_fault`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import signal
import time
from collections.abc import Callable
from typing import Protocol

from dynprobe.actions.filter import matches
from dynprobe.actions.model import ActionKind, Program, filter_args
from dynprobe.arch.x86_64 import (
    FLAG_TF,
    INT3,
    EmulationFault,
    Fixup,
    Regs,
    ResumeKind,
    needs_step_for_post_handler,
    prepare,
)
from dynprobe.arch.x86_64.codegen.asm import RSEQ_CPU_ID, Unsupported
from dynprobe.arch.x86_64.codegen.detours import build_trap_actions
from dynprobe.core.engine import Engine
from dynprobe.core.probe import Hit, Probe, ProbeEvent, Site, call_handler
from dynprobe.core.returns import ReturnProbes
from dynprobe.core.slots import PlacedCode, place_code
from dynprobe.core.stacks import Stack
from dynprobe.core.traced import MemoryReader, StepState, TracedProcess
from dynprobe.errors import OptimizeRefusal, ProcessError
from dynprobe.ptrace import syscalls as sc
from dynprobe.ptrace.procfs import thread_cpu
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.areas import AreaRef
from dynprobe.ringbuf.consumer import CPUS
from dynprobe.spec.fetch import FetchContext, evaluate

_EMULATE, _BOOST, _STEP, _COUNT = ResumeKind.EMULATE, ResumeKind.BOOST, ResumeKind.STEP, ActionKind.COUNT
_STAMP_BUSY, _STAMP_RESUME = L.STAMP_BUSY // 8, L.STAMP_RESUME // 8  # (as u64 indices: the hot path)


class TrapsEngine(Engine, Protocol):
    """What serving a trap asks of the runtime (core/runtime.py), besides the engine's services."""

    stats: dict[str, int]  # "stops": trap stops served
    returns: ReturnProbes

    def action_refusal(self, probe: Probe) -> OptimizeRefusal | None: ...
    def program_for(self, proc: TracedProcess, probe: Probe, site: Site) -> Program: ...
    def count_stack(self, probe: Probe, proc: TracedProcess, tid: int, regs: Regs, site: int, value: int) -> Stack: ...
    def symbol_resolver(self, site: Site) -> Callable[[str], int | None]: ...
    def symbolizer(self, pid: int) -> Callable[[int], str | None]: ...
    def slot_at_hit(self, proc: TracedProcess, site: Site) -> bool: ...
    def give_slot(self, proc: TracedProcess, site: Site) -> bool: ...
    def ensure_thread_areas(self, proc: TracedProcess) -> bool: ...
    def give_area(self, proc: TracedProcess, tid: int) -> None: ...
    def rseq_offset_at(self, proc: TracedProcess) -> int | None: ...
    def keep_event(self, event: ProbeEvent) -> None: ...


class Traps:
    """Serves the hits of trap probes (and of probes whose site is a trap for now)."""

    def __init__(self, engine: TrapsEngine) -> None:
        self.engine = engine

    @staticmethod
    def past_trap(proc: TracedProcess, tid: int, regs: Regs, site: Site | None) -> bool:
        """A thread that hit an int3 of ours just before a jump replaced it (run the jump) or
        just before we took it out (run the original instruction) goes back to the site and
        on. False (nothing done) for any other SIGTRAP stop at `regs`."""
        rip = int(regs.rip)
        if (
            not (
                (site is not None and site.optimized)
                or ((rip - 1) in proc.retired and proc.tracee.read(rip - 1, 1)[0] != INT3)
            )
            or sc.get_siginfo(tid).si_code != sc.SI_KERNEL
        ):
            return False
        regs.rip = rip - 1
        proc.set_trap_regs(tid, regs)
        proc.resume_trapped(tid)
        return True

    def slot_site(self, proc: TracedProcess, addr: int) -> Site | None:
        if not proc.slots.contains(addr):
            return None
        return next((site for site in proc.sites.values() if site.in_slot(addr)), None)

    def deliver_fault(self, proc: TracedProcess, tid: int, sig: int) -> None:
        """Deliver a fault; if it happened in a slot, make it look as if it was at the site."""
        regs = sc.get_regs(tid)
        slot_rip = int(regs.rip)
        site = self.slot_site(proc, slot_rip)
        if site is not None:
            regs.rip = site.original_rip(slot_rip)
            sc.set_regs(tid, regs)
            info = sc.get_siginfo(tid)
            if info.si_addr == slot_rip:  # SIGFPE, SIGILL, SIGTRAP: si_addr is the instruction's
                info.si_addr = int(regs.rip)
                sc.set_siginfo(tid, info)
        proc.tracee.resume(tid, sig)

    def context(self, proc: TracedProcess, tid: int, regs: Regs, site: Site) -> FetchContext:
        return FetchContext(
            regs, MemoryReader(proc.tracee), lambda: proc.comm(tid), self.engine.symbol_resolver(site),
            self.engine.symbolizer(proc.pid),
        )  # fmt: skip

    def hit(self, proc: TracedProcess, tid: int, site: Site, regs: Regs) -> None:
        # The hot path of a trap probe: no enum attribute in it (each lookup costs ~0.2 us).
        self.engine.stats["stops"] += 1
        regs.rip = site.addr
        if site.internal is not None:
            site.internal(tid, regs)
        probes: list[Probe] = []
        context: FetchContext | None = None
        now = 0.0
        post: list[Probe] = []
        stamps: list[int] = []  # return-probe entries taken: their time is stamped at the resume
        actions: list[Probe] = []  # probes whose action runs in the target as the thread resumes
        failed = self.engine.handler_failed
        for probe in list(site.probes) if proc.follow else ():  # (a probe a handler places: from the next hit)
            if not probe.enabled:
                continue
            probes.append(probe)
            if probe.is_return:
                if context is None:
                    context, now = self.context(proc, tid, regs, site), time.monotonic()
                self.engine.returns.on_entry(proc, tid, site, probe, regs, context, stamps)
                continue
            if probe.action is not None:
                if probe.action is _COUNT and probe.filter is None and not probe.stack_frames and probe.lang is None:
                    probe.trap_hits += 1  # nothing to fetch: no context to build
                    continue
                actions.append(probe)
                continue
            probe.trap_hits += 1
            if probe.post is not None:
                post.append(probe)
            if probe.pre is None:
                continue
            if not now:
                now = time.monotonic()
            source = context or (lambda hit: self.context(proc, tid, hit.regs, site))
            moved = call_handler(probe.pre, Hit(probe, proc.pid, tid, regs, site.addr, now, source), failed)
            # A handler takes its time, and the process goes on meanwhile: another thread's
            # exec or exit_group may have ended this one, whose tid an exec'd thread then
            # takes. The exec's or exit's event, handled next, settles it.
            if proc.tracee.image_gone():
                raise ProcessLookupError(errno.ESRCH, f"pid {proc.pid} exec'd or ended while a handler ran")
            if moved:
                # The handler moved rip itself: the instruction is skipped, no post-handler runs.
                self._act_at_stop(proc, tid, site, regs, actions)
                proc.set_trap_regs(tid, regs)
                proc.resume_trapped(tid)
                return
        user_tf = bool(regs.eflags & FLAG_TF)
        plan = site.plan
        if post or user_tf:
            plan = needs_step_for_post_handler(plan)
        kind = plan.kind
        if kind is _EMULATE and site.prefer_slot and not (post or user_tf):
            kind = _BOOST
        stub = None
        if actions:
            # In the target, then the instruction from its slot (they see the registers of the
            # hit); at the stop where the thread resumes otherwise: stepped, or stamped
            steps = kind is _STEP or post or user_tf
            if (
                not (steps or stamps)
                and proc.areas_refused is None
                and (site.slot is not None or self.engine.slot_at_hit(proc, site))
            ):
                stub = self._actions_stub(proc, tid, site, regs, actions)
            if stub is None:
                self._act_at_stop(proc, tid, site, regs, actions)
            else:
                kind = _BOOST
        if kind is _EMULATE:
            if self._emulate(proc, site, regs):
                for probe in probes:
                    probe.resumes[kind] += 1
                if post:
                    self._run_post(proc, tid, post, regs, site, context or self.context(proc, tid, regs, site))
                if stamps and not user_tf:  # (the target's own single step must see its instruction)
                    self.engine.returns.stamp_on_resume(proc, tid, regs, stamps)
                proc.set_trap_regs(tid, regs)
                if user_tf:
                    self._deliver_step_trap(proc, tid)
                else:
                    proc.resume_trapped(tid)
                return
            kind = _STEP if post or user_tf else _BOOST
        if site.slot is None and not self.engine.give_slot(proc, site):
            raise ProcessError(f"no out-of-line slot for {site.addr:#x}")
        for probe in probes:
            probe.resumes[kind] += 1
        regs.rip = site.slot
        if stub is not None:
            # The thread goes through the actions, which then go on at gs:[STAMP_RESUME]
            words = stub[1]
            words[_STAMP_RESUME] = int(regs.rip)
            words[_STAMP_BUSY] = 1
            regs.rip = stub[0]
        elif stamps and kind is _BOOST:
            self.engine.returns.stamp_on_resume(proc, tid, regs, stamps)
        proc.set_trap_regs(tid, regs)
        if kind is _BOOST:
            proc.resume_trapped(tid)
        else:
            proc.stepping[tid] = StepState(site, post, user_tf)
            proc.resume_trapped(tid, step=True)

    def _act_at_stop(self, proc: TracedProcess, tid: int, site: Site, regs: Regs, probes: list[Probe]) -> None:
        if probes:
            context = self.context(proc, tid, regs, site)
            for probe in probes:
                self.act_in_tracer(probe, proc, tid, site.addr, context)

    def _actions_stub(
        self, proc: TracedProcess, tid: int, site: Site, regs: Regs, probes: list[Probe]
    ) -> tuple[int, memoryview] | None:  # fmt: skip
        """Where a thread that hit `site` can run the actions of `probes` in the target as it
        resumes, and its area's words: the site's action code, made for
        these probes if it was not. None where the actions run at the stop: no thread area
        (the target uses GS, or runs under seccomp), the thread's resume in use (a signal
        handler's hit inside it), an action that cannot run in the target."""
        areas = proc.areas
        area = areas.by_tid.get(tid) if areas is not None else None
        if area is None:
            area = self._give_area_now(proc, tid, regs)
            if area is None:
                return None
        words = area.cells
        if words[_STAMP_BUSY]:
            return None
        key = tuple(probes)
        if site.actions is not None and site.actions_probes == key:
            return site.actions.start, words
        if any(self.engine.action_refusal(p) is not None for p in probes):
            return None
        try:
            programs = [self.engine.program_for(proc, p, site) for p in probes]
        except Unsupported:
            return None
        symbols = self.engine.symbol_resolver(site)
        placed = place_code(
            functools.partial(self.engine.allocate_slot, proc), proc, site.addr,
            lambda at: build_trap_actions(programs, self.engine.layout, site.addr, at, symbols, proc.rseq_offset_at),
        )  # fmt: skip
        if isinstance(placed, OptimizeRefusal):
            return None
        at, built = placed
        proc.fixups.update(built.fixups)
        if site.actions is not None:
            proc.dirty.append(site.actions)  # a thread may be in it: freed once none is
        site.actions, site.actions_probes = PlacedCode(at, len(built.code), tuple(built.fixups)), key
        return at, words

    def _give_area_now(self, proc: TracedProcess, tid: int, regs: Regs) -> AreaRef | None:
        """An area for the stopped thread, the process's first areas made if need be (None: no
        areas here); `regs`, to be written back by the caller, get its GS base too."""
        if proc.areas is None and (proc.areas_refused is not None or not self.engine.ensure_thread_areas(proc)):
            return None
        assert proc.areas is not None
        if not proc.areas.owns(tid):
            self.engine.give_area(proc, tid)
        area = proc.areas.by_tid.get(tid)
        if area is not None:
            regs.gs_base = area.target_addr
        return area

    def act_in_tracer(
        self,
        probe: Probe,
        proc: TracedProcess,
        tid: int,
        address: int,
        context: FetchContext,
        caller: int | None = None,
    ) -> None:
        """What the probe's detour (or return code) does, done at the stop (the probe is not
        optimized yet, or cannot be): the same filter, counters, histogram and record. A
        bpftrace body runs in the target only: its hit is counted missed."""
        if probe.lang is not None:
            probe.trap_hits += 1
            probe.trap_missed += 1
            return
        if probe.filter is not None:
            values: dict[str, int | None] = {}
            for arg in filter_args(probe.filter):
                v = evaluate(arg, context)
                values[arg.name] = v if isinstance(v, int) else None
            if not matches(probe.filter, values):
                return
        probe.trap_hits += 1
        stack = None
        if probe.stack_frames:
            summed = (
                evaluate(probe.value, context) if probe.value is not None and probe.action == ActionKind.COUNT else 0
            )
            stack = self.engine.count_stack(
                probe, proc, tid, context.regs, address, summed if isinstance(summed, int) else 0
            )
        if probe.action == ActionKind.HIST:
            assert probe.value is not None
            v = evaluate(probe.value, context)
            bucket = L.HIST_FAULTED if not isinstance(v, int) else 0 if v <= 0 else min(v.bit_length(), 64)
            probe.trap_hist[bucket] += 1
        elif probe.action == ActionKind.RECORD and probe.on_event is not None:
            event = ProbeEvent(
                probe, proc.pid, tid, self._cpu_at_stop(proc, tid, context.regs), time.monotonic_ns(), address,
                {arg.name: evaluate(arg, context) for arg in probe.args}, proc.comm(tid), context.symbolize, caller,
                stack=stack,
            )  # fmt: skip
            self.engine.keep_event(event)

    def _cpu_at_stop(self, proc: TracedProcess, tid: int, regs: Regs) -> int:
        """The CPU a stopped thread ran on when it stopped: the number the kernel keeps in the
        thread's rseq area (glibc 2.35 and later register one; a read of the target's memory),
        else field 39 of /proc/PID/task/TID/stat (a file the kernel formats: ~10x the cost).
        The target can write its rseq area: a number past this machine's CPUs is not taken."""
        if proc.rseq_offset is None:
            at = self.engine.rseq_offset_at(proc)
            try:
                proc.rseq_offset = 0 if at is None else int.from_bytes(proc.tracee.read(at, 8), "little", signed=True)
            except OSError:
                proc.rseq_offset = 0
            if not proc.rseq_offset and at is not None:
                proc.rseq_offset = None  # the loader has not set it yet: ask again next time
                return thread_cpu(proc.pid, tid)
        if proc.rseq_offset:
            try:
                cpu = int.from_bytes(
                    proc.tracee.read(int(regs.fs_base) + proc.rseq_offset + RSEQ_CPU_ID, 4), "little", signed=True
                )
            except OSError:
                cpu = -1
            if 0 <= cpu < CPUS:
                return cpu
        return thread_cpu(proc.pid, tid)

    @staticmethod
    def _emulate(proc: TracedProcess, site: Site, regs: Regs) -> bool:
        """Emulate the site's instruction on `regs` and apply its memory writes. False (regs as
        they were) when it cannot be done here, e.g. the stack is unmapped: the hardware will
        then run it out of line and fault as it should."""
        if site.emulator is None:
            site.emulator = prepare(site.insn)
        try:
            assert site.emulator is not None
            writes = site.emulator(regs, proc.tracee.read)
        except EmulationFault:
            return False  # raised before any register changed
        try:
            for addr, data in writes:
                proc.tracee.write(addr, data)
        except OSError:
            # Only push/call write, each one word at the new rsp: undo the register changes.
            regs.rip = site.addr
            regs.rsp = (regs.rsp + 8) & ((1 << 64) - 1)
            return False
        return True

    def _run_post(
        self, proc: TracedProcess, tid: int, post: list[Probe], regs: Regs, site: Site, context: FetchContext
    ) -> None:
        now = time.monotonic()
        for probe in post:
            assert probe.post is not None
            call_handler(
                probe.post, Hit(probe, proc.pid, tid, regs, site.addr, now, context), self.engine.handler_failed
            )

    def finish_step(self, proc: TracedProcess, tid: int, step: StepState) -> None:
        self.engine.stats["stops"] += 1
        proc.stepping.pop(tid)
        site = step.site
        regs = sc.get_regs(tid)
        assert site.slot is not None
        after = site.slot + site.slot_insn_len
        if regs.rip == after:
            regs.rip = site.next_ip
            if site.plan.fixup & Fixup.SYSCALL_REGS and regs.rcx == after:
                regs.rcx = site.next_ip
                if not step.user_tf:
                    regs.r11 &= ~FLAG_TF
        if step.probes:
            self._run_post(proc, tid, step.probes, regs, site, self.context(proc, tid, regs, site))
        proc.set_trap_regs(tid, regs)
        for extra in step.held_signals[1:]:
            with contextlib.suppress(OSError):
                sc.tgkill(proc.pid, tid, extra)
        if step.user_tf:
            self._deliver_step_trap(proc, tid)  # the hardware trap the target asked for
            for sig in step.held_signals[:1]:
                with contextlib.suppress(OSError):
                    sc.tgkill(proc.pid, tid, sig)
        else:
            proc.resume_trapped(tid, step.held_signals[0] if step.held_signals else 0)

    def _deliver_step_trap(self, proc: TracedProcess, tid: int) -> None:
        info = sc.get_siginfo(tid)
        info.si_signo = signal.SIGTRAP
        info.si_code = sc.TRAP_TRACE
        info.si_addr = int(sc.get_regs(tid).rip)
        sc.set_siginfo(tid, info)
        proc.resume_trapped(tid, signal.SIGTRAP)
