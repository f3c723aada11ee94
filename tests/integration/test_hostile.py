"""A hostile target, traced by root: what it controls (its descriptors, its libraries) never makes
dynprobe open, map or write a file with root's rights, nor run the target's code in a process of
dynprobe's."""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import dynprobe
from dynprobe.ptrace.guardian import rescue
from dynprobe.ptrace.journal import Journal
from dynprobe.ptrace.process import Tracee
from dynprobe.ptrace.procfs import start_time
from dynprobe.symbols.elf import load_elf
from tests.conftest import build_target


@pytest.fixture
def nobody_can_reach() -> Iterator[Path]:
    """A directory `nobody` may pass through (not read), in which root keeps a 0600 file."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the target runs as nobody, dynprobe as root")
    where = Path(tempfile.mkdtemp(prefix="dynprobe-hostile-", dir="/tmp"))
    where.chmod(0o711)
    try:
        yield where
    finally:
        shutil.rmtree(where)


def test_a_descriptor_swapped_under_the_shared_memory_is_never_used(
    nobody_can_reach: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target (as nobody) watches for the memory it makes for dynprobe to be mapped, then
    puts a descriptor of root's 0600 file (opened O_PATH, which needs no right on it) in place
    of the memfd's, before dynprobe takes it; it starts threads all the time, so dynprobe maps
    pools of thread areas while its other threads run. Over sessions making at least 200
    mappings: dynprobe takes the memory with pidfd_getfd (never by /proc/PID/fd, which it would
    open with root's rights) and checks it is its memfd, so the file is never mapped nor
    written; the target wins the race now and then, and that session's probes stay traps
    (SHARED_MEMORY) while it goes on; the target runs on."""
    victim = nobody_can_reach / "root-only"
    victim.write_bytes(b"root's secret\n")
    os.truncate(victim, 64 << 20)  # larger than any mapping dynprobe makes
    victim.chmod(0o600)
    before = victim.stat()
    mappings = 0
    map_shared = Tracee.map_shared

    def counted(self: Tracee, tid: int, scratch: int, size: int) -> tuple[int, mmap.mmap]:
        nonlocal mappings
        mappings += 1
        return map_shared(self, tid, scratch, size)

    monkeypatch.setattr(Tracee, "map_shared", counted)
    target = build_target("hostile_fds", flags=("-O1", "-pthread"))
    proc = subprocess.Popen([target, str(victim)], stdout=subprocess.PIPE, text=True, user="nobody")
    refused = 0
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        sessions = 0
        while mappings < 200 and sessions < 100:
            sessions += 1
            with dynprobe.attach(proc.pid) as session:
                probe = session.probe("work", action="count")
                session.optimize_now()
                session.run(timeout=0.2)
                process = session.process(proc.pid)
                assert process is not None
                if process.areas_refused is not None:
                    refused += 1
                    assert process.areas_refused == dynprobe.OptimizeRefusal.SHARED_MEMORY
                    assert probe.mode == dynprobe.ProbeMode.TRAP
                    with pytest.raises(dynprobe.ProbeRefused) as no_return:
                        session.retprobe("work", action="count")
                    assert no_return.value.reason == dynprobe.Refusal.SHARED_MEMORY
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out.startswith("calls="), out
    assert mappings >= 200 and refused > 0, (mappings, refused)  # the race was run, and won at times
    after = victim.stat()
    with open(victim, "rb") as f:
        assert f.read(14) == b"root's secret\n" and not f.read().strip(bytes(1))
    assert (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_ctime_ns,
    )


def test_the_target_s_library_never_runs_in_dynprobe(tmp_path: Path) -> None:
    """A library with an indirect function and a constructor that notes the pid of every process
    that loads it: every command that touches the library (list of the file, list -p, probes,
    return probes, the function tracer over it, spawn before it is loaded) resolves the indirect
    function from what the target's loader did, never by loading the library into a process of
    dynprobe's (its constructor would run with dynprobe's rights: root's)."""
    marker = tmp_path / "loaded-by"
    lib = build_target("libhostile.so", "hostile_lib.c", flags=("-O1", "-fPIC", "-shared", f'-DMARKER="{marker}"'))
    prog = build_target(
        "hostile_prog",
        "hostile_prog.c",
        flags=("-O1", f"-L{Path(lib).parent}", "-lhostile", f"-Wl,-rpath,{Path(lib).parent}"),
    )
    proc = subprocess.Popen([prog], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        dp = [sys.executable, "-m", "dynprobe.cli.main"]
        listed = subprocess.run([*dp, "list", lib], capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0 and "hostile_impl" in listed.stdout and "hostile_fn" not in listed.stdout
        listed = subprocess.run(
            [*dp, "list", "-p", str(proc.pid), "hostile*"], capture_output=True, text=True, timeout=60
        )
        assert listed.returncode == 0 and "hostile_fn" in listed.stdout, listed.stdout + listed.stderr
        for command in (
            ["count", "-o", "-", "-i", "0.05", "p libhostile:hostile_fn"],
            ["trace", "p libhostile:hostile_fn x=%di", "-o", str(tmp_path / "events.txt")],
            ["latency", "libhostile:hostile_fn"],
            ["record", "--lib", "libhostile", "-o", str(tmp_path / "t.data")],
        ):
            tracer = subprocess.Popen([*dp, *command, "-p", str(proc.pid)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)  # fmt: skip
            assert tracer.stderr is not None and tracer.stdout is not None
            for line in tracer.stderr:  # until its probes are in: "... placed in pid", "dynprobe: tracing"
                if "placed in pid" in line or line.startswith("dynprobe: tracing"):
                    break
            if command[0] == "count":  # the implementation was found: an interval counts its calls
                lines = itertools.islice(tracer.stdout, 2000)  # (a bound: 1,000 intervals of 50 ms)
                assert any(re.search(r"p_hostile_fn +[1-9]", line) for line in lines)
            tracer.send_signal(signal.SIGINT)
            _, err = tracer.communicate(timeout=60)
            assert tracer.returncode == 0 and "error" not in err, err
        unloaded = r"indirect function: .* no traced process has it loaded"
        with (
            dynprobe.spawn([prog], stdout=subprocess.DEVNULL) as session,
            pytest.raises(dynprobe.SymbolError, match=unloaded),
        ):
            session.probe("libhostile:hostile_fn")  # before its loader ran
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert set(marker.read_text().split()) == {str(proc.pid)}  # the target alone (the spawned one never ran)


ADDR_NO_RANDOMIZE = 0x0040000


def _spinner_without_aslr(spinner: str) -> subprocess.Popen[str]:
    libc = ctypes.CDLL(None)
    proc = subprocess.Popen([spinner, "0"], stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: libc.personality(ADDR_NO_RANDOMIZE))  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def _tick_of(pid: int, spinner: str) -> int:
    path = os.path.realpath(spinner)
    first = next(line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if line.endswith(path))
    image = load_elf(spinner)
    tick = image.address_of("tick")
    assert tick is not None
    return int(first.split("-")[0], 16) - image.first_page + tick


def test_the_guardian_never_writes_to_a_pid_another_process_took(spinner: str) -> None:
    """The tracer died and so did its target; its pid went to another process (here, on
    purpose, through ns_last_pid): the guardian puts nothing back into that one. The same
    journal entry for the process that is still there is put back (the check is what stops it)."""
    last_pid = Path("/proc/sys/kernel/ns_last_pid")
    if os.geteuid() != 0 or not os.access(last_pid, os.W_OK):
        pytest.skip("needs root, to give a process a chosen pid (/proc/sys/kernel/ns_last_pid)")
    first = _spinner_without_aslr(spinner)
    tick = _tick_of(first.pid, spinner)
    with open(f"/proc/{first.pid}/mem", "rb") as mem:
        mem.seek(tick)
        original = mem.read(1)
    journal = Journal(capacity=16)
    journal.record(first.pid, tick, original)  # as if an int3 were there
    started = start_time(first.pid)
    first.kill()
    first.wait()
    # Another process or thread may take the pid first (a busy machine makes threads all the
    # time: another suite, a stress run), or the new one may start in the same tick of the
    # start time (10 ms: what a kernel without pidfs goes by): then again, as often as it takes.
    for _ in range(5000):
        last_pid.write_text(str(first.pid - 1))
        second = _spinner_without_aslr(spinner)
        if second.pid == first.pid and start_time(second.pid) != started:
            break
        second.kill()
        second.wait()
    else:
        pytest.fail(f"pid {first.pid} could not be given to a new process")
    try:
        assert _tick_of(second.pid, spinner) == tick
        with open(f"/proc/{second.pid}/mem", "r+b", buffering=0) as mem:
            mem.seek(tick)
            mem.write(b"\xcc")  # what the guardian would take for its own int3
            assert list(rescue(journal.spans(), {}, None, {}, journal.identities())) == []
            mem.seek(tick)
            assert mem.read(1) == b"\xcc"
            mine = Journal(capacity=16)
            mine.record(second.pid, tick, original)
            assert list(rescue(mine.spans(), {}, None, {}, mine.identities())) == [
                f"dynprobe let pid {second.pid} go without detaching; 1 probe site(s) put back"
            ]
            mem.seek(tick)
            assert mem.read(1) == original
    finally:
        second.kill()
        second.wait()
