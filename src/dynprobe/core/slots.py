"""Out-of-line slots: small pieces of executable memory near each module, carved from pages.

Out-of-line slots are `SLOT_SIZE` bytes, detours of optimized probes as long as their code
(rounded up to `ALIGN`); a page holds many (a page per probe would waste memory, the seed's
complaint about ftrace trampolines). Pages are mapped in the target with a remote mmap at a fixed
hint within +-2 GB of the module, so RIP-relative operands and `jmp rel32` reach. The first bytes
of each page are kept for the `syscall; jmp $` stub remote syscalls run.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from typing import Protocol, TypeVar

from dynprobe.arch.x86_64 import SLOT_SIZE
from dynprobe.arch.x86_64.codegen.asm import Detour
from dynprobe.debug import debug as _debug
from dynprobe.errors import OptimizeRefusal, ProcessError, SharedMemoryRefused
from dynprobe.frozen import frozen
from dynprobe.ptrace.process import Tracee

PAGE = 4096
REGION = 16 * PAGE
STUB_BYTES = SLOT_SIZE  # the first slot of a region holds the remote-syscall stub
REACH = (1 << 31) - REGION
ALIGN = 16


@frozen
class PlacedCode:
    """Generated code in the target: where, how long, and its loads that may fault (see
    codegen's fix-up table)."""

    start: int
    size: int
    fixups: tuple[int, ...] = ()

    def __contains__(self, addr: int) -> bool:
        return self.start <= addr < self.start + self.size


class SlotCache:
    """Slot allocator of one process. `map_near(hint, size)` maps memory in the target."""

    def __init__(self, map_near: Callable[[int, int], int | None]) -> None:
        self._map_near = map_near
        self.regions: list[int] = []
        self._free: dict[int, list[int]] = {}  # size -> free slots of that size
        self._next: dict[int, int] = {}
        self.in_use = 0  # bytes handed out and not freed

    def stub(self) -> int | None:
        """An address in our own executable memory where a remote syscall stub may go."""
        return self.regions[0] if self.regions else None

    def allocate(self, near: int, size: int = SLOT_SIZE) -> int | None:
        """`size` free bytes within rel32 reach of `near`, mapping a new region if needed."""
        size = -(-size // ALIGN) * ALIGN
        if size > REGION - STUB_BYTES:
            return None
        free = self._free.get(size, [])
        for i, slot in enumerate(free):
            if abs(slot - near) < REACH:
                del free[i]
                self.in_use += size
                return slot
        for region in self.regions:
            offset = self._next[region]
            if offset + size <= REGION and abs(region - near) < REACH:
                self._next[region] = offset + size
                self.in_use += size
                return region + offset
        fresh = self._new_region(near)
        if fresh is None:
            return None
        self._next[fresh] = STUB_BYTES + size
        self.in_use += size
        return fresh + STUB_BYTES

    def shrink(self, slot: int, size: int, new_size: int) -> int:
        """Give back the unused end of the last allocation of its region (a detour sized after
        its code was built at its address). Returns the size now held."""
        size, new_size = (-(-n // ALIGN) * ALIGN for n in (size, new_size))
        for region, offset in self._next.items():
            if region + offset == slot + size and new_size < size:
                self._next[region] = slot - region + new_size
                self.in_use -= size - new_size
                return new_size
        return size

    def free(self, slot: int, size: int = SLOT_SIZE) -> None:
        size = -(-size // ALIGN) * ALIGN
        self._free.setdefault(size, []).append(slot)
        self.in_use -= size

    def contains(self, addr: int) -> bool:
        return any(r <= addr < r + REGION for r in self.regions)

    def _new_region(self, near: int) -> int | None:
        base = near & ~(REGION - 1)
        # Try below the module first (heap and stacks usually lie above), then above.
        for step in range(1, 64):
            for hint in (base - step * (1 << 24), base + step * (1 << 24)):
                if hint <= 0x10000 or hint >= (1 << 47) - REGION:
                    continue
                got = self._map_near(hint, REGION)
                if got is not None:
                    self.regions.append(got)
                    return got
        return None

    def bytes_mapped(self) -> int:
        return len(self.regions) * REGION

    def inherit(self, parent: SlotCache) -> None:
        """A forked child has a copy of the parent's regions, slots and all."""
        self.regions = list(parent.regions)
        self._free = {size: list(slots) for size, slots in parent._free.items()}
        self._next = dict(parent._next)
        self.in_use = parent.in_use

    def forget(self) -> None:
        """After exec the regions are gone with the old image."""
        self.regions.clear()
        self._free.clear()
        self._next.clear()
        self.in_use = 0


FIRST_GUESS = 512  # bytes: generated code's first room; most fits, the rest is placed again
Code = TypeVar("Code", Detour, bytes)


class CodeSpace(Protocol):
    """A process's room for generated code (core/traced.py's TracedProcess)."""

    slots: SlotCache
    tracee: Tracee


def place_code(
    allocate: Callable[[int, int], int | None], proc: CodeSpace, near: int,
    build: Callable[[int], Code | OptimizeRefusal],
) -> tuple[int, Code] | OptimizeRefusal:  # fmt: skip
    """Generated code near `near` (a detour, actions, a return part), written into the target:
    `build(address)` at a first guess of its size, again with the room it needs if longer, where
    `allocate(near, size)` finds room (in `proc.slots`); the bytes it does not use go back."""
    room = FIRST_GUESS
    while True:
        start = allocate(near, room)
        if start is None:
            return OptimizeRefusal.NO_MEMORY
        built = build(start)
        if isinstance(built, OptimizeRefusal):
            proc.slots.free(start, room)
            return built
        code = built if isinstance(built, bytes) else built.code
        if len(code) <= room:
            break
        proc.slots.free(start, room)
        if room > FIRST_GUESS:  # (placed again with the room it asked for, and still longer)
            return OptimizeRefusal.NO_MEMORY
        room = len(code) + 32  # a big record: placed again with the room it needs
    proc.slots.shrink(start, room, len(code))
    proc.tracee.write(start, code)
    return start, built


def map_shared_memory(proc: CodeSpace, size: int, what: str) -> tuple[int, int, int, mmap.mmap] | OptimizeRefusal:
    """Memory shared with `proc` (a memfd it creates and maps, by remote system calls through one
    of its stopped threads and its slots' stub) for `what`: (that thread, the stub, the address
    in the process, our view)."""
    tid = next((t for t, s in proc.tracee.threads.items() if s.stopped), None)
    stub = proc.slots.stub()
    if tid is None or stub is None:
        return OptimizeRefusal.SHARED_MEMORY
    try:
        address, view = proc.tracee.map_shared(tid, stub, size)
    except (SharedMemoryRefused, ProcessError, OSError) as exc:
        _debug(f"pid {proc.tracee.pid}: no memory shared for {what}: {exc}")
        return OptimizeRefusal.SHARED_MEMORY
    return tid, stub, address, view
