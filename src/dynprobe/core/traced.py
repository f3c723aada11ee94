"""One traced process as the engine keeps it (`TracedProcess`): its tracee, its sites, slots
and thread areas, and what each mechanism installed in it that others must know of (the return
machinery: `ProcessReturns`); with the few things done to a process whatever the mechanism (a
thread's resume from a trap, its memory as fetches read it). What the mechanisms and services do
with it is theirs (core/runtime.py lists them): none of them is imported here (core/probe.py's
Site and Probe are records too).
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from dynprobe.arch.x86_64 import Regs
from dynprobe.arch.x86_64.codegen.asm import HOOK_ROOM, Trampoline
from dynprobe.core.probe import Probe, Site
from dynprobe.core.rescue import Rescue
from dynprobe.core.slots import PlacedCode, SlotCache
from dynprobe.errors import OptimizeRefusal
from dynprobe.ptrace import syscalls as sc
from dynprobe.ptrace.process import Tracee
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.areas import ThreadAreas
from dynprobe.symbols.loader import loaded_libraries


@dataclass
class StepState:
    """A thread single-stepping a probed instruction in its slot."""

    site: Site
    probes: list[Probe]
    user_tf: bool  # the target itself had TF set: it expects a SIGTRAP after the instruction
    held_signals: list[int] = field(default_factory=list)


class Instance(NamedTuple):
    """A pending instance of a probe with Python handlers (the shadow entry is in the target)."""

    probe: Probe
    data: object


@dataclass(eq=False)
class ProcessReturns:
    """The return-probe machinery of one process."""

    trampoline: Trampoline
    stub: int  # the return code of probes whose return part runs in the tracer
    stub_trap: int  # its int3
    entry_stamp: int  # where a thread resumes from a trap entry (build_entry_stamp)
    upcall_stub: int  # the return code of probes whose return part is an upcall (room until made)
    end: int  # of this code
    upcall_doorbell: int | None = None  # the doorbell the upcall stub rings, once it is made
    code: dict[int, tuple[int, int]] = field(default_factory=dict)  # probe index -> (address, size)
    instances: dict[tuple[int, int], Instance] = field(default_factory=dict)  # (tid, entry number)
    snapshot: array[int] | None = None  # a fork child's copy of its parent thread's area (u64s)

    def going_to(self, rip: int, rsp: int, read_u64: Callable[[int], int]) -> int:
        """Where a thread at `rip` runs next: at an entry's call (`enter_tail`), the relocated
        region of a function in its detour, which the detour's life must count with."""
        offset = rip - self.trampoline.table
        if 0 <= offset < L.SHADOW_CAPACITY * L.TRAMPOLINE_STRIDE and offset % L.TRAMPOLINE_STRIDE == 0:
            with contextlib.suppress(OSError):
                return read_u64(rsp - 8 - HOOK_ROOM)
        return rip

    def owns(self, rip: int) -> bool:
        """Whether `rip` is in code a thread must leave before the thread area goes."""
        if self.trampoline.table <= rip < self.end:
            return True
        return any(a <= rip < a + n for a, n in self.code.values())


@dataclass(eq=False)
class TracedProcess:
    """One traced process: its tracee, and what dynprobe installed in it and keeps of it."""

    tracee: Tracee
    exe: str
    follow: bool = True  # False: an unfollowed vfork child, traced only until it execs or exits
    sites: dict[int, Site] = field(default_factory=dict)
    stepping: dict[int, StepState] = field(default_factory=dict)
    retired: set[int] = field(default_factory=set)  # addresses where we removed an int3
    moving: set[int] = field(default_factory=set)  # optimized sites that took branches along (Site.moved)
    comms: dict[int, str] = field(default_factory=dict)
    status: int | None = None  # exit status once it ended (128+N for a signal)
    leader_status: int | None = None  # set when the leader thread has ended
    slots: SlotCache = field(init=False)
    pid: int = field(init=False)  # (the tracee's, read at every upcall)
    areas: ThreadAreas | None = None  # thread areas, once a site of this process is optimized
    # GS_IN_USE (the target uses GS itself) or SECCOMP: no thread areas, no optimized probes
    areas_refused: OptimizeRefusal | None = None
    gs_inherited: bool = False  # a forked child: its threads' GS bases are its parent's areas
    fixups: dict[int, int] = field(default_factory=dict)  # faulting load in a detour -> its fix-up
    dirty: list[PlacedCode] = field(default_factory=list)  # detours a thread may still be in
    returns: ProcessReturns | None = None  # the return trampoline, once a return probe needs it
    loader_hook: int | None = None  # the internal site that reports dlopen/dlclose
    needed: dict[str, str] | None = None  # the libraries its loader maps (symbols/loader.py), once asked
    rseq_offset_at: int | None = None  # where its glibc keeps __rseq_offset (set with its areas)
    rseq_offset: int | None = None  # its value, once read at a trap stop (0: none; see cpu_at_stop)
    rescue: Rescue | None = None  # its SIGTRAP handler for when dynprobe dies (core/rescue.py)

    def libraries(self) -> dict[str, str]:
        """The libraries the process's loader maps (or has mapped) at start: where a library
        named before it is mapped is looked for."""
        if self.needed is None:
            self.needed = loaded_libraries(self.exe, *self.tracee.environment())
        return self.needed

    def __post_init__(self) -> None:
        self.pid = self.tracee.pid
        self.slots = SlotCache(self._map_region)
        # Where the slot cache maps a new region: the stopped thread its remote mmap runs in, and
        # the stub it runs from until the process has one of ours (Patcher.allocate_slot sets them)
        self.map_tid: int | None = None
        self.scratch: int | None = None

    def moved_over(self, low: int, high: int) -> Site | None:
        """The site that took along a branch whose bytes meet [low, high), if one did."""
        for addr in self.moving:
            site = self.sites.get(addr)  # (None: dropped as its process ended, before the optimizer forgot it)
            if site is not None and any(at < high and low < at + len(original) for at, original in site.moved):
                return site
        return None

    def _map_region(self, hint: int, size: int) -> int | None:
        assert self.map_tid is not None and self.scratch is not None
        scratch = self.slots.stub() or self.scratch
        return self.tracee.mmap_exec_near(self.map_tid, scratch, hint, size)

    def set_trap_regs(self, tid: int, regs: Regs) -> None:
        """The registers of a thread stopped at a trap of ours, about to resume: its rescue handler
        is told first (should dynprobe die before the resume, the thread goes on as set;
        `resume_trapped` takes that back once it is on its way)."""
        if self.rescue is not None:
            self.rescue.mark(tid, int(regs.rip))
        sc.set_regs(tid, regs)

    def resume_trapped(self, tid: int, sig: int = 0, step: bool = False) -> None:
        """Resume a thread whose registers `set_trap_regs` set. The mark goes: a later trap of the
        thread at that very rip (an emulated one-byte push resumes at site + 1) is another one."""
        self.tracee.resume(tid, sig, step)
        if self.rescue is not None:
            self.rescue.mark(0, 0)

    def comm(self, tid: int) -> str:
        name = self.comms.get(tid)
        if name is None:
            name = self.comms[tid] = self.tracee.comm(tid)
        return name


class MemoryReader:
    """The memory of one traced process, as handlers and fetch arguments read it."""

    def __init__(self, tracee: Tracee) -> None:
        self._tracee = tracee

    def read(self, addr: int, size: int) -> bytes:
        return self._tracee.read(addr, size)

    def read_upto(self, addr: int, size: int) -> bytes:
        return self._tracee.read_upto(addr, size)

    def read_u64(self, addr: int) -> int:
        return self._tracee.read_u64(addr)

    def read_string(self, addr: int, limit: int = 4096) -> str:
        data = self._tracee.read_upto(addr, limit)
        return data.split(b"\0", 1)[0].decode("utf-8", "replace")
