"""The readers of files dynprobe is handed, fuzzed (tests/fuzz.py): thousands of malformed ELF
files and trace directories, a fixed seed, each read the way the commands read it, in a process
with bounded memory. Every case is read or refused with a DynprobeError (one line in the CLI):
never another exception, a hang, or memory taken for what a file only claims to hold."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

from tests.conftest import build_target

MEMORY = 1 << 30  # address space of the fuzzing process: a few times what it needs


def fuzz(*args: str) -> None:
    def bounded() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))

    r = subprocess.run([sys.executable, "-m", "tests.fuzz", *args, "--seed", "23"],
                       capture_output=True, text=True, timeout=900, preexec_fn=bounded)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert "none broke the reader" in r.stdout


def test_malformed_elf_files(wordcount: str) -> None:
    """A C program, a C++ one (long mangled names, exception tables), a shared library."""
    names = build_target("names", "names.cpp", flags=("-O0", "-lstdc++"))
    library = build_target("libret_lib.so", "ret_lib.cpp", flags=("-O1", "-fPIC", "-shared", "-lstdc++"))
    fuzz("elf", wordcount, names, library, "--cases", "1500")


def test_malformed_trace_directories(ret: str, tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    r = subprocess.run([sys.executable, "-m", "dynprobe.cli.main", "record", "-o", str(trace), "--", ret,
                        "threads", "3", "2"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    fuzz("trace", str(trace), "--cases", "3000")
