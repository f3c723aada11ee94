"""Stacks counted in the target (`count --by stack`, `session.probe(..., by="stack")`, issue 20).

Per process, in memory shared with it (a memfd, as the thread areas): the directory of the
modules whose unwind rows the stack walker reads (codegen/stacks.py), each module's rows, and
the table of stacks the probes count by; in its code cache, the walker. The directory follows
the process's maps (libraries mapped and unmapped). A fork child shares all of it with its
parent (the same memory: their counts add up), and the directory keeps following the parent's
maps; an exec leaves it behind. The counts are read
back at any time, after the process has ended too (our mapping stays), as stacks named by the
maps the process had (core/stacks.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import mmap
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from dynprobe.actions.model import ActionKind, Program, StackCount
from dynprobe.arch.x86_64.codegen.asm import Asm, Detour
from dynprobe.arch.x86_64.codegen.stacks import (
    BLOCK_SHIFT,
    CUT,
    DIR_BYTES,
    DIR_COUNT,
    DIR_ENTRIES,
    DIR_ENTRY,
    DIR_POINTS,
    DIR_SIZE,
    EXACT_FRAME,
    FRAME_ADDRESS,
    MAX_MODULES,
    MAX_ROWS,
    MAX_STACK_FRAMES,
    MODULE_SHIFT,
    SLOT_COUNT,
    SLOT_FRAMES,
    SLOT_FRAMES_CUT,
    SLOT_PROBE,
    SLOT_READY,
    SLOT_SIZE,
    SLOT_SUM,
    build_stack_walker,
)
from dynprobe.core.engine import Engine
from dynprobe.core.probe import Probe
from dynprobe.core.slots import map_shared_memory, place_code
from dynprobe.core.stacks import Stack, named
from dynprobe.core.traced import TracedProcess
from dynprobe.debug import debug as _debug
from dynprobe.errors import OptimizeRefusal, ProcessError, SharedMemoryRefused, SymbolError
from dynprobe.ptrace.process import SYS_MUNMAP
from dynprobe.ringbuf import layout as L
from dynprobe.symbols.elf import load_elf
from dynprobe.symbols.maps import Mapping

if TYPE_CHECKING:
    import numpy as np
else:
    from dynprobe.deferred import numpy as np

STACK_SLOTS = 4096  # stacks a process's table holds (a power of two)
_TABLE_AT = (DIR_BYTES + 63) & ~63
_REGION = (_TABLE_AT + STACK_SLOTS * SLOT_SIZE + L.PAGE - 1) & ~(L.PAGE - 1)


class StackMapsEngine(Engine, Protocol):
    def maps_of(self, pid: int) -> list[Mapping]: ...


@dataclass
class _Module:
    """Where a module's unwind table is in the target's stack-walk memory."""

    ips: int  # where its table's addresses are in the target
    rows: int
    count: int
    blocks: int  # where its blocks' bounds are
    block_count: int
    link_base: int  # the link-time address its addresses are offsets from
    view: mmap.mmap


def block_bounds(ips: np.ndarray) -> np.ndarray:
    """For each block of 2^BLOCK_SHIFT bytes of code (and one past the last), how many of the
    sorted offsets `ips` are at or below its first byte (the walker's search bounds)."""
    starts = np.arange((int(ips[-1]) >> BLOCK_SHIFT) + 2, dtype=np.uint64) << np.uint64(BLOCK_SHIFT)
    return np.searchsorted(ips, starts, side="right").astype(np.uint32)


@dataclass
class _Shared:
    """What one process (and the fork children that share it) has of ours."""

    walker: int
    region: int  # the directory, then the table of stacks (in the target)
    view: mmap.mmap
    modules: dict[str, _Module | None] = field(default_factory=dict)  # by path (None: no rows)
    listed: list[Mapping] = field(default_factory=list)  # the directory's entries
    maps: dict[int, Mapping] = field(default_factory=dict)  # every executable mapping seen, by start
    owner: int = 0  # the process whose maps the directory follows (a fork child's are not)
    pids: set[int] = field(default_factory=set)  # the processes that share it
    named: dict[int, Stack] = field(default_factory=dict)  # the stacks of slots read so far, by slot

    @property
    def table(self) -> np.ndarray:
        return np.frombuffer(self.view, dtype=np.uint64, offset=_TABLE_AT)


class StackMaps:
    """The stacks probes count by, in the target (see the module's docstring)."""

    def __init__(self, engine: StackMapsEngine) -> None:
        self.engine = engine
        self._of: dict[TracedProcess, _Shared] = {}
        self._ended: list[_Shared] = []  # of processes gone: their counts are still read
        self._refused: dict[TracedProcess, OptimizeRefusal] = {}  # (tried once per process)
        # (the tracing thread places, forks and forgets; the consumer names records' stacks)
        self._lock = threading.RLock()

    def program(self, proc: TracedProcess, probe: Probe, program: Program, *, at_return: bool = False
                ) -> Program | OptimizeRefusal:  # fmt: skip
        """`program` counting by stack too, in `proc` (set up there on first use, through a
        stopped thread); `at_return`: a return probe's return code, walking from where the
        return went back to."""
        with self._lock:
            shared = self._of.get(proc) or self._refused.get(proc) or self._set_up(proc)
            if isinstance(shared, OptimizeRefusal):
                self._refused[proc] = shared
                return shared
        loc = probe.location
        at_entry = not at_return and loc.function is not None and loc.function.addr == loc.vaddr
        sums = probe.action == ActionKind.COUNT and probe.value is not None
        count = StackCount(shared.walker, shared.region + _TABLE_AT, STACK_SLOTS, probe.stack_frames, at_entry, sums)
        return dataclasses.replace(program, stacks=count)

    def _set_up(self, proc: TracedProcess) -> _Shared | OptimizeRefusal:
        mapped = map_shared_memory(proc, _REGION, "the table of stacks")
        if isinstance(mapped, OptimizeRefusal):
            return mapped
        tid, stub, region, view = mapped

        def build(at: int) -> Detour:
            asm = Asm()
            build_stack_walker(asm, directory=region, shadow=self.engine.layout.shadow)
            code, fixups = asm.encode(at)
            return Detour(code, fixups, len(code))

        placed = place_code(functools.partial(self.engine.allocate_slot, proc), proc, stub, build)
        if isinstance(placed, OptimizeRefusal):
            view.close()
            with contextlib.suppress(ProcessError, OSError):
                proc.tracee.remote_syscall(tid, stub, SYS_MUNMAP, region, _REGION)
            return placed
        walker, built = placed
        proc.fixups.update(built.fixups)
        shared = self._of[proc] = _Shared(walker, region, view, owner=proc.pid, pids={proc.pid})
        self._list_modules(proc, shared, tid, self.engine.maps_of(proc.pid))
        self.trampoline_made(proc)
        return shared

    def trampoline_made(self, proc: TracedProcess) -> None:
        """`proc` has a return trampoline now (maybe after its walker was made): the walker
        finds it in the directory."""
        shared = self._of.get(proc)
        if shared is not None and proc.returns is not None and proc.pid == shared.owner:  # (as modules_changed)
            words = np.frombuffer(shared.view, dtype=np.uint64, count=DIR_BYTES // 8)
            words[DIR_POINTS // 8] = proc.returns.trampoline.points

    def _list_modules(self, proc: TracedProcess, shared: _Shared, tid: int | None, maps: list[Mapping]) -> None:
        """The directory as `maps` say: a module that went has its range emptied (a walk in it
        meanwhile finds no row, or faults: its table may be unmapped); one that came is added."""
        words = np.frombuffer(shared.view, dtype=np.uint64, count=DIR_BYTES // 8)
        executable = [m for m in maps if m.executable and m.path.startswith("/")]
        shared.maps.update((m.start, m) for m in executable)
        now = set(executable)
        for index, listed in enumerate(shared.listed):  # (one mapped again is back)
            words[(DIR_ENTRIES + index * DIR_ENTRY + DIR_SIZE) // 8] = listed.end - listed.start if listed in now else 0
        for m in executable:
            if m in shared.listed or len(shared.listed) >= MAX_MODULES:
                continue
            module = self._module(proc, shared, tid, m.path)
            bias = self._bias(m)
            if module is None or bias is None:
                continue
            at = (DIR_ENTRIES + len(shared.listed) * DIR_ENTRY) // 8
            words[at : at + DIR_ENTRY // 8] = (
                m.start, m.end - m.start, (bias + module.link_base) & ((1 << 64) - 1), module.ips, module.rows,
                module.count, module.blocks, module.block_count,
            )  # fmt: skip
            shared.listed.append(m)
            words[DIR_COUNT // 8] = len(shared.listed)  # (last: the entry is whole before it counts)

    @staticmethod
    def _bias(m: Mapping) -> int | None:
        try:
            vaddr = load_elf(m.path).offset_to_vaddr(m.offset)
        except SymbolError:
            return None
        return None if vaddr is None else m.start - vaddr

    def _module(self, proc: TracedProcess, shared: _Shared, tid: int | None, path: str) -> _Module | None:
        """The module's rows, mapped in the target (once per file)."""
        if path in shared.modules:
            return shared.modules[path]
        stub = proc.slots.stub()
        try:
            table = load_elf(path).unwind_table
        except SymbolError:
            return None
        if tid is None or stub is None:
            return None
        if not len(table) or table.skipped:
            what = f"{table.skipped} unwind descriptions dynprobe cannot read" if len(table) else "no unwind table"
            what += "" if len(table) else " dynprobe can read"
            self.engine.warn(f"{path} has {what}: stacks through its code follow frame pointers, and may be cut")
        if not len(table) or len(table) > MAX_ROWS:
            shared.modules[path] = None
            return None
        starts = np.frombuffer(table.starts, dtype=np.uint64)
        link_base = int(starts[0])
        if int(starts[-1]) - link_base >= 1 << 32:
            return None
        count = len(table)
        ips = (starts - np.uint64(link_base)).astype(np.uint32)
        blocks = block_bounds(ips)
        ips_bytes = (4 * count + 7) & ~7
        blocks_at = ips_bytes + 8 * count
        size = (blocks_at + 4 * len(blocks) + L.PAGE - 1) & ~(L.PAGE - 1)
        try:
            addr, view = proc.tracee.map_shared(tid, stub, size)
        except (SharedMemoryRefused, ProcessError, OSError) as exc:
            _debug(f"pid {proc.pid}: no unwind table for {path}: {exc}")
            return None
        np.frombuffer(view, dtype=np.uint32, count=count)[:] = ips
        np.frombuffer(view, dtype=np.int64, count=count, offset=ips_bytes)[:] = np.frombuffer(table.rows, np.int64)
        np.frombuffer(view, dtype=np.uint32, count=len(blocks), offset=blocks_at)[:] = blocks
        module = shared.modules[path] = _Module(
            addr, addr + ips_bytes, count, addr + blocks_at, len(blocks), link_base, view
        )  # fmt: skip
        return module

    # --- process life (core/engine.py's Mechanism) --------------------------------------------------
    def forked(self, parent: TracedProcess, child: TracedProcess, tid: int, *, vfork: bool) -> None:
        with self._lock:
            shared = self._of.get(parent)
            if shared is not None:  # (the same memory, mapped shared; the walker copied at its address)
                self._of[child] = shared
                shared.pids.add(child.pid)

    def let_go(self, child: TracedProcess) -> None:
        with self._lock:
            shared = self._of.pop(child, None)
            if shared is not None:
                shared.pids.discard(child.pid)

    def forget_image(self, proc: TracedProcess) -> None:
        with self._lock:
            self._refused.pop(proc, None)
            shared = self._of.pop(proc, None)
            if shared is not None:
                shared.pids.discard(proc.pid)
                self._end(shared)

    def execed(self, proc: TracedProcess, maps: list[Mapping]) -> None:
        pass

    def modules_changed(self, proc: TracedProcess, maps: list[Mapping]) -> None:
        """The directory follows its owner's maps: a fork child shares the directory (the same
        memory) and leaves it as its parent's (what the child alone maps is walked by frame
        pointers; what the parent maps later may be code of another file in the child)."""
        shared = self._of.get(proc)
        if shared is not None and proc.pid == shared.owner:
            tid = next((t for t, s in proc.tracee.threads.items() if s.stopped), None)
            self._list_modules(proc, shared, tid, maps)

    # --- reading --------------------------------------------------------------------------------
    def stacks_of(self, probe: Probe, *, sums: bool = False) -> Counter[Stack]:
        """The probe's hits by stack (`sums`: the sums of its value by stack), in every process
        it was placed in."""
        counts: Counter[Stack] = Counter()
        field = (SLOT_SUM if sums else SLOT_COUNT) // 8
        signed = sums and probe.value is not None and probe.value.type.kind == "s"
        for shared in self._distinct():
            for slot in np.flatnonzero(_probe_words(shared.table) == np.uint64(SLOT_READY | probe.index)).tolist():
                value = int(_slot_words(shared.table, slot)[field])
                counts[self._named(shared, slot)] += value - (1 << 64) if signed and value >> 63 else value
        return counts

    def stack_at(self, pid: int, address: int) -> Stack | None:
        """The stack in the slot at `address` of the table of process `pid` (a record's: the
        target wrote it), if that is a ready slot."""
        with self._lock:  # (the table of a process traced now, else of the last one gone with that pid)
            self._distinct()
            live = [s for p, s in self._of.items() if p.pid == pid]
            shared = next(iter(live), None) or next((s for s in reversed(self._ended) if pid in s.pids), None)
        if shared is None:
            return None
        slot, rest = divmod(address - shared.region - _TABLE_AT, SLOT_SIZE)
        if rest or not 0 <= slot < STACK_SLOTS or not _probe_words(shared.table)[slot] & np.uint64(SLOT_READY):
            return None
        return self._named(shared, slot)

    def _distinct(self) -> list[_Shared]:
        """Every table once, of processes traced or gone (those that ended move to `_ended`)."""
        with self._lock:
            for proc in [p for p in self._of if p.status is not None]:
                self._end(self._of.pop(proc))  # (its pid kept: its last records may come)
            self._refused = {p: r for p, r in self._refused.items() if p.status is None}
            return list({id(s): s for s in [*self._of.values(), *self._ended]}.values())

    def _end(self, shared: _Shared) -> None:
        if all(s is not shared for s in self._ended):  # (a fork child's and its parent's: once)
            self._ended.append(shared)

    @staticmethod
    def _named(shared: _Shared, slot: int) -> Stack:
        """The stack in a ready slot (its frames never change), named once: a frame in a
        directory's entry by the file mapped there when it was hit."""
        stack = shared.named.get(slot)
        if stack is None:
            words = _slot_words(shared.table, slot).tolist()
            frames_cut = words[SLOT_FRAMES_CUT // 8]
            n = min(frames_cut & ~CUT, MAX_STACK_FRAMES)
            where = []
            for i, word in enumerate(words[SLOT_FRAMES // 8 : SLOT_FRAMES // 8 + n]):
                tag = word >> MODULE_SHIFT & 0x7FFF
                mapping = shared.listed[tag - 1] if 0 < tag <= len(shared.listed) else None
                where.append((word & FRAME_ADDRESS, bool(word & EXACT_FRAME) or i == 0, mapping))
            maps = sorted(shared.maps.values(), key=lambda m: m.start)
            stack = shared.named[slot] = named(where, bool(frames_cut & CUT), maps)
        return stack


def _slot_words(table: np.ndarray, slot: int) -> np.ndarray:
    return table[slot * SLOT_SIZE // 8 : (slot + 1) * SLOT_SIZE // 8]


def _probe_words(table: np.ndarray) -> np.ndarray:
    """Each slot's probe word (READY | the probe's index once its frames are written)."""
    return table[SLOT_PROBE // 8 : STACK_SLOTS * SLOT_SIZE // 8 : SLOT_SIZE // 8]
