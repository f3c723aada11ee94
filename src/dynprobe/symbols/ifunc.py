"""GNU indirect functions (STT_GNU_IFUNC): libc's memcpy, strlen, strcmp, memset and their kin.

Such a symbol's address is a resolver, which the loader runs once to pick an implementation for
the CPU (`__memmove_avx_unaligned_erms`, ...), and every call goes to that implementation. A probe
on the symbol's address would probe the resolver and count nothing (a classic trap of perf probe
and bpftrace); a newer symbol of the same name can even hide behind an old compatibility one
(memcpy@GLIBC_2.2.5). dynprobe probes what programs run: the implementation `dlsym` returns, on
this machine. In this process when it has the very file loaded (libc always is), else in a
throwaway Python that loads it (so the library's constructors never run here). The target is
assumed to pick as this machine's loader does (a GLIBC_TUNABLES that masks CPU features in the
target's environment would make it pick another).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import subprocess
import sys

from dynprobe.errors import SymbolError
from dynprobe.symbols.elf import ElfImage, Function

_DLSYM_SCRIPT = """
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
out = {}
for name in sys.argv[2:]:
    try:
        out[name] = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    except AttributeError:
        pass
base = next(int(line.split("-")[0], 16) for line in open("/proc/self/maps")
            if line.rstrip().endswith(" " + sys.argv[1]) and line.split()[2] == "00000000")
print(json.dumps({"base": base, "addresses": out}))
"""


def implementations(image: ElfImage, names: list[str]) -> dict[str, Function]:
    """The implementation each IFUNC of `names` (symbols of `image`) resolves to, as a
    Function named after the IFUNC; names that cannot be resolved are left out."""
    wanted = tuple(sorted(n for n in set(names) if n in image.ifuncs))
    if not wanted:
        return {}
    found = _resolved(image.path, wanted)
    out = {}
    for name, vaddr in found.items():
        vaddr += image.first_page
        func = image.function_at(vaddr)
        if func is not None and func.addr == vaddr and image.is_executable(vaddr):
            out[name] = Function(name, vaddr, func.size)
    return out


def callable_functions(image: ElfImage) -> list[Function]:
    """The functions programs call by name: symbols with a size, where an indirect function's
    name means its implementation (not its resolver, nor an old compatibility function of the
    same name, memcpy@GLIBC_2.2.5), and names that implementation alone."""
    resolved = implementations(image, list(image.ifuncs))
    taken = {f.addr for f in resolved.values()}  # (named by a debug file too: __strlen_avx2)
    plain = [f for f in image.functions if f.size and f.name not in image.ifuncs and f.addr not in taken]
    return sorted([*plain, *resolved.values()], key=lambda f: f.addr)


def implementation(image: ElfImage, name: str) -> Function:
    """`implementations` for one name; SymbolError if it cannot be resolved."""
    func = implementations(image, [name]).get(name)
    if func is None:
        raise SymbolError(
            f"{name!r} in {image.path} is an indirect function (its implementation is chosen at load time) "
            "and dynprobe could not tell which one runs here: probe the implementation by name or PATH:0xOFFSET"
        )
    return func


@functools.cache
def _resolved(path: str, names: tuple[str, ...]) -> dict[str, int]:
    """name -> the implementation's offset from the file's first page, as `dlsym` resolves it."""
    mine = _loaded_here(path)
    if mine is not None:
        base, handle = mine
        out = {}
        for name in names:
            try:
                addr = ctypes.cast(getattr(handle, name), ctypes.c_void_p).value
            except AttributeError:
                continue
            if addr is not None:
                out[name] = addr - base
        return out
    try:
        done = subprocess.run(
            [sys.executable, "-c", _DLSYM_SCRIPT, path, *names], capture_output=True, text=True, timeout=30
        )
        reply = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}
    return {name: int(addr) - int(reply["base"]) for name, addr in reply["addresses"].items() if addr}


def _loaded_here(path: str) -> tuple[int, ctypes.CDLL] | None:
    """(where it starts, a handle) if this process has the file `path` mapped: then dlsym costs
    nothing and loads nothing."""
    try:
        key = os.stat(path)
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[2] == "00000000" and fields[5].startswith("/"):
                    try:
                        other = os.stat(fields[5].rstrip("\n"))
                    except OSError:
                        continue
                    if (other.st_dev, other.st_ino) == (key.st_dev, key.st_ino):
                        handle = ctypes.CDLL(fields[5].rstrip("\n"), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
                        return int(fields[0].split("-")[0], 16), handle
    except OSError:
        return None
    return None
