"""Shared fixtures: C/asm targets compiled at test time into tests/.build (cached by content)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

DYNPROBE = [sys.executable, "-m", "dynprobe.cli.main"]  # the command, as this Python runs it


TARGETS = Path(__file__).parent / "targets"
BUILD = Path(__file__).parent / ".build"


_BUILT: dict[str, str] = {}  # a target's name -> what it was built from (see build_target)


def build_target(name: str, *sources: str, flags: tuple[str, ...] = (), output: str | None = None) -> str:
    """Compile tests/targets/<sources> into tests/.build/<output or name>; rebuilt when anything changes."""
    BUILD.mkdir(exist_ok=True)
    srcs = [TARGETS / s for s in (sources or (f"{name}.c",))]
    digest = hashlib.sha256()
    for src in srcs:
        digest.update(src.read_bytes())
    digest.update(" ".join(flags).encode())
    out = BUILD / (output or name)
    stamp = BUILD / f".{output or name}.sha"
    # One name, one build: another test process (pytest -n) may be running the binary a name
    # gives, and a rebuild with other flags would change it under that test's feet.
    assert _BUILT.setdefault(out.name, digest.hexdigest()) == digest.hexdigest(), f"{out.name} built two ways"
    if out.exists() and stamp.exists() and stamp.read_text() == digest.hexdigest():
        return str(out)
    # Built under a name of this process's, then renamed into place: two test processes
    # (pytest -n) building the same target never run or overwrite a half-written one.
    partial = out.with_name(f".{out.name}.{os.getpid()}")
    cmd = ["gcc", "-g", "-o", str(partial), *map(str, srcs), *flags]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    os.replace(partial, out)
    partial_stamp = stamp.with_name(f"{stamp.name}.{os.getpid()}")
    partial_stamp.write_text(digest.hexdigest())
    os.replace(partial_stamp, stamp)
    return str(out)


@pytest.fixture(scope="session")
def build() -> object:
    return build_target


@pytest.fixture(scope="session")
def wordcount() -> str:
    """The bundled example, optimized (short -O2 code: many instruction kinds per function)."""
    return build_target("wordcount", "../../examples/wordcount.c", flags=("-O2",))


@pytest.fixture(scope="session")
def spinner() -> str:
    """A long-running, multi-threaded target for attach, detach and kill tests."""
    return build_target("spinner", flags=("-O1", "-pthread"))


@pytest.fixture(scope="session")
def ret() -> str:
    """Return-probe and function-tracer scenarios (tests/targets/ret.c), one per mode."""
    return build_target("ret", "ret.c", flags=("-O1", "-fno-omit-frame-pointer", "-rdynamic", "-pthread"))


@pytest.fixture(scope="session")
def ret_cxx() -> str:
    """C++ exceptions through probed frames, one of them in a shared library."""
    build_target("libret_lib.so", "ret_lib.cpp", flags=("-O1", "-fPIC", "-shared", "-lstdc++"))
    return build_target(
        "ret_cxx", "ret_cxx.cpp", flags=("-O1", "-lstdc++", f"-L{BUILD}", "-lret_lib", f"-Wl,-rpath,{BUILD}")
    )


@pytest.fixture(autouse=True)
def _no_leaked_children() -> object:
    """Every test must leave no traced or stopped process behind."""
    yield
    leftovers = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                status = f.read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("PPid", "0").strip()) == os.getpid() and "zombie" not in fields.get("State", ""):
            leftovers.append(pid)
    for pid in leftovers:
        try:
            os.kill(int(pid), 9)
            os.waitpid(int(pid), 0)
        except OSError:
            pass
    assert not leftovers, f"test left processes running: {leftovers}"


@pytest.fixture(scope="session", autouse=True)
def unwind_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What dynprobe keeps on disk (symbols/diskcache.py: unwind tables, ELF analyses) of this
    run alone, for every process it starts: worked out by the code under test, never what an
    earlier build left (in pytest's own temporary directory: it keeps the last few runs')."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    yield


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An XDG cache directory of this test's (0700), with the cache on: dynprobe's is under it,
    in dynprobe/KIND."""
    home = tmp_path / "cache"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    monkeypatch.delenv("DYNPROBE_CACHE", raising=False)
    return home / "dynprobe"
