"""The readers of files dynprobe is handed, fuzzed (tests/fuzz.py): thousands of malformed ELF
files and trace directories, a fixed seed, each read the way the commands read it, in a process
with bounded memory. Every case is read or refused with a DynprobeError (one line in the CLI):
never another exception, a hang, or memory taken for what a file only claims to hold."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize(
    ("program", "cases"),
    [
        (["-N", "add", "-D", "3", "-T", "worker@depth=2,trace_on", "--", "threads", "3", "2"], 3000),
        (["-F", "main", "--", "fork"], 1000),
    ],
    ids=["threads-filtered", "forked-child"],
)
def test_malformed_trace_directories(ret: str, tmp_path: Path, program: list[str], cases: int) -> None:
    """Traces with what record writes of filters (-F, -N, -D) and of the calls a forked child
    began inside, damaged at random."""
    trace = tmp_path / "trace"
    options, argv = program[: program.index("--")], program[program.index("--") + 1 :]
    r = subprocess.run([sys.executable, "-m", "dynprobe.cli.main", "record", "-o", str(trace), *options, "--", ret,
                        *argv], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    info = json.loads((trace / "info.json").read_text())
    assert info["filters"] and (argv[0] != "fork" or info["inherited"])
    fuzz("trace", str(trace), "--cases", str(cases))


def test_malformed_traces_of_recorded_values(tmp_path: Path) -> None:
    """Traces whose calls recorded arguments and return values (strings too) in data records,
    damaged at random: the values' specs in info.json, the data records' numbers, sizes and
    flags are the program's or the file's to forge."""
    binary = build_target("args", "args.c", flags=("-O1",))
    trace = tmp_path / "trace"
    values = ["-A", "echo@arg1/s", "-R", "echo@retval/s", "-A", "eight@arg1,arg2/x,arg7,fparg1", "-R", "fact@retval",
              "-A", "add@arg1/i32,arg2/u16", "-R", "next_letter@retval/c"]  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "dynprobe.cli.main", "record", "-o", str(trace), *values, "--", binary,
                        "3"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert len(json.loads((trace / "info.json").read_text())["captures"]) == 5
    fuzz("trace", str(trace), "--cases", "1500")
