"""Raw ptrace(2) and friends through ctypes. Errors come back as OSError with errno set."""

from __future__ import annotations

import ctypes
import errno
import os
import time

from dynprobe.arch.x86_64.regs import Regs

_libc = ctypes.CDLL("libc.so.6", use_errno=True)  # (find_library would run `ldconfig -p`)
_ptrace = _libc.ptrace
_ptrace.restype = ctypes.c_long
_ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
# The same function without argtypes, for the calls of every trap hit (GETREGS, SETREGS, CONT):
# converting through argtypes costs ~0.4 us a call here, a tenth of what dynprobe adds to a hit.
# glibc's ptrace is variadic and reads addr and data as pointers: they are given as None (NULL)
# or byref (a pointer), never as a Python int, which would go as a 32-bit C int. These calls
# keep the GIL (PyDLL): each takes a microsecond, and letting the GIL go for it let the consumer
# thread take it, which the tracing thread then waited for after every call (a trap hit took
# 25-50% longer while the consumer printed events).
_libc_with_gil = ctypes.PyDLL("libc.so.6", use_errno=True)
_ptrace_hot = _libc_with_gil.ptrace
_ptrace_hot.restype = ctypes.c_long

PTRACE_PEEKUSER = 3
PTRACE_CONT = 7
PTRACE_KILL = 8
PTRACE_SINGLESTEP = 9
PTRACE_SYSCALL = 24
PTRACE_GETREGS = 12
PTRACE_SETREGS = 13
PTRACE_DETACH = 17
PTRACE_SETOPTIONS = 0x4200
PTRACE_GETEVENTMSG = 0x4201
PTRACE_GETSIGINFO = 0x4202
PTRACE_SETSIGINFO = 0x4203
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_LISTEN = 0x4208

PTRACE_O_TRACESYSGOOD = 0x01
PTRACE_O_TRACEFORK = 0x02
PTRACE_O_TRACEVFORK = 0x04
PTRACE_O_TRACECLONE = 0x08
PTRACE_O_TRACEEXEC = 0x10
PTRACE_O_TRACEVFORKDONE = 0x20
PTRACE_O_SUSPEND_SECCOMP = 0x200000

PTRACE_EVENT_FORK = 1
PTRACE_EVENT_VFORK = 2
PTRACE_EVENT_CLONE = 3
PTRACE_EVENT_EXEC = 4
PTRACE_EVENT_VFORK_DONE = 5
PTRACE_EVENT_EXIT = 6
PTRACE_EVENT_STOP = 128

WALL = 0x40000000

SI_KERNEL = 0x80
TRAP_BRKPT = 1
TRAP_TRACE = 2


class SigInfo(ctypes.Structure):
    """`siginfo_t` as far as we read it; the union is kept as raw words."""

    _fields_ = [
        ("si_signo", ctypes.c_int),
        ("si_errno", ctypes.c_int),
        ("si_code", ctypes.c_int),
        ("_pad0", ctypes.c_int),
        ("si_addr", ctypes.c_uint64),  # first union word: si_addr for faults, pid/uid for kill
        ("_rest", ctypes.c_uint8 * (128 - 24)),
    ]


def _check(result: int, what: str) -> int:
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def ptrace(request: int, tid: int, addr: int = 0, data: int = 0) -> int:
    # Hot path (several calls per probe hit): no errno reset; PEEK requests, whose result can
    # legitimately be -1, are not used.
    result: int = _ptrace(request, tid, addr, data)
    if result == -1:
        _check(result, f"ptrace({request:#x}, {tid})")
    return result


def seize(tid: int, options: int) -> None:
    ptrace(PTRACE_SEIZE, tid, 0, options)


def interrupt(tid: int) -> None:
    ptrace(PTRACE_INTERRUPT, tid)


def cont(tid: int, sig: int = 0) -> None:
    if sig:
        ptrace(PTRACE_CONT, tid, 0, sig)
    elif _ptrace_hot(PTRACE_CONT, tid, None, None) == -1:
        _check(-1, f"ptrace(PTRACE_CONT, {tid})")


def to_syscall_stop(tid: int) -> None:
    """Resume `tid` until its next system call's entry or exit (PTRACE_SYSCALL)."""
    ptrace(PTRACE_SYSCALL, tid)


def singlestep(tid: int, sig: int = 0) -> None:
    ptrace(PTRACE_SINGLESTEP, tid, 0, sig)


def listen(tid: int) -> None:
    ptrace(PTRACE_LISTEN, tid)


def detach(tid: int, sig: int = 0) -> None:
    ptrace(PTRACE_DETACH, tid, 0, sig)


def set_options(tid: int, options: int) -> None:
    ptrace(PTRACE_SETOPTIONS, tid, 0, options)


def get_regs(tid: int) -> Regs:
    regs = Regs()
    if _ptrace_hot(PTRACE_GETREGS, tid, None, ctypes.byref(regs)) == -1:
        _check(-1, f"ptrace(PTRACE_GETREGS, {tid})")
    return regs


def set_regs(tid: int, regs: Regs) -> None:
    if _ptrace_hot(PTRACE_SETREGS, tid, None, ctypes.byref(regs)) == -1:
        _check(-1, f"ptrace(PTRACE_SETREGS, {tid})")


def get_siginfo(tid: int) -> SigInfo:
    info = SigInfo()
    ptrace(PTRACE_GETSIGINFO, tid, 0, ctypes.addressof(info))
    return info


def set_siginfo(tid: int, info: SigInfo) -> None:
    ptrace(PTRACE_SETSIGINFO, tid, 0, ctypes.addressof(info))


def get_event_msg(tid: int) -> int:
    msg = ctypes.c_ulong()
    ptrace(PTRACE_GETEVENTMSG, tid, 0, ctypes.addressof(msg))
    return msg.value


def tgkill(tgid: int, tid: int, sig: int) -> None:
    _check(_libc.syscall(234, tgid, tid, sig), f"tgkill({tid}, {sig})")


SYS_FUTEX = 202
SYS_FUTEX_WAITV = 449  # Linux 5.16
FUTEX_WAKE = 1  # shared (no FUTEX_PRIVATE_FLAG): the word is in memory the target maps too
FUTEX2_SIZE_U32 = 0x02
CLOCK_MONOTONIC = 1


class _FutexWaitv(ctypes.Structure):
    _fields_ = [("val", ctypes.c_uint64), ("uaddr", ctypes.c_uint64), ("flags", ctypes.c_uint32),
                ("reserved", ctypes.c_uint32)]  # fmt: skip


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


# futex_wake keeps the GIL (PyDLL): it never sleeps, and letting the GIL go costs as much.
_syscall_hot = _libc_with_gil.syscall


def futex_wake(addr: int, count: int = 1) -> int:
    """Wake up to `count` waiters on the shared futex at `addr` (our address of it): how many."""
    return int(_syscall_hot(SYS_FUTEX, ctypes.c_void_p(addr), FUTEX_WAKE, count, None, None, 0))


current_cpu = _libc_with_gil.sched_getcpu
current_cpu.restype = ctypes.c_int
current_cpu.argtypes = []
current_cpu.__doc__ = """The CPU the calling thread runs on (the vDSO's getcpu: no system call)."""


def futex_waitv(words: list[tuple[int, int]], timeout: float) -> None:
    """Sleep until one of the shared u32 futexes (address, the value seen) is woken or no longer
    holds its value, or `timeout` seconds pass. Lets the GIL go while it sleeps."""
    waiters = (_FutexWaitv * len(words))(*(_FutexWaitv(value, addr, FUTEX2_SIZE_U32, 0) for addr, value in words))
    deadline = time.clock_gettime(time.CLOCK_MONOTONIC) + timeout
    until = _Timespec(int(deadline), int(deadline % 1 * 1e9))
    result = _libc.syscall(SYS_FUTEX_WAITV, waiters, len(words), 0, ctypes.byref(until), CLOCK_MONOTONIC)
    if result == -1 and ctypes.get_errno() not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
        _check(result, "futex_waitv")


def has_futex_waitv() -> bool:
    """Whether this kernel has futex_waitv (5.16 and later)."""
    result = _libc.syscall(SYS_FUTEX_WAITV, None, 0, 0, None, 0)
    return not (result == -1 and ctypes.get_errno() == errno.ENOSYS)
