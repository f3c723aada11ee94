"""The wait loop's output: every waitpid status turned into a typed event."""

from __future__ import annotations

import contextlib
import enum
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass

from dynprobe.ptrace import syscalls as sc


class EventKind(enum.Enum):
    EXITED = "exited"  # the thread (or process, for the leader) ended with exit status `code`
    KILLED = "killed"  # ended by signal `sig`
    SIGNAL = "signal"  # signal-delivery-stop of `sig`
    STOP = "stop"  # PTRACE_EVENT_STOP: PTRACE_INTERRUPT or a new tracee's first stop
    GROUP_STOP = "group-stop"  # job-control stop (SIGSTOP, SIGTSTP, ...)
    CLONE = "clone"
    FORK = "fork"
    VFORK = "vfork"
    VFORK_DONE = "vfork-done"
    EXEC = "exec"

    # Members are singletons: identity hashing is exact, and C-fast (looked up on every event).
    __hash__ = object.__hash__


_PTRACE_EVENTS = {
    sc.PTRACE_EVENT_CLONE: EventKind.CLONE,
    sc.PTRACE_EVENT_FORK: EventKind.FORK,
    sc.PTRACE_EVENT_VFORK: EventKind.VFORK,
    sc.PTRACE_EVENT_VFORK_DONE: EventKind.VFORK_DONE,
    sc.PTRACE_EVENT_EXEC: EventKind.EXEC,
}
_STOP_SIGNALS = {signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU}


@dataclass
class Event:
    """One wait status, decoded: what happened to which thread."""

    kind: EventKind
    tid: int
    sig: int = 0
    code: int = 0  # exit status for EXITED
    msg: int = 0  # PTRACE_GETEVENTMSG: new tid/pid for clone/fork, former tid for exec


def decode_status(tid: int, status: int) -> Event:
    if os.WIFEXITED(status):
        return Event(EventKind.EXITED, tid, code=os.WEXITSTATUS(status))
    if os.WIFSIGNALED(status):
        return Event(EventKind.KILLED, tid, sig=os.WTERMSIG(status))
    sig = os.WSTOPSIG(status)
    event = status >> 16
    if event == sc.PTRACE_EVENT_STOP:
        kind = EventKind.GROUP_STOP if sig in _STOP_SIGNALS else EventKind.STOP
        return Event(kind, tid, sig=sig)
    if event in _PTRACE_EVENTS:
        kind = _PTRACE_EVENTS[event]
        try:
            msg = sc.get_event_msg(tid)
        except OSError:
            msg = 0
        return Event(kind, tid, sig=sig, msg=msg)
    return Event(EventKind.SIGNAL, tid, sig=sig)


def wait_event(tid: int) -> Event | None:
    """The next event of thread `tid`, waited for; None if it is no tracee of ours (any more)."""
    try:
        pid, status = os.waitpid(tid, sc.WALL)
    except ChildProcessError:
        return None
    return decode_status(pid, status)


# Timed waits for stops sleep in slices. SIGCHLD ends the sleep at once; the slice bounds the
# wait when another thread of the tracer took the SIGCHLD, or a stop's event was already taken.
WAIT_SLICE = 0.05


@contextlib.contextmanager
def sigchld_blocked() -> Iterator[None]:
    """SIGCHLD blocked in this thread, so it stays pending for sigtimedwait."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


_CLD_EXITED, _CLD_KILLED, _CLD_DUMPED = 1, 2, 3


def peek_stop(block: bool) -> tuple[int, int] | None:
    """(tid, waitpid status) of the next stop or end of any tracee, left to be taken (WNOWAIT):
    (-1, 0) when there is no tracee, None when none is ready (not blocking).

    A stop taken by a wait is the tracer's: should the tracer die before it resumes the thread,
    the kernel lets it go with no signal, where it stopped. A thread at one of our int3s would
    run on from the middle of an instruction. Left untaken, it goes on with its SIGTRAP, which
    its rescue handler serves (arch/x86_64/rescue.py). Resuming it takes the stop."""
    options = os.WEXITED | os.WSTOPPED | os.WNOWAIT | sc.WALL | (0 if block else os.WNOHANG)
    try:
        info = os.waitid(os.P_ALL, 0, options)
    except ChildProcessError:
        return -1, 0
    if info is None or not info.si_pid:
        return None
    code, value = info.si_code, info.si_status
    if code == _CLD_EXITED:
        status = (value & 0xFF) << 8
    elif code in (_CLD_KILLED, _CLD_DUMPED):
        status = value | (0x80 if code == _CLD_DUMPED else 0)
    else:  # CLD_TRAPPED, CLD_STOPPED: the stop's code, with a ptrace event in its high bits
        status = (value << 8) | 0x7F
    return info.si_pid, status


def take_stop(tid: int) -> int | None:
    """Take the stop (or end) of `tid` that `peek_stop` saw: its waitpid status (None: gone)."""
    try:
        pid, status = os.waitpid(tid, sc.WALL | os.WNOHANG)
    except ChildProcessError:
        return None
    return status if pid else None


def poll_event(tid: int = -1) -> Event | None:
    try:
        pid, status = os.waitpid(tid, sc.WALL | os.WNOHANG)
    except ChildProcessError:
        return None
    return decode_status(pid, status) if pid else None


def thread_state(pid: int, tid: int) -> bytes | None:
    """The thread's state letter in /proc (b"t": in a tracing stop, b"Z": ended, not reaped yet);
    None when it is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    at = stat.rfind(b")") + 2  # the name in parentheses may hold anything
    return stat[at : at + 1]


def in_tracing_stop(pid: int, tid: int) -> bool:
    return thread_state(pid, tid) in (b"t", None)  # gone: nothing to wait for
