"""Helpers for integration tests: symbol addresses of test targets, running them plainly."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

if TYPE_CHECKING:
    import dynprobe


def symbols(path: str) -> dict[str, int]:
    """Every named symbol of an ELF file -> its value (link-time address)."""
    with open(path, "rb") as f:
        elf = ELFFile(f)
        table = elf.get_section_by_name(".symtab")
        assert isinstance(table, SymbolTableSection)
        return {s.name: s["st_value"] for s in table.iter_symbols() if s.name}


def run_plain(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def traced(
    argv: list[str], setup: object, follow_fork: bool = False, timeout: float = 60, optimize: bool = False
) -> tuple[int | None, str, list[object]]:
    """Spawn `argv` under dynprobe, call `setup(session)` (returns probes), run to the end.
    Returns (exit status, the command's stdout, what setup returned). Trap mode unless `optimize`."""
    import tempfile

    import dynprobe

    with tempfile.TemporaryFile("w+") as out:
        with dynprobe.spawn(argv, follow_fork=follow_fork, stdout=out.fileno()) as session:
            session.optimize = optimize
            made = setup(session)  # type: ignore[operator]
            status = session.run(timeout=timeout)
            assert status is not None, "the target did not finish in time"
        out.seek(0)
        return status, out.read(), made


def at(path: str, vaddr: int) -> str:
    """A 'PATH:0xFILEOFFSET' spec for a link-time address of `path` (works for PIE and non-PIE)."""
    from dynprobe.symbols.elf import load_elf

    offset = load_elf(path).vaddr_to_offset(vaddr)
    assert offset is not None
    return f"{path}:{offset:#x}"


@contextlib.contextmanager
def started(argv: list[str], says: str, stdin: int | None = None) -> Iterator[subprocess.Popen[str]]:
    """`argv` running once it has printed the line `says` (its stdout a pipe, `stdin` a pipe
    with subprocess.PIPE); killed after the block."""
    process = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline() == says + "\n"
        yield process
    finally:
        process.kill()
        process.wait()


@contextlib.contextmanager
def held_by_other_tracer(pid: int) -> Iterator[subprocess.Popen[str]]:
    """Another process (a second dynprobe) traces `pid` for the duration of the block."""
    code = f"import dynprobe, time; s = dynprobe.attach({pid}); print('in', flush=True); time.sleep(60)"
    with started([sys.executable, "-c", code], "in") as holder:
        yield holder


def run_until(session: dynprobe.Session, done: Callable[[], bool], what: str) -> None:
    """Let the target run until `done()` holds: a machine under load may not run it for a while
    (a fixed run of 50 ms once saw no call at all). Fails, saying `what`, after a minute."""
    deadline = time.monotonic() + 60
    while not done():
        assert time.monotonic() < deadline, f"after a minute, still not: {what}"
        assert session.run(timeout=0.01) is None, "the target ended"
