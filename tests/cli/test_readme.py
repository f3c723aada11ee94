"""Every code block of README.md runs as written, so the docs cannot drift from the tool: shell
lines from a directory that stands for the repository's root (links to examples/, README.md and
.venv: what the lines write stays out of the tree), Python blocks in a fresh interpreter, and
console transcripts (`$ command` then its output) compared with what the command prints. `1234`
stands for a running program's pid, as the README says: `examples/bin/app --serve`. The lines
that set up (`make demo`, `make test`: this suite is one of them) are the only ones not run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
PID_PLACEHOLDER = "1234"
# What a command attached with -p says once it is set up, before it waits for Ctrl-C.
READY = re.compile(r"placed in pid|^dynprobe: tracing ", re.M)
TIMEOUT = 300  # seconds: a guard against a hang, far above any block's run


def readme_blocks() -> list[tuple[str, int, str]]:
    """(language, line number, text) of each fenced block that runs, in README order."""
    text = README.read_text()
    found = []
    for m in BLOCK.finditer(text):
        language, body = m.group(1), m.group(2)
        if language in ("sh", "python", "console"):
            found.append((language, text.count("\n", 0, m.start()) + 1, body))
    return found


BLOCKS = readme_blocks()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    subprocess.run(["make", "-s", "-C", str(ROOT), "examples/bin/app", "examples/bin/wordcount"], check=True)
    where = tmp_path_factory.mktemp("readme")
    for name in ("examples", "README.md"):
        (where / name).symlink_to(ROOT / name)
    (where / ".venv").symlink_to(Path(sys.executable).parent.parent)
    # What the README's first commands leave, for a block that reads it to run on any worker
    subprocess.run([sys.executable, "-m", "dynprobe", "record", "--", "examples/bin/app", "README.md"], cwd=where,
                   env=environment(), capture_output=True, check=True, timeout=TIMEOUT)  # fmt: skip
    return where


@pytest.fixture
def server(root: Path) -> Iterator[int]:
    with subprocess.Popen([str(root / "examples/bin/app"), "--serve"]) as proc:
        yield proc.pid
        proc.kill()


def environment() -> dict[str, str]:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    if "PYTHONPATH" in env:  # (a run from another checkout's sources: absolute, for our cwd)
        env["PYTHONPATH"] = ":".join(str(Path(p).resolve()) for p in env["PYTHONPATH"].split(":"))
    return env


def run_attached(line: str, root: Path) -> tuple[int, str]:
    """A line that attaches to a running program: Ctrl-C once it says it is set up."""
    with subprocess.Popen(["bash", "-c", line], cwd=root, env=environment(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        err: list[str] = []
        out: list[str] = []
        readers = [
            threading.Thread(target=lambda: err.extend(iter(proc.stderr.readline, ""))),  # type: ignore[union-attr]
            threading.Thread(target=lambda: out.append(proc.stdout.read())),  # type: ignore[union-attr]
        ]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + TIMEOUT
        while not READY.search("".join(err)) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # (bash -c execs a lone command: this is dynprobe)
        try:
            proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"{line!r} ran on {TIMEOUT} s after its Ctrl-C: {''.join(err)}") from None
        finally:
            for reader in readers:
                reader.join()
    return proc.returncode, "".join(out) + "".join(err)


def run_line(line: str, root: Path) -> tuple[int, str]:
    r = subprocess.run(["bash", "-c", line], cwd=root, env=environment(), text=True, timeout=TIMEOUT,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    return r.returncode, r.stdout


def commands(body: str) -> list[str]:
    lines = [line.strip() for line in body.splitlines()]
    return [line for line in lines if line and not line.startswith(("#", "make "))]


@pytest.mark.parametrize(("language", "line", "body"), BLOCKS, ids=[f"{b[0]}-line{b[1]}" for b in BLOCKS])
def test_readme_block_runs(language: str, line: int, body: str, root: Path, server: int) -> None:
    body = body.replace(PID_PLACEHOLDER, str(server))
    if language == "python":
        r = subprocess.run([sys.executable, "-c", "import dynprobe\n" + body], cwd=root, env=environment(),
                           capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip
        assert r.returncode == 0 and "Traceback" not in r.stderr, f"README.md:{line}\n{r.stdout}\n{r.stderr}"
        return
    if language == "console":
        command, *expected = body.splitlines()
        status, output = run_line(command.removeprefix("$ "), root)
        assert output.splitlines() == expected, f"README.md:{line}: {command}"
        return
    for command in commands(body):
        attached = f"-p {server}" in command
        status, output = run_attached(command, root) if attached else run_line(command, root)
        assert status == 0, f"README.md:{line}: {command}\n{output}"
        assert "Traceback" not in output and "error:" not in output, f"README.md:{line}: {command}\n{output}"
