"""One traced process: its threads, its memory, remote syscalls; spawn and attach.

Memory goes through /proc/PID/mem, which lets a tracer write read-only text (no mprotect dance,
no PTRACE_POKETEXT word loop). The file must be reopened after exec (it names the old mm).

One concept in one module: the tracee, what every part of the engine does to a process goes
through it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import signal
import stat
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from dynprobe.arch.x86_64 import REMOTE_SYSCALL, Regs
from dynprobe.errors import (
    AlreadyTraced,
    NoSuchProcess,
    PermissionDenied,
    ProcessError,
    SeccompFiltered,
    SharedMemoryRefused,
    ThreadGone,
)
from dynprobe.ptrace import syscalls as sc
from dynprobe.ptrace.events import Event, EventKind, poll_event, thread_state, wait_event
from dynprobe.ptrace.journal import Journal
from dynprobe.ptrace.procfs import is_kernel_thread, list_threads, seccomp_mode
from dynprobe.threads import signals_blocked

# TRACESYSGOOD: a syscall stop of ours (remote syscalls) is SIGTRAP | 0x80, which a tracer that
# dies in it leaves as no signal at all (a plain SIGTRAP would be sent to the thread).
TRACE_OPTIONS = (
    sc.PTRACE_O_TRACECLONE | sc.PTRACE_O_TRACEFORK | sc.PTRACE_O_TRACEVFORK | sc.PTRACE_O_TRACEEXEC
    | sc.PTRACE_O_TRACEVFORKDONE | sc.PTRACE_O_TRACESYSGOOD
)  # fmt: skip
_SYSCALL_STOP = signal.SIGTRAP | 0x80
ATTACH_POLL = 0.0005  # seconds between polls for the first stops of the threads seized

SYS_MMAP = 9
SYS_MUNMAP = 11
SYS_CLOSE = 3
SYS_FTRUNCATE = 77
SYS_MEMFD_CREATE = 319
SYS_MADVISE = 28
MADV_POPULATE_WRITE = 23  # Linux 5.14
MFD_CLOEXEC = 1
MAP_SHARED = 0x01
SHARED_NAME = b"dynprobe\0"
PROT_READ, PROT_WRITE, PROT_EXEC = 1, 2, 4
MAP_PRIVATE, MAP_ANONYMOUS, MAP_FIXED_NOREPLACE = 0x02, 0x20, 0x100000


EVENT_STOPS = {EventKind.CLONE, EventKind.FORK, EventKind.VFORK, EventKind.VFORK_DONE, EventKind.EXEC}


@dataclass
class ThreadState:
    """What the tracer knows of one thread of the tracee."""

    tid: int
    stopped: bool = True
    # Stopped in a ptrace event stop (clone, fork, exec, ...): inside a syscall that has not
    # returned yet. Resuming finishes that syscall, which then writes its result to rax.
    in_event_stop: bool = False
    # Events seen while stopping the world, handled once the world runs again.
    deferred: list[Event] = field(default_factory=list)
    # Stopped at our int3 at this site, its stop not taken (being served; see peek_stop): a
    # remote syscall run in it leaves it at the site, should dynprobe die before its resume.
    at_trap: int | None = None
    # Stopped inside a system call a signal or stop interrupted: its registers as the kernel
    # left them, before a remote syscall made them restart it (`_restarted`). A signal
    # delivered at its next resume needs them: its handler's return then decides, as the
    # kernel does, whether the call is restarted or fails with EINTR. Cleared by a resume.
    interrupted: Regs | None = None
    # Last resumed by a single step: the kernel keeps its trap flag set until a resume without
    # one (or a detach), also across a later interrupt stop. Should the tracer die meanwhile,
    # the thread would take a SIGTRAP after its next instruction.
    stepped: bool = False


def tracer_of(pid: int, tid: int | None = None) -> int:
    """The pid tracing `pid` (or its thread `tid`); 0 if none."""
    try:
        with open(f"/proc/{pid}/task/{tid}/status" if tid else f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("TracerPid:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _ptrace_error(exc: OSError, pid: int) -> ProcessError:
    if exc.errno == errno.ESRCH:
        return NoSuchProcess(f"no process with pid {pid}")
    if exc.errno == errno.EPERM:
        if thread_state(pid, pid) == b"Z":
            with contextlib.suppress(NoSuchProcess, PermissionDenied):
                if any(thread_state(pid, tid) not in (b"Z", b"X", None) for tid in list_threads(pid)):
                    return ProcessError(
                        f"the main thread of pid {pid} has ended while others run: dynprobe attaches through the "
                        "main thread; start the program under dynprobe instead"
                    )
            return NoSuchProcess(f"pid {pid} has ended (a zombie its parent has not reaped): nothing runs to trace")
        if is_kernel_thread(pid):
            return ProcessError(f"pid {pid} is a kernel thread: dynprobe traces programs (user space)")
        other = tracer_of(pid)
        if other and other != os.getpid():
            return AlreadyTraced(f"pid {pid} is already traced by pid {other}; detach that tracer first")
        return PermissionDenied(
            f"not permitted to trace pid {pid}: run as its owner or root, or check /proc/sys/kernel/yama/ptrace_scope"
        )
    return ProcessError(f"cannot trace pid {pid}: {exc.strerror}")


_PAGE = 4096
_MERGE_GAP = 64  # held writes this close are written out as one


class Tracee:
    """A traced process (thread group): its threads' stop states and its address space."""

    def __init__(self, pid: int, threads: list[int]) -> None:
        self.pid = pid
        self.threads: dict[int, ThreadState] = {t: ThreadState(t) for t in threads}
        # The tracer's CPU while it serves stops: resumed threads wake up there (see resume).
        self.home_cpu: int | None = None
        self._mem_fd = -1
        # Within batched(): pages read so far, and the byte ranges written but not written out.
        self._pages: dict[int, bytearray] | None = None
        self._dirty: list[tuple[int, int]] = []
        # The guardian's undo journal (a session's), and its updates waiting for held writes.
        self.journal: Journal | None = None
        self._journal_after: list[Callable[[], None]] = []
        self.open_memory()

    # --- memory -----------------------------------------------------------------------------
    def open_memory(self) -> None:
        self.close_memory()
        try:
            self._mem_fd = os.open(f"/proc/{self.pid}/mem", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise ProcessError(f"cannot open the memory of pid {self.pid}: {exc.strerror}") from exc

    def image_gone(self) -> bool:
        """The process's memory is no longer the one `open_memory` opened: it exec'd (its exec
        stop may not be handled yet) or it ended. (A read of an unmapped page fails; a read of
        a memory the process has let go reads nothing.)"""
        try:
            return not os.pread(self._mem_fd, 1, 0)
        except OSError:
            return False

    def close_memory(self) -> None:
        if self._mem_fd >= 0:
            os.close(self._mem_fd)
            self._mem_fd = -1

    def read(self, addr: int, size: int) -> bytes:
        """Exactly `size` bytes at `addr`; OSError (EIO/EFAULT) if any is unmapped."""
        if self._pages is not None:
            return bytes(self._cached(addr, size))
        data = os.pread(self._mem_fd, size, addr)
        if len(data) != size:
            raise OSError(errno.EFAULT, f"short read at {addr:#x}")
        return data

    @property
    def batching(self) -> bool:
        """Within `batched()`: writes are held until its end."""
        return self._pages is not None

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Many small reads and writes while the process is stopped (placing thousands of
        probes): reads come from pages read once; writes are held and written out at the end,
        writes a few bytes apart as one (the bytes between as they were read). A remote
        syscall writes out first and forgets the pages (it may change the memory map)."""
        if self._pages is not None:
            yield
            return
        self._pages = {}
        try:
            yield
        finally:
            try:
                self._write_out()
            finally:
                self._pages = None

    def _page(self, index: int) -> bytearray:
        assert self._pages is not None
        page = self._pages.get(index)
        if page is None:
            data = os.pread(self._mem_fd, _PAGE, index * _PAGE)
            if len(data) != _PAGE:
                raise OSError(errno.EFAULT, f"short read at {index * _PAGE:#x}")
            page = self._pages[index] = bytearray(data)
        return page

    def _cached(self, addr: int, size: int) -> bytearray:
        out = bytearray()
        while size > 0:
            index, offset = divmod(addr, _PAGE)
            chunk = min(size, _PAGE - offset)
            out += self._page(index)[offset : offset + chunk]
            addr += chunk
            size -= chunk
        return out

    def _write_out(self) -> None:
        dirty, self._dirty = sorted(self._dirty), []
        runs: list[list[int]] = []
        for start, end in dirty:
            if runs and start <= runs[-1][1] + _MERGE_GAP:
                runs[-1][1] = max(runs[-1][1], end)
            else:
                runs.append([start, end])
        for start, end in runs:
            data = self._cached(start, end - start)
            if os.pwrite(self._mem_fd, data, start) != len(data):
                raise OSError(errno.EFAULT, f"short write at {start:#x}")
        self._update_journal()

    def read_upto(self, addr: int, size: int) -> bytes:
        """As many of `size` bytes at `addr` as are readable (stops at the first unmapped page)."""
        if self._pages is not None:
            self._write_out()
        out = b""
        while size > 0:
            chunk = min(size, 4096 - (addr & 4095))
            try:
                data = os.pread(self._mem_fd, chunk, addr)
            except OSError:
                break
            out += data
            if len(data) < chunk:
                break
            addr += chunk
            size -= chunk
        return out

    def write(self, addr: int, data: bytes) -> None:
        if self._pages is not None:
            at, rest = addr, memoryview(data)
            while rest:
                index, offset = divmod(at, _PAGE)
                chunk = min(len(rest), _PAGE - offset)
                self._page(index)[offset : offset + chunk] = rest[:chunk]
                at += chunk
                rest = rest[chunk:]
            self._dirty.append((addr, addr + len(data)))
            return
        written = os.pwrite(self._mem_fd, data, addr)
        if written != len(data):
            raise OSError(errno.EFAULT, f"short write at {addr:#x}")

    def patch(self, addr: int, data: bytes, original: bytes) -> None:
        """Write `data` over the process's own code at `addr`, where `original` (as long) is
        what the file holds: the journal keeps the bytes that differ until they are back, for
        the guardian to put back if dynprobe dies first. Its span grows before the write and
        shrinks after it (held writes: once written out)."""
        journal = self.journal
        if journal is None:
            self.write(addr, data)
            return
        changed = next((n for n in range(len(data), 0, -1) if data[n - 1] != original[n - 1]), 0)
        if changed >= journal.length(self.pid, addr):
            journal.record(self.pid, addr, original[:changed])
            self.write(addr, data)
            return
        self.write(addr, data)
        self._journal_after.append(lambda: journal.record(self.pid, addr, original[:changed]))
        if self._pages is None:
            self._update_journal()

    def unpatch(self, addr: int, original: bytes) -> None:
        """The file's bytes back at `addr` (see `patch`)."""
        self.patch(addr, original, original)

    def _update_journal(self) -> None:
        updates, self._journal_after = self._journal_after, []
        for update in updates:
            update()

    def read_u64(self, addr: int) -> int:
        return int(struct.unpack("<Q", self.read(addr, 8))[0])

    def peek_u64(self, addr: int) -> int | None:
        """`read_u64`, None where the memory cannot be read."""
        try:
            return self.read_u64(addr)
        except OSError:
            return None

    # --- threads ----------------------------------------------------------------------------
    def resume(self, tid: int, sig: int = 0, step: bool = False) -> None:
        """Resume a stopped thread. With `home_cpu` set, the thread wakes up on that CPU: its
        affinity is narrowed to it while it is stopped and restored as soon as it is runnable, so
        the target never runs with a mask it did not set (a cross-CPU wake-up of an idle vCPU
        costs ~10x a whole trap round trip on one CPU)."""
        state = self.threads[tid]
        state.interrupted = None
        restore = None
        if self.home_cpu is not None:
            try:
                mask = os.sched_getaffinity(tid)
                if self.home_cpu in mask and len(mask) > 1:
                    os.sched_setaffinity(tid, {self.home_cpu})
                    restore = mask
            except OSError:
                pass  # gone, or a mask we may not change: resume as is
        try:  # noqa: SIM105 (contextlib.suppress costs a context manager per probe hit)
            (sc.singlestep if step else sc.cont)(tid, sig)
        except ProcessLookupError:
            pass  # killed under us (SIGKILL, another thread's exec); its exit event follows
        if restore is not None:
            try:  # noqa: SIM105
                os.sched_setaffinity(tid, restore)
            except OSError:
                pass  # exited meanwhile
        state.stopped = False
        state.in_event_stop = False
        state.at_trap = None
        state.stepped = step

    def remote_syscall(self, tid: int, scratch: int, nr: int, *args: int) -> int:
        """Run syscall `nr` in stopped thread `tid`, using `scratch` (4 executable bytes we own or
        may borrow: the caller saves and restores them) for `syscall; jmp $`. Returns rax.

        A thread under seccomp (a sandboxed program) would have our mmap or memfd_create refused,
        or be killed for it: its filter is suspended (PTRACE_O_SUSPEND_SECCOMP, CAP_SYS_ADMIN)
        for our system call only; without that right, SeccompFiltered and nothing runs."""
        state = self.threads[tid]
        try:
            suspended = self._suspend_seccomp(tid)
        except OSError as exc:
            raise SeccompFiltered(
                f"pid {self.pid} runs under a seccomp filter: dynprobe may run its set-up code in it (memory "
                f"for probes) only with CAP_SYS_ADMIN ({exc.strerror}); run it as root, or use trap probes on "
                "instructions it emulates (--trap)"
            ) from exc
        try:
            return self._remote_syscall(tid, state, scratch, nr, args)
        except ProcessLookupError:
            raise
        except OSError as exc:
            # Its process began to exit under us (another thread's exit_group): the memory is
            # gone (a short read) and the thread is leaving its stop. The caller sees a thread
            # gone, as from any ptrace call, and its exit event settles the rest.
            if thread_state(self.pid, tid) != b"t":
                raise ThreadGone(f"thread {tid} of {self.pid} ended during a remote syscall") from exc
            raise
        finally:
            if suspended:
                with contextlib.suppress(OSError):
                    sc.set_options(tid, TRACE_OPTIONS)

    def _suspend_seccomp(self, tid: int) -> bool:
        """Suspend the stopped thread's seccomp filter, if it has one (True: until the options are
        set back). OSError if we may not."""
        if seccomp_mode(self.pid, tid) == 0:
            return False
        sc.set_options(tid, TRACE_OPTIONS | sc.PTRACE_O_SUSPEND_SECCOMP)
        return True

    def may_run_code(self, tid: int) -> bool:
        """Whether system calls of ours may run in the stopped thread: it is under no seccomp
        filter, or one we may suspend."""
        try:
            if self._suspend_seccomp(tid):
                sc.set_options(tid, TRACE_OPTIONS)
        except OSError:
            return False
        return True

    def _remote_syscall(self, tid: int, state: ThreadState, scratch: int, nr: int, args: tuple[int, ...]) -> int:
        original = self.read(scratch, len(REMOTE_SYSCALL))
        self.patch(scratch, REMOTE_SYSCALL, original)  # journaled: it may be borrowed program code
        if self._pages is not None:
            self._write_out()  # the stub and everything before it, in memory before it runs
            self._pages.clear()  # the syscall may change the memory map
        try:
            if state.in_event_stop:
                self._leave_event_stop(tid)
            result = self._run_syscall(tid, state, scratch, nr, args)
        except BaseException:
            with contextlib.suppress(OSError):  # the process may be gone with its memory
                self.unpatch(scratch, original)
            raise
        self.unpatch(scratch, original)
        return result

    def _leave_event_stop(self, tid: int) -> None:
        """Let the syscall the thread is stopped in (an event stop: exec, clone, ...) return, to
        its exit stop: its real result in rax, rip back in place."""
        self._to_syscall_stop(tid)
        self.threads[tid].in_event_stop = False

    def _to_syscall_stop(self, tid: int) -> None:
        """Resume `tid` to its next syscall stop; signals arriving meanwhile are kept for later.
        A thread that ends meanwhile (its process exits) raises ThreadGone, as a thread gone
        under us does, with its exit event kept in its deferred events."""
        sc.to_syscall_stop(tid)
        while True:
            event = wait_event(tid)
            if event is None or event.kind in (EventKind.EXITED, EventKind.KILLED):
                if event is not None:
                    self.threads[tid].deferred.append(event)
                raise ThreadGone(f"thread {tid} of {self.pid} ended during a remote syscall")
            if event.kind == EventKind.SIGNAL and event.sig == _SYSCALL_STOP:
                return
            if event.kind == EventKind.SIGNAL:
                self.threads[tid].deferred.append(event)
            sc.to_syscall_stop(tid)

    def _run_syscall(self, tid: int, state: ThreadState, scratch: int, nr: int, args: tuple[int, ...]) -> int:
        """The syscall run from `scratch` to its exit stop, with the thread's registers as they
        were put back after it. Should dynprobe die meanwhile, the guardian puts them back (the
        journal holds them); a thread at our int3 is put back at the site (see
        ThreadState.at_trap)."""
        raw = sc.get_regs(tid)
        saved = _restarted(raw.copy())
        if saved.rip != raw.rip and state.interrupted is None:
            state.interrupted = raw
        if state.at_trap is not None:
            saved.rip = state.at_trap
        regs = saved.copy()
        regs.rax = nr
        for name, value in zip(("rdi", "rsi", "rdx", "r10", "r8", "r9"), args, strict=False):
            setattr(regs, name, value & ((1 << 64) - 1))
        regs.rip = scratch
        regs.orig_rax = (1 << 64) - 1  # not inside a syscall: no restart logic on resume
        if self.journal is not None:
            self.journal.begin_syscall(self.pid, tid, scratch, bytes(saved))
        try:
            sc.set_regs(tid, regs)
            self._to_syscall_stop(tid)  # its entry
            self._to_syscall_stop(tid)  # its exit
            result = int(sc.get_regs(tid).rax)
        finally:
            with contextlib.suppress(OSError):  # gone: its exit event settles the rest
                sc.set_regs(tid, saved)
            if self.journal is not None:
                self.journal.end_syscall()
        if result >= (1 << 64) - 4095:
            result -= 1 << 64
        return result

    def mmap_exec_near(self, tid: int, scratch: int, hint: int, size: int) -> int | None:
        """An rwx anonymous mapping of `size` bytes at `hint` exactly, or None if that range is taken."""
        addr = self.remote_syscall(
            tid, scratch, SYS_MMAP, hint, size, PROT_READ | PROT_WRITE | PROT_EXEC,
            MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, (1 << 64) - 1, 0,
        )  # fmt: skip
        if addr < 0:
            return None
        if addr != hint:  # kernels before 4.17 ignore MAP_FIXED_NOREPLACE and treat it as a hint
            self.remote_syscall(tid, scratch, SYS_MUNMAP, addr, size)
            return None
        return addr

    def map_shared(self, tid: int, scratch: int, size: int) -> tuple[int, mmap.mmap]:
        """Memory shared between the target and us: a memfd the target creates and maps, which we
        map too, through a descriptor of our own (`_own_copy`), before the target closes its
        descriptor. Nothing is ever named in /dev/shm, and the memory goes away with the last
        mapping. `scratch` holds the stub and the memfd's name after it. Returns (address in
        the target, our mapping); SharedMemoryRefused if what the target's descriptor holds by
        then is not that memfd."""
        name_at = scratch + 8
        saved = self.read(name_at, len(SHARED_NAME))
        self.write(name_at, SHARED_NAME)
        try:
            fd = self.remote_syscall(tid, scratch, SYS_MEMFD_CREATE, name_at, MFD_CLOEXEC)
        except BaseException:
            with contextlib.suppress(OSError):  # the process may be gone with its memory
                self.write(name_at, saved)
            raise
        self.write(name_at, saved)
        if fd < 0:
            raise SharedMemoryRefused(f"memfd_create in pid {self.pid} failed: {os.strerror(-fd)}")
        try:
            err = self.remote_syscall(tid, scratch, SYS_FTRUNCATE, fd, size)
            if err < 0:
                raise SharedMemoryRefused(f"cannot size shared memory in pid {self.pid}: {os.strerror(-err)}")
            addr = self.remote_syscall(
                tid, scratch, SYS_MMAP, 0, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0
            )  # fmt: skip
            if -4096 < addr < 0:
                raise SharedMemoryRefused(f"cannot map shared memory in pid {self.pid}: {os.strerror(-addr)}")
            ours = self._own_copy(fd, size, addr)
            try:
                view = mmap.mmap(ours, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(ours)
        except BaseException:
            with contextlib.suppress(OSError):  # gone, or the first error is the one to tell
                self.remote_syscall(tid, scratch, SYS_CLOSE, fd)
            raise
        self.remote_syscall(tid, scratch, SYS_CLOSE, fd)
        return addr, view

    def _own_copy(self, fd: int, size: int, addr: int) -> int:
        """A descriptor of ours for the target's `fd`, through pidfd_getfd (Linux 5.6): never by
        a path (/proc/PID/fd/N is the target's to change: a hostile target can put any file it
        may open there between our syscalls, which we would then open with our rights), and
        with the access the target's own descriptor has, no more. Checked to be the memfd we
        asked for: a regular file with no links, `size` bytes, named so, the file mapped at
        `addr` in the target. SharedMemoryRefused (nothing mapped or written) otherwise."""
        try:
            pidfd = os.pidfd_open(self.pid)
        except OSError as exc:
            raise SharedMemoryRefused(f"cannot reach the descriptors of pid {self.pid}: {exc.strerror}") from exc
        try:
            ours = _pidfd_getfd(pidfd, fd)
        except OSError as exc:
            why = "Linux 5.6 or later is needed" if exc.errno == errno.ENOSYS else exc.strerror
            raise SharedMemoryRefused(f"cannot take the shared memory of pid {self.pid}: {why}") from exc
        finally:
            os.close(pidfd)
        try:
            info = os.fstat(ours)
            name = os.readlink(f"/proc/self/fd/{ours}")
            mapped = _mapped_file(self.pid, addr)
        except OSError as exc:
            os.close(ours)
            raise SharedMemoryRefused(f"cannot check the shared memory of pid {self.pid}: {exc.strerror}") from exc
        expected = f"/memfd:{SHARED_NAME.rstrip(bytes(1)).decode()} (deleted)"
        if not (
            stat.S_ISREG(info.st_mode) and info.st_nlink == 0 and info.st_size == size and name == expected
            and mapped == (os.major(info.st_dev), os.minor(info.st_dev), info.st_ino)
        ):  # fmt: skip
            os.close(ours)
            raise SharedMemoryRefused(
                f"pid {self.pid} put another file in place of dynprobe's shared memory ({name}): not used"
            )
        return ours

    def commit(self, tid: int, scratch: int, addr: int, size: int) -> int:
        """Fault in `size` bytes of shared memory at `addr` for writing, in the target's page
        tables (MADV_POPULATE_WRITE): the memory exists before generated code writes it, so a
        record never takes a page fault and a short tmpfs shows up here, not as a SIGBUS in the
        target. Returns 0 or the errno it failed with."""
        return -min(0, self.remote_syscall(tid, scratch, SYS_MADVISE, addr, size, MADV_POPULATE_WRITE))

    def comm(self, tid: int) -> str:
        try:
            with open(f"/proc/{self.pid}/task/{tid}/comm") as f:
                return f.read().strip()
        except OSError:
            return "<...>"

    def environment(self) -> tuple[dict[str, str], str]:
        """The process's environment (as at its exec) and working directory; empty if unreadable."""
        try:
            with open(f"/proc/{self.pid}/environ", "rb") as f:
                raw = f.read()
            cwd = os.readlink(f"/proc/{self.pid}/cwd")
        except OSError:
            return {}, "/"
        pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
        return {key: value for key, _, value in pairs}, cwd


_SYS_PIDFD_GETFD = 438
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _pidfd_getfd(pidfd: int, fd: int) -> int:
    result = int(_libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    os.set_inheritable(result, False)
    return result


def _mapped_file(pid: int, addr: int) -> tuple[int, int, int] | None:
    """(major, minor, inode) of the file the mapping at `addr` in `pid` maps (/proc/PID/maps)."""
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) >= 5 and int(fields[0].split("-")[0], 16) == addr:
                major, minor = (int(part, 16) for part in fields[3].split(":"))
                return major, minor, int(fields[4])
    return None


_ERESTARTSYS, _ERESTARTNOINTR, _ERESTARTNOHAND, _ERESTART_RESTARTBLOCK = 512, 513, 514, 516
_SYS_RESTART_SYSCALL = 219
_MASK64 = (1 << 64) - 1


def _restarted(regs: Regs) -> Regs:
    """A thread stopped in a system call that a signal or a stop interrupted is due to restart
    it, which the kernel does on its way back to user space from that stop. A remote syscall
    takes it back through the exit of ours instead, where nothing restarts it (a futex wait
    would return -ERESTARTSYS to the program, and glibc aborts): the registers it goes back to
    restart it themselves, as the kernel would have (`rip` back onto the `syscall`)."""
    if regs.orig_rax & (1 << 63):
        return regs  # not in a syscall
    error = -regs.rax & _MASK64
    if error in (_ERESTARTSYS, _ERESTARTNOINTR, _ERESTARTNOHAND, _ERESTART_RESTARTBLOCK):
        regs.rax = _SYS_RESTART_SYSCALL if error == _ERESTART_RESTARTBLOCK else regs.orig_rax
        regs.rip -= 2
        regs.orig_rax = _MASK64
    return regs


_IGNORED_BY_PYTHON = (signal.SIGPIPE, signal.SIGXFSZ)


def _spawn_child(
    argv: list[str],
    env: dict[str, str] | None,
    go_r: int,
    err_w: int,
    fds: tuple[int | None, ...],
    *,
    mask: set[int | signal.Signals],
) -> None:
    """In the forked child: wait until the tracer has seized us, then exec with the tracer's
    signal mask; if the tracer goes without a word, end. Never returns. The
    signals Python ignores for itself (SIGPIPE, SIGXFSZ) get their default action back, as
    subprocess gives them: ignored dispositions survive exec, and `yes | head -1` under dynprobe
    would have `yes` fail on EPIPE instead of ending by SIGPIPE."""
    try:
        for sig in _IGNORED_BY_PYTHON:
            signal.signal(sig, signal.SIG_DFL)
        if os.read(go_r, 1) != b"g":
            return
        os.close(go_r)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for target, fd in enumerate(fds):
            if fd is not None:
                os.dup2(fd, target)
        if env is None:
            os.execvp(argv[0], argv)
        else:
            os.execvpe(argv[0], argv, env)
    except OSError as exc:
        os.write(err_w, f"{exc.errno}".encode())
    finally:  # whatever went wrong: never back into the tracer's code
        os._exit(127)


def spawn(
    argv: list[str],
    env: dict[str, str] | None = None,
    stdin: int | None = None,
    stdout: int | None = None,
    stderr: int | None = None,
) -> Tracee:
    """Start `argv` traced; it is stopped at its first instruction after exec (in the loader).
    `stdin`/`stdout`/`stderr` are file descriptors to give the command instead of ours."""
    if not argv:
        raise ProcessError("no command given")
    go_r, go_w = os.pipe()
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    pid = 0
    try:
        with signals_blocked() as mask:  # (a Ctrl-C then lands below, where it is undone)
            pid = os.fork()
            if pid == 0:
                os.close(go_w)
                os.close(err_r)
                _spawn_child(argv, env, go_r, err_w, (stdin, stdout, stderr), mask=mask)
            os.close(go_r)
            os.close(err_w)
        sc.seize(pid, TRACE_OPTIONS)
        os.write(go_w, b"g")
    except BaseException as exc:
        if pid:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        else:  # (the fork failed: both ends are ours)
            os.close(go_r)
            os.close(err_w)
        os.close(err_r)
        if isinstance(exc, OSError) and pid:
            raise _ptrace_error(exc, pid) from exc
        raise
    finally:
        os.close(go_w)
    while True:
        event = wait_event(pid)
        if event is None:
            raise ProcessError(f"cannot start {argv[0]}")
        if event.kind == EventKind.EXEC:
            break
        if event.kind in (EventKind.EXITED, EventKind.KILLED):
            failure = os.read(err_r, 64).decode()
            os.close(err_r)
            reason = os.strerror(int(failure)) if failure else f"exit status {event.code}"
            raise ProcessError(f"cannot run {argv[0]}: {reason}")
        sc.cont(pid, event.sig if event.kind == EventKind.SIGNAL else 0)
    os.close(err_r)
    tracee = Tracee(pid, [pid])
    tracee.threads[pid].in_event_stop = True  # the exec event stop
    return tracee


def attach(pid: int) -> Tracee:
    """Seize every thread of `pid` and stop them all (threads created meanwhile included)."""
    if pid <= 0:
        raise NoSuchProcess(f"no process with pid {pid}")
    try:
        with open(f"/proc/{pid}/status") as f:
            tgid = next(int(line.split()[1]) for line in f if line.startswith("Tgid:"))
    except FileNotFoundError as exc:
        raise NoSuchProcess(f"no process with pid {pid}") from exc
    if tgid != pid:
        pid = tgid
    if pid == os.getpid():
        raise ProcessError("dynprobe cannot trace itself")
    seized: list[int] = []
    try:
        while True:
            new = [t for t in list_threads(pid) if t not in seized]
            if not new:
                break
            for tid in new:
                try:
                    sc.seize(tid, TRACE_OPTIONS)
                except ProcessLookupError:
                    continue  # exited meanwhile
                except PermissionError:
                    if tid != pid and thread_state(pid, tid) in (b"Z", b"X", None):
                        continue  # a thread that has just ended (a zombie until reaped) cannot be seized
                    if tracer_of(pid, tid) != os.getpid():
                        raise
                    # Created by a thread we had seized: PTRACE_O_TRACECLONE attached it already.
                    seized.append(tid)
                    continue
                sc.interrupt(tid)
                seized.append(tid)
    except OSError as exc:
        for tid in seized:
            with contextlib.suppress(OSError):
                sc.detach(tid)
        raise _ptrace_error(exc, pid) from exc
    tracee = Tracee(pid, [])
    # Wait on each seized thread by tid, never waitpid(-1): that would also take events of the
    # caller's other children, and of other sessions' tracees. Polled, never waited for one by
    # one: a process exiting as it is seized reports its leader's end only once its other
    # threads' ends have been taken (waiting for the leader first would wait forever).
    pending = list(seized)
    while pending:
        ready = [(tid, event) for tid in pending if (event := poll_event(tid)) is not None]
        gone = [tid for tid in pending if thread_state(pid, tid) is None and all(t != tid for t, _ in ready)]
        if not ready and not gone:
            time.sleep(ATTACH_POLL)
            continue
        for tid in gone:
            pending.remove(tid)
            if tid == pid:
                raise NoSuchProcess(f"pid {pid} exited while attaching")
        for tid, event in ready:
            pending.remove(tid)
            if event.kind in (EventKind.EXITED, EventKind.KILLED):
                if tid == pid:
                    raise NoSuchProcess(f"pid {pid} exited while attaching")
                continue
            _attached(tracee, tid, event, seized, pending)
    return tracee


def _attached(tracee: Tracee, tid: int, event: Event, seized: list[int], pending: list[int]) -> None:
    """A seized thread's first stop: its state, and a thread it made meanwhile to wait for."""
    tracee.threads[tid] = ThreadState(tid, in_event_stop=event.kind in EVENT_STOPS)
    if event.kind != EventKind.STOP:
        # A group-stop too: a process stopped by job control (SIGSTOP, Ctrl-Z) is handled as one
        # stopped while traced, held with PTRACE_LISTEN: it stays stopped until SIGCONT.
        tracee.threads[tid].deferred.append(event)
    if event.kind == EventKind.CLONE and event.msg not in seized:
        seized.append(event.msg)  # born during attach: auto-attached, stopped at birth
        pending.append(event.msg)
