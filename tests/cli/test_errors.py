"""Bad paths, files that cannot be written and a full disk, at every subcommand: one line on
stderr saying what was wrong, a non-zero exit, no traceback, nothing written where it should not
be, and the program unharmed (it runs to its end, with its own output)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

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
    (["--", "/dev/zero"], "/dev/zero is not a regular file, nor an ELF file"),
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
