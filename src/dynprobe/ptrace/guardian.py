"""The guardian: a small process that puts a target's code back if its tracer dies.

A tracer killed by SIGKILL or the OOM killer leaves its int3s and jumps in the target. The
session forks a guardian when it starts and keeps an undo journal in memory the two share: every
span of the target's own code dynprobe has changed, with the bytes that were there, and the remote
system call it is running, if any. The guardian waits for the tracer thread to let go of a robust
mutex (`_Lifeline`): the kernel releases it, marked as its owner's death, as soon as the thread
starts to exit, before the tracer's memory is torn down (milliseconds for a big Python process)
and before the tracees are let go. A dismissal (a word on a pipe, then the mutex released) ends
it; otherwise the guardian restores what the journal lists:

- int3s first, at once, while the target runs: a one-byte write cannot be torn;
- then, with every thread stopped (the guardian attaches, writes, and detaches): a thread left
  in a remote system call gets its registers back (its stub ends in a `jmp $` it waits in),
  longer spans (an optimized probe's or a traced function's `jmp`, a borrowed stub) go back,
  and the return addresses that return probes and the function tracer hooked are put back
  (the trampoline would still take them to their callers, but a C++ exception or a backtrace
  cannot walk through it without the tracer, which traps the unwinder to put them back).
  Without permission to attach it leaves the jumps, which need no tracer, and says so;
- last, it tells each process's rescue handler it is done (core/rescue.py).

The threads the kernel lets go with a SIGTRAP of dynprobe's (stopped at a trap probe, or hitting
an int3 before the guardian put it back) are the rescue handler's, in the target.

The journal (ptrace/journal.py) is written only by the tracer and read only after it is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Iterator

from dynprobe.arch.x86_64 import REMOTE_SYSCALL
from dynprobe.arch.x86_64.regs import Regs
from dynprobe.errors import ProcessError
from dynprobe.ptrace import syscalls as sc
from dynprobe.ptrace.events import EventKind
from dynprobe.ptrace.journal import LIFELINE_AT, Journal
from dynprobe.ptrace.process import attach as attach_process
from dynprobe.ptrace.procfs import identity
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.shadow import entries_in, swap_slots, trampoline_point
from dynprobe.threads import signals_blocked

ATTACH_PATIENCE = 2.0  # seconds the guardian retries attaching while the dying tracer lets go


_libc = ctypes.CDLL(None, use_errno=True)
_EOWNERDEAD = 130
_PTHREAD_PROCESS_SHARED = _PTHREAD_MUTEX_ROBUST = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Lifeline:
    """A robust, process-shared mutex in the journal's memory, held by the tracer thread. The
    kernel lets go of a thread's robust mutexes, marking their owner dead, as soon as the thread
    starts to exit, before its memory is torn down, its files closed or its tracees let go: a
    dying Python tracer of 100 MB takes milliseconds to get that far, and a trap hit meanwhile
    stops for a tracer that never answers. Per thread, as ptrace is: if the tracer thread ends
    alone, its tracees are let go as well."""

    def __init__(self, memory: mmap.mmap) -> None:
        self._mutex = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(memory, LIFELINE_AT)))
        attr = ctypes.create_string_buffer(16)  # pthread_mutexattr_t: 4 bytes
        self.held = not (
            _libc.pthread_mutexattr_init(attr)
            or _libc.pthread_mutexattr_setpshared(attr, _PTHREAD_PROCESS_SHARED)
            or _libc.pthread_mutexattr_setrobust(attr, _PTHREAD_MUTEX_ROBUST)
            or _libc.pthread_mutex_init(self._mutex, attr)
            or _libc.pthread_mutex_lock(self._mutex)
        )

    def release(self) -> None:
        if self.held:
            self.held = False
            _libc.pthread_mutex_unlock(self._mutex)

    def wait(self, word_r: int) -> bytes:
        """In the guardian: the tracer's word (see `_word`) once the tracer thread releases the
        mutex; b"" at once if it dies. Every second it also looks at the pipe, should the mutex
        have been lost (the pipe closes when the last tracer thread is gone)."""
        while True:
            deadline = _Timespec(int(time.time()) + 1, 0)
            result = _libc.pthread_mutex_timedlock(self._mutex, ctypes.byref(deadline))
            if result == _EOWNERDEAD:
                return b""
            if result == 0 or select.select([word_r], [], [], 0)[0]:
                return _word(word_r)


class Guardian:
    """The guardian process of one session (see the module's docstring). `dismiss()` when every
    byte is back; `hand_over()` when a detach could not put everything back: the guardian then
    does what it can, as if the tracer had died. Each waits until the guardian is gone.

    It is a grandchild, in a session of its own: no child of ours is left for the session's
    `waitpid(-1)` to find, and the terminal's Ctrl-C reaches only the tracer (which then
    dismisses it). It tells its pid on a second pipe, whose end closing says it has finished."""

    def __init__(self) -> None:
        self.journal = Journal()
        self._lifeline = _Lifeline(self.journal.memory)  # held before the fork: never the guardian's
        word_r, self._word_w = os.pipe2(os.O_CLOEXEC)
        self._done_r, done_w = os.pipe2(os.O_CLOEXEC)
        tracer = os.getpid()
        with signals_blocked():  # (a Ctrl-C lands once the guardian is known: see signals_blocked)
            middle = os.fork()
            if middle == 0:  # the guardian (_guard unblocks the signals it does not ignore)
                try:
                    os.setsid()
                    if os.fork() == 0:
                        _guard(word_r, done_w, self.journal, self._lifeline, tracer)
                finally:
                    os._exit(0)
            os.close(word_r)
            os.close(done_w)
            os.waitpid(middle, 0)
            self.pid = int.from_bytes(os.read(self._done_r, 8).ljust(8, b"\0"), "little")

    def dismiss(self) -> None:
        self._end(b"d")

    def hand_over(self) -> None:
        self._end(b"r")

    def _end(self, word: bytes) -> None:
        if self._word_w < 0:
            return
        with contextlib.suppress(OSError):
            os.write(self._word_w, word)
        os.close(self._word_w)
        self._word_w = -1
        self._lifeline.release()
        deadline = time.monotonic() + ATTACH_PATIENCE + 1.0
        with contextlib.suppress(OSError):
            while select.select([self._done_r], [], [], max(0.0, deadline - time.monotonic()))[0]:
                if not os.read(self._done_r, 64):
                    break
        os.close(self._done_r)


_PR_SET_NAME = 15
# Neither its name nor its command line says "dynprobe": `pkill -9 dynprobe` or `pkill -9 -f
# dynprobe`, aimed at the tracer, must not take the guardian with it (hazard 21).
GUARDIAN_NAME = b"dp-guardian"
GUARDIAN_TITLE = "dp-guardian (tracer {pid})"


def _name_process(tracer: int) -> None:
    """Tell the guardian from the tracer it is a copy of: its name (`ps`, `top`, `pkill NAME`)
    and its command line (`ps aux`, `pkill -f`), which is the tracer's until it is written over
    where the kernel reads it (the argument strings at the stack's top, as setproctitle does:
    this process's own copy since the fork; Python keeps its own copy of them)."""
    _libc.prctl(_PR_SET_NAME, GUARDIAN_NAME, 0, 0, 0)
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rfind(b")") + 2 :].split()  # from field 3 (state) on
        start, end = int(fields[48 - 3]), int(fields[49 - 3])  # arg_start, arg_end (proc(5))
    except (OSError, ValueError, IndexError):
        return
    title = GUARDIAN_TITLE.format(pid=tracer).encode()
    if end > start:
        ctypes.memmove(start, title[: end - start - 1].ljust(end - start, b"\0"), end - start)


def _guard(word_r: int, done_w: int, journal: Journal, lifeline: _Lifeline, tracer: int) -> None:
    """The guardian's life: holding no file of the tracer's open, deaf to the signals meant for
    the tracer, waiting for the tracer thread to die (the lifeline) or to say the word, or, if
    the lifeline could not be made, for the pipe to close."""
    _name_process(tracer)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    keep = sorted((2, word_r, done_w))
    for low, high in zip([-1, *keep], [*keep, os.sysconf("SC_OPEN_MAX")], strict=True):
        os.closerange(max(low + 1, 0), high)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.write(done_w, os.getpid().to_bytes(8, "little"))
    if (lifeline.wait(word_r) if lifeline.held else _word(word_r)) == b"d":
        return
    for line in rescue(
        journal.spans(), journal.returns(), journal.syscall(), journal.rescues(), journal.identities(),
        journal.doorbells(),
    ):  # fmt: skip
        with contextlib.suppress(OSError):
            print(f"dynprobe guardian: {line}", file=sys.stderr, flush=True)


def _word(word_r: int) -> bytes:
    """The tracer's word: b"d" (dismissed), b"r" (rescue), b"" (the pipe closed: it is gone)."""
    while True:
        try:
            return os.read(word_r, 1)
        except InterruptedError:
            continue


def rescue(
    spans: dict[int, list[tuple[int, bytes]]],
    returns: dict[int, tuple[int, int]],
    syscall: tuple[int, int, int, bytes] | None = None,
    rescues: dict[int, int] | None = None,
    identities: dict[int, tuple[int, int]] | None = None,
    doorbells: dict[int, int] | None = None,
) -> Iterator[str]:
    """Put the journaled spans back, int3s first, a thread left in a remote syscall and hooked
    returns back to their callers, then tell each process's rescue handler it is done (but first,
    no thread is to wait for an answer at a doorbell: its GONE word set); yields
    a line per process for the user. Only in the processes journaled (`identities`): a pid
    whose process has ended may be another's by now."""
    rescues, identities, doorbells = rescues or {}, identities or {}, doorbells or {}
    for pid in {**spans, **returns, **rescues, **doorbells}:
        with _same_process(pid, identities.get(pid)) as same:
            if same is None:
                continue  # ended: nothing to save
            fd, still_same = same
            if pid in doorbells:  # threads waiting for an upcall's answer go on without it
                _put_back(fd, doorbells[pid], (1).to_bytes(8, "little"))
            plain = 0
            changed = [(a, b) for a, b in spans.get(pid, []) if _ours(fd, a, b)]
            short = [(a, b) for a, b in changed if len(b) == 1]
            long = [(a, b) for a, b in changed if len(b) > 1]
            restored = sum(_put_back(fd, addr, original) for addr, original in short)
            in_syscall = syscall is not None and syscall[0] == pid
            if long or pid in returns or in_syscall:
                with _stopped(pid) as threads:
                    if threads and not still_same():  # (the attach was to whoever has the pid now)
                        threads = []
                    if in_syscall and syscall is not None and threads:
                        _out_of_syscall(*syscall[1:])  # before its stub goes (it may be borrowed code)
                    restored += sum(_put_back(fd, addr, original) for addr, original in long) if threads else 0
                    if pid in returns:
                        plain = sum(_plain_returns(fd, tid, *returns[pid]) for tid in threads)
            if pid in rescues:  # threads waiting in the rescue handler go on
                _put_back(fd, rescues[pid] + L.RESCUE_RESCUED, (1).to_bytes(8, "little"))
        left = len(changed) - restored
        yield (
            f"dynprobe let pid {pid} go without detaching; {restored} probe site(s) put back"
            + (f", {left} left as jumps (they work without dynprobe)" if left else "")
            + (f", {plain} pending return(s) back to their callers" if plain else "")
        )


@contextlib.contextmanager
def _same_process(pid: int, journaled: tuple[int, int] | None) -> Iterator[tuple[int, Callable[[], bool]] | None]:
    """The memory (/proc/PID/mem, open) of the process journaled as `pid`, and a check that it
    is still alive (then `pid` is still its own); None if it has ended. A pidfd is taken first:
    it names one process, for good. If that is the one journaled, and it is alive once
    /proc/PID/mem is open, the memory opened is its own."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        yield None  # gone
        return
    try:

        def alive() -> bool:
            return not select.select([pidfd], [], [], 0)[0]  # a pidfd reads once its process has ended

        try:
            fd = os.open(f"/proc/{pid}/mem", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            yield None
            return
        try:
            same = journaled is not None and journaled[0] and identity(pid, pidfd) == journaled
            yield (fd, alive) if same and alive() else None
        finally:
            os.close(fd)
    finally:
        os.close(pidfd)


def _out_of_syscall(tid: int, stub: int, saved: bytes) -> None:
    """A thread the tracer left in a remote syscall (at its stub, or in the stub's `jmp $` once
    the syscall returned) gets its registers back."""
    with contextlib.suppress(OSError):
        rip = int(sc.get_regs(tid).rip)
        if stub <= rip < stub + len(REMOTE_SYSCALL):
            sc.set_regs(tid, Regs.from_buffer_copy(saved))


# Every change dynprobe makes to a target's code starts with one of these. A span whose first byte
# is something else is not ours (any more): a library unloaded and another mapped in its place.
_OUR_FIRST_BYTES = (0xCC, 0xE9, REMOTE_SYSCALL[0])  # int3, jmp rel32, a remote syscall's stub


def _ours(fd: int, addr: int, original: bytes) -> bool:
    try:
        current = os.pread(fd, len(original), addr)
    except OSError:
        return False
    return current != original and len(current) == len(original) and current[0] in _OUR_FIRST_BYTES


def _put_back(fd: int, addr: int, original: bytes) -> bool:
    try:
        return os.pwrite(fd, original, addr) == len(original)
    except OSError:
        return False


@contextlib.contextmanager
def _stopped(pid: int) -> Iterator[list[int]]:
    """Every thread of `pid` stopped (a running thread could fetch half an instruction), attaching
    as soon as the dying tracer has let go; yields their tids (none: it could not attach)."""
    deadline = time.monotonic() + ATTACH_PATIENCE
    while True:
        try:
            tracee = attach_process(pid)
            break
        except ProcessError:
            if time.monotonic() > deadline:
                yield []
                return
            time.sleep(0.001)
    try:
        yield list(tracee.threads)
    finally:
        for tid, state in tracee.threads.items():
            signals = [e.sig for e in state.deferred if e.kind == EventKind.SIGNAL]
            with contextlib.suppress(OSError):
                sc.detach(tid, signals[0] if signals else 0)
        tracee.close_memory()


def _plain_returns(fd: int, tid: int, points: int, shadow: int) -> int:
    """The original return addresses back where a stopped thread's frames still return into the
    trampoline (its shadow stack is in the thread area its GS base points to): C++ exceptions
    and backtraces cannot walk through the trampoline without the tracer. Returns how many."""
    try:
        area = int(sc.get_regs(tid).gs_base)
        top = min(int.from_bytes(os.pread(fd, 8, area + L.SHADOW_TOP), "little"), L.SHADOW_CAPACITY)
        entries = entries_in(os.pread(fd, top * L.SHADOW_ENTRY, area + shadow)) if area else []
    except OSError:
        return 0
    swaps = [(k, slot, trampoline_point(points, k), original) for k, slot, original in entries]

    def write_u64(addr: int, value: int) -> None:
        if os.pwrite(fd, value.to_bytes(8, "little"), addr) != 8:
            raise OSError(errno.EFAULT, "short write")

    return len(swap_slots(swaps, lambda addr: int.from_bytes(os.pread(fd, 8, addr), "little"), write_u64))
