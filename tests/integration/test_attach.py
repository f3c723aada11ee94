"""Attach to running processes, detach leaving every byte as found; hazards 21-23."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dynprobe
from dynprobe.errors import AlreadyTraced, NoSuchProcess, ProbeRefused, Refusal
from dynprobe.symbols.maps import read_maps
from tests.conftest import BUILD, build_target

from .helpers import held_by_other_tracer, run_until


def start(argv: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


@pytest.fixture
def running(spinner: str) -> Iterator[subprocess.Popen[str]]:
    proc = start([spinner, "4"])
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def finish(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, out
    return out


def assert_text_matches_files(pid: int) -> None:
    """Every executable file mapping of `pid` holds exactly the file's bytes."""
    with open(f"/proc/{pid}/mem", "rb") as mem:
        for m in read_maps(pid):
            if not m.executable or not m.path.startswith("/"):
                continue
            mem.seek(m.start)
            live = mem.read(m.end - m.start)
            with open(m.path, "rb") as f:
                f.seek(m.offset)
                disk = f.read(m.end - m.start)
            n = min(len(live), len(disk))
            assert live[:n] == disk[:n], f"{m.path} differs in memory after detach"


def test_attach_probe_detach_restores_text(running: subprocess.Popen[str]) -> None:
    with dynprobe.attach(running.pid) as session:
        tick = session.probe("tick")
        sleep = session.probe("libc:clock_gettime")
        run_until(session, lambda: tick.hits > 0 and sleep.hits > 0, "a hit of each probe")
        # dynprobe's own bytes are in place while attached
        assert tick.armed_addresses and sleep.armed_addresses
    assert_text_matches_files(running.pid)
    assert "ticks=" in finish(running)


def test_detach_with_threads_blocked_in_a_probed_call(running: subprocess.Popen[str]) -> None:
    with dynprobe.attach(running.pid) as session:
        session.probe("libc:usleep")
        session.probe("libc:clock_nanosleep")  # the threads sleep inside it right now
        status = session.run(timeout=0.3)
        assert status is None, f"the target ended while traced, status {status}"
    assert_text_matches_files(running.pid)
    assert "ticks=" in finish(running)


def test_attach_never_fails_on_a_thread_that_has_just_ended(spinner: str) -> None:
    """A thread that has ended but is not reaped yet (a zombie for a moment) is listed in
    /proc/PID/task and cannot be seized: attach skips it. Before, ~1 attach in 60 to a program
    that keeps creating short-lived threads failed with 'not permitted to trace'."""
    from dynprobe.ptrace import syscalls as sc
    from dynprobe.ptrace.process import attach

    proc = start([spinner, "2", "churn"])
    try:
        for _ in range(600):
            tracee = attach(proc.pid)
            for tid in tracee.threads:
                with contextlib.suppress(ProcessLookupError):
                    sc.detach(tid, 0)
            tracee.close_memory()
        assert "ticks=" in finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_attach_while_threads_are_created(spinner: str) -> None:
    """Hazard 23: new threads appear during attach and stop-the-world; all see the probes: the
    threads there at the attach (both loops) and threads created after it."""
    proc = start([spinner, "2", "churn"])
    try:
        for _ in range(3):
            with dynprobe.attach(proc.pid) as session:
                there = {int(tid) for tid in os.listdir(f"/proc/{proc.pid}/task")}
                tids: set[int] = set()
                session.probe("tick", pre=lambda hit, tids=tids: tids.add(hit.tid))

                def both_and_new(tids: set[int] = tids, there: set[int] = there) -> bool:
                    return len(tids & there) >= 2 and len(tids - there) >= 3

                run_until(session, both_and_new, "hits from both loop threads and 3 threads created since the attach")
        assert_text_matches_files(proc.pid)
        assert "ticks=" in finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_attach_errors(running: subprocess.Popen[str]) -> None:
    with pytest.raises(NoSuchProcess):
        dynprobe.attach(2**22 + 12345)
    with held_by_other_tracer(running.pid) as other, pytest.raises(AlreadyTraced) as info:
        dynprobe.attach(running.pid)
    assert f"already traced by pid {other.pid}" in str(info.value)


def test_attach_not_permitted(running: subprocess.Popen[str]) -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run dynprobe as an unprivileged user")
    code = (
        f"import dynprobe\ntry:\n dynprobe.attach({running.pid})\n"
        "except dynprobe.errors.PermissionDenied as e:\n print(e)"
    )
    out = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert "not permitted to trace" in out.stdout, out.stderr


def test_replaced_binary_is_refused(spinner: str) -> None:
    """Hazard 22: the file was replaced on disk (as an upgrade does) since the process mapped it."""
    copy = str(BUILD / "spinner-replaced")
    shutil.copy(spinner, copy)
    proc = start([copy, "1"])
    try:
        shutil.copy(spinner, copy + ".new")
        os.replace(copy + ".new", copy)
        with dynprobe.attach(proc.pid) as session, pytest.raises(ProbeRefused) as info:
            session.probe("tick")
        assert info.value.reason == Refusal.FILE_REPLACED
        assert "ticks=" in finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def spinning(spinner: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """The spinner running (killed at the end if a test left it running)."""
    proc = start([spinner, *args])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _killed_tracer(argv: list[str], ready: str, delay: float = 0.0) -> str:
    """Start a tracer, wait for a line starting with `ready` on its stdout or stderr, SIGKILL it
    `delay` seconds later. Returns what the guardian said on the tracer's stderr (it holds that
    pipe until it has finished)."""
    tracer = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert tracer.stdout is not None
        seen = []
        for line in tracer.stdout:
            seen.append(line)
            if line.startswith(ready):
                break
        else:
            raise AssertionError(f"the tracer ended before {ready!r}: {''.join(seen)}")
        time.sleep(delay)
        tracer.kill()
        return tracer.communicate(timeout=20)[0]
    finally:
        if tracer.poll() is None:
            tracer.kill()
            tracer.wait()


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2])
def test_a_killed_tracer_s_guardian_puts_the_code_back(spinner: str, delay: float) -> None:
    """Hazard 21: SIGKILL the tracer while its probes are in place (a jump on `tick`, which two
    threads call 2,000 times a second, an optimized count on clock_gettime, and trap probes with
    Python handlers on functions not running then). The guardian restores every byte, so the
    target's SIGTERM handler, which had a trap probe, runs and the target ends normally."""
    with spinning(spinner, "2", "idle", "20") as proc:
        code = (
            f"import dynprobe; s = dynprobe.attach({proc.pid}); t = s.probe('tick', action='count');"
            "c = s.probe('libc:clock_gettime', action='count');"
            "s.probe('on_term', pre=lambda hit: None); s.probe('brief', pre=lambda hit: None);"
            "s.run(timeout=0.3); print('ready', t.mode.value, c.mode.value, flush=True); s.run()"
        )
        said = _killed_tracer([sys.executable, "-c", code], "ready optimized optimized", delay)
        # its 4 probes' sites and the loader hook dynprobe keeps (to see dlopen)
        assert f"dynprobe let pid {proc.pid} go without detaching; 5 probe site(s) put back\n" in said, said
        assert_text_matches_files(proc.pid)
        assert "ticks=" in finish(proc)


def test_a_killed_function_tracer_s_guardian_puts_the_code_back(spinner: str, tmp_path: Path) -> None:
    """Hazard 21 for `dynprobe record -p`: every function entry of the program is a jump, and
    new threads keep coming."""
    with spinning(spinner, "2", "churn", "20") as proc:
        argv = [sys.executable, "-m", "dynprobe", "record", "-o", str(tmp_path / "t.data"), "-p", str(proc.pid)]
        said = _killed_tracer(argv, "dynprobe: tracing", 0.3)
        assert f"dynprobe let pid {proc.pid} go without detaching" in said and "left" not in said, said
        assert_text_matches_files(proc.pid)
        assert "ticks=" in finish(proc)


@pytest.mark.parametrize("hooks", ["retprobe", "function tracer"])
def test_a_killed_tracer_s_pending_returns_go_back_to_their_callers(hooks: str, tmp_path: Path) -> None:
    """Hazard 21 with returns pending: the tracer dies while a hooked function waits, which
    then throws a C++ exception through its own frame. The unwinder cannot walk through the
    return trampoline: the guardian has put the original return address back."""
    target = build_target("ret_blocked", "ret_blocked.cpp", flags=("-O1", "-lstdc++"))
    proc = subprocess.Popen([target], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        if hooks == "retprobe":
            code = (
                f"import dynprobe; s = dynprobe.attach({proc.pid}); p = s.retprobe('blocked', action='count');"
                "s.run(timeout=0.3); print('ready', p.mode.value, flush=True); s.run()"
            )
            argv, ready = [sys.executable, "-c", code], "ready optimized"
        else:
            argv = [sys.executable, "-m", "dynprobe", "record", "-o", str(tmp_path / "t.data"), "-p", str(proc.pid)]
            ready = "dynprobe: tracing"
        tracer = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert tracer.stdout is not None
        for line in tracer.stdout:
            if line.startswith(ready):
                break
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "waiting\n"  # in blocked(), its return hooked
        tracer.kill()
        said = tracer.communicate(timeout=20)[0]
        assert f"dynprobe let pid {proc.pid} go without detaching" in said, said
        # blocked(), and with the function tracer the library call it waits in
        pending = 1 if hooks == "retprobe" else 2
        assert f"{pending} pending return(s) back to their callers" in said, said
        proc.stdin.write("x")
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=20)
        assert (proc.returncode, out) == (0, "caught x\n")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_guardian_leaves_with_its_session(spinner: str) -> None:
    with open(os.devnull, "w") as devnull, dynprobe.spawn([spinner, "1", "idle", "0.2"], stdout=devnull) as session:
        session.probe("tick")
        guardian = session._runtime.guardian.pid
        with open(f"/proc/{guardian}/comm") as comm:  # there while the session is, by its own name
            assert comm.read() == "dp-guardian\n"
        assert session.run(timeout=20) == 0
    # Gone at close: it has closed its end of a pipe the session waits on, and is exiting (its
    # parent is init, which reaps it in its own time).
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{guardian}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    break
        except FileNotFoundError:
            break
        time.sleep(0.01)
    else:
        raise AssertionError(f"the guardian {guardian} is still there")


def test_the_guardian_survives_a_pkill_aimed_at_the_tracer(spinner: str) -> None:
    """Hazard 21: `pkill -9 -f dynprobe` (or `pkill -9 dynprobe`) kills every process whose
    command line (or name) matches. The guardian, a fork of the tracer, has a name and a
    command line of its own: it survives and puts the target's code back. Emulated here for a
    marker only the tracer's command line holds (pkill itself could match this test's runner).
    (A thread at a trap probe is the rescue handler's: tests/integration/test_killed_tracer.py.)"""
    marker = f"dynprobe-tracer-{os.getpid()}-{time.monotonic_ns()}"
    with spinning(spinner, "4") as proc:
        code = (
            f"import dynprobe; s = dynprobe.attach({proc.pid}); p = s.probe('tick'); s.run(timeout=0.3); "
            "print('ready', s._runtime.guardian.pid, p.mode.value, flush=True); s.run()"
        )
        tracer = subprocess.Popen([sys.executable, "-c", code, marker], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)  # fmt: skip
        try:
            assert tracer.stdout is not None
            ready, guardian_pid, mode = tracer.stdout.readline().split()
            assert (ready, mode) == ("ready", "optimized")
            guardian = int(guardian_pid)
            with open(f"/proc/{guardian}/cmdline", "rb") as f:
                assert b"dynprobe" not in f.read()
            with open(f"/proc/{guardian}/comm", "rb") as f:
                assert b"dynprobe" not in f.read()
            killed = []
            for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
                with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
            assert killed == [tracer.pid]
            said = tracer.communicate(timeout=20)[0]
        finally:
            if tracer.poll() is None:
                tracer.kill()
                tracer.wait()
        assert f"dynprobe let pid {proc.pid} go without detaching" in said and "left" not in said, said
        assert_text_matches_files(proc.pid)
        assert "ticks=" in finish(proc)


def test_sites_whose_bytes_are_not_the_files_are_refused() -> None:
    """Hazard 22 / docs/architecture.md §4: memory that differs from the file, and someone else's int3."""
    selfmod = build_target("selfmod", flags=("-O1",))
    proc = start([selfmod])
    try:
        with dynprobe.attach(proc.pid) as session:
            with pytest.raises(ProbeRefused) as info:
                session.probe("changed")
            assert info.value.reason == Refusal.BYTES_MISMATCH
            with pytest.raises(ProbeRefused) as info:
                session.probe("never_called")
            assert info.value.reason == Refusal.FOREIGN_INT3
            assert session.probes == []
        assert finish(proc) == "done\n"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_job_control_stop_and_continue_pass_through(spinner: str) -> None:
    """A SIGSTOP stops the traced process as it would untraced (group-stop, held with PTRACE_LISTEN;
    /proc shows it as 't (tracing stop)' rather than 'T', as under any ptrace tracer); SIGCONT
    resumes it; probes keep counting. The stop is sent at the 50th hit, the SIGCONT a window
    later: hits come again after it, and none in the window's second half (a tick already on its
    way when the stop was sent, before the stop reaches the thread, may come just after it; as
    it may untraced)."""
    window = 0.4
    times: list[float] = []
    stop_sent = threading.Event()
    continued: list[float] = []

    def on_tick(hit: dynprobe.Hit) -> None:
        times.append(hit.time)
        if len(times) == 50:
            os.kill(hit.pid, signal.SIGSTOP)
            stop_sent.set()

    def continue_after_the_window(pid: int) -> None:
        if stop_sent.wait(60):
            time.sleep(window)  # (not a wait for anything: the time the program stays stopped)
            continued.append(time.monotonic())
            os.kill(pid, signal.SIGCONT)

    with open(os.devnull, "w") as devnull, dynprobe.spawn([spinner, "1", "x", "60"], stdout=devnull.fileno()) as s:
        s.probe("tick", pre=on_tick)
        helper = threading.Thread(target=continue_after_the_window, args=(s.pid,))
        helper.start()
        run_until(s, lambda: len(times) >= 150, "50 hits, the stop, and 100 hits after it")
        helper.join()
        os.kill(s.pid, signal.SIGTERM)
        status = s.run(timeout=60)
    assert status == 0
    before = [t for t in times if t < continued[0]]
    assert len(before) >= 50 and before[-1] < continued[0] - window / 2
    assert len(times) > len(before)


def _state(pid: int, tid: int | str | None = None) -> str:
    with open(f"/proc/{pid}/task/{tid}/status" if tid else f"/proc/{pid}/status") as f:
        return next(line.split()[1] for line in f if line.startswith("State:"))


@pytest.mark.parametrize("action", ["count", None], ids=["optimized", "trap"])
def test_attach_to_a_stopped_process_keeps_it_stopped(running: subprocess.Popen[str], action: str | None) -> None:
    """A process stopped by job control (SIGSTOP, Ctrl-Z) before the attach stays stopped while
    traced (even when setting up optimized probes ran code in its threads) until SIGCONT, and
    is left stopped if it is at the detach."""
    pid = running.pid
    os.kill(pid, signal.SIGSTOP)
    while _state(pid) != "T":
        time.sleep(0.01)
    with dynprobe.attach(pid) as session:
        probe = session.probe("tick", action=action) if action else session.probe("tick", pre=lambda hit: None)
        session.run(timeout=0.5)
        assert probe.hits == 0 and _state(pid) == "t"  # held in its group-stop (PTRACE_LISTEN)
        os.kill(pid, signal.SIGCONT)
        run_until(session, lambda: probe.hits > 100, "100 hits once continued")
        os.kill(pid, signal.SIGSTOP)
        for _ in range(40):  # until every thread has stopped
            session.run(timeout=0.05)
            if all(_state(pid, tid) == "t" for tid in os.listdir(f"/proc/{pid}/task")):
                break
        stopped_at = probe.hits
        session.run(timeout=0.3)
        assert probe.hits == stopped_at
    deadline = time.monotonic() + 5
    while _state(pid) != "T" and time.monotonic() < deadline:  # detached threads settle into the stop
        time.sleep(0.01)
    assert _state(pid) == "T"  # stopped, as it was at the detach
    os.kill(pid, signal.SIGCONT)
    assert int(finish(running).split("=")[1]) > 100


def traced_without_sys_admin(proc: subprocess.Popen[str], code: str) -> list[str]:
    """Run the tracer `code` on the sandboxed `proc` without CAP_SYS_ADMIN (the seccomp filter
    cannot be suspended); then the program must finish untouched. The lines the tracer printed."""
    tracer = subprocess.run(
        ["setpriv", "--inh-caps=-sys_admin", "--bounding-set=-sys_admin", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0 and out.endswith(" sum=0\n"), out
    assert not tracer.stderr, tracer.stderr
    return tracer.stdout.splitlines()


def test_sandboxed_process_under_seccomp_survives_optimized_probes() -> None:
    """A seccomp filter that kills the process on mmap or memfd_create (the system calls dynprobe
    runs in the target for slots and thread areas): with CAP_SYS_ADMIN the filter is suspended
    for those calls only, the probe is optimized and the program never notices; without it, the
    probe stays a trap (its entry `push rbp` is emulated: no memory needed) and says why; a probe
    that needs a slot is refused, as is a return probe. (Before: the program was killed, 'Bad
    system call'.)"""
    target = build_target("seccomp", flags=("-O0",))
    proc = start([target, "usr1"])  # (it runs until told: a loaded machine attaches slowly)
    with dynprobe.attach(proc.pid) as session:
        probe = session.probe("work", action="count")
        run_until(session, lambda: probe.hits > 100, "100 hits")
        assert probe.mode == dynprobe.ProbeMode.OPTIMIZED
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0 and out.endswith(" sum=0\n"), out
    proc = start([target, "usr1"])
    code = (
        "import dynprobe\n"
        f"with dynprobe.attach({proc.pid}) as s:\n"
        "    p = s.probe('work', action='count')\n"
        "    while p.hits <= 100: s.run(timeout=0.05)\n"
        "    print(p.mode.name, p.trap_reason.name)\n"
        "    for place in (lambda: s.probe('work+4'), lambda: s.retprobe('work')):\n"  # (work+4: from a slot)
        "        try:\n"
        "            place()\n"
        "        except dynprobe.ProbeRefused as exc:\n"
        "            print(exc.reason.name)\n"
    )
    assert traced_without_sys_admin(proc, code) == ["TRAP SECCOMP", "SECCOMP", "SECCOMP"]


def test_actions_of_a_process_without_thread_areas_run_at_the_stop() -> None:
    """Under seccomp without CAP_SYS_ADMIN no thread area can be made: each probe's action runs
    in the tracer at the trap, as the target would have run it (a filter, a histogram, records
    for a callback and for a BatchHandler, the CPU each hit ran on)."""
    target = build_target("seccomp", flags=("-O0",))
    proc = start([target, "usr1"])
    code = (
        "import os, dynprobe\n"
        "from dynprobe.core.probe import BatchHandler\n"
        "class Rows(BatchHandler):\n"
        "    rows = 0\n"
        "    def on_batches(self, batches): self.rows += sum(len(b.time_ns) for b in batches)\n"
        f"with dynprobe.attach({proc.pid}) as s:\n"
        "    events, rows = [], Rows()\n"
        "    counted = s.probe('p work i=%di', action='count')\n"
        "    never = s.probe('p work i=%di', filter='i > 1000000000')\n"
        "    hist = s.probe('p work i=%di', action='hist', value='i')\n"
        "    recorded = s.probe('p work i=%di', on_event=events.append)\n"
        "    columns = s.probe('p work i=%di', on_event=rows)\n"
        "    while counted.hits < 50:\n"
        "        s.run(timeout=0.1)\n"
        "    s.drain()\n"
        "    n = counted.hits\n"
        "    values = [e.values['i'] for e in events]\n"
        "    print(counted.trap_reason.name, never.hits, sum(hist.histogram) == n, len(events) == rows.rows == n)\n"
        "    print(values == list(range(values[0], values[0] + n)), all(0 <= e.cpu < os.cpu_count() for e in events))\n"
    )
    assert traced_without_sys_admin(proc, code) == ["SECCOMP 0 True True", "True True"]


def test_count_probes_on_many_threads_hold_little_memory(spinner: str) -> None:
    """Counting needs no ring: a thread area's pages fault in as they are used, not all at once
    (a 1 MiB ring and the tables, ~2.3 MiB a thread, were faulted in for each of them; 500
    threads took 2.5 s to attach and held 1.2 GiB)."""
    proc = start([spinner, "30"])
    try:
        with dynprobe.attach(proc.pid) as session:
            probe = session.probe("tick", action="count")
            run_until(session, lambda: probe.hits > 1000, "1000 hits")
            assert probe.mode == dynprobe.ProbeMode.OPTIMIZED
            with open(f"/proc/{proc.pid}/status") as f:
                shmem_kib = next(int(line.split()[1]) for line in f if line.startswith("RssShmem:"))
            assert shmem_kib < 4096, shmem_kib  # a few pages a thread, not megabytes
    finally:
        finish(proc)


def test_process_in_another_mount_namespace(spinner: str, tmp_path: Path) -> None:
    """A containerized program: its files are reached through /proc/PID/root (the paths in its
    maps do not exist here)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to make a mount namespace")
    (tmp_path / "bin").mkdir()
    (tmp_path / "mnt").mkdir()
    shutil.copy(spinner, tmp_path / "bin" / "spinner")
    inside = tmp_path / "mnt" / "spinner"  # exists only in the target's mount namespace
    proc = start(
        ["unshare", "-m", "sh", "-c", f"mount --bind {tmp_path / 'bin'} {tmp_path / 'mnt'} && exec {inside} 2"]
    )
    try:
        assert not inside.exists() and os.readlink(f"/proc/{proc.pid}/exe") == str(inside)
        with dynprobe.attach(proc.pid) as session:
            ticks = session.probe("tick", action="count")
            sleeps = session.probe("libc:usleep", action="count")
            run_until(session, lambda: ticks.hits > 100 and sleeps.hits > 100, "100 hits of each")
            assert ticks.mode == dynprobe.ProbeMode.OPTIMIZED
    finally:
        assert int(finish(proc).split("=")[1]) > 100
    # The same libc, reached through our root now that that process (and its root) is gone.
    with open(tmp_path / "out", "w") as out, dynprobe.spawn([spinner, "1", "idle", "0.2"], stdout=out) as session:
        ticks = session.probe("tick", action="count")
        sleeps = session.probe("libc:usleep", action="count")
        assert session.run(timeout=20) == 0
    # (the thread sleeps after each tick; the main thread sleeps too)
    assert (tmp_path / "out").read_text() == f"ready\nticks={ticks.hits}\n" and sleeps.hits > ticks.hits > 0


def test_ctrl_c_during_detach_waits_for_it(running: subprocess.Popen[str]) -> None:
    """A Ctrl-C that arrives while the session detaches does not cut the detach short (the target
    would keep int3s and jumps of a tracer that is gone): it is raised once the detach is done."""
    code = (
        "import os, signal, dynprobe\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # (ignored where started in the background)\n"
        "from dynprobe.core.detach import Detacher\n"
        "detach = Detacher.detach_all\n"
        "def interrupted(self):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    detach(self)\n"
        "    print('detached', flush=True)\n"
        "Detacher.detach_all = interrupted\n"
        "try:\n"
        f"    with dynprobe.attach({running.pid}) as s:\n"
        "        s.probe('tick', action='count'); s.probe('tick+1', pre=lambda hit: None)\n"
        "        print('placed', flush=True); s.run(timeout=0.3)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout == "placed\ndetached\ninterrupted\n", r.stdout + r.stderr
    assert_text_matches_files(running.pid)
    assert int(finish(running).split("=")[1]) > 100


def test_a_ctrl_c_whose_handler_comes_late_still_ends_the_run(spinner: str) -> None:
    """Python runs a signal's handler between bytecodes: a Ctrl-C caught just before the wait for
    a stop had its handler run only once the wait ended, and on a target that never stops the run
    went on (a CI run hung so). `interrupt_main` leaves the handler pending in the same way while
    the main thread sleeps in its wait (waitid or sigtimedwait); the run must still end."""
    with spinning(spinner, "1", "plain", "600") as proc:  # (it ends within the test only if run() does)
        code = (
            "import _thread, signal, threading, dynprobe\n"
            f"with dynprobe.attach({proc.pid}) as s:\n"
            "    signal.signal(signal.SIGINT, s.interrupt_wait)\n"
            "    main = threading.get_native_id()\n"
            "    def late():\n"
            "        while open(f'/proc/self/task/{main}/syscall').read().split()[0] not in ('247', '128'):\n"
            "            pass\n"
            "        _thread.interrupt_main(signal.SIGINT)\n"
            "    threading.Thread(target=late).start()\n"
            "    print(s.run(), len(s.processes()), flush=True)\n"
            "    tick = s.probe('tick', pre=lambda hit: s.stop())\n"
            "    print(s.run(), tick.hits, flush=True)\n"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        # The target runs on; the next run is not ended by the Ctrl-C that ended this one.
        assert r.stdout == "None 1\nNone 1\n", r.stdout + r.stderr
        assert "ticks=" in finish(proc)


def test_request_stop_from_another_thread_ends_an_untimed_run(spinner: str) -> None:
    """As the consumer does when its output fails: the main thread sleeps in its wait for a stop
    with no time limit, and another thread asks for the stop."""
    with spinning(spinner, "1", "plain", "600") as proc, dynprobe.attach(proc.pid) as session:
        main = threading.get_native_id()

        def ask() -> None:
            while Path(f"/proc/self/task/{main}/syscall").read_text().split()[0] != "247":  # waitid
                pass
            session.request_stop()

        asker = threading.Thread(target=ask)
        asker.start()
        assert session.run() is None and session.processes()
        asker.join()


def test_a_detach_that_cannot_finish_hands_over_to_the_guardian(spinner: str) -> None:
    """docs/architecture.md §3: a detach that fails half-way (here: putting the optimized sites back raises)
    still lets every thread go; the guardian then puts back what is left."""
    with spinning(spinner, "2", "idle", "20") as proc:
        session = dynprobe.attach(proc.pid)
        tick = session.probe("tick", action="count")
        session.probe("on_term", pre=lambda hit: None)
        session.run(timeout=0.3)
        assert tick.mode.value == "optimized"

        def fail(*args: object) -> None:
            raise OSError("a detach that cannot finish")

        session._runtime.optimizer.restore_all = fail  # type: ignore[method-assign]
        session.close()
        assert_text_matches_files(proc.pid)
        assert "ticks=" in finish(proc)
