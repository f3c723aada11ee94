"""A process's rescue handler and page (arch/x86_64/rescue.py): installed when dynprobe starts
tracing the process, kept up to date as sites come and go, taken out when it detaches.

The page is shared memory (the tracer writes it as memory: the mark of the thread it resumes
costs a store at each trap hit); the table of sites is written whole into the half not in use,
then the header is pointed at it (one 8-byte store), before any new int3 can be hit.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dynprobe.arch.x86_64.rescue import HANDLER_FLAGS, MEM_PATH, SIGTRAP, build_rescue_handler
from dynprobe.debug import debug as _debug
from dynprobe.errors import ProcessError
from dynprobe.ringbuf import layout as L

if TYPE_CHECKING:
    from dynprobe.core.probe import Site
    from dynprobe.ptrace.process import Tracee

SYS_RT_SIGACTION = 13
_ACTION = struct.Struct("<QQQQ")  # struct kernel_sigaction: handler, flags, restorer, mask
_ALL_SIGNALS = (1 << 64) - 1
_SIG_DFL, _SIG_IGN = 0, 1
_ENTRY = struct.Struct("<QBB6x")  # a table entry: the site's address, its first byte, RESCUE_ flags


@dataclass(eq=False)
class Rescue:
    """The rescue handler of one process (and of its forked children, which share the page)."""

    page: int  # the page's address in the target
    view: mmap.mmap  # the page here
    handler: int  # the handler's address in the target
    half: int = 0  # the table's half in use
    stale: bool = False  # a site was added while writes were held: publish before they go out

    def __post_init__(self) -> None:
        self._words = memoryview(self.view).cast("Q")
        self.known: set[int] = set()  # the sites in the table

    def mark(self, tid: int, rip: int) -> None:
        """The tracer is about to resume thread `tid` at `rip` (see the handler's rule 1)."""
        words = self._words
        words[L.RESCUE_MARK_TID // 8] = tid
        words[L.RESCUE_MARK_RIP // 8] = rip

    def publish(self, sites: list[Site]) -> None:
        """The table: every site of the process (an optimized one's entry says: take the jump)."""
        if len(sites) > L.RESCUE_CAPACITY:
            _debug(f"rescue table: {len(sites)} sites, {L.RESCUE_CAPACITY} kept")
            sites = sites[: L.RESCUE_CAPACITY]
        table = b"".join(
            _ENTRY.pack(s.addr, s.original[0], L.RESCUE_WAIT if s.rescue_wait else 0)
            for s in sorted(sites, key=lambda site: site.addr)
        )
        half = 1 - self.half
        at = L.RESCUE_ENTRIES + half * L.RESCUE_CAPACITY * L.RESCUE_ENTRY
        self.view[at : at + len(table)] = table
        self._words[L.RESCUE_TABLE // 8] = len(sites) | half << 32
        self.half = half
        self.known = {s.addr for s in sites}
        self.stale = False

    def close(self) -> None:
        self._words.release()
        self.view.close()


def install(tracee: Tracee, tid: int, stub: int, allocate: Callable[[int, int], int | None]) -> Rescue | None:
    """The handler and page in `tracee` (stopped: no thread of it may change its SIGTRAP action
    meanwhile), through remote syscalls in thread `tid` at `stub`; the handler's code where
    `allocate(near, size)` says. None where the program handles SIGTRAP itself: its handler
    stays, and its threads at traps die with a killed tracer."""
    page, view = tracee.map_shared(tid, stub, L.RESCUE_BYTES)
    code, restorer = build_rescue_handler(page)
    at = allocate(page, len(code))
    if at is None:
        view.close()
        raise ProcessError(f"no executable memory for the rescue handler in pid {tracee.pid}")
    tracee.write(at, code)
    words = memoryview(view).cast("Q")
    words[0] = L.RESCUE_MAGIC
    words.release()
    view[L.RESCUE_MEM_PATH : L.RESCUE_MEM_PATH + len(MEM_PATH)] = MEM_PATH
    _ACTION.pack_into(view, L.RESCUE_ACTION, at, HANDLER_FLAGS, at + restorer, _ALL_SIGNALS)
    _ACTION.pack_into(view, L.RESCUE_DEFAULT_ACTION, _SIG_DFL, 0, 0, 0)
    _sigaction(tracee, tid, stub, page + L.RESCUE_ACTION, page + L.RESCUE_OLD_ACTION)
    own = _ACTION.unpack_from(view, L.RESCUE_OLD_ACTION)[0]
    if own not in (_SIG_DFL, _SIG_IGN):
        _sigaction(tracee, tid, stub, page + L.RESCUE_OLD_ACTION, 0)  # the program's own handler, back
        _debug(f"pid {tracee.pid} handles SIGTRAP itself: no rescue handler")
        view.close()
        return None
    view[L.RESCUE_OWN : L.RESCUE_OWN + 8] = own.to_bytes(8, "little")
    return Rescue(page, view, at)


def uninstall(tracee: Tracee, rescue: Rescue, tid: int, stub: int) -> None:
    """The program's own disposition of SIGTRAP back (unless it has set another since)."""
    view = rescue.view
    own = int.from_bytes(view[L.RESCUE_OWN : L.RESCUE_OWN + 8], "little")
    _ACTION.pack_into(view, L.RESCUE_ACTION, own, 0, 0, 0)  # (ours is not needed again)
    _sigaction(tracee, tid, stub, rescue.page + L.RESCUE_ACTION, rescue.page + L.RESCUE_OLD_ACTION)
    if _ACTION.unpack_from(view, L.RESCUE_OLD_ACTION)[0] != rescue.handler:
        _sigaction(tracee, tid, stub, rescue.page + L.RESCUE_OLD_ACTION, 0)  # the program's, since


def _sigaction(tracee: Tracee, tid: int, stub: int, action: int, old: int) -> None:
    result = tracee.remote_syscall(tid, stub, SYS_RT_SIGACTION, SIGTRAP, action, old, 8)
    if result < 0:
        raise ProcessError(f"rt_sigaction in pid {tracee.pid} failed: error {-result}")
