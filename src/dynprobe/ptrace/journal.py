"""The undo journal: every span of a target's own code dynprobe has changed, with the bytes
that were there, its hooked returns, its rescue page and the remote system call in progress, in
memory the tracer shares with its guardian (ptrace/guardian.py), which puts them back if the
tracer dies.

The journal is written only by the tracer and read only after it is gone, so it needs no lock: an
entry's `kind` byte is written last when one is made and first when one is dropped, and a span's
length grows before the target's bytes change and shrinks after them.
"""

from __future__ import annotations

import ctypes
import mmap
import struct
from collections.abc import Callable, Iterator

from dynprobe.arch.x86_64.regs import Regs
from dynprobe.ptrace.procfs import identity

_HEADER = struct.Struct("<8sQ")  # magic, entries in use (the high-water mark)
LIFELINE_AT = 64  # a pthread_mutex_t (40 bytes), never written by the journal
# The remote syscall in progress (one at a time: the tracer runs them): pid (0: none, written
# last), tid, the stub's address, the thread's registers before it
_SYSCALL_AT = 128
_SYSCALL = struct.Struct(f"<IIQ{ctypes.sizeof(Regs)}s")
_ENTRIES_AT = 512
_MAGIC = b"dpundo2\0"
_ENTRY = struct.Struct("<IBBxxQ16s")  # pid, kind, length, address, original bytes
_KIND_AT, _LENGTH_AT, _BYTES_AT = 4, 5, 16
# _RESCUE: the address of the process's rescue page; _DOORBELL: the address of its doorbell's
# GONE word (core/upcalls.py), which the guardian sets first; _PROCESS: who the process is (its start
# time in the address field, its pidfd's inode in the bytes: ptrace.process.identity), which
# the guardian checks (a pid names another process once its own has ended)
_FREE, _PATCH, _RETURNS, _RESCUE, _PROCESS, _DOORBELL = 0, 1, 2, 3, 4, 5
_RETURNS_BYTES = struct.Struct("<Q8x")  # a _RETURNS entry's bytes: the shadow stack's offset in a thread area
MAX_SPAN = 16  # bytes of one entry (dynprobe changes at most the 5 bytes of a jump)
CAPACITY = 1 << 18  # entries (8 MiB of address space; pages are touched only as entries are used)


class Journal:
    """The undo journal: spans of a target's own code dynprobe has changed, each with the bytes
    that were there. In memory shared with the guardian (an anonymous shared mapping made before
    the fork)."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self.memory = mmap.mmap(-1, _ENTRIES_AT + capacity * _ENTRY.size)
        _HEADER.pack_into(self.memory, 0, _MAGIC, 0)
        self._used = 0
        self._free: list[int] = []
        self._index: dict[tuple[int, int], int] = {}  # (pid, address) -> entry
        self._returns: dict[int, int] = {}  # pid -> its _RETURNS entry
        self._rescues: dict[int, int] = {}  # pid -> its _RESCUE entry
        self._doorbells: dict[int, int] = {}  # pid -> its _DOORBELL entry
        self._processes: dict[int, int] = {}  # pid -> its _PROCESS entry
        self.full = False  # more spans than entries: the rest are not journaled
        self.on_full: Callable[[], object] | None = None  # told once, when that happens

    @property
    def empty(self) -> bool:
        """No span of code is changed (hooked returns alone need no rescue after a detach:
        it has put their addresses back)."""
        return not self._index

    def length(self, pid: int, addr: int) -> int:
        """How many bytes at `addr` the journal says are changed (0: none)."""
        entry = self._index.get((pid, addr))
        return 0 if entry is None else self.memory[self._at(entry) + _LENGTH_AT]

    def record(self, pid: int, addr: int, original: bytes) -> None:
        """`original` was at `addr` before dynprobe changed it (a prefix of what it changed)."""
        if not original:
            self.drop(pid, addr)
            return
        original = original[:MAX_SPAN]
        entry = self._index.get((pid, addr))
        if entry is not None:
            at = self._at(entry)
            # The bytes first: those of a shorter span are a prefix of these (a file's bytes).
            self.memory[at + _BYTES_AT : at + _BYTES_AT + len(original)] = original
            self.memory[at + _LENGTH_AT] = len(original)
            return
        self._known(pid)
        entry = self._new(pid, _PATCH, length=len(original), addr=addr, data=original)
        if entry is not None:
            self._index[(pid, addr)] = entry

    def record_returns(self, pid: int, points: int, shadow: int) -> None:
        """The process hooks returns: its trampoline's entry point 0 is at `points`, and each
        thread's shadow stack at `shadow` in the thread area its GS base points to."""
        if pid in self._returns:
            return
        self._known(pid)
        entry = self._new(pid, _RETURNS, length=_RETURNS_BYTES.size, addr=points, data=_RETURNS_BYTES.pack(shadow))
        if entry is not None:
            self._returns[pid] = entry

    def record_rescue(self, pid: int, page: int) -> None:
        """The process has a rescue handler (core/rescue.py), whose page is at `page`: the
        guardian tells it when it has put everything back (RESCUE_RESCUED)."""
        self._release(self._rescues.pop(pid, None))
        self._known(pid)
        entry = self._new(pid, _RESCUE, length=0, addr=page, data=b"")
        if entry is not None:
            self._rescues[pid] = entry

    def record_doorbell(self, pid: int, gone: int) -> None:
        """The process's threads ask dynprobe through a doorbell (core/upcalls.py) whose GONE word
        is at `gone`: the guardian sets it first, so that no thread waits for an answer."""
        self._release(self._doorbells.pop(pid, None))
        self._known(pid)
        entry = self._new(pid, _DOORBELL, length=0, addr=gone, data=b"")
        if entry is not None:
            self._doorbells[pid] = entry

    def begin_syscall(self, pid: int, tid: int, stub: int, regs: bytes) -> None:
        """Thread `tid` runs a remote syscall from `stub`; `regs` are its registers before it."""
        self._known(pid)
        _SYSCALL.pack_into(self.memory, _SYSCALL_AT, 0, tid, stub, regs)
        self.memory[_SYSCALL_AT : _SYSCALL_AT + 4] = pid.to_bytes(4, "little")

    def end_syscall(self) -> None:
        self.memory[_SYSCALL_AT : _SYSCALL_AT + 4] = bytes(4)

    def syscall(self) -> tuple[int, int, int, bytes] | None:
        """(pid, tid, stub, registers) of the remote syscall in progress, if one is."""
        pid, tid, stub, regs = _SYSCALL.unpack_from(self.memory, _SYSCALL_AT)
        return (pid, tid, stub, regs) if pid else None

    def drop(self, pid: int, addr: int) -> None:
        """The bytes at `addr` are the original ones again."""
        self._release(self._index.pop((pid, addr), None))

    def _release(self, entry: int | None) -> None:
        if entry is not None:
            self.memory[self._at(entry) + _KIND_AT] = _FREE
            self._free.append(entry)

    def forget(self, pid: int) -> None:
        """The process exited or exec'd: its spans and hooks are gone with its old image."""
        for key in [k for k in self._index if k[0] == pid]:
            self.drop(*key)
        self._release(self._returns.pop(pid, None))
        self._release(self._rescues.pop(pid, None))
        self._release(self._doorbells.pop(pid, None))
        self._release(self._processes.pop(pid, None))

    def _known(self, pid: int) -> None:
        """Who the process is, journaled once, before its first entry."""
        if pid in self._processes:
            return
        started, inode = identity(pid)
        entry = self._new(pid, _PROCESS, length=0, addr=started, data=inode.to_bytes(8, "little"))
        if entry is not None:
            self._processes[pid] = entry

    def _new(self, pid: int, kind: int, *, length: int, addr: int, data: bytes) -> int | None:
        """A new entry of `kind`, its kind byte written last (see the module's docstring); None
        when the journal is full."""
        entry = self._take()
        if entry is None:
            return None
        at = self._at(entry)
        _ENTRY.pack_into(self.memory, at, pid, _FREE, length, addr, data)
        self.memory[at + _KIND_AT] = kind
        return entry

    def inherit(self, parent: int, child: int) -> None:
        """A forked child has a copy of its parent's changed code and hooked returns."""
        for (pid, addr), entry in list(self._index.items()):
            if pid == parent:
                at = self._at(entry)
                length = self.memory[at + _LENGTH_AT]
                self.record(child, addr, bytes(self.memory[at + _BYTES_AT : at + _BYTES_AT + length]))
        hooks = self._returns.get(parent)
        if hooks is not None:
            _, _, _, points, data = _ENTRY.unpack_from(self.memory, self._at(hooks))
            self.record_returns(child, points, _RETURNS_BYTES.unpack(data)[0])
        rescue = self._rescues.get(parent)
        if rescue is not None:
            self.record_rescue(child, _ENTRY.unpack_from(self.memory, self._at(rescue))[3])
        doorbell = self._doorbells.get(parent)
        if doorbell is not None:
            self.record_doorbell(child, _ENTRY.unpack_from(self.memory, self._at(doorbell))[3])

    def spans(self) -> dict[int, list[tuple[int, bytes]]]:
        """Every journaled span by pid: (address, original bytes). Read from the shared memory
        alone (the guardian has no index)."""
        magic, used = _HEADER.unpack_from(self.memory, 0)
        assert magic == _MAGIC
        out: dict[int, list[tuple[int, bytes]]] = {}
        for entry in range(min(used, self.capacity)):
            pid, kind, length, addr, original = _ENTRY.unpack_from(self.memory, self._at(entry))
            if kind == _PATCH and 0 < length <= MAX_SPAN:
                out.setdefault(pid, []).append((addr, original[:length]))
        return out

    def returns(self) -> dict[int, tuple[int, int]]:
        """pid -> (trampoline entry point 0, shadow stack offset) of processes that hook returns.
        Read from the shared memory alone."""
        return {pid: (points, _RETURNS_BYTES.unpack(data)[0]) for pid, points, data in self._of_kind(_RETURNS)}

    def rescues(self) -> dict[int, int]:
        """pid -> the address of its rescue page. Read from the shared memory alone."""
        return {pid: page for pid, page, _ in self._of_kind(_RESCUE)}

    def doorbells(self) -> dict[int, int]:
        """pid -> the address of its doorbell's GONE word. Read from the shared memory alone."""
        return {pid: gone for pid, gone, _ in self._of_kind(_DOORBELL)}

    def identities(self) -> dict[int, tuple[int, int]]:
        """pid -> who its process was (ptrace.process.identity). Read from the shared memory
        alone."""
        return {pid: (started, int.from_bytes(data[:8], "little")) for pid, started, data in self._of_kind(_PROCESS)}

    def _of_kind(self, wanted: int) -> Iterator[tuple[int, int, bytes]]:
        magic, used = _HEADER.unpack_from(self.memory, 0)
        assert magic == _MAGIC
        for entry in range(min(used, self.capacity)):
            pid, kind, _, address, data = _ENTRY.unpack_from(self.memory, self._at(entry))
            if kind == wanted:
                yield pid, address, data

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._used == self.capacity:
            if not self.full and self.on_full is not None:
                self.on_full()
            self.full = True
            return None
        entry = self._used
        self._used += 1
        _HEADER.pack_into(self.memory, 0, _MAGIC, self._used)
        return entry

    @staticmethod
    def _at(entry: int) -> int:
        return _ENTRIES_AT + entry * _ENTRY.size
