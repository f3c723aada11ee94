"""Bad paths, files that cannot be written and a full disk, at every subcommand: one line on
stderr saying what was wrong, a non-zero exit, no traceback, nothing written where it should not
be, and the program unharmed (it runs to its end, with its own output)."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynprobe.ptrace.process import tracer_of

DYNPROBE = [sys.executable, "-m", "dynprobe.cli.main"]


def dp(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DYNPROBE, *args], capture_output=True, text=True, timeout=120, input=stdin)


def one_error_line(r: subprocess.CompletedProcess[str], says: str) -> None:
    assert r.returncode != 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("dynprobe: error: ")]
    assert len(errors) == 1, r.stderr
    assert says in errors[0], errors[0]


@pytest.fixture
def trace_dir(tmp_path: Path, wordcount: str) -> str:
    """A real trace to read back."""
    r = dp("record", "-o", str(tmp_path / "good.data"), "--", wordcount, "a b")
    assert r.returncode == 0, r.stderr
    return str(tmp_path / "good.data")


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file someone planted a symbolic link to: it must never be written through the link."""
    path = tmp_path / "secret"
    path.write_text("keep me\n")
    return path


RUNNING = {  # each command that runs a program, as given before its target
    "trace": ["trace", "p add_word"],
    "count": ["count", "p add_word"],
    "hist": ["hist", "p add_word n=%si", "--value", "n"],
    "latency": ["latency", "add_word"],
    "record": ["record"],
    "live": ["live"],
}
TARGETS = [
    (["-p", "999999999"], "no process with pid 999999999"),
    (["--", "/nonexistent/program"], "no such file: /nonexistent/program"),
    (["--", "/dev/zero"], "/dev/zero is not a regular file: name an ELF file"),
]
SPEC_FILES = [
    ("/nonexistent/specs", "cannot read spec file /nonexistent/specs: No such file or directory"),
    ("/bin/true", "spec file /bin/true is not text"),
]


@pytest.mark.parametrize("command", list(RUNNING))
@pytest.mark.parametrize(("target", "says"), TARGETS)
def test_a_target_that_cannot_be_traced(command: str, target: list[str], says: str) -> None:
    one_error_line(dp(*RUNNING[command], *target), says)


@pytest.mark.parametrize("command", ["trace", "count", "hist"])
@pytest.mark.parametrize(("path", "says"), SPEC_FILES)
def test_a_spec_file_that_cannot_be_read(command: str, path: str, says: str, wordcount: str) -> None:
    value = ["--value", "%si"] if command == "hist" else []
    one_error_line(dp(command, "-f", path, *value, "--", wordcount, "a"), says)


def test_a_spec_file_with_nothing_or_one_huge_word(wordcount: str, tmp_path: Path) -> None:
    """Empty: no probe. One word of 2 MB (no such function): quoted cut, not in full."""
    (tmp_path / "empty").write_text("# nothing\n")
    one_error_line(dp("count", "-f", str(tmp_path / "empty"), "--", wordcount, "a"), "no probe given")
    (tmp_path / "huge").write_text("p" + "x" * 2_000_000 + "\n")
    r = dp("count", "-f", str(tmp_path / "huge"), "--", wordcount, "a")
    one_error_line(r, "no function 'p" + "x" * 99 + "'... (2,000,001 characters) in ")
    assert len(r.stderr) < 400


def test_a_spec_file_too_large_to_be_a_list_of_specs(wordcount: str, tmp_path: Path) -> None:
    """More than 64 MiB (a file given by mistake, a device): refused once that much is read, not
    read whole."""
    huge = tmp_path / "huge"
    with open(huge, "wb") as f:
        f.truncate((64 << 20) + 1)  # (sparse)
    one_error_line(
        dp("count", "-f", str(huge), "--", wordcount, "a"), "is larger than 64 MiB: not a list of probe specs"
    )


@pytest.mark.parametrize("top", ["0", "-1", "x"])
def test_a_count_that_is_not_one(wordcount: str, top: str) -> None:
    r = dp("count", "--top", top, "p add_word", "--", wordcount, "a")
    assert r.returncode == 2 and f"argument --top: {top!r} is not a count (1 or more)" in r.stderr, r.stderr


@pytest.mark.parametrize("command", ["trace", "record", "dump"])
def test_an_output_that_cannot_be_created(command: str, wordcount: str, trace_dir: str) -> None:
    args = {
        "trace": ["trace", "p add_word", "-o", "/proc/no/such/file", "--", wordcount, "a"],
        "record": ["record", "-o", "/proc/no/such/dir", "--", wordcount, "a"],
        "dump": ["dump", "--chrome", trace_dir, "-o", "/proc/no/such/file"],
    }[command]
    one_error_line(dp(*args), "/proc/no/such/")


@pytest.mark.parametrize("command", ["trace", "record", "dump"])
def test_a_planted_symbolic_link_is_never_followed(command: str, wordcount: str, trace_dir: str,
                                                   secret: Path, tmp_path: Path) -> None:  # fmt: skip
    link = tmp_path / "out"
    link.symlink_to(secret)
    args = {
        "trace": ["trace", "p add_word", "-o", str(link), "--", wordcount, "a"],
        "record": ["record", "-o", str(link), "--", wordcount, "a"],
        "dump": ["dump", "--flame", trace_dir, "-o", str(link)],
    }[command]
    r = dp(*args)
    one_error_line(r, str(link))
    assert secret.read_text() == "keep me\n" and link.is_symlink()


def test_results_can_go_to_dev_null_and_never_to_a_fifo(wordcount: str, tmp_path: Path) -> None:
    """-o /dev/null (a character device: only root makes one) is written as it is, its mode
    untouched; a FIFO someone put at the name is refused (it would block), left as it was."""
    before = os.stat("/dev/null")
    assert dp("trace", "p add_word", "-o", "/dev/null", "--", wordcount, "a b").returncode == 0
    after = os.stat("/dev/null")
    assert (after.st_mode, after.st_uid) == (before.st_mode, before.st_uid)
    fifo = tmp_path / "out"
    os.mkfifo(fifo)
    one_error_line(dp("trace", "p add_word", "-o", str(fifo), "--", wordcount, "a"), "is not a regular file")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


def test_outputs_are_ours_alone_and_an_old_one_is_kept(wordcount: str, tmp_path: Path) -> None:
    """Files 0600 and trace directories 0700 whatever the umask (they hold what was fetched
    from the program); an earlier output is kept as NAME.old, never deleted; a directory that
    is not a trace is refused, left as it was."""
    old_umask = os.umask(0o022)
    try:
        events = tmp_path / "events.txt"
        for _ in range(2):
            assert dp("trace", "p add_word", "-o", str(events), "--", wordcount, "a").returncode == 0
        data = tmp_path / "t.data"
        for _ in range(3):
            assert dp("record", "-o", str(data), "--", wordcount, "a").returncode == 0
    finally:
        os.umask(old_umask)
    assert events.stat().st_mode & 0o777 == 0o600 and (tmp_path / "events.txt.old").stat().st_mode & 0o777 == 0o600
    assert data.stat().st_mode & 0o777 == 0o700 and (tmp_path / "t.data.old").is_dir()
    assert {p.stat().st_mode & 0o777 for p in data.iterdir()} == {0o600}
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    one_error_line(dp("record", "-o", str(mine), "--", wordcount, "a"), "is not a trace directory")
    assert os.listdir(mine) == ["notes.txt"]
    (tmp_path / "events.txt.old").unlink()
    (tmp_path / "events.txt.old").mkdir()  # where the earlier output would go: refused, both left
    r = dp("trace", "p add_word", "-o", str(events), "--", wordcount, "a")
    one_error_line(r, f"{events}.old is in the way (not a regular file): move it, or choose another name")
    assert events.is_file() and (tmp_path / "events.txt.old").is_dir()


@pytest.mark.parametrize("what", ["a file", "a directory", "no trace"])
def test_reading_what_is_not_a_trace(what: str, tmp_path: Path) -> None:
    path = tmp_path / "x"
    if what == "a file":
        path.write_text("hello\n")
    elif what == "a directory":
        path.mkdir()
    for command in (["replay"], ["report"], ["dump", "--chrome"], ["dump", "--flame"]):
        one_error_line(dp(*command, str(path)), str(path))


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: full after a few thousand events."""
    where = tmp_path / "small"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"a small tmpfs could not be mounted (root is needed): {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@pytest.mark.parametrize("command", ["trace", "record", "dump"])
def test_a_full_disk(command: str, full_disk: Path, trace_dir: str, tmp_path: Path) -> None:
    """Writing stops at the first failure and says so once; the program runs on to its end."""
    seed = tmp_path / "loop"
    subprocess.run(["gcc", "-O0", "-o", str(seed), "-x", "c", "-"], check=True, text=True, input=(
        "#include <stdio.h>\n#include <stdlib.h>\n__attribute__((noinline)) void f(int i) { (void)i; }\n"
        "int main(int c, char **v) { for (int i = 0; i < atoi(v[1]); i++) f(i); puts(\"done\"); return 0; }\n"
    ))  # fmt: skip
    args = {
        "trace": ["trace", "p f i=%di", "-o", str(full_disk / "events.txt"), "--", str(seed), "200000"],
        "record": ["record", "-o", str(full_disk / "t.data"), "--", str(seed), "200000"],
        "dump": ["dump", "--chrome", trace_dir, "-o", str(full_disk / "x.json")],
    }[command]
    if command == "dump":  # a trace whose dump is larger than the disk
        big = tmp_path / "big.data"
        assert dp("record", "-o", str(big), "--", str(seed), "20000").returncode == 0
        args[2] = str(big)
    r = dp(*args)
    one_error_line(r, "No space left on device")
    if command != "dump":
        assert r.stdout.splitlines()[-1] == "done"  # the program's own output, whole


@pytest.fixture
def zombie() -> Iterator[int]:
    """A process that has ended and that its parent (this test) has not reaped yet."""
    child = subprocess.Popen(["true"])
    try:
        while (Path(f"/proc/{child.pid}/stat").read_bytes().rsplit(b")", 1)[1].split() or [b""])[0] != b"Z":
            time.sleep(0.01)
        yield child.pid
    finally:
        child.wait()


def test_a_zombie_is_said_to_have_ended(zombie: int) -> None:
    for command in ("trace", "count", "record"):
        one_error_line(dp(*RUNNING[command], "-p", str(zombie)), f"pid {zombie} has ended (a zombie")


DEEP = "(" * 5000 + "%di > 0" + ")" * 5000
LONG = " or ".join(["%di == 1"] * 100)
VALUES = [  # each refused in one line, before the program is touched
    (["count", "-i", "nan", "p add_word"], "an interval is 0.01 to 86400 seconds, not 'nan'"),
    (["hist", "-i", "1e-9", "p add_word n=%si", "--value", "n"], "an interval is 0.01 to 86400 seconds, not '1e-9'"),
    (["latency", "-i", "inf", "add_word"], "an interval is 0.01 to 86400 seconds, not 'inf'"),
    (["record", "--threshold", "inf"], "a time is 0 or more, finite and under 2^63 ns, not 'inf'"),
    (["record", "--threshold", "1e400us"], "a time is 0 or more, finite and under 2^63 ns, not '1e400'"),
    (["count", "--filter", DEEP, "p add_word"], "FILTER_TOO_DEEP: parentheses nested deeper than 16 levels"),
    (["trace", "--filter", LONG, "p add_word"], "FILTER_TOO_LONG: more than 64 comparisons in one filter"),
    (["count", "--ring-size=-4K", "p add_word"], "'-4K' is not a size (bytes, or with K, M or G: 64M)"),
    (["record", "-T", "add_word@bogus"], "not a trigger: 'add_word@bogus' (FUNC@ACTIONS, the actions among"),
    (["record", "-T", "add_word"], "not a trigger: 'add_word' (FUNC@ACTIONS, e.g. parse@depth=2,trace_on)"),
    (["record", "-T", "add_word@depth=0"], "not a trigger: 'add_word@depth=0'"),
    (["record", "-D", "0"], "-D 0: a depth is 1 or more"),
    (["count", "-p", "1", "p add_word"], "give either -p PID or -- COMMAND, not both"),
    (["latency", "p add_word"], "give a function, not a probe spec: 'p add_word'"),
    (["count", "--by", "stack", "--max-frames", "128", "p add_word"], "'128' is not a number of frames (1 to 127)"),
    (["count", "--max-frames", "8", "p add_word"], "--max-frames is for --by stack"),
    (["count", "--top-stacks", "8", "p add_word"], "--top-stacks is for --by stack"),
    (
        ["stacks", "--folded", "--top-stacks", "8", "p add_word"],
        "--top-stacks is for stacks printed whole, not --folded",
    ),
    (["trace", "--max-frames", "8", "p add_word"], "--max-frames is for --stack"),
    (["stacks", "--value", "nope", "p add_word n=%si"], "VALUE_UNKNOWN: the value is not a fetch argument"),
]


@pytest.mark.parametrize(("args", "says"), VALUES, ids=lambda value: str(value)[:40])
def test_values_out_of_range(args: list[str], says: str, wordcount: str) -> None:
    r = dp(*args, "--", wordcount, "a")
    assert r.returncode in (1, 2) and "Traceback" not in r.stderr and says in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) <= 3 and not r.stdout  # (a spec's error shows it, and a caret)


LISTING = [  # `dynprobe list`: what it is asked, and the one line it says
    ([], "give a MODULE (a file, or a library: libc) or -p PID"),
    (["libc:malloc*", "free*"], "give MODULE:GLOB or MODULE GLOB, not both: 'libc:malloc*' 'free*'"),
    (["-p", "999999999"], "no process with pid 999999999"),
    (["-p", "{sleeper}", "{wordcount}:*"], "has not mapped {wordcount}"),
    (["/tmp"], "/tmp is a directory, not an ELF file"),
]


@pytest.mark.parametrize(("args", "says"), LISTING, ids=[" ".join(a) or "nothing" for a, _ in LISTING])
def test_list_refuses_in_one_line(args: list[str], says: str, wordcount: str) -> None:
    with subprocess.Popen(["sleep", "60"]) as sleeper:
        try:
            names = {"sleeper": str(sleeper.pid), "wordcount": os.path.realpath(wordcount)}
            one_error_line(dp("list", *(a.format(**names) for a in args)), says.format(**names))
        finally:
            sleeper.kill()
    r = dp("list", wordcount, "no_such_function_*")
    assert (
        r.returncode == 1 and r.stderr == "dynprobe: error: no function matches 'no_such_function_*'\n" and not r.stdout
    )


def test_no_command_prints_the_commands() -> None:
    r = dp()
    assert r.returncode == 2 and r.stdout.startswith("usage: dynprobe [-h] [--version] COMMAND ...")
    assert "record    trace every function's entry and exit" in r.stdout


def test_reading_a_trace_refuses_in_one_line(trace_dir: str) -> None:
    one_error_line(dp("graph", "-d", trace_dir, "no_such_function"), f"no call of no_such_function in {trace_dir}")
    one_error_line(dp("replay", trace_dir, "--", "ls"), "reading a trace runs no command")


def test_sigterm_while_probes_are_placed_detaches(spinner: str, tmp_path: Path) -> None:
    """SIGTERM during the set-up (libc's ~3,000 functions being patched) unwinds it as Ctrl-C
    does: every byte written is restored, the program runs on untraced, nothing is left."""
    target = subprocess.Popen([spinner, "1"], stdout=subprocess.PIPE, text=True)
    assert target.stdout is not None and target.stdout.readline() == "ready\n"
    out = tmp_path / "t.data"
    tracer = subprocess.Popen([*DYNPROBE, "record", "--lib", "libc", "-o", str(out), "-p", str(target.pid)],
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        while tracer_of(target.pid) != tracer.pid:  # attached: the set-up has begun
            assert tracer.poll() is None, tracer.communicate()
            time.sleep(0.001)
        tracer.send_signal(signal.SIGTERM)
        _, err = tracer.communicate(timeout=60)
        assert tracer.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
        assert "dynprobe: tracing" not in err  # (it came before the set-up was done)
        assert tracer_of(target.pid) == 0 and not out.exists()
        libc = next(line.split() for line in Path(f"/proc/{target.pid}/maps").read_text().splitlines()
                    if "r-xp" in line and "/libc.so" in line)  # fmt: skip
        start, end = (int(x, 16) for x in libc[0].split("-"))
        with open(f"/proc/{target.pid}/mem", "rb") as mem, open(libc[5], "rb") as file:
            mem.seek(start)
            file.seek(int(libc[2], 16))
            assert mem.read(end - start) == file.read(end - start)  # not an int3 nor a jump left
        target.send_signal(signal.SIGTERM)
        out_text, _ = target.communicate(timeout=30)
        assert target.returncode == 0 and "ticks=" in out_text
    finally:
        for p in (tracer, target):
            if p.poll() is None:
                p.kill()
                p.wait()


# dynprobe's CLI with SIGTERM sent to itself as each of its forks returns: while os.fork runs its
# at-fork callbacks (logging has one), where an exception its handler raises is printed and lost
SIGTERM_IN_FORK = (
    "import os, signal, sys;"
    "os.register_at_fork(after_in_parent=lambda: os.kill(os.getpid(), signal.SIGTERM));"
    "from dynprobe.cli.main import main; sys.exit(main())"
)


@pytest.mark.parametrize("how", ["attached", "started"])
def test_sigterm_as_a_fork_returns_is_not_lost(how: str, spinner: str, tmp_path: Path) -> None:
    """The forks are the guardian's (attached) and the command's (started): SIGTERM then ends
    the set-up as anywhere else, and nothing is left (the command is never run untraced)."""
    out = tmp_path / "t.data"
    started = tmp_path / "started"  # (a copy of its own, to find any process left running it)
    shutil.copy(spinner, started)
    target = subprocess.Popen([spinner, "1"], stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout is not None and target.stdout.readline() == "ready\n"
        which = ["-p", str(target.pid)] if how == "attached" else ["--", str(started), "1"]
        r = subprocess.run([sys.executable, "-c", SIGTERM_IN_FORK, "record", "--lib", "libc", "-o", str(out), *which],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 128 + signal.SIGTERM and not r.stderr and not r.stdout, r.stderr
        assert tracer_of(target.pid) == 0 and not out.exists()
        running = [p for p in Path("/proc").glob("[0-9]*/exe") if os.path.realpath(p) == str(started)]
        assert not running
    finally:
        target.kill()
        target.wait()


def test_an_output_is_named_in_messages_as_the_user_gave_it() -> None:
    from dynprobe.cli.common import output_name

    assert (output_name(None), output_name(None, sys.stdout)) == ("the standard error", "the standard output")
    assert (output_name("-"), output_name("out.txt")) == ("the standard output", "out.txt")
