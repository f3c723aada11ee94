"""GNU indirect functions (STT_GNU_IFUNC): libc's memcpy, strlen, strcmp, memset and their kin.

Such a symbol's address is a resolver, which the loader runs once to pick an implementation for
the CPU (`__memmove_avx_unaligned_erms`, ...), and every call goes to that implementation. A probe
on the symbol's address would probe the resolver and count nothing (a classic trap of perf probe
and bpftrace); a newer symbol of the same name can even hide behind an old compatibility one
(memcpy@GLIBC_2.2.5). dynprobe probes what programs run: the implementation the loader picked.

It never runs the library's code itself (the target's library, run in dynprobe's process, would
run its constructors with dynprobe's rights: as root, a way to root for the library's owner). It
learns the implementation:

- from its own process, when it has the very file mapped (libc always is): dlsym, on code it
  runs anyway;
- else from the target's memory, where the loader has relocated the file: the library's own
  calls of the function go through a GOT slot relocated by R_X86_64_IRELATIVE, whose addend is
  the resolver, and which holds the implementation the resolver returned.

Otherwise (a file no process has relocated yet) the name cannot be resolved: SymbolError says
so, and what to do.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

from dynprobe.errors import SymbolError
from dynprobe.frozen import frozen
from dynprobe.symbols.elf import ElfImage, Function


@frozen
class LoadedIn:
    """A process that has the file mapped: what to add to its link-time addresses, a read of 8
    bytes of its memory (None where it cannot be read), and where its other modules keep the
    address of a symbol of the file (GOT slots: Elf.symbol_slots, where they are)."""

    bias: int
    read_u64: Callable[[int], int | None]
    references: Callable[[str], list[int]] = lambda name: []


def implementations(image: ElfImage, names: list[str], loaded: LoadedIn | None = None) -> dict[str, Function]:
    """The implementation each IFUNC of `names` (symbols of `image`) resolves to, as a
    Function named after the IFUNC; names that cannot be resolved are left out. `loaded`: a
    process that has the file mapped (see the module's docstring)."""
    wanted = tuple(sorted(n for n in set(names) if n in image.ifuncs))
    if not wanted:
        return {}
    found = _resolved_here(image.path, wanted)
    if loaded is not None:
        for name in wanted:
            if name not in found:
                vaddr = _relocated(image, name, loaded)
                if vaddr is not None:
                    found[name] = vaddr - image.first_page
    out = {}
    for name, offset in found.items():
        vaddr = offset + image.first_page
        func = image.function_at(vaddr)
        if func is not None and func.addr == vaddr and image.is_executable(vaddr):
            out[name] = Function(name, vaddr, func.size)
    return out


def _relocated(image: ElfImage, name: str, loaded: LoadedIn) -> int | None:
    """The link-time address of the implementation the loader put where the process keeps the
    address of indirect function `name`: a GOT slot of `image` relocated by R_X86_64_IRELATIVE
    with its resolver as the addend (the library's own calls), else a slot of another module
    naming it (a program's calls, once bound). None: no such slot holds an address in the
    file's code yet."""
    resolver = image.ifuncs[name]
    slots = [slot + loaded.bias for slot in image.irelative.get(resolver, ())] + loaded.references(name)
    for slot in slots:
        value = loaded.read_u64(slot)
        if value is None or value == resolver + loaded.bias:
            continue
        vaddr = value - loaded.bias
        func = image.function_at(vaddr)
        if func is not None and func.addr == vaddr and image.is_executable(vaddr):
            return vaddr
    return None


def callable_functions(image: ElfImage, loaded: LoadedIn | None = None) -> list[Function]:
    """The functions programs call by name: symbols with a size, where an indirect function's
    name means its implementation (not its resolver, nor an old compatibility function of the
    same name, memcpy@GLIBC_2.2.5), and names that implementation alone. An indirect function
    that cannot be resolved (`implementations`) is left out."""
    resolved = implementations(image, list(image.ifuncs), loaded)
    taken = {f.addr for f in resolved.values()}  # (named by a debug file too: __strlen_avx2)
    resolvers = set(image.ifuncs.values())  # (a resolver's own local name: memchr_ifunc)
    plain = [
        f for f in image.functions
        if f.size and f.name not in image.ifuncs and f.addr not in taken | resolvers and not is_fragment(f.name)
    ]  # fmt: skip
    return sorted([*plain, *resolved.values()], key=lambda f: f.addr)


def is_fragment(name: str) -> bool:
    """A piece of another function the compiler moved away ('strfromd.cold', 'f.cold.3'):
    entered by a jump, never called, it is no function to probe or trace."""
    return "cold" in name.split(".")[1:]


def implementation(image: ElfImage, name: str, loaded: LoadedIn | None = None) -> Function:
    """`implementations` for one name; SymbolError if it cannot be resolved."""
    func = implementations(image, [name], loaded).get(name)
    if func is None:
        raise SymbolError(
            f"{name!r} in {image.path} is an indirect function: its implementation is chosen when a program "
            "loads the library, and no traced process has it loaded yet (dynprobe never runs the library's "
            "code itself): probe a process that has loaded it (-p PID), or its implementation by name or "
            "PATH:0xOFFSET"
        )
    return func


@functools.cache
def _resolved_here(path: str, names: tuple[str, ...]) -> dict[str, int]:
    """name -> the implementation's offset from the file's first page, as `dlsym` resolves it in
    this process, if it has the file `path` mapped (it runs that code anyway); else nothing."""
    mine = _loaded_here(path)
    if mine is None:
        return {}
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


def _loaded_here(path: str) -> tuple[int, ctypes.CDLL] | None:
    """(where it starts, a handle) if this process has the file `path` mapped: dlsym then costs
    nothing and loads nothing (RTLD_NOLOAD)."""
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
