"""Hazards 19-20: fork, vfork+exec, fork in a threaded program, exec of a probed binary, dlopen."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dynprobe
from dynprobe.errors import ProcessError
from dynprobe.ptrace.process import thread_state
from dynprobe.symbols.elf import load_elf
from tests.conftest import TARGETS, build_target

from .helpers import run_plain, run_until, traced


@pytest.fixture(scope="module")
def forks() -> str:
    return build_target("forks", flags=("-O1", "-pthread"))


@pytest.mark.parametrize("mode", ["fork", "vfork", "threads", "exec"])
def test_children_exit_normally_without_following(forks: str, mode: str) -> None:
    plain = run_plain([forks, mode]).stdout
    status, out, probe = traced([forks, mode], lambda s: s.probe("probed"))
    assert status == 0 and out == plain, out
    # main calls probed(0) first; exec of the same binary: the path-based probe re-arms in the new
    # image, where the leaf calls it 1 + 3 times.
    parent_calls = {"fork": 2, "vfork": 2, "threads": 402, "exec": 1 + 4}[mode]
    assert probe.hits == parent_calls


@pytest.mark.parametrize(("mode", "total"), [("fork", 2 + 5), ("threads", 402 + 2), ("vfork", 2 + 4)])
def test_follow_fork_counts_children(forks: str, mode: str, total: int) -> None:
    plain = run_plain([forks, mode]).stdout
    status, out, probe = traced([forks, mode], lambda s: s.probe("probed"), follow_fork=True)
    assert status == 0 and out == plain
    assert probe.hits == total


@pytest.fixture(scope="module")
def dl_target() -> tuple[str, str, str]:
    lib_a = build_target("libdl_a", "libdl_a.c", flags=("-O1", "-shared", "-fPIC"), output="libdl_a.so")
    lib_b = build_target("libdl_b", "libdl_b.c", flags=("-O1", "-shared", "-fPIC"), output="libdl_b.so")
    main = build_target("dl", flags=("-O1", "-ldl"))
    return main, lib_a, lib_b


def test_probe_in_library_loaded_later_and_closed(dl_target: tuple[str, str, str]) -> None:
    main, lib_a, lib_b = dl_target
    argv = [main, lib_a, lib_b]
    plain = run_plain(argv).stdout
    status, out, (pa, pb) = traced(argv, lambda s: (s.probe(f"{lib_a}:lib_func"), s.probe(f"{lib_b}:other_func")))
    assert status == 0 and out == plain
    # Each round: lib_a loaded (3 calls), closed; lib_b loaded (likely at the same address), 1 call.
    assert pa.hits == 6
    assert pb.hits == 2


@pytest.fixture(scope="module")
def linked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """bin/linked needs libmine.so.1, which is in lib/ (its RUNPATH, $ORIGIN/../lib) and, with
    another lib_func, in decoy/; the system's cache knows neither."""
    root = tmp_path_factory.mktemp("linked")
    for directory, source in (("lib", "libdl_a.c"), ("decoy", "libdl_b.c")):
        (root / directory).mkdir()
        lib = build_target(
            f"libmine_{directory}", source, flags=("-O1", "-shared", "-fPIC", "-Wl,-soname,libmine.so.1")
        )
        shutil.copy(lib, root / directory / "libmine.so.1")
    (root / "bin").mkdir()
    subprocess.run(["gcc", "-O1", "-o", str(root / "bin" / "linked"), str(TARGETS / "linked.c"), f"-L{root / 'lib'}",
                    "-l:libmine.so.1", "-Wl,-rpath,$ORIGIN/../lib"], check=True)  # fmt: skip
    return root


@pytest.mark.parametrize("where", ["lib", "decoy", "preload"])
@pytest.mark.parametrize("how", ["probe", "tracer"])
def test_library_named_before_the_loader_ran_is_the_one_it_maps(linked: Path, where: str, how: str) -> None:
    """'libmine:lib_func' placed (or `--lib libmine` traced) before the target runs names the
    file its loader will map: through the RUNPATH, LD_LIBRARY_PATH first when set (ld.so's
    order), or the file LD_PRELOAD names by its path (the same soname: ld.so loads it once)."""
    argv = [str(linked / "bin" / "linked")]
    env = {
        "lib": None,
        "decoy": {**os.environ, "LD_LIBRARY_PATH": str(linked / "decoy")},
        "preload": {**os.environ, "LD_PRELOAD": str(linked / "decoy" / "libmine.so.1")},
    }[where]
    where = "decoy" if where == "preload" else where
    plain = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryFile("w+") as out:
        with dynprobe.spawn(argv, env=env, stdout=out.fileno()) as session:
            if how == "probe":
                probe = session.probe("libmine:lib_func")
                assert probe.location.path == str(linked / where / "libmine.so.1")
            else:
                tracer = session.function_tracer(libraries=["libmine"], filter=["*_func"])
                assert {f.path for f in tracer.functions} == {str(linked / where / "libmine.so.1")}
                tracer.start()
            assert session.run(timeout=60) == 0
            assert (probe.hits if how == "probe" else tracer.calls) == 3  # (the decoy's other_func is too short)
        out.seek(0)
        assert out.read() == plain


def _exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except FileNotFoundError:
        return None  # (between two images, in the middle of an exec)


def test_an_exec_taken_while_stopping_the_process_is_not_written_over() -> None:
    """A thread execs while the tracer is held (a Python handler) and an optimization falls
    due: the stop-the-world for it takes the exec stop. Nothing of the old image is written
    (it was: a read of the gone image, a traceback, the guardian left to restore); the exec
    is handled next and the new program runs to its end."""
    target = build_target("exec_race", flags=("-O1", "-pthread"))
    true = os.path.realpath("/bin/true")
    with open(os.devnull, "w") as devnull, dynprobe.spawn([target], stdout=devnull.fileno()) as session:

        def held(hit: object) -> None:
            session.probe("other")  # queued: optimized in 10 ms, at the loop's next turn
            # Until the other thread has exec'd; a while at most: an exec from a thread may need
            # the tracer (the leader's exit, reported to it), which this handler holds.
            deadline = time.monotonic() + 2
            while _exe(session.pid) != true and time.monotonic() < deadline:
                time.sleep(0.001)

        session.probe("hit", pre=held)
        assert session.run(timeout=60) == 0


def test_leader_pthread_exit_while_others_run() -> None:
    target = build_target("leader_exit", flags=("-O1", "-pthread"))
    status, _, probe = traced([target], lambda s: s.probe("probed"))
    assert status == 5
    assert probe.hits == 100


def test_attaching_after_the_leader_ended_says_why_it_cannot() -> None:
    """PTRACE_SEIZE goes through the main thread: once it has called pthread_exit (a zombie while
    the others run) the attach is refused, and the error says so and what to do."""
    target = build_target("leader_exit", flags=("-O1", "-pthread"))
    with subprocess.Popen([target, "held"], stdin=subprocess.PIPE) as proc:
        assert proc.stdin is not None
        deadline = time.monotonic() + 60
        while thread_state(proc.pid, proc.pid) != b"Z" and time.monotonic() < deadline:
            time.sleep(0.001)
        with pytest.raises(ProcessError, match=f"the main thread of pid {proc.pid} has ended while others run"):
            dynprobe.attach(proc.pid)
        proc.stdin.close()
        assert proc.wait(timeout=60) == 5


def test_target_killed_by_sigkill_is_fully_reaped(spinner: str) -> None:
    """A multi-threaded target SIGKILLed mid-trace: run() returns 128+9 and every thread is reaped
    (a traced thread left unreaped keeps its parent's wait() blocked forever)."""
    with open(os.devnull, "w") as devnull, dynprobe.spawn([spinner, "4"], stdout=devnull.fileno()) as s:
        probe = s.probe("tick")
        pid = s.pid
        run_until(s, lambda: probe.hits >= 100, "100 hits")
        os.kill(pid, signal.SIGKILL)
        status = s.run(timeout=30)
    assert status == 128 + signal.SIGKILL
    assert not os.path.exists(f"/proc/{pid}")  # reaped, leader and threads


def test_record_names_the_libraries_of_a_program_with_few_functions(linked: Path, tmp_path: Path) -> None:
    """Like a Python built with --enable-shared: the code is in a library; record says which."""
    cmd = [
        sys.executable,
        "-m",
        "dynprobe.cli.main",
        "record",
        "-o",
        str(tmp_path / "t"),
        "--",
        str(linked / "bin" / "linked"),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "sum=30\n", r.stderr
    assert "linked has few functions of its own; its code may be in the libraries it loads: --lib libmine\n" in r.stderr


@pytest.mark.parametrize("action", ["count", "record"])
def test_process_exiting_while_a_new_thread_gets_its_area(action: str) -> None:
    """A new thread's first stop gives it a thread area by remote syscalls in it (a pool, and
    for records its ring faulted in); the process exits meanwhile (exit right after
    pthread_create): the thread's end is an event like any other, not an error out of run(),
    whether the thread is gone (ESRCH) or only its memory is (a short read or write of
    /proc/PID/mem). (9 runs in 40 failed before; the memory case, ~1 in 60 of the Go test.)"""
    target = build_target("exit_race", flags=("-O1", "-pthread"))
    for _ in range(20):
        with dynprobe.spawn([target, "1000"]) as session:
            probe = session.probe("p probed x=%di", action=action)
            assert session.run(timeout=30) == 0
            assert probe.hits == 1000


def test_a_spawned_command_has_the_signal_dispositions_it_has_untraced() -> None:
    """Python ignores SIGPIPE and SIGXFSZ for itself, and an ignored disposition survives exec: a
    command dynprobe starts gets them back at their default, as subprocess gives them. `yes |
    head -1` then ends `yes` by SIGPIPE, silently, instead of with 'Broken pipe' on EPIPE."""
    script = "yes | head -1; grep SigIgn /proc/self/status"
    untraced = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert untraced.stderr == "" and untraced.stdout.startswith("y\nSigIgn:")
    with tempfile.TemporaryFile("w+") as out:
        with dynprobe.spawn(["sh", "-c", script], stdout=out, stderr=out) as session:
            assert session.run(timeout=30) == 0
        out.seek(0)
        assert out.read() == untraced.stdout


TRACEFS = Path("/sys/kernel/tracing")


@contextlib.contextmanager
def kernel_uprobe(path: Path, offset: int) -> Iterator[None]:
    """A kernel uprobe on path:offset (what bpftrace and perf probe place: an int3 in every
    process that maps the file), enabled in a tracing instance of our own; removed after."""
    group, event = "dynprobe_test", "foreign"
    instance = TRACEFS / "instances" / group

    def append(line: str) -> None:
        fd = os.open(TRACEFS / "uprobe_events", os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    append(f"p:{group}/{event} {path}:{offset:#x}")
    try:
        instance.mkdir(exist_ok=True)
        (instance / "events" / group / event / "enable").write_text("1\n")
        try:
            yield
        finally:
            (instance / "events" / group / event / "enable").write_text("0\n")
    finally:
        with contextlib.suppress(OSError):
            instance.rmdir()
        append(f"-:{group}/{event}")


def test_a_library_probe_over_another_tool_s_breakpoint_is_refused_and_said(linked: Path) -> None:
    """A kernel uprobe (bpftrace's, perf probe's) on a library function is an int3 in every
    process that maps the library: dynprobe does not patch over it (the kernel would write its
    original byte back over dynprobe's jump when it goes). The probe, refused as the loader maps
    the library, says why, and is not said to be on a library the program never loaded."""
    if not os.access(TRACEFS / "uprobe_events", os.W_OK):
        pytest.skip("no kernel uprobes here: tracefs is not mounted or not writable (make tracefs mounts it)")
    library = linked / "lib" / "libmine.so.1"
    image = load_elf(str(library))
    offset = image.vaddr_to_offset(image.by_name["lib_func"].addr)
    assert offset is not None
    argv = [str(linked / "bin" / "linked")]
    plain = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    with kernel_uprobe(library, offset):
        for command in (["count", "p libmine:lib_func"], ["run", "-e", "uprobe:libmine:lib_func { @ = count(); }"]):
            run = subprocess.run([sys.executable, "-m", "dynprobe.cli.main", *command, "--", *argv],
                                 capture_output=True, text=True, timeout=120)  # fmt: skip
            assert run.returncode == 0 and run.stdout == plain, run.stderr
            assert "int3 that dynprobe did not write [FOREIGN_INT3]" in run.stderr, run.stderr
            if command[0] == "count":  # (count says which probes were never placed, and why)
                assert "never placed" not in run.stderr, run.stderr
