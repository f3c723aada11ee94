"""Code patching: the sites of a process (where a probe is), their int3s, the out-of-line slots
traps resume from, and the rescue handler that keeps a killed dynprobe's int3s harmless. Every
byte written goes through the tracee's patch/unpatch, which the guardian's undo journal records.
Whether an armed site is a trap or a jump is the optimizer's to say (`consider`); this module
writes the int3 when it stays a trap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

from dynprobe.arch.x86_64 import (
    INT3,
    MAX_INSN_LEN,
    SLOT_SIZE,
    Regs,
    ResumeKind,
    boost_is_cheaper,
    decode_one,
    out_of_line,
)
from dynprobe.core import rescue
from dynprobe.core.ftrace import Tracing
from dynprobe.core.optimizer import Optimizer
from dynprobe.core.probe import Probe, Site
from dynprobe.core.processes import ProcessTable
from dynprobe.core.returns import ReturnProbes
from dynprobe.core.sites import first_instruction
from dynprobe.core.traced import TracedProcess
from dynprobe.debug import debug as _debug
from dynprobe.errors import OptimizeRefusal, ProbeRefused, ProcessError, Refusal, SeccompFiltered, SymbolError
from dynprobe.ptrace import syscalls as sc
from dynprobe.symbols.elf import load_elf
from dynprobe.symbols.maps import Mapping, address_of_offset, file_key
from dynprobe.symbols.resolve import Location

# Reasons a site stays a trap for as long as its probes are there (not the optimizer's delay).
_LASTING_TRAP = (
    OptimizeRefusal.DISABLED,
    OptimizeRefusal.POST_HANDLER,
    OptimizeRefusal.PYTHON_HANDLER,
    OptimizeRefusal.SECCOMP_FILTER,
)


class PatcherEngine(Protocol):
    """What patching asks of the runtime (core/runtime.py)."""

    processes: ProcessTable
    optimizer: Optimizer
    returns: ReturnProbes
    tracing: Tracing

    def maps_of(self, pid: int) -> list[Mapping]: ...
    def warn(self, message: str) -> None: ...


class Patcher:
    """Places, arms and takes out the sites of every traced process."""

    def __init__(self, engine: PatcherEngine) -> None:
        self.engine = engine
        # within a batch: sites armed for the optimizer, whose int3 waits for its verdict
        self.int3_deferred: list[tuple[TracedProcess, Site]] | None = None

    # --- sites ----------------------------------------------------------------------------------
    def install(self, proc: TracedProcess, probe: Probe, addr: int) -> None:
        """`probe` at `addr` of `proc`: its site made (or shared), armed as the probe wants."""
        if probe.is_return:
            self._ensure_returns(proc, probe, addr)
        site = proc.sites.get(addr)
        if site is None:
            sites = proc.sites
            covering = [sites[a] for a in range(addr - MAX_INSN_LEN * 2, addr) if a in sites]
            covering = [o for o in covering if o.optimized and addr < o.addr + len(o.region)]
            moving = proc.moved_over(addr, addr + 1)
            for other in [*covering, *([moving] if moving is not None else [])]:
                # The new int3 would land inside the other site's jmp or a branch it took along:
                # that one goes back to a trap (before the new site reads its instruction).
                self._overlapped(proc, other)
            site = self._make_site(proc, probe.location, addr)
            proc.sites[addr] = site
        site.probes.append(probe)
        probe.sites[proc.pid] = addr
        self.set_armed(proc, site, site.wanted)
        if (
            site.armed  # then the optimizer has said why it is a trap (site.refusal)
            and site.refusal in _LASTING_TRAP
            and site.plan.kind == ResumeKind.EMULATE
            and not site.prefer_slot
            and boost_is_cheaper(site.insn)
        ):
            # A slot for an emulated push whose site stays a trap: cheaper from there (an
            # emulated hit if none can be made).
            with contextlib.suppress(SeccompFiltered):
                site.prefer_slot = self.give_slot(proc, site)

    def add_internal_site(
        self, proc: TracedProcess, location: Location, addr: int, callback: Callable[[int, Regs], None],
        *, rescue_wait: bool = False,
    ) -> None:  # fmt: skip
        """A trap of dynprobe's own at `addr` (a function of a mapped file): `callback(tid,
        regs)` runs at each hit, before any probe of the same site (`rescue_wait`: see
        Site.rescue_wait)."""
        site = proc.sites.get(addr)
        if site is None:
            site = proc.sites[addr] = self._make_site(proc, location, addr)
        site.internal = callback
        site.rescue_wait = rescue_wait
        self.set_armed(proc, site, True)

    def _make_site(self, proc: TracedProcess, location: Location, addr: int) -> Site:
        def refused(reason: Refusal) -> ProbeRefused:
            return ProbeRefused(reason, f"{location.basename}:{location.label}")

        decoded = first_instruction(location)
        if isinstance(decoded, Refusal):
            raise refused(decoded)
        plan = decoded[1]  # the plan holds wherever the file is mapped; RIP-relative operands do not
        code = load_elf(location.path).code(location.vaddr, decoded[0].len)
        insn = decode_one(code, addr)
        if insn is None:
            raise refused(Refusal.UNDECODABLE)
        if self.engine.tracing.patched_over(proc, addr):
            raise refused(Refusal.FUNCTION_TRACED)
        try:
            current = proc.tracee.read(addr, insn.len)
        except OSError as exc:
            raise refused(Refusal.NOT_EXECUTABLE) from exc
        if current != code:
            raise refused(Refusal.FOREIGN_INT3 if current[0] == INT3 else Refusal.BYTES_MISMATCH)
        site = Site(addr, insn, code, plan)  # its emulator is prepared at its first hit
        try:
            if plan.kind != ResumeKind.EMULATE and not self.give_slot(proc, site):
                raise refused(Refusal.RIP_REL_OUT_OF_REACH)
        except SeccompFiltered as exc:
            raise refused(Refusal.SECCOMP) from exc
        return site

    def _ensure_returns(self, proc: TracedProcess, probe: Probe, addr: int) -> None:
        """The process's return trampoline, made as its first return probe is placed: a process
        with no memory left for it, or whose threads use GS (no thread area for the shadow
        stack), refuses the probe here rather than miss every call."""
        if proc.returns is not None:
            return
        where = f"{probe.location.basename}:{probe.location.label}"
        if proc.areas is None and self.engine.optimizer.gs_in_use(proc):
            raise ProbeRefused(Refusal.GS_IN_USE, where)
        try:
            self.engine.returns.setup(proc, addr)
        except ProcessError as exc:
            _debug(f"pid {proc.pid}: {exc}")
            raise ProbeRefused(Refusal.NO_MEMORY, where) from exc

    def _overlapped(self, proc: TracedProcess, other: Site) -> None:
        """A new int3 lands in bytes `other` changed (its jump, a branch it took along): it goes
        back to a trap, for good."""
        other.static_refusal = OptimizeRefusal.REGION_OVERLAP
        self.engine.optimizer.unoptimize(proc, other, arm=True)
        other.refusal = OptimizeRefusal.REGION_OVERLAP

    def set_armed(self, proc: TracedProcess, site: Site, armed: bool) -> None:
        """Make the site a probe (`armed`) or not. An armed site is a trap, queued for the
        optimizer when it may take a jump; an optimized site that may not stay one goes back."""
        if proc.status is not None:
            return
        optimizer = self.engine.optimizer
        moving = proc.moved_over(site.addr, site.addr + 1) if armed and not site.armed else None
        if moving is not None and moving is not site:
            self._overlapped(proc, moving)  # (its int3 would land in a branch another site took along)
        if site.optimized:
            if armed and optimizer.trap_reason(proc, site) is None and optimizer.detour_current(site):
                return
            # A Python handler, a disabled or removed probe, or one more action on the site: the
            # detour no longer does what the probes ask. Back to a trap; re-optimized if it may.
            optimizer.unoptimize(proc, site, arm=armed)
        newly_armed = armed and not site.armed
        if site.armed and not armed:
            try:
                proc.tracee.unpatch(site.addr, site.original[:1])
            except OSError as exc:
                raise ProcessError(f"cannot write at {site.addr:#x} in pid {proc.pid}: {exc.strerror}") from exc
            site.armed = False
            proc.retired.add(site.addr)
        if not armed:
            return
        site.armed = True
        queued = optimizer.consider(proc, site)
        if newly_armed:
            proc.retired.discard(site.addr)
            if queued and self.int3_deferred is not None:
                self.int3_deferred.append((proc, site))  # optimized at the batch's end: no trap first
            else:
                self.write_int3(proc, site)

    @contextlib.contextmanager
    def int3s_deferred(self, defer: bool, *, flush: Callable[[], None]) -> Iterator[None]:
        """A batch: sites the optimizer may take (`defer`) get no int3 during the block; at its
        end, `flush` runs the optimizer on them, and those it refused get their int3. The
        rescue tables the block changed are published last, before the batch's writes go out."""
        deferred: list[tuple[TracedProcess, Site]] = []
        self.int3_deferred = deferred if defer else None
        try:
            yield
        finally:
            self.int3_deferred = None
            try:
                if deferred:
                    flush()
            finally:
                for proc, site in deferred:
                    if site.armed and not site.optimized and proc.status is None and proc.sites.get(site.addr) is site:
                        self.write_int3(proc, site)
                for proc in self.engine.processes:
                    if proc.rescue is not None and proc.rescue.stale:
                        proc.rescue.publish(list(proc.sites.values()))

    def write_int3(self, proc: TracedProcess, site: Site) -> None:
        self.rescue_knows(proc, site)
        try:
            proc.tracee.patch(site.addr, bytes([INT3]), site.original[:1])
        except OSError as exc:
            raise ProcessError(f"cannot write at {site.addr:#x} in pid {proc.pid}: {exc.strerror}") from exc

    @staticmethod
    def take_out_int3s(proc: TracedProcess) -> None:
        """Every int3 of ours in `proc` back to its original byte, as best it can (a detach, a
        fork child we let go)."""
        for site in proc.sites.values():
            if site.armed:
                with contextlib.suppress(OSError):
                    proc.tracee.unpatch(site.addr, site.original[:1])
                site.armed = False

    def drop_site(self, proc: TracedProcess, addr: int) -> None:
        site = proc.sites.get(addr)
        if site is None:
            return
        self.set_armed(proc, site, False)
        del proc.sites[addr]
        # The slot is not reused: a thread may still be inside it until the next quiescent point.
        if site.actions is not None:
            proc.dirty.append(site.actions)

    def forget_site(self, proc: TracedProcess, addr: int) -> None:
        """The module holding `addr` is gone: nothing to restore, just forget it (and the
        branches it took along: in that module too, their journal entries go as well)."""
        site = proc.sites.pop(addr, None)
        self.engine.processes.journal.drop(proc.pid, addr)
        if site is not None:
            for moved, _ in site.moved:
                self.engine.processes.journal.drop(proc.pid, moved)
        proc.moving.discard(addr)

    # --- slots ----------------------------------------------------------------------------------
    def slot_at_hit(self, proc: TracedProcess, site: Site) -> bool:
        """`give_slot` at a hit, in a process that may turn out to run no code of ours (a
        seccomp filter we may not suspend): then it has no thread area either."""
        try:
            return self.give_slot(proc, site)
        except SeccompFiltered:
            proc.areas_refused = OptimizeRefusal.SECCOMP
            return False

    def give_slot(self, proc: TracedProcess, site: Site) -> bool:
        """The site's out-of-line slot: made at placement, or for an emulated instruction at the
        first hit that needs it (emulation refused, a post-handler): most function entries are
        emulated, and a probe optimized at once never needs one."""
        if site.slot is not None:
            return True
        slot = self.allocate_slot(proc, site.addr)
        if slot is None:
            return False
        built = out_of_line(site.insn, slot)
        if built is None:
            proc.slots.free(slot)
            return False
        proc.tracee.write(slot, built[0])
        site.slot, site.slot_insn_len = slot, built[1]
        return True

    def allocate_slot(self, proc: TracedProcess, near: int, size: int = SLOT_SIZE) -> int | None:
        stopped = next((t for t, s in proc.tracee.threads.items() if s.stopped), None)
        if proc.slots.stub() is not None and stopped is not None:
            proc.map_tid = stopped  # our own page holds the syscall stub: nothing else is touched
            return proc.slots.allocate(near, size)
        # The first region borrows target code for the stub, with every thread stopped: the
        # program's entry point, which runs once, at its start (not the site, which may hold
        # an int3 of ours and is where threads go).
        with self.engine.processes.world_stopped(proc) as tid:
            if tid is None:
                return None
            proc.map_tid, proc.scratch = tid, self._entry_point(proc) or near
            return proc.slots.allocate(near, size)

    def _entry_point(self, proc: TracedProcess) -> int | None:
        """Where the main executable's entry point is mapped in `proc`."""
        try:
            image = load_elf(proc.exe)
        except SymbolError:
            return None
        offset = image.vaddr_to_offset(image.entry)
        if offset is None:
            return None
        return address_of_offset(self.engine.maps_of(proc.pid), file_key(proc.exe), proc.exe, offset)

    # --- the rescue handler ---------------------------------------------------------------------
    def install_rescue(self, proc: TracedProcess) -> None:
        """The process's rescue handler (core/rescue.py), with every thread stopped: a killed
        tracer then leaves no thread to die of a SIGTRAP of its. Not in a process where we may
        run no code (seccomp, without the right to suspend it), nor one that handles SIGTRAP."""
        if not proc.follow:
            return
        try:
            with self.engine.processes.world_stopped(proc) as tid:
                if tid is None or not proc.tracee.may_run_code(tid):
                    _debug(f"pid {proc.pid}: no rescue handler (it may not run our code)")
                    return
                if proc.slots.stub() is None:  # the first region of ours, for the remote syscalls' stub
                    near = self._entry_point(proc) or int(sc.get_regs(tid).rip)
                    slot = self.allocate_slot(proc, near)
                    if slot is None:
                        return
                    proc.slots.free(slot)
                stub = proc.slots.stub()
                assert stub is not None
                proc.rescue = rescue.install(
                    proc.tracee, tid, stub, lambda near, size: self.allocate_slot(proc, near, size)
                )
                if proc.rescue is not None and proc.tracee.journal is not None:
                    proc.tracee.journal.record_rescue(proc.pid, proc.rescue.page)
        except (ProcessError, OSError) as exc:
            _debug(f"pid {proc.pid}: no rescue handler: {exc}")

    @staticmethod
    def uninstall_rescue(proc: TracedProcess, tid: int) -> None:
        """The program's own disposition of SIGTRAP back, through stopped thread `tid`."""
        stub = proc.slots.stub()
        if proc.rescue is not None and stub is not None:
            try:
                rescue.uninstall(proc.tracee, proc.rescue, tid, stub)
            except (ProcessError, OSError) as exc:
                _debug(f"pid {proc.pid}: the rescue handler stays: {exc}")

    @staticmethod
    def rescue_knows(proc: TracedProcess, site: Site) -> None:
        """The process's rescue table has `site`, before an int3 of ours goes there."""
        table = proc.rescue
        if table is not None and site.addr not in table.known:
            if proc.tracee.batching:
                table.stale = True  # published at the batch's end, before its writes go out
            else:
                table.publish(list(proc.sites.values()))
