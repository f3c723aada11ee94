"""Thread areas in pools of shared memory, as the tracer sees them (layout: ringbuf/layout.py).

A pool is one memfd mapped in the target (at `target_addr`) and in the tracer (`view`). Areas are
handed to threads as they appear and come back when a thread has ended and its area was drained
(its counters folded into the totals first): a program that starts threads all the time does not
grow without bound.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from dynprobe.frozen import frozen
from dynprobe.ptrace.syscalls import futex_wake
from dynprobe.ringbuf import layout as L

POOL_AREAS = 8


@dataclass(eq=False)
class Pool:
    """One memfd of thread areas, mapped in the target and here."""

    pid: int
    target_addr: int
    view: mmap.mmap
    count: int
    # each area as u64s in a memoryview (a word read or written in a tenth of numpy's time)
    cells: list[memoryview] = field(init=False)
    address: int = field(init=False)
    committed: set[int] = field(default_factory=set)  # areas whose memory the target faulted in

    def __post_init__(self) -> None:
        size = len(self.view) // self.count
        whole = memoryview(self.view)
        self.cells = [whole[i * size : (i + 1) * size].cast("Q") for i in range(self.count)]
        whole.release()
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.view))  # the view's, here

    def close(self) -> None:
        """Let go of the shared memory (no view of it may be left)."""
        for cells in self.cells:
            cells.release()
        self.cells = []
        self.view.close()


@frozen
class AreaRef:
    """One thread area of a pool."""

    pool: Pool
    index: int

    @property
    def offset(self) -> int:
        return self.index * (len(self.pool.view) // self.pool.count)

    @functools.cached_property
    def target_addr(self) -> int:
        return self.pool.target_addr + self.offset

    @functools.cached_property
    def address(self) -> int:
        """Where the area is here (in our view of its pool)."""
        return self.pool.address + self.offset

    @property
    def cells(self) -> memoryview:
        """The area as u64s, for a word or two (see Pool.cells)."""
        return self.pool.cells[self.index]

    def wake_writer(self) -> None:
        """The thread, if it sleeps waiting for room in its ring (layout.WAIT_SLEEPING), is woken:
        the reader moved TAIL, or the tracer ended the waits."""
        if self.cells[L.WAIT_SLEEPING // 8]:
            futex_wake(self.address + L.TAIL, 1)


def _publish_held(area: AreaRef, layout: L.AreaLayout) -> None:
    words = area.cells
    head, reserve, tail = (words[at // 8] for at in (L.HEAD, L.RESERVE, L.TAIL))
    if head < reserve <= tail + layout.ring_slots:  # (the target is not trusted)
        words[L.HEAD // 8] = reserve


class ThreadAreas:
    """The areas of one process (and of its vfork children: one address space). Both callbacks run
    remote syscalls through the stopped thread an area is being given to: `map_pool(tid, size)`
    maps a new pool and returns (its address in the target, our view); `commit(tid, addr)` may
    fault the area at `addr` in (the part worth it) before its first use."""

    # Areas given, taken back or closed, in any process (an upcall server keeps a list of the
    # threads that may ask: core/upcalls.py)
    changes = 0

    def __init__(
        self,
        pid: int,
        layout: L.AreaLayout,
        map_pool: Callable[[int, int], tuple[int, mmap.mmap]],
        commit: Callable[[int, int], None],
    ) -> None:
        self.pid = pid
        self.layout = layout
        self._map_pool = map_pool
        self._commit = commit
        self.pools: list[Pool] = []
        self.by_tid: dict[int, AreaRef] = {}
        self.retired: list[tuple[int, AreaRef]] = []  # (tid, area) of ended threads, to drain
        self.wait_ticks = 0  # how long a writer may wait for room in a full ring (layout.WAIT_TICKS)
        self.spin_ticks = 0  # of which it spins before it sleeps (layout.WAIT_SPIN)
        self.sleeps = True  # False: its writers never sleep (a seccomp filter may forbid the futex call)
        self.overwrite = False  # a flight recorder's rings: a full one gives up its oldest records
        self._free: list[AreaRef] = []
        self.lock = threading.Lock()  # the consumer recycles retired areas from its thread

    def assign(self, tid: int, *, pid: int | None = None) -> AreaRef:
        """Thread `tid`'s area (given now if it has none) of process `pid` (a fork child's
        threads take areas of its parent's; by default, the process these are)."""
        with self.lock:
            area = self.by_tid.get(tid)
            if area is not None:
                return area
            if not self._free:
                pool = self._new_pool(tid)
                self._free.extend(AreaRef(pool, i) for i in reversed(range(pool.count)))
            area = self._free.pop()
            self.by_tid[tid] = area
            ThreadAreas.changes += 1
        if area.index not in area.pool.committed:
            area.pool.committed.add(area.index)
            self._commit(tid, area.target_addr)
        words = area.cells
        words[L.TID // 8], words[L.TGID // 8] = tid, self.pid if pid is None else pid
        words[L.LANG_BUSY // 8] = 0  # (a thread killed in a program's body left it)
        words[L.WAIT_SPIN // 8], words[L.WAIT_TICKS // 8] = self.spin_ticks, self.wait_ticks
        for word in (L.WAIT_SLEEPING, L.WAIT_GAVE_UP):  # (a thread killed asleep left them)
            words[word // 8] = 0
        words[L.OVERWRITE // 8] = self.overwrite
        words[L.AREA_SELF // 8] = area.target_addr  # (for its futex waits: an upcall's, a full ring's)
        for word in (L.UPCALL_STATE, L.UPCALL_BUSY, L.UPCALL_SLEEPING):  # (a thread killed in an upcall left them)
            words[word // 8] = 0
        words[L.SLEEP_TIMEOUT // 8], words[L.SLEEP_TIMEOUT // 8 + 1] = divmod(L.SLEEP_NS, 1_000_000_000)
        words[L.MAGIC // 8] = L.AREA_MAGIC
        return area

    def set_wait(self, ticks: int, spin_ticks: int) -> None:
        """How long a writer may wait for room from now on, and spin before it sleeps, in every
        area (`ticks` 0: a wait going on ends; the tracer sets it when it leaves: nobody would
        make room)."""
        self.wait_ticks, self.spin_ticks = ticks, spin_ticks if self.sleeps else ticks
        for _, area in self.live():
            words = area.cells
            # (the spin first: a writer that reads them between never sees a longer wait with
            # the shorter spin of a process that must not sleep)
            words[L.WAIT_SPIN // 8] = self.spin_ticks
            words[L.WAIT_TICKS // 8] = ticks
            if not ticks:
                area.wake_writer()

    def never_sleep(self) -> None:
        """From now on no writer sleeps (a thread of the process runs under a seccomp filter,
        which may forbid the futex call): each spins its whole wait."""
        if self.sleeps:
            self.sleeps = False
            self.set_wait(self.wait_ticks, self.wait_ticks)

    def set_overwrite(self, overwrite: bool) -> None:
        """Whether a full ring gives up its oldest records (a flight recorder's), in every area."""
        self.overwrite = overwrite
        for _, area in self.live():
            area.cells[L.OVERWRITE // 8] = overwrite

    def _new_pool(self, tid: int) -> Pool:
        count = POOL_AREAS * (1 << min(len(self.pools), 4))
        addr, view = self._map_pool(tid, count * self.layout.size)
        pool = Pool(self.pid, addr, view, count)
        self.pools.append(pool)
        return pool

    def retire(self, tid: int) -> None:
        with self.lock:
            area = self.by_tid.pop(tid, None)
            if area is not None:
                ThreadAreas.changes += 1
                _publish_held(area, self.layout)
                self.retired.append((tid, area))

    def publish_held(self) -> None:
        """Records held back (entries of calls a time threshold may still drop) are published:
        the threads are stopped or gone, and those calls are still running."""
        for _, area in self.live():
            _publish_held(area, self.layout)

    def recycle(self, area: AreaRef) -> None:
        """A drained, folded area is clean again (called by the consumer)."""
        lay = self.layout
        ctypes.memset(area.address, 0, lay.ring)  # (no copy of zeros the ring's size)
        with self.lock:
            self._free.append(area)

    def owns(self, tid: int) -> bool:
        return tid in self.by_tid

    def live(self) -> list[tuple[int, AreaRef]]:
        with self.lock:
            return list(self.by_tid.items())

    def close(self) -> None:
        ThreadAreas.changes += 1
        for pool in self.pools:
            pool.close()
        self.pools.clear()
