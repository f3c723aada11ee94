"""Return probes: kretprobes for user space (docs/architecture.md §7).

A return probe sits on its function's first instruction. There it takes an entry of the thread's
shadow stack (in the thread area), keeps what the return needs in it (the original return
address, where the return address was, the entry's `$argN`, a time stamp) and replaces the return
address with entry point k of the process's return trampoline, k being the entry's number. The
function returns into the trampoline, which runs the probe's return code and returns to the
original address. The return address names its entry, not the stack pointer: a frame whose stack
was copied elsewhere still finds its entry. A detour then enters the function through the call
before entry point k (codegen/detours.py's `hook_targets`), so both returns are predicted.

Who does what:
- the entry: the site's detour (optimized: codegen/actions.py's `Emitter.return_entry`), or `on_entry` here at a trap
  stop (a Python entry handler, a site that cannot take a jump), with the same shadow-stack rules;
- the return: always the trampoline, in the target, so a tracer that dies or detaches never
  leaves a return address that leads nowhere. A probe's return code runs its action in the
  target; probes with Python handlers share a trap stub whose stop runs `on_return` here;
- unwinding (C++ exceptions, backtrace()): the unwinder reads return addresses, so a trap on its
  entry points puts the thread's original return addresses back first, and a trap where the
  exception is caught (or where backtrace() returns to) puts the trampoline's back in the frames
  that live on;
- detach and a fork child let go: original return addresses back wherever a frame still points
  at the trampoline; threads with entries left keep their thread area and the trampoline.

Stale entries (frames left by longjmp) are reused when a new frame takes the same return-address
slot: a slot holds one return address, so the older frame is gone. Entries are never dropped by
comparing stack pointers: coroutines (swapcontext) keep live frames on other stacks.

One mechanism, kept whole in one module: the entry, the return, unwinding and detach apply one
set of shadow-stack rules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import time
from array import array
from collections.abc import Callable, Iterator
from typing import Protocol

from dynprobe.actions.model import Program, ReturnEntry
from dynprobe.arch.x86_64 import Regs, ResumeKind, decode_one, plan_resume, prepare
from dynprobe.arch.x86_64.codegen.asm import SAVED_AT
from dynprobe.arch.x86_64.codegen.returns import (
    build_entry_stamp,
    build_return_code,
    build_trampoline,
    return_stub_code,
)
from dynprobe.arch.x86_64.codegen.upcall import build_return_upcall
from dynprobe.arch.x86_64.regs import ARG_REGS, MASK64
from dynprobe.core.engine import Engine
from dynprobe.core.probe import Hit, Probe, Site, call_handler
from dynprobe.core.slots import place_code
from dynprobe.core.traced import Instance, ProcessReturns, TracedProcess
from dynprobe.debug import debug as _debug
from dynprobe.errors import OptimizeRefusal, ProbeRefused, ProcessError, Refusal, SymbolError
from dynprobe.ptrace import syscalls as sc
from dynprobe.ptrace.events import EventKind
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.shadow import entries_in, swap_slots, through_entry_points
from dynprobe.spec.fetch import FetchContext, ReturnValues
from dynprobe.symbols.elf import load_elf
from dynprobe.symbols.maps import Mapping, address_of_offset, file_key, read_maps
from dynprobe.symbols.resolve import Location, resolve_address


class ReturnsEngine(Engine, Protocol):
    """What return probes ask of the runtime (core/runtime.py), besides the engine's services."""

    def act_in_tracer(
        self, probe: Probe, proc: TracedProcess, tid: int, address: int, context: FetchContext,
        caller: int | None = None,
    ) -> None: ...  # fmt: skip
    def add_internal_site(
        self, proc: TracedProcess, location: Location, addr: int, callback: Callable[[int, Regs], None],
        *, rescue_wait: bool = False,
    ) -> None: ...  # fmt: skip
    def arm_site(self, proc: TracedProcess, site: Site) -> None: ...
    def return_program(self, proc: TracedProcess, probe: Probe) -> Program | OptimizeRefusal: ...
    def action_refusal(self, probe: Probe) -> OptimizeRefusal | None: ...
    def fetch_context(self, proc: TracedProcess, tid: int, regs: Regs, probe: Probe) -> FetchContext: ...
    def give_area(self, proc: TracedProcess, tid: int) -> None: ...
    def probe_by_index(self, index: int) -> Probe | None: ...
    def read_tsc(self) -> int: ...
    def symbol_resolver_for(self, probe: Probe, proc: TracedProcess) -> Callable[[str], int | None]: ...
    def tsc_mult(self) -> int: ...
    def tsc_to_ns(self, ticks: int) -> int: ...
    def trampoline_made(self, proc: TracedProcess) -> None: ...


# Where the unwinder starts reading return addresses: exceptions (throw, a cleanup's resume,
# rethrow, the forced unwind of pthread_cancel/pthread_exit) and backtrace(); and where an
# exception has been caught.
# Functions that return twice, the second time to a return address saved by the first call
# (in a jmp_buf, a ucontext, or the stack a vfork child shared): one replaced by a return hook
# would be taken after the hook's entry was used, and the program would jump to nowhere.
RETURNS_TWICE = frozenset(
    {"setjmp", "_setjmp", "__sigsetjmp", "sigsetjmp", "vfork", "__vfork", "getcontext", "swapcontext"}
)
UNWINDER_ENTRIES = ("_Unwind_RaiseException", "_Unwind_Resume", "_Unwind_Resume_or_Rethrow", "_Unwind_ForcedUnwind")
BACKTRACE_ENTRY = "_Unwind_Backtrace"
CATCH_ENTRY = "__cxa_begin_catch"
_SAVED_RAX, _SAVED_RDX = SAVED_AT["rax"], SAVED_AT["rdx"]  # in the trampoline's frame
_WORDS_PER_ENTRY = L.SHADOW_ENTRY // 8
# an entry's words (see ringbuf/layout.py), as indices into the list of them
_RET, _PROBE = L.ENTRY_RET // 8, L.ENTRY_PROBE // 8
_TSC, _RETURN_TSC, _DATA = L.ENTRY_TSC // 8, L.ENTRY_RETURN_TSC // 8, L.ENTRY_DATA // 8
_POINTS_BYTES = L.SHADOW_CAPACITY * L.TRAMPOLINE_STRIDE
_UPCALL_RSI = L.UPCALL_RSI // 8
_FRAME_RAX, _FRAME_RDX = ((L.UPCALL_FRAME + field.offset) // 8 for field in (Regs.rax, Regs.rdx))
_UPCALL_ENTRY_WORDS = range(L.UPCALL_ENTRIES // 8, L.UPCALL_ENTRIES // 8 + L.UPCALL_ENTRIES_MAX)
_STUB_ROOM = 32  # for the trap stub (the entry stamp follows)
_UPCALL_STUB_ROOM = 1280  # for the upcall stub (codegen/upcall.py's build_return_upcall), last


_RETURNED_RSP = 8 * (len(SAVED_AT) + 1)  # the stack pointer after the return, above a stub's: its frame
_SHADOW_BYTES = L.SHADOW_CAPACITY * L.SHADOW_ENTRY  # the offsets of shadow entries are below


def _add_pending(words: memoryview, layout: L.AreaLayout, probe: int, count: int) -> None:
    """`count` (1 or -1) more pending instances in probe `probe`'s PENDING counter (a u64 the
    target also writes: it wraps as the target's does)."""
    at = layout.counter(probe, L.PENDING) // 8
    words[at] = (words[at] + count) & MASK64


def default_maxactive() -> int:
    return max(10, 2 * (os.cpu_count() or 1))


def shadow_stack_in(status: str) -> bool:
    """Whether a /proc/PID/status text says a CET shadow stack is on (Linux 6.6+)."""
    for line in status.splitlines():
        if line.startswith("x86_Thread_features:"):
            return "shstk" in line.split()[1:]
    return False


def shadow_stack_enabled(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return shadow_stack_in(f.read())
    except OSError:
        return False


class ReturnProbes:
    def __init__(self, engine: ReturnsEngine) -> None:
        self.engine = engine
        self._probe_by_index, self._failed = engine.probe_by_index, engine.handler_failed  # (at every hit)
        self._shadow: int | None = None  # the shadow stack's first word in a thread area (the layout's, once fixed)

    # --- policy -------------------------------------------------------------------------------------
    @staticmethod
    def refusal(proc: TracedProcess, path: str) -> Refusal | None:
        """Why return probes cannot be safe in `proc` (for a function of `path`), or None."""
        if proc.areas_refused is not None:
            return Refusal[proc.areas_refused.name]
        if load_elf(path).is_go or load_elf(proc.exe).is_go:
            return Refusal.MOVING_STACKS
        if shadow_stack_enabled(proc.pid):
            return Refusal.SHADOW_STACK
        return None

    @staticmethod
    def entry_of(probe: Probe) -> ReturnEntry:
        """What the entry keeps for the probe's return (no handler: its return code is per process)."""
        return probe.program().return_entry(probe.maxactive, handler=0)

    # --- set-up ---------------------------------------------------------------------------------------
    def setup(self, proc: TracedProcess, near: int) -> ProcessReturns:
        """The process's trampoline, trap stub and unwinder hooks, made once (a thread of
        `proc` is stopped)."""
        if proc.returns is not None:
            return proc.returns
        engine = self.engine
        layout = engine.layout
        size = len(build_trampoline(layout, 0)[0])
        entry_stamp = build_entry_stamp()
        at = engine.allocate_slot(proc, near, size + _STUB_ROOM + len(entry_stamp) + _UPCALL_STUB_ROOM)
        if at is None:
            raise ProcessError(f"no executable memory for the return trampoline in pid {proc.pid}")
        code, trampoline = build_trampoline(layout, at)
        assert len(code) == size
        stub = at + size
        stub_code, stub_trap = return_stub_code(layout, stub, trampoline)
        assert len(stub_code) <= _STUB_ROOM
        stamp_at = stub + _STUB_ROOM
        upcall_at = stamp_at + len(entry_stamp)
        room = b"\xcc" * _UPCALL_STUB_ROOM
        proc.tracee.write(at, code + stub_code.ljust(_STUB_ROOM, b"\xcc") + entry_stamp + room)
        proc.returns = ProcessReturns(trampoline, stub, stub_trap, stamp_at, upcall_at, upcall_at + _UPCALL_STUB_ROOM)
        if proc.tracee.journal is not None:  # for the guardian: hooked returns to put back
            proc.tracee.journal.record_returns(proc.pid, trampoline.points, layout.shadow)
        self._add_stub(proc, stub_trap, stub_code[stub_trap - stub :])
        self.hook_unwinders(proc, read_maps(proc.pid))
        self.engine.trampoline_made(proc)
        _debug(f"pid {proc.pid}: return trampoline at {at:#x}, {size} bytes")
        return proc.returns

    def _add_stub(self, proc: TracedProcess, addr: int, code: bytes) -> None:
        """The trap stub: an internal site on our own `jmp finish` (emulated at each stop)."""
        insn = decode_one(code, addr)
        assert insn is not None
        plan = plan_resume(insn)
        assert not isinstance(plan, Refusal) and plan.kind == ResumeKind.EMULATE
        site = Site(addr, insn, code, plan, prepare(insn), internal=lambda tid, regs: self.on_return(proc, tid, regs))
        proc.sites[addr] = site
        self.engine.arm_site(proc, site)

    def hook_unwinders(self, proc: TracedProcess, maps: list[Mapping]) -> None:
        """Trap the unwinder's entry points in every mapped module that has them."""
        if proc.returns is None:
            return
        for path in sorted({m.path for m in maps if m.executable and m.path.startswith("/")}):
            try:
                image = load_elf(path)
            except SymbolError:
                continue
            hooks: list[tuple[str, Callable[[int, Regs], None]]] = [
                *((name, lambda tid, regs: self.on_unwind(proc, tid, regs)) for name in UNWINDER_ENTRIES),
                (BACKTRACE_ENTRY, lambda tid, regs: self.on_backtrace(proc, tid, regs)),
                (CATCH_ENTRY, lambda tid, regs: self.rehijack(proc, tid, int(regs.rsp))),
            ]
            for name, callback in hooks:
                func = image.own_function(name)  # (exported names: no library's debug file is read)
                offset = image.vaddr_to_offset(func.addr) if func is not None else None
                addr = address_of_offset(maps, file_key(path), path, offset) if offset is not None else None
                if func is None or offset is None or addr is None or addr in proc.sites:
                    continue
                location = Location(path, offset, func.addr, func, name)
                try:
                    self.engine.add_internal_site(proc, location, addr, callback, rescue_wait=True)
                except (ProbeRefused, OSError) as exc:
                    self.engine.warn(f"cannot watch {name} in {path} for C++ exceptions: {exc}")

    def return_code(self, proc: TracedProcess, probe: Probe) -> int:
        """Where the probe's return part runs in `proc`: its generated code, or the trap stub
        (Python handlers, or an action with no in-process form)."""
        returns = proc.returns
        assert returns is not None
        if probe.action is None:
            return returns.stub
        if probe.index in returns.code:
            return returns.code[probe.index][0]
        engine = self.engine
        mult, resolver, rseq = engine.tsc_mult(), engine.symbol_resolver_for(probe, proc), proc.rseq_offset_at
        allocate = functools.partial(engine.allocate_slot, proc)
        refused = engine.action_refusal(probe)  # (a record larger than the rings' fixed one)
        program = refused or engine.return_program(proc, probe)
        placed = program if isinstance(program, OptimizeRefusal) else place_code(
            allocate, proc, returns.trampoline.table,
            lambda at: build_return_code(program, engine.layout, at, returns.trampoline, mult, resolver, rseq),
        )  # fmt: skip
        if isinstance(placed, OptimizeRefusal):
            _debug(f"{probe.name}: return part at a stop ({placed})")
            return returns.stub
        at, code = placed
        returns.code[probe.index] = (at, len(code))
        return at

    def upcall_stub(self, proc: TracedProcess, near: int, doorbell: int) -> int:
        """Where the return part of probes served by upcalls runs in `proc`, ringing `doorbell`
        (made once, in the room the trampoline keeps for it; a thread of `proc` is stopped)."""
        returns = self.setup(proc, near)
        if returns.upcall_doorbell != doorbell:
            code = build_return_upcall(self.engine.layout, returns.upcall_stub, doorbell, returns.trampoline)
            assert len(code) <= _UPCALL_STUB_ROOM
            proc.tracee.write(returns.upcall_stub, code)
            returns.upcall_doorbell = doorbell
        return returns.upcall_stub

    def entry_program(self, proc: TracedProcess, probe: Probe, near: int) -> Program:
        """The probe's program for its entry site's detour."""
        self.setup(proc, near)
        entry = probe.program().return_entry(probe.maxactive, self.return_code(proc, probe))
        return dataclasses.replace(probe.program(), entry=entry)

    # --- the shadow stack, from the tracer --------------------------------------------------------------
    def real_return(self, proc: TracedProcess, tid: int) -> Callable[[int], int]:
        """For a stack walk of thread `tid`: the return address an entry point of the trampoline
        stands for (its shadow entry's original; other addresses are themselves)."""
        words = self._words(proc, tid) if proc.returns is not None else None
        if words is None or proc.returns is None:
            return lambda ret: ret
        points = proc.returns.trampoline.points

        def original(ret: int) -> int:
            return through_entry_points(ret, points, lambda k: int(words[self._at(k) + L.ENTRY_RET // 8]))[1]

        return original

    def _words(self, proc: TracedProcess, tid: int) -> memoryview | None:
        """Thread `tid`'s area as u64s, if it has one."""
        if proc.areas is None:
            return None
        area = proc.areas.by_tid.get(tid)
        return None if area is None else area.cells

    def _area_for(self, proc: TracedProcess, tid: int, regs: Regs) -> memoryview | None:
        """The stopped thread's area, made now if it has none (None: the target uses GS);
        `regs`, to be written back by the caller, get its GS base too."""
        if proc.areas is None:
            if regs.gs_base and not proc.gs_inherited:
                proc.areas_refused = OptimizeRefusal.GS_IN_USE
                self.engine.warn(f"pid {proc.pid} uses the GS segment base itself: its return probes miss")
                return None
            proc.areas = self.engine.new_areas(proc)
        if not proc.areas.owns(tid):
            self.engine.give_area(proc, tid)
            regs.gs_base = proc.areas.by_tid[tid].target_addr
        return self._words(proc, tid)

    def _take(self, points: int, words: memoryview, slot: int, held: int) -> int | None:
        """The entry a new frame at `slot` (holding `held`) takes, as the detour chooses it."""
        lay = self.engine.layout
        base = lay.shadow // 8
        top = min(int(words[L.SHADOW_TOP // 8]), L.SHADOW_CAPACITY)
        slots: list[int] = words[base : base + top * _WORDS_PER_ENTRY : _WORDS_PER_ENTRY].tolist()
        # entries of other return probes of this very call
        chained, _ = through_entry_points(
            held, points, lambda k: int(words[base + k * _WORDS_PER_ENTRY + L.ENTRY_RET // 8])
        )
        same = [k for k, s in enumerate(slots) if s == slot and k not in chained]
        if same:
            k = same[0]
            old = int(words[base + k * _WORDS_PER_ENTRY + L.ENTRY_PROBE // 8]) & 0xFFFF_FFFF
            if old < lay.max_probes:
                _add_pending(words, lay, old, -1)
            return k
        if 0 in slots:
            return slots.index(0)
        if top >= L.SHADOW_CAPACITY:
            return None
        words[L.SHADOW_TOP // 8] = top + 1
        return top

    def _free(self, proc: TracedProcess, tid: int, words: memoryview, k: int) -> None:
        lay = self.engine.layout
        at = self._at(k)
        probe = int(words[at + L.ENTRY_PROBE // 8]) & 0xFFFF_FFFF
        if probe < lay.max_probes:
            _add_pending(words, lay, probe, -1)
        words[at + L.ENTRY_SLOT // 8] = 0
        top = min(int(words[L.SHADOW_TOP // 8]), L.SHADOW_CAPACITY)
        while top and words[lay.shadow // 8 + (top - 1) * _WORDS_PER_ENTRY] == 0:
            top -= 1
        words[L.SHADOW_TOP // 8] = top
        assert proc.returns is not None
        proc.returns.instances.pop((tid, k), None)

    # --- trap mode --------------------------------------------------------------------------------------
    def on_entry(
        self, proc: TracedProcess, tid: int, site: Site, probe: Probe, regs: Regs,
        context: FetchContext, stamps: list[int],
    ) -> None:  # fmt: skip
        """A return probe's entry at a trap stop: the entry handler, then the shadow entry, whose
        time stamp goes into `stamps` for `stamp_on_resume` (the tracer's clock, meanwhile)."""
        returns = self.setup(proc, site.addr)
        words = self._area_for(proc, tid, regs)
        lay = self.engine.layout
        pending = lay.counter(probe.index, L.PENDING) // 8
        if words is None or words[L.SHADOW_BUSY // 8] or int(words[pending]) >= probe.maxactive:
            probe.trap_missed += 1
            return
        now = time.monotonic()
        hit = Hit(probe, proc.pid, tid, regs, site.addr, now, context)
        if probe.on_entry is not None and call_handler(probe.on_entry, hit, self.engine.handler_failed):
            return  # vetoed: no return handler, nothing missed
        k = self._push(proc, words, regs, self.return_code(proc, probe), probe.index)
        if k is None:
            probe.trap_missed += 1
            return
        stamps.append(lay.shadow + k * L.SHADOW_ENTRY + L.ENTRY_TSC)
        if probe.action is None:
            returns.instances[tid, k] = Instance(probe, hit.data)

    def entered(self, proc: TracedProcess, hit: Hit, cells: memoryview) -> None:
        """A return probe's entry served by an upcall (core/upcalls.py; `cells`: the thread's
        area): the detour has taken its shadow entry (UPCALL_ENTRIES; none: missed, and counted
        so). The entry handler runs on `hit`; a veto marks the entry (its return runs no
        handler), else its data is kept for the return."""
        assert proc.returns is not None
        probe = hit.probe
        k = self._taken_at_upcall(cells, probe.index)
        if k is None:
            return
        if probe.on_entry is not None and call_handler(probe.on_entry, hit, self._failed, anything=True):
            cells[self._at(k) + L.ENTRY_PROBE // 8] |= L.ENTRY_VETOED << 32
            return
        if hit.data is None:  # (what the return finds: nothing, not an instance a longjmp left)
            proc.returns.instances.pop((hit.tid, k), None)
        else:
            proc.returns.instances[hit.tid, k] = Instance(probe, hit.data)

    @staticmethod
    def _taken_at_upcall(cells: memoryview, index: int) -> int | None:
        """The entry the upcall detour took for probe `index` (its word in UPCALL_ENTRIES, which
        this upcall wrote; an offset checked: the thread area is the target's to write)."""
        for word in _UPCALL_ENTRY_WORDS:
            value = cells[word]
            if value >> 32 == index:
                offset = value & 0xFFFF_FFFF
                return offset // L.SHADOW_ENTRY if offset < _SHADOW_BYTES and not offset % L.SHADOW_ENTRY else None
            if value == L.ENTRIES_END:
                break
        return None

    def stamp_on_resume(self, proc: TracedProcess, tid: int, regs: Regs, stamps: list[int]) -> None:
        """The thread, about to resume at `regs.rip` from a trap entry that took shadow entries,
        goes through the entry stamp first, which gives them their time as it runs on (unless it
        is inside the stamp already: a signal handler's entry; those keep the tracer's time)."""
        words = self._words(proc, tid)
        if words is None or proc.returns is None or words[L.STAMP_BUSY // 8]:
            return
        targets = stamps[: L.STAMP_TARGETS_MAX]
        targets += [L.STAMP_DISCARD] * (L.STAMP_TARGETS_MAX - len(targets))
        words[L.STAMP_TARGETS // 8 : L.STAMP_TARGETS // 8 + L.STAMP_TARGETS_MAX] = array("Q", targets)
        words[L.STAMP_RESUME // 8] = int(regs.rip)
        words[L.STAMP_BUSY // 8] = 1
        regs.rip = proc.returns.entry_stamp

    def _push(self, proc: TracedProcess, words: memoryview, regs: Regs, handler: int, index: int) -> int | None:
        """At a function entry (rsp: the return address): a shadow entry for the frame, as the
        detour makes it, and the return address pointed at its trampoline entry point."""
        assert proc.returns is not None
        lay = self.engine.layout
        slot = int(regs.rsp)
        try:
            ret = proc.tracee.read_u64(slot)
        except OSError:
            return None
        k = self._take(proc.returns.trampoline.points, words, slot, ret)
        if k is None:
            return None
        at = self._at(k)
        words[at + L.ENTRY_SLOT // 8] = slot
        words[at + L.ENTRY_RET // 8] = ret
        words[at + L.ENTRY_HANDLER // 8] = handler
        words[at + L.ENTRY_PROBE // 8] = index  # and the flags, cleared
        words[at + L.ENTRY_TSC // 8] = self.engine.read_tsc()
        data = at + L.ENTRY_DATA // 8
        words[data : data + len(ARG_REGS)] = array("Q", [getattr(regs, name) for name in ARG_REGS])
        _add_pending(words, lay, index, 1)
        proc.tracee.write(slot, proc.returns.trampoline.point(k).to_bytes(8, "little"))
        return k

    def on_return(self, proc: TracedProcess, tid: int, regs: Regs, *, cells: memoryview | None = None) -> None:
        """The trap stub: a return whose part runs here. rsi holds the entry's offset; the
        trampoline's saved registers are on the stack (rax, rdx: the return value). Or the
        upcall stub (`cells`: the thread's area): `regs` is a copy of the frame, whose rax and
        rdx are the return value (what a handler changed of it is written back into the frame,
        nothing else) and UPCALL_RSI the function's rsi; it becomes the return handler's."""
        returns = proc.returns
        words = self._words(proc, tid) if cells is None else cells
        offset = regs.rsi
        if returns is None or words is None or offset % L.SHADOW_ENTRY or offset >= _SHADOW_BYTES:
            return
        k = offset // L.SHADOW_ENTRY
        at = self._at(k)
        word = words[at + _PROBE]
        probe = self._probe_by_index(word & 0xFFFF_FFFF)
        if probe is None:
            return
        instance = returns.instances.pop((tid, k), None)
        if word >> 32 & L.ENTRY_VETOED:
            return  # (its entry handler vetoed it: nothing runs, nothing is counted)
        if instance is not None and instance.probe is not probe:
            instance = None  # (an entry a longjmp left, taken again by another probe's call)
        caller, points = words[at + _RET], returns.trampoline.points
        if 0 <= caller - points < _POINTS_BYTES:  # (other return probes of the call hooked it before)
            _, caller = through_entry_points(caller, points, lambda k: int(words[self._at(k) + _RET]))
        base = regs.rsp
        if cells is not None:
            view = regs
            view.rsi = cells[_UPCALL_RSI]
        else:
            view = Regs.from_buffer_copy(regs)
            saved = proc.tracee.read(base, 8 * len(SAVED_AT))
            for name, kept_at in SAVED_AT.items():  # the trampoline's own values are in the registers
                setattr(view, name, int.from_bytes(saved[kept_at : kept_at + 8], "little"))
        view.rsp = base + _RETURNED_RSP
        view.rip = caller
        if probe.action is None and (probe.on_return is None or not probe.enabled):
            probe.trap_hits += 1
            return
        entry = words[at : at + _WORDS_PER_ENTRY].tobytes()  # (for its fetches: read before the entry goes)
        function, returning = probe.sites.get(proc.pid, 0), functools.partial(self._returning, proc, entry)
        hit = Hit(probe, proc.pid, tid, view, function, time.monotonic(), returning,
                  instance.data if instance else None, caller)  # fmt: skip
        if probe.action is not None:
            self.engine.act_in_tracer(probe, proc, tid, function, hit.context, caller)
        elif probe.on_return is not None:
            probe.trap_hits += 1
            rax, rdx = view.rax, view.rdx
            call_handler(probe.on_return, hit, self._failed, anything=cells is not None)
            if view.rax != rax or view.rdx != rdx:
                self._return_value_back(proc, base, view, cells)

    def _returning(self, proc: TracedProcess, entry_bytes: bytes, hit: Hit) -> FetchContext:
        """What a return's fetches read (made if a handler asks: most never do): its shadow
        entry as read at the return gives the arguments and the latency."""
        made = self.engine.fetch_context(proc, hit.tid, hit.regs, hit.probe)
        entry = memoryview(entry_bytes).cast("Q")
        # (not ordered: a return stamped in its entry's tick, or on a CPU a little behind, is 0)
        ticks = max(0, entry[_RETURN_TSC] - entry[_TSC])
        args = tuple(entry[_DATA : _DATA + len(ARG_REGS)])
        return dataclasses.replace(made, returning=ReturnValues(args, hit.caller or 0, self.engine.tsc_to_ns(ticks)))

    @staticmethod
    def _return_value_back(proc: TracedProcess, base: int, view: Regs, cells: memoryview | None) -> None:
        """The return value a handler changed, where the thread takes it from: the upcall's frame
        (`cells`: the thread's area), or the trampoline's saved registers (at `base`)."""
        if cells is not None:
            cells[_FRAME_RAX], cells[_FRAME_RDX] = view.rax, view.rdx
        else:
            proc.tracee.write(base + _SAVED_RAX, view.rax.to_bytes(8, "little"))
            proc.tracee.write(base + _SAVED_RDX, view.rdx.to_bytes(8, "little"))

    # --- unwinding -----------------------------------------------------------------------------------------
    def on_unwind(self, proc: TracedProcess, tid: int, regs: Regs) -> None:
        """The thread enters the unwinder, which reads the return addresses of the frames above:
        the originals go back for it, and their entries are marked. The frames it unwinds are
        gone; those it does not (above the catch) get the trampoline back at `rehijack`."""
        words = self._words(proc, tid)
        returns = proc.returns
        if words is None or returns is None:
            return
        # (its own return address, at rsp, is the first it reads: _Unwind_Resume called where
        # the program calls a library, its return hooked, unwinds from its caller)
        above = [e for e in self._entries(words) if e[2] >= int(regs.rsp)]
        for k in self._swap(proc, words, above, restore=True):
            words[self._at(k) + L.ENTRY_PROBE // 8] |= L.ENTRY_RESTORED << 32

    def on_backtrace(self, proc: TracedProcess, tid: int, regs: Regs) -> None:
        """backtrace() walks the frames without unwinding them: the originals go back while it
        runs, and a trap where it returns to puts the trampoline back (its own return address
        is read too, so it cannot return through the trampoline)."""
        self.on_unwind(proc, tid, regs)
        try:
            back = proc.tracee.read_u64(int(regs.rsp))
        except OSError:
            return
        if back not in proc.sites:
            try:
                location = resolve_address(back, read_maps(proc.pid))
                self.engine.add_internal_site(
                    proc, location, back, lambda tid, regs: self.rehijack(proc, tid, int(regs.rsp))
                )
            except (ProbeRefused, SymbolError, OSError) as exc:
                _debug(f"no trap after {BACKTRACE_ENTRY} at {back:#x}: {exc}")

    def rehijack(self, proc: TracedProcess, tid: int, rsp: int) -> None:
        """Unwinding is over (an exception was caught; backtrace() returned) with the thread at
        `rsp`: frames above it that were left alone return through the trampoline again; the
        entries of frames it unwound are freed."""
        words = self._words(proc, tid)
        returns = proc.returns
        if words is None or returns is None:
            return
        restored = [e for e in self._entries(words) if int(words[e[1] + L.ENTRY_PROBE // 8]) >> 32 & L.ENTRY_RESTORED]
        back = self._swap(proc, words, [e for e in restored if e[2] > rsp], restore=False)
        for k, at, _ in restored:
            words[at + L.ENTRY_PROBE // 8] &= ~(L.ENTRY_RESTORED << 32) & MASK64
            if k not in back:
                self._free(proc, tid, words, k)

    def _at(self, k: int) -> int:
        """The first word of shadow entry `k` in a thread area."""
        if self._shadow is None:
            self._shadow = self.engine.layout.shadow // 8
        return self._shadow + k * _WORDS_PER_ENTRY

    def _swap(
        self, proc: TracedProcess, words: memoryview, entries: list[tuple[int, int, int]], restore: bool
    ) -> set[int]:
        """Original return addresses back into the slots of `entries` that hold their entry
        points (`restore`), or entry points back where the originals are. Several return probes
        of one call chain through each other, so this goes round until nothing changes; returns
        the entries done."""
        assert proc.returns is not None
        trampoline, tracee = proc.returns.trampoline, proc.tracee
        swaps = []
        for k, at, slot in entries:
            point, original = trampoline.point(k), int(words[at + L.ENTRY_RET // 8])
            swaps.append((k, slot, point, original) if restore else (k, slot, original, point))
        return swap_slots(swaps, tracee.read_u64, lambda slot, value: tracee.write(slot, value.to_bytes(8, "little")))

    def _entries(self, words: memoryview) -> Iterator[tuple[int, int, int]]:
        """(number, word index, slot) of the entries in use, read as the guardian reads them."""
        base = self.engine.layout.shadow // 8
        top = min(int(words[L.SHADOW_TOP // 8]), L.SHADOW_CAPACITY)
        for k, slot, _ in entries_in(words[base : base + top * _WORDS_PER_ENTRY].tobytes()):
            yield k, base + k * _WORDS_PER_ENTRY, slot

    # --- putting return addresses back ------------------------------------------------------------------
    def restore(self, proc: TracedProcess, tid: int) -> bool:
        """Put the thread's original return addresses back wherever its frames still return into
        the trampoline, freeing those entries (unwinding, detach). True if no entry is left."""
        words = self._words(proc, tid)
        if words is None or proc.returns is None:
            return True
        return self._restore_entries(proc, tid, words)

    def _restore_entries(self, proc: TracedProcess, tid: int, words: memoryview) -> bool:
        entries = list(self._entries(words))
        done = self._swap(proc, words, entries, restore=True)
        for k in done:
            self._free(proc, tid, words, k)
        return len(done) == len(entries)

    # --- process life (core/engine.py's Mechanism) ---------------------------------------------
    def forked(self, parent: TracedProcess, child: TracedProcess, tid: int, *, vfork: bool) -> None:
        if vfork:
            child.returns = parent.returns  # one address space, and the parent's thread areas
        else:
            self.snapshot(parent, tid, child)

    def let_go(self, child: TracedProcess) -> None:
        self.restore_child(child)

    def forget_image(self, proc: TracedProcess) -> None:
        proc.returns = None

    def execed(self, proc: TracedProcess, maps: list[Mapping]) -> None:
        """(The trampoline is made again with the first return probe placed.)"""

    def modules_changed(self, proc: TracedProcess, maps: list[Mapping]) -> None:
        self.hook_unwinders(proc, maps)

    def restore_child(self, child: TracedProcess) -> None:
        """A fork child let go: its copy of the forking thread's frames returns to the original
        addresses (its copy of the trampoline would use its parent's thread area)."""
        returns = child.returns
        if returns is None or returns.snapshot is None:
            return
        words = memoryview(array("Q", returns.snapshot))
        child.returns = dataclasses.replace(returns, instances={})
        self._restore_entries(child, child.pid, words)

    def snapshot(self, parent: TracedProcess, tid: int, child: TracedProcess) -> None:
        """At a fork: the child's thread returns through copies of the forking thread's frames,
        so it gets a copy of that thread's shadow stack (applied when its area is made)."""
        returns = parent.returns
        words = self._words(parent, tid)
        if returns is None:
            return
        snapshot = None
        if words is not None:
            snapshot = array("Q")
            snapshot.frombytes(words.cast("B"))  # (one copy)
        child.returns = dataclasses.replace(
            returns,
            code=dict(returns.code),
            instances={(child.pid, k): i for (t, k), i in list(returns.instances.items()) if t == tid},
            snapshot=snapshot,
        )

    def thread_area_given(self, proc: TracedProcess, tid: int) -> list[tuple[int, int, int]]:
        """A fork child's thread has its own area now: its shadow stack is the copy. Returns the
        entries it begins inside, as (probe index, return-address slot, data) of each (for the
        function tracer: `Tracing.began_inside`)."""
        returns = proc.returns
        if returns is None or returns.snapshot is None or tid != proc.pid:
            return []
        words = self._words(proc, tid)
        if words is None:
            return []
        lay = self.engine.layout
        snap, returns.snapshot = returns.snapshot, None
        words[L.SHADOW_TOP // 8] = snap[L.SHADOW_TOP // 8]
        words[lay.shadow // 8 :] = snap[lay.shadow // 8 :]
        # The ring's sequence goes on from the parent's published records: an entry record the
        # parent held back (a tracer's time threshold) is not in this ring, and its call's return
        # here then writes nothing, rather than take back records of the child's.
        for at in (L.TAIL, L.HEAD, L.RESERVE, L.READ):  # (READ: a flight recorder's reader, from there)
            words[at // 8] = snap[L.HEAD // 8]
        top = min(int(snap[L.SHADOW_TOP // 8]), L.SHADOW_CAPACITY)
        entries = []
        for k in range(top):
            at = self._at(k)
            index = int(snap[at + L.ENTRY_PROBE // 8]) & 0xFFFF_FFFF
            if snap[at] and index < lay.max_probes:
                _add_pending(words, lay, index, 1)
                entries.append((index, int(snap[at]), int(snap[at + L.ENTRY_DATA // 8])))
        return entries

    # --- detach -----------------------------------------------------------------------------------------
    def before_detach(self, proc: TracedProcess) -> None:
        """The trap stubs become plain jumps (a return served at a stop now just returns); a
        thread stopped on one is moved back to run that jump."""
        returns = proc.returns
        if returns is None:
            return
        site = proc.sites.get(returns.stub_trap)
        if site is None:
            return
        with contextlib.suppress(OSError):
            proc.tracee.unpatch(site.addr, site.original)
        site.armed = False
        for tid, state in proc.tracee.threads.items():
            traps = [e for e in state.deferred if e.kind == EventKind.SIGNAL and e.sig == signal.SIGTRAP]
            if not state.stopped or not traps:
                continue
            with contextlib.suppress(OSError):
                regs = sc.get_regs(tid)
                if int(regs.rip) == site.addr + 1:
                    regs.rip = site.addr
                    sc.set_regs(tid, regs)
                    state.deferred.remove(traps[0])

    def keep_areas_at_detach(self, proc: TracedProcess) -> set[int]:
        """Original return addresses back in every thread; the threads that still have entries
        (a frame whose slot moved, or one left by longjmp) keep their thread area."""
        if proc.returns is None or proc.areas is None:
            return set()
        keep = set()
        for tid, state in proc.tracee.threads.items():
            if state.stopped and proc.areas.owns(tid) and not self.restore(proc, tid):
                keep.add(tid)
        return keep
