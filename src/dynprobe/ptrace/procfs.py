"""What /proc says of a process and its threads: states, start time, identity, signal sets.
Read-only and stateless: the tracer, the guardian and the journal all ask it."""

from __future__ import annotations

import os
import signal

from dynprobe.errors import NoSuchProcess, PermissionDenied


def seccomp_mode(pid: int, tid: int, unreadable: int = 0) -> int:
    """The thread's seccomp mode (/proc/PID/task/TID/status): 0 none, 1 strict, 2 filter;
    `unreadable` when the file cannot be read or says nothing."""
    try:
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("Seccomp:")), unreadable)
    except (OSError, ValueError):
        return unreadable


def _stat_field(path: str, field: int) -> int | None:
    """Field `field` (numbered as proc(5) does) of a /proc stat file; None if it is gone."""
    try:
        with open(path, "rb") as f:
            stat = f.read()
        return int(stat[stat.rfind(b")") + 2 :].split()[field - 3])  # (the name may hold anything)
    except (OSError, IndexError, ValueError):
        return None


def thread_cpu(pid: int, tid: int) -> int:
    """The CPU the thread last ran on (field 39 of /proc/PID/task/TID/stat); -1 if unknown."""
    cpu = _stat_field(f"/proc/{pid}/task/{tid}/stat", 39)
    return -1 if cpu is None else cpu


def start_time(pid: int) -> int:
    """When the process started (field 22 of /proc/PID/stat, clock ticks since boot). 0 if it
    is gone."""
    return _stat_field(f"/proc/{pid}/stat", 22) or 0


_PF_KTHREAD = 0x00200000


def is_kernel_thread(pid: int) -> bool:
    """A kernel thread (PF_KTHREAD in field 9 of /proc/PID/stat): no user space to trace."""
    return bool((_stat_field(f"/proc/{pid}/stat", 9) or 0) & _PF_KTHREAD)


def identity(pid: int, pidfd: int | None = None) -> tuple[int, int]:
    """Who has `pid` now (a pid is another process's once its own has ended): its start time,
    and the inode of a pidfd of it (`pidfd`, or one opened here). From Linux 6.9 (pidfs) that
    inode is one process's for the life of the system; before, every pidfd has the same one,
    and the start time (in 10 ms ticks) is all there is. (0, 0) if it is gone."""
    try:
        fd = os.pidfd_open(pid) if pidfd is None else pidfd
    except OSError:
        return 0, 0
    try:
        return start_time(pid), os.fstat(fd).st_ino
    finally:
        if pidfd is None:
            os.close(fd)


def _signal_set(pid: int, tid: int, field: str) -> int:
    """A signal set of /proc/PID/task/TID/status (SigPnd, SigIgn, SigCgt) as a mask; 0 if unread."""
    try:
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def sigtrap_pending(pid: int, tid: int) -> bool:
    """Whether SIGTRAP waits in the thread's own signal queue."""
    return bool(_signal_set(pid, tid, "SigPnd") & (1 << (signal.SIGTRAP - 1)))


_DEFAULT_IGNORE_OR_STOP = {signal.SIGCHLD, signal.SIGURG, signal.SIGWINCH, signal.SIGCONT, signal.SIGSTOP,
                           signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU}  # fmt: skip


def runs_no_code_to_take(pid: int, tid: int, sig: int) -> bool:
    """Whether taking `sig` runs no instruction of the thread: a handler is set up (it runs
    later), or the default action ends the process; not so for an ignored signal, nor one whose
    default is to be ignored or to stop."""
    bit = 1 << (sig - 1)
    if _signal_set(pid, tid, "SigCgt") & bit:
        return True
    return not _signal_set(pid, tid, "SigIgn") & bit and sig not in _DEFAULT_IGNORE_OR_STOP


def list_threads(pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError as exc:
        raise NoSuchProcess(f"no process with pid {pid}") from exc
    except PermissionError as exc:
        raise PermissionDenied(f"not permitted to read /proc/{pid}") from exc
