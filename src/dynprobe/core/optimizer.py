"""Jump optimization of probe sites (docs/architecture.md §5) and the thread areas it needs (§6).

A site whose enabled probes all run in-process actions starts as a trap (correct at once) and is
queued; `flush()` turns queued sites into jumps in one stop-the-world per process: thread areas
for threads that have none, a detour per site from the slot cache, the 5-byte `jmp`. A site goes
back to a trap (`unoptimize`) when a Python handler or a probe inside its region arrives, and when
it is disabled or removed; its detour stays "dirty" until a stop-the-world finds no thread in it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import iced_x86 as iced

from dynprobe.arch.x86_64 import INT3, jump_to
from dynprobe.arch.x86_64.codegen.asm import Detour, Unsupported
from dynprobe.arch.x86_64.codegen.detours import build_detour
from dynprobe.arch.x86_64.codegen.records import RESUME_RET
from dynprobe.arch.x86_64.codegen.upcall import UpcallReturns, build_upcall
from dynprobe.arch.x86_64.optimize import JMP_REL32_LEN, OptimizePlan
from dynprobe.arch.x86_64.relocate import retarget
from dynprobe.core.engine import Engine
from dynprobe.core.slots import PlacedCode, place_code
from dynprobe.core.traced import TracedProcess
from dynprobe.core.upcalls import Upcalls
from dynprobe.debug import ENABLED as DEBUG
from dynprobe.debug import debug as _debug
from dynprobe.errors import OptimizeRefusal, ProcessError, SharedMemoryRefused
from dynprobe.gcpause import gc_paused
from dynprobe.ptrace import syscalls as sc
from dynprobe.ptrace.events import EventKind
from dynprobe.ptrace.process import SHARED_NAME
from dynprobe.ptrace.procfs import seccomp_mode
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.areas import ThreadAreas
from dynprobe.symbols import files
from dynprobe.symbols.elf import load_elf
from dynprobe.symbols.maps import Mapping, mapping_at, read_maps

if TYPE_CHECKING:
    from dynprobe.actions.model import Program
    from dynprobe.core.ftrace import Tracing
    from dynprobe.core.probe import Probe, Site
    from dynprobe.core.returns import ReturnProbes


class OptimizerEngine(Engine, Protocol):
    """What the optimizer asks of the runtime (core/runtime.py), besides the engine's services."""

    upcalls: Upcalls
    optimize: bool  # False: every probe stays a trap
    returns: ReturnProbes
    tracing: Tracing

    def action_refusal(self, probe: Probe) -> OptimizeRefusal | None: ...
    def comm_of(self, pid: int, tid: int, *, fresh: bool = False) -> str: ...
    def process(self, pid: int) -> TracedProcess | None: ...
    def process_of(self, tid: int) -> TracedProcess | None: ...
    def program_for(self, proc: TracedProcess, probe: Probe, site: Site) -> Program: ...
    def records(self) -> bool: ...
    def rescue_knows(self, proc: TracedProcess, site: Site) -> None: ...
    def symbol_resolver(self, site: Site) -> Callable[[str], int | None]: ...


Moved = tuple[tuple[int, bytes], ...]  # branches taken along: where each is, the bytes it replaces
_MAX_PATCH = JMP_REL32_LEN + 15  # bytes a site's jump may change (its region: whole instructions)
PROGRESS_STEP = 100  # sites optimized between two reports of a flush's progress


class Optimizer:
    def __init__(self, engine: OptimizerEngine) -> None:
        self.engine = engine
        self.delay = 0.01  # seconds between a site's arming and its optimization (batching)
        self._queue: dict[int, set[int]] = {}  # pid -> site addresses
        self._due: float | None = None

    # --- policy -------------------------------------------------------------------------------------
    def trap_reason(self, proc: TracedProcess, site: Site) -> OptimizeRefusal | None:
        """Why `site` must stay a trap now, or None if it may take a jump."""
        if not self.engine.optimize:
            return OptimizeRefusal.DISABLED
        if site.internal is not None:
            return OptimizeRefusal.INTERNAL_SITE
        probes = [p for p in site.probes if p.enabled]
        python = any(p.pre is not None or p.post is not None or p.action is None for p in probes)
        if python and not self.engine.upcalls.serves(probes):
            return OptimizeRefusal.POST_HANDLER if any(p.post is not None for p in probes) else (
                OptimizeRefusal.PYTHON_HANDLER
            )  # fmt: skip
        if python and any(seccomp_mode(proc.pid, tid) for tid in list(proc.tracee.threads)):
            return OptimizeRefusal.SECCOMP_FILTER  # (a filter may kill the thread at its first futex call)
        if proc.areas_refused is not None:
            return proc.areas_refused
        for probe in probes:
            reason = self.engine.action_refusal(probe)
            if reason is not None:
                return reason
        return site.static_refusal

    def consider(self, proc: TracedProcess, site: Site) -> bool:
        """An armed trap site: queue it if it may be optimized (True if it is queued)."""
        self._set_refusal(site, self.trap_reason(proc, site))
        if DEBUG:
            _debug(f"site {site.addr:#x}: {site.refusal or 'queued for optimization'}")
        if site.refusal is None and proc.follow:
            self._queue.setdefault(proc.pid, set()).add(site.addr)
            if self._due is None:
                self._due = time.monotonic() + self.delay
            return True
        return False

    @staticmethod
    def _programs_key(site: Site) -> tuple[int, ...]:
        return tuple(p.index for p in site.probes if p.enabled)

    def detour_current(self, site: Site) -> bool:
        """The site's detour runs exactly the programs of its enabled probes."""
        return site.detour_probes == self._programs_key(site)

    def expedite(self) -> None:
        """Optimize what is queued at the next chance, without the batching delay."""
        if self._queue:
            self._due = time.monotonic()

    def due_in(self) -> float | None:
        """Seconds until the queued batch is due (0: now), or None if nothing is queued."""
        if self._due is None:
            return None
        return max(0.0, self._due - time.monotonic())

    # --- optimizing ----------------------------------------------------------------------------------
    def flush(self, progress: Callable[[int, int], object] | None = None, *, at_int3: int | None = None) -> None:
        """Optimize every queued site: one stop-the-world per process. `progress(done, total)`
        is told how far it is, every PROGRESS_STEP sites. `at_int3`: a thread stopped at one of
        our int3s and not served yet, to be sent through a jump that replaces it (core/loop.py's
        `_flushed_at_trap`)."""
        queue, self._queue, self._due = self._queue, {}, None
        for pid, addrs in queue.items():
            proc = self.engine.process(pid)
            if proc is None or proc.status is not None:
                continue
            sites = [s for a in sorted(addrs) if (s := proc.sites.get(a)) is not None and not s.optimized]
            sites = [s for s in sites if s.armed and self.trap_reason(proc, s) is None]
            _debug(f"optimizing {len(sites)} site(s) of pid {pid}")
            if sites:
                with self.engine.world_stopped(proc) as tid, files.unchanged(), gc_paused(), proc.tracee.batched():
                    if tid is not None:
                        self._optimize_stopped(proc, sites, progress, at_int3=at_int3)

    def _optimize_stopped(
        self, proc: TracedProcess, sites: list[Site], progress: Callable[[int, int], object] | None = None, *,
        at_int3: int | None = None,
    ) -> None:  # fmt: skip
        if not self.ensure_areas(proc):
            for site in sites:
                self._refuse(site, proc.areas_refused or OptimizeRefusal.GS_IN_USE)
            return
        rips = self.thread_rips(proc)
        places = self.every_place(rips)
        self._free_dirty(proc, places)
        # A thread that has just hit the int3 (its SIGTRAP not served yet) is at site+1; it will
        # be moved back to the site and take the jump (Traps.past_trap, from core/loop.py or lifecycle.py).
        trapped = {found[0] - 1 for tid, found in rips.items() if tid == at_int3 or self._trapped(proc, tid)}
        busy: list[Site] = []
        for done, site in enumerate(sites):
            if progress is not None and done % PROGRESS_STEP == 0:
                progress(done, len(sites))
            planned = self._plan(proc, site)
            if isinstance(planned, OptimizeRefusal):
                self._refuse(site, planned, static=True)
                continue
            plan, original, moved = planned
            inside = [
                rip for rip in places
                if (site.addr < rip < plan.resume_at and not (rip == site.addr + 1 and site.addr in trapped))
                or site.in_slot(rip) or any(addr < rip < addr + len(bytes_) for addr, bytes_ in moved)
                # (a thread in code of ours may be on its way through an old copy of a branch taken along)
                or (moved and proc.slots.contains(rip))
            ]  # fmt: skip
            if inside:
                busy.append(site)  # a thread is inside the region, its slot or a moved branch: next batch
                continue
            detour = self._place_detour(proc, site, plan)
            if isinstance(detour, OptimizeRefusal):
                self._refuse(site, detour)
                continue
            start, built = detour
            for branch, (addr, bytes_) in zip(plan.moved, moved, strict=True):  # (first: they run either way)
                proc.tracee.patch(addr, _aimed(branch, built), bytes_)
            site.moved = moved
            if moved:
                proc.moving.add(site.addr)
            site.region = original
            proc.tracee.patch(site.addr, jump_to(site.addr, start), site.region)
            site.optimized = True
            site.armed = False
            site.detour = (start, len(built.code))
            site.fixups = tuple(built.fixups)
            site.detour_probes = self._programs_key(site)
            for probe in site.probes:
                probe.jumps.add((proc.pid, site.addr))
            proc.fixups.update(built.fixups)
            proc.retired.discard(site.addr)
            if DEBUG:
                _debug(f"optimized {site.addr:#x}: detour {start:#x}, {len(built.code)} bytes")
        for site in busy:
            self.consider(proc, site)
        if progress is not None:
            progress(len(sites), len(sites))

    @staticmethod
    def _set_refusal(site: Site, reason: OptimizeRefusal | None) -> None:
        """Why the site is a trap (None: it may be optimized), told to its probes too."""
        site.refusal = reason
        for probe in site.probes:
            probe.refusal = reason

    def _refuse(self, site: Site, reason: OptimizeRefusal, static: bool = False) -> None:
        _debug(f"site {site.addr:#x} stays a trap: {reason.name}")
        self._set_refusal(site, reason)
        if static:
            site.static_refusal = reason

    def _plan(self, proc: TracedProcess, site: Site) -> tuple[OptimizePlan, bytes, Moved] | OptimizeRefusal:
        """The site's plan, decoded where it runs, the bytes its jump replaces, and each branch
        it takes along: where, and the bytes its new form replaces."""
        loc = site.probes[0].location
        image = load_elf(loc.path)
        func = loc.function if loc.function is not None and loc.function.size else image.function_at(loc.vaddr)
        if func is None or not func.size:
            return OptimizeRefusal.FUNCTION_UNKNOWN
        bias = site.addr - loc.vaddr
        plan = image.jump_plan(func.addr, func.size, site.addr, bias=bias, other_probes=proc.sites)
        if isinstance(plan, OptimizeRefusal):
            return plan
        start = loc.vaddr - func.addr
        code = image.code(func.addr, func.size) + image.padding_after(func.end)
        original = code[start : start + plan.overwritten]
        if proc.tracee.read(site.addr + 1, plan.overwritten - 1) != original[1:]:
            return OptimizeRefusal.UNDECODABLE  # the target changed its own code there
        moved: Moved = tuple(
            (int(b.ip), image.code(int(b.ip) - bias, len(retarget(b, int(b.near_branch_target)) or b"")))
            for b in plan.moved
        )
        if any(proc.tracee.read(addr, len(bytes_)) != bytes_ for addr, bytes_ in moved):
            return OptimizeRefusal.UNDECODABLE
        patched = [(site.addr, site.addr + plan.overwritten), *((a, a + len(b)) for a, b in moved)]
        if any(self._patched_elsewhere(proc, site, low, high) for low, high in patched):
            return OptimizeRefusal.REGION_OVERLAP  # (another site's bytes: its int3, jump or moved branch)
        return plan, original, moved

    @staticmethod
    def _patched_elsewhere(proc: TracedProcess, site: Site, low: int, high: int) -> bool:
        """Whether a site other than `site` changed a byte of [low, high): its int3, its jump's
        region, a branch it took along."""
        for at in range(low - _MAX_PATCH, high):
            other = proc.sites.get(at)
            if other is not None and other is not site:
                end = at + len(other.region) if other.optimized else at + 1 if other.armed else at
                if low < end:
                    return True
        moving = proc.moved_over(low, high)
        return moving is not None and moving is not site

    def _place_detour(
        self, proc: TracedProcess, site: Site, plan: OptimizePlan
    ) -> tuple[int, Detour] | OptimizeRefusal:
        """Build the site's detour in the slot cache near it; the bytes it does not use go back."""
        engine = self.engine
        probes = [p for p in site.probes if p.enabled]
        if engine.upcalls.serves(probes):
            return self._place_upcall(proc, site, plan, probes[0])
        try:
            programs = [engine.program_for(proc, p, site) for p in probes]
        except Unsupported as exc:
            return exc.reason
        loc = site.probes[0].location
        entry = loc.function is not None and loc.function.addr == loc.vaddr
        symbols = engine.symbol_resolver(site)
        trampoline = proc.returns.trampoline if proc.returns is not None else None
        layout, rseq = engine.layout, proc.rseq_offset_at
        return place_code(
            functools.partial(engine.allocate_slot, proc), proc, site.addr,
            lambda at: _reaching(plan, build_detour(plan, programs, layout, at, entry, symbols, trampoline, rseq)),
        )  # fmt: skip

    def _place_upcall(
        self, proc: TracedProcess, site: Site, plan: OptimizePlan, first: Probe
    ) -> tuple[int, Detour] | OptimizeRefusal:
        """An upcall detour (its probes' Python handlers served by core/upcalls.py)."""
        tid = next((t for t, s in proc.tracee.threads.items() if s.stopped), None)
        if tid is None:
            return OptimizeRefusal.SHARED_MEMORY
        try:
            doorbell = self.engine.upcalls.doorbell(proc, tid)
        except (SharedMemoryRefused, ProcessError, OSError) as exc:
            _debug(f"pid {proc.pid}: no doorbell: {exc}")
            return OptimizeRefusal.SHARED_MEMORY
        layout = self.engine.layout
        probes = [p for p in site.probes if p.enabled]
        returning = tuple((p.index, p.maxactive) for p in probes if p.is_return)
        returns = None
        if returning:  # (their shadow entries taken by the detour; their returns by the upcall stub)
            if len(returning) > L.UPCALL_ENTRIES_MAX:
                return OptimizeRefusal.UPCALL_RETURNS
            try:
                stub = self.engine.returns.upcall_stub(proc, site.addr, doorbell)
            except ProcessError as exc:
                _debug(f"pid {proc.pid}: no return trampoline: {exc}")
                return OptimizeRefusal.NO_MEMORY
            assert proc.returns is not None
            returns = UpcallReturns(returning, layout, stub, proc.returns.trampoline.points)
        pre = self.engine.upcalls.asks_before(probes)
        post = any(p.post is not None for p in probes)
        placed = place_code(
            functools.partial(self.engine.allocate_slot, proc), proc, site.addr,
            lambda at: _reaching(plan, build_upcall(plan, first.index, layout, at, doorbell, pre=pre, post=post,
                                                    returns=returns)),
        )  # fmt: skip
        if isinstance(placed, OptimizeRefusal):
            return placed
        start, built = placed
        site.upcall_resume = built.region_copy
        return start, built

    # --- back to trap ------------------------------------------------------------------------------------
    def unoptimize(self, proc: TracedProcess, site: Site, arm: bool) -> None:
        """Put the original bytes back (and the int3 if `arm`); the detour becomes dirty."""
        with self.engine.world_stopped(proc):
            if proc.tracee.image_gone():
                return  # the site went with the old image
            if arm:
                self.engine.rescue_knows(proc, site)
            data = (bytes([INT3]) + site.region[1:]) if arm else site.region
            with contextlib.suppress(OSError):  # the process is exiting
                proc.tracee.patch(site.addr, data, site.region)
                for addr, bytes_ in site.moved:
                    proc.tracee.unpatch(addr, bytes_)
            self._retire_detour(proc, site)
            site.armed = arm
            if not arm:
                proc.retired.add(site.addr)
            self._free_dirty(proc, self.every_place(self.thread_rips(proc)))

    def _retire_detour(self, proc: TracedProcess, site: Site, letting_go: bool = False) -> None:
        """The site is a trap again; `letting_go` (the process is let go): its probes still
        say they ran optimized there, as when a process ends."""
        _debug(f"unoptimized {site.addr:#x}")
        if site.detour is not None:
            proc.dirty.append(PlacedCode(site.detour[0], site.detour[1], site.fixups))
        site.optimized = False
        site.detour = None
        site.fixups = ()
        site.moved = ()
        proc.moving.discard(site.addr)
        if not letting_go:
            for probe in site.probes:
                probe.jumps.discard((proc.pid, site.addr))

    def _free_dirty(self, proc: TracedProcess, rips: list[int]) -> None:
        keep = []
        for dirty in proc.dirty:
            if any(dirty.start <= rip < dirty.start + dirty.size for rip in rips):
                keep.append(dirty)
                continue
            for addr in dirty.fixups:
                proc.fixups.pop(addr, None)
            proc.slots.free(dirty.start, dirty.size)
        proc.dirty = keep

    def in_detour(self, proc: TracedProcess, rip: int) -> bool:
        if any(rip in d for d in proc.dirty):
            return True
        return any(s.detour is not None and s.detour[0] <= rip < s.detour[0] + s.detour[1] for s in proc.sites.values())

    def restore_all(self, proc: TracedProcess) -> None:
        """Original bytes at every optimized site (the world is stopped: detach, unfollowed fork)."""
        for site in proc.sites.values():
            if site.optimized:
                try:
                    proc.tracee.unpatch(site.addr, site.region)
                    for addr, bytes_ in site.moved:
                        proc.tracee.unpatch(addr, bytes_)
                except OSError:
                    continue
                self._retire_detour(proc, site, letting_go=True)

    @staticmethod
    def thread_rips(proc: TracedProcess) -> dict[int, tuple[int, ...]]:
        """Per stopped thread, where it is (first) and where it goes on without a stop: where a
        trampoline's entry point sends it (ProcessReturns.going_to), and, while code that resumes
        through its area runs (an entry stamp, a trap site's actions: `resume_through_area`),
        gs:[STAMP_RESUME], or at that code's last instruction the copy it pushed. No patch may
        change the bytes at any of them, no detour they are in may go."""
        rips: dict[int, tuple[int, ...]] = {}
        for tid, state in proc.tracee.threads.items():
            if state.stopped:
                with contextlib.suppress(OSError):
                    regs = sc.get_regs(tid)
                    rip, rsp = int(regs.rip), int(regs.rsp)
                    places = [rip]
                    rips[tid] = (rip,)  # (what follows reads memory, which may fail)
                    area = proc.areas.by_tid.get(tid) if proc.areas is not None else None
                    if proc.returns is not None:
                        places.append(proc.returns.going_to(rip, rsp, proc.tracee.read_u64))
                    if area is not None and area.cells[L.STAMP_BUSY // 8]:
                        places.append(area.cells[L.STAMP_RESUME // 8])
                    elif proc.slots.contains(rip) and proc.tracee.read(rip, len(RESUME_RET)) == RESUME_RET:
                        places.append(proc.tracee.read_u64(rsp))
                    rips[tid] = tuple(places)
        return rips

    @staticmethod
    def every_place(rips: dict[int, tuple[int, ...]]) -> list[int]:
        """`thread_rips`' places, of every thread together."""
        return [place for found in rips.values() for place in found]

    @staticmethod
    def _trapped(proc: TracedProcess, tid: int) -> bool:
        """Stopped by our int3, its SIGTRAP not handled yet (kept while the world was stopped)."""
        state = proc.tracee.threads[tid]
        return any(e.kind == EventKind.SIGNAL and e.sig == signal.SIGTRAP for e in state.deferred)

    # --- thread areas -------------------------------------------------------------------------------------
    @staticmethod
    def gs_in_use(proc: TracedProcess) -> bool:
        """A stopped thread of `proc` has a GS base of the program's own: no thread area can go
        there (nothing is changed by asking)."""
        maps = read_maps(proc.pid)
        for tid, state in proc.tracee.threads.items():
            gs = 0
            if state.stopped:
                with contextlib.suppress(ProcessLookupError):  # born, its first stop not reported
                    gs = int(sc.get_regs(tid).gs_base)
            if gs and not proc.gs_inherited and not _left_by_dynprobe(maps, gs):
                return True
        return False

    def ensure_areas(self, proc: TracedProcess) -> bool:
        """Every stopped thread of `proc` has a thread area in its GS base. False if the target
        uses GS itself, or runs under a seccomp filter we may not suspend (then nothing is
        changed; `proc.areas_refused` says which)."""
        if proc.areas_refused is not None:
            return False
        if proc.areas is None:
            if self.gs_in_use(proc):
                proc.areas_refused = OptimizeRefusal.GS_IN_USE
                self.engine.warn(f"pid {proc.pid} uses the GS segment base itself: its probes stay traps")
                return False
            stopped = next((tid for tid, state in proc.tracee.threads.items() if state.stopped), None)
            if stopped is not None and not proc.tracee.may_run_code(stopped):
                proc.areas_refused = OptimizeRefusal.SECCOMP
                self.engine.warn(f"pid {proc.pid}: {OptimizeRefusal.SECCOMP.value}: its probes stay traps")
                return False
            proc.areas = self.engine.new_areas(proc)
        try:
            for tid, state in list(proc.tracee.threads.items()):
                if state.stopped and tid not in proc.areas.by_tid:
                    self.give_area(proc, tid)
        except SharedMemoryRefused as exc:
            self.retreat(proc, exc)
            return False
        return True

    def retreat(self, proc: TracedProcess, why: SharedMemoryRefused) -> None:
        """No thread area can be had safely in `proc` any more (the target put another file in
        place of the memory it made for dynprobe): a thread without one must never run a
        detour, so every jump of the process goes back to a trap, and its functions are no
        longer traced. Nothing of that file is mapped or written."""
        proc.areas_refused = OptimizeRefusal.SHARED_MEMORY
        self.engine.warn(f"{why}: its probes stay traps")
        with self.engine.world_stopped(proc):
            if proc.tracee.image_gone():
                return
            for site in [s for s in proc.sites.values() if s.optimized]:
                self.unoptimize(proc, site, arm=site.wanted)
            self.engine.tracing.restore(proc)

    def give_area(self, proc: TracedProcess, tid: int) -> None:
        """Point a stopped thread's GS base at its own area. A thread killed meanwhile (another
        thread's exit_group) is left to its exit event."""
        assert proc.areas is not None
        try:
            regs = sc.get_regs(tid)
        except ProcessLookupError:
            return
        except OSError as exc:
            raise ProcessError(f"cannot read the registers of thread {tid}: {exc.strerror}") from exc
        if seccomp_mode(proc.pid, tid, unreadable=-1):  # (a filter may forbid a full ring's futex wait)
            proc.areas.never_sleep()
        area = proc.areas.assign(tid, pid=proc.pid)
        self.engine.comm_of(proc.pid, tid, fresh=True)  # remembered for its events (a new image: a new name)
        # Read again: making a pool may have run remote syscalls on this very thread, and taken
        # it out of the event stop it was in (a clone's: its registers now hold the result).
        # Writing back the registers read before would undo that (a parent taking the child's
        # return of clone(), which ended a test target without a word).
        regs = sc.get_regs(tid)
        regs.gs_base = area.target_addr
        try:
            sc.set_regs(tid, regs)
        except ProcessLookupError:
            return  # killed meanwhile (another thread's exit_group): its exit event frees the area
        except OSError as exc:
            raise ProcessError(f"cannot set the thread area of thread {tid}: {exc.strerror}") from exc
        began_inside = self.engine.returns.thread_area_given(proc, tid)
        if began_inside:
            self.engine.tracing.began_inside(tid, began_inside)

    # --- process life (core/engine.py's Mechanism) ---------------------------------------------
    def forked(self, parent: TracedProcess, child: TracedProcess, tid: int, *, vfork: bool) -> None:
        """(The child's sites are its parent's copies: the process table copied them.)"""

    def let_go(self, child: TracedProcess) -> None:
        self.restore_all(child)

    def forget_image(self, proc: TracedProcess) -> None:
        """(The sites went with the process's `sites`, emptied by the exec.)"""

    def execed(self, proc: TracedProcess, maps: list[Mapping]) -> None:
        """(Probes placed again in a new program are queued as they are armed.)"""

    def modules_changed(self, proc: TracedProcess, maps: list[Mapping]) -> None:
        """Probes armed in libraries just mapped are optimized at once: they arrive as one batch,
        and the program may not run long enough for the delay."""
        self.expedite()

    def thread_stopped(self, proc: TracedProcess, tid: int) -> None:
        """A thread without an area of its own, in a process that uses areas (a new thread, a
        forked child's whose GS base is its parent's), gets one before it runs."""
        if proc.areas is None and proc.gs_inherited:
            proc.areas = self.engine.new_areas(proc)
        if proc.areas is not None and tid not in proc.areas.by_tid:
            try:
                self.give_area(proc, tid)
            except SharedMemoryRefused as exc:
                self.retreat(proc, exc)


def _reaching(plan: OptimizePlan, built: Detour | OptimizeRefusal) -> Detour | OptimizeRefusal:
    """A detour every branch the plan takes along can be aimed at (else refused)."""
    if isinstance(built, Detour) and any(
        retarget(branch, built.region_copy[int(branch.near_branch_target)]) is None for branch in plan.moved
    ):
        return OptimizeRefusal.JUMP_INTO_REGION
    return built


def _aimed(branch: iced.Instruction, built: Detour) -> bytes:
    """A branch taken along, aimed at the detour's copy of the instruction it lands on."""
    aimed = retarget(branch, built.region_copy[int(branch.near_branch_target)])
    assert aimed is not None  # (_reaching: the detour was built for it)
    return aimed


def _left_by_dynprobe(maps: list[Mapping], gs_base: int) -> bool:
    """A GS base in a thread area of an earlier session (one whose tracer was killed)."""
    m = mapping_at(maps, gs_base)
    return m is not None and m.path.startswith(f"/memfd:{SHARED_NAME.rstrip(bytes(1)).decode()}")


COMMIT_BUDGET = 256 << 20  # bytes of rings faulted in at once, per process


def new_thread_areas(proc: TracedProcess, engine: OptimizerEngine) -> ThreadAreas:
    """The areas of `proc`, and of its vfork children: the remote syscalls run in the process of
    the (stopped) thread an area is given to."""

    def map_pool(tid: int, size: int) -> tuple[int, object]:
        owner = engine.process_of(tid) or proc
        stub = owner.slots.stub()
        if stub is None:  # no slot yet (emulated traps need none): a region for the stub
            near = next(iter(owner.sites), None) or int(sc.get_regs(tid).rip)
            slot = engine.allocate_slot(owner, near)
            if slot is None:
                raise ProcessError(f"no memory for dynprobe's code in pid {owner.pid}")
            owner.slots.free(slot)
            stub = owner.slots.stub()
        assert stub is not None
        return owner.tracee.map_shared(tid, stub, size)

    committed = 0

    def commit(tid: int, addr: int) -> None:
        # Only a ring that records will fill is worth faulting in at once (a record would take
        # a page fault every 4 KiB), and only up to COMMIT_BUDGET a process: it costs ~2.5 ms a
        # MiB and holds the memory (500 threads with 32 MiB rings would hold 16 GiB). Counters,
        # histograms, the shadow stack and the rings past the budget fault in as they are used.
        nonlocal committed
        size = engine.layout.ring_bytes
        if not engine.records() or committed + size > COMMIT_BUDGET:
            return
        committed += size
        owner = engine.process_of(tid) or proc
        stub = owner.slots.stub()
        assert stub is not None  # made with the pool
        err = owner.tracee.commit(tid, stub, addr + engine.layout.ring, size)
        if err and err != errno.EINVAL:  # EINVAL: a kernel before 5.14, which faults it in as it goes
            reason = os.strerror(err)
            engine.warn(f"pid {owner.pid}: cannot commit {size >> 10} KiB for thread {tid}'s ring ({reason})")

    return ThreadAreas(proc.pid, engine.layout, map_pool, commit)  # type: ignore[arg-type]


__all__ = ["JMP_REL32_LEN", "Optimizer", "new_thread_areas"]
