"""Probe locations: 'SYMBOL[+OFF]', 'PATH:SYMBOL[+OFF]', 'PATH:0xOFF' -> a file and a file offset.

A location names a place in a file, as uprobe_events does, so it stays valid wherever the file is
mapped, in every process that maps it, and again after exec or dlopen.
"""

from __future__ import annotations

import difflib
import fnmatch
import os
from collections.abc import Callable

from dynprobe.errors import SymbolError
from dynprobe.frozen import frozen
from dynprobe.spec.model import split_location
from dynprobe.symbols import files
from dynprobe.symbols.demangle import names_of
from dynprobe.symbols.elf import ElfImage, Function, load_elf
from dynprobe.symbols.ifunc import LoadedIn, callable_functions, implementation
from dynprobe.symbols.loader import ld_cache
from dynprobe.symbols.maps import Mapping, file_key, load_bias


@frozen
class Location:
    """A probe's place: the file, the instruction's offset and address, and its function."""

    path: str  # real path of the ELF file
    offset: int  # file offset of the probed instruction
    vaddr: int  # its link-time virtual address
    function: Function | None  # the function containing it
    label: str  # how to print it: 'main', 'main+0x4', '0x1139'

    @property
    def basename(self) -> str:
        return os.path.basename(self.path)


def find_file(
    name: str, maps: list[Mapping] | None = None, libraries: Callable[[], dict[str, str]] | None = None
) -> str:
    """A path for `name`: an existing file, else a library mapped in the target ('libc' matches
    libc.so.6), else one of `libraries()` (those the target's loader will map: loader.py), else
    one the dynamic linker's cache knows. SymbolError if none."""
    if os.path.exists(name):
        return files.real_path(name)
    if "/" not in name:
        candidates = [name, f"{name}.so", f"lib{name}.so"]

        def matches(base: str) -> bool:
            return any(base == c or base.startswith(c + ".") for c in candidates)

        for m in maps or []:
            if m.path.startswith("/") and matches(os.path.basename(m.path)):
                return files.real_path(m.path)
        for known in (libraries() if libraries else {}, ld_cache()):
            for so, path in known.items():
                if matches(so):
                    return files.real_path(path)
        raise SymbolError(
            f"no such file: {name} (no library of that name is mapped in the process, needed by the program or in "
            "the loader's cache: give its path)"
        )
    raise SymbolError(f"no such file: {name}")


def parse_symbol_offset(text: str) -> tuple[str, int]:
    """'main+0x10' -> ('main', 16); 'main' -> ('main', 0)."""
    if "+" in text:
        sym, _, off = text.rpartition("+")
        try:
            return sym, int(off, 0)
        except ValueError as exc:
            raise SymbolError(f"bad offset {off!r} in {text!r}") from exc
    return text, 0


def unversioned(image: ElfImage, symbol: str) -> str:
    """A name as `nm -D` prints it -> the name dynprobe knows it by: the default version is the
    plain name (`exp@@GLIBC_2.29`, and `exp@GLIBC_2.29` if that is the default: `exp`), an
    older one keeps its version (`exp@GLIBC_2.2.5`)."""
    name, sep, version = symbol.partition("@")
    if not sep:
        return symbol
    default = image.default_versions.get(name)
    if version.removeprefix("@") == default:
        return name
    if version.startswith("@"):
        have = f"its default version is {name}@@{default}" if default else f"{name} has no versioned symbol"
        raise SymbolError(f"no function {_shown(symbol)} in {image.path}: {have}")
    return symbol


Memory = Callable[[int], int | None]  # 8 bytes of a process's memory (None: not readable)


def _shown(symbol: str, most: int = 100) -> str:
    """A name as an error quotes it: a long one cut (a spec file of one 2 MB word was quoted whole)."""
    return repr(symbol) if len(symbol) <= most else f"{symbol[:most]!r}... ({len(symbol):,} characters)"


def loaded_in(image: ElfImage, maps: list[Mapping] | None, memory: Memory | None) -> LoadedIn | None:
    """Where a process (its `maps` and `memory`) has `image` mapped, for resolving its indirect
    functions from what its loader did (symbols/ifunc.py); None if it has not."""
    if maps is None or memory is None:
        return None
    bias = load_bias(maps, file_key(image.path), image.path, image.first_page)
    if bias is None:
        return None

    def references(name: str) -> list[int]:
        out = []
        for m in maps:
            if m.offset or not m.path.startswith("/") or files.real_path(m.path) == image.path:
                continue
            try:
                other = load_elf(m.path)
            except SymbolError:
                continue
            out += [m.start - other.first_page + slot for slot in other.symbol_slots.get(name, ())]
        return out

    return LoadedIn(bias, memory, references)


def resolve_symbol(image: ElfImage, symbol: str, offset: int, loaded: LoadedIn | None = None) -> Location:
    symbol = unversioned(image, symbol)
    # A name the file itself gives one function (libc's malloc): that one, whatever static
    # functions its debug file names alike (which takes a while to read).
    own = image.own_function(symbol)
    if own is not None:
        return _location(image, own, symbol, offset)
    # An indirect function (libc's memcpy, strlen): what runs is the implementation it resolves
    # to, not the resolver at its address (nor an old compatibility symbol of the same name).
    found = [implementation(image, symbol, loaded)] if symbol in image.ifuncs else image.functions_named(symbol)
    if not found:
        close = difflib.get_close_matches(symbol, [*image.by_name, *image.ifuncs], n=3, cutoff=0.8)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise SymbolError(f"no function {_shown(symbol)} in {image.path}{hint}")
    same = image.shared_names.get(symbol, [])
    if same:  # static functions of one name in different source files
        offsets = ", ".join(f"{image.path}:{image.vaddr_to_offset(a) or a:#x}" for a in same[:4])
        raise SymbolError(f"{symbol!r} names {len(same)} functions in {image.path} (static functions of different "
                          f"files): give one by its offset: {offsets}{', ...' if len(same) > 4 else ''}")  # fmt: skip
    if len(found) > 1:
        names = ", ".join(f.name for f in found[:4]) + (", ..." if len(found) > 4 else "")
        raise SymbolError(f"{symbol!r} names {len(found)} functions in {image.path} (overloads): "
                          f"give one's symbol: {names}")  # fmt: skip
    return _location(image, found[0], symbol, offset)


def _location(image: ElfImage, func: Function, symbol: str, offset: int) -> Location:
    vaddr = func.addr + offset
    if func.size and offset >= func.size:
        raise SymbolError(f"{symbol}+{offset:#x} is past the end of {symbol} ({func.size} bytes)")
    file_off = image.vaddr_to_offset(vaddr)
    if file_off is None or not image.is_executable(vaddr):
        raise SymbolError(f"{symbol}+{offset:#x} is not in executable code of {image.path}")
    label = f"{symbol}+{offset:#x}" if offset else symbol
    return Location(image.path, file_off, vaddr, func, label)


def resolve_file_offset(image: ElfImage, file_off: int) -> Location:
    vaddr = image.offset_to_vaddr(file_off)
    if vaddr is None or not image.is_executable(vaddr):
        raise SymbolError(f"offset {file_off:#x} is not in executable code of {image.path}")
    return Location(image.path, file_off, vaddr, image.function_at(vaddr), f"{file_off:#x}")


def resolve(
    text: str,
    main_exe: str,
    maps: list[Mapping] | None = None,
    libraries: Callable[[], dict[str, str]] | None = None,
    memory: Memory | None = None,
) -> Location:
    """Resolve a location string. Bare symbols refer to `main_exe`; a file is found as
    `find_file` finds it; `memory` (the process of `maps`) resolves indirect functions."""
    path_part, sep, what = split_location(text)
    path = find_file(path_part, maps, libraries) if sep else main_exe
    image = load_elf(path)
    if what.lower().startswith("0x") or what.isdigit():
        try:
            return resolve_file_offset(image, int(what, 0))
        except ValueError as exc:
            raise SymbolError(f"bad offset {what!r}") from exc
    symbol, offset = parse_symbol_offset(what)
    if not symbol:
        raise SymbolError(f"no symbol in {text!r}")
    try:
        return resolve_symbol(image, symbol, offset, loaded_in(image, maps, memory))
    except SymbolError as exc:
        if sep or "::" in symbol or not str(exc).startswith("no function"):
            raise
        library = _library_with(symbol, maps, libraries)
        if library is None:
            raise
        short = os.path.basename(library).split(".so", 1)[0]
        raise SymbolError(f"{exc}; {os.path.basename(library)} has it: {short}:{symbol}") from exc


def _library_with(
    symbol: str, maps: list[Mapping] | None, libraries: Callable[[], dict[str, str]] | None
) -> str | None:
    """A library the target maps, or will, with a function named `symbol` (for the hint of a
    symbol the program itself lacks)."""
    paths = {m.path for m in maps or [] if m.path.startswith("/") and ".so" in os.path.basename(m.path)}
    paths.update((libraries() if libraries else {}).values())
    for path in sorted(paths):
        try:
            image = load_elf(path)
        except SymbolError:
            continue
        if image.functions_named(symbol) or symbol in image.ifuncs:
            return path
    return None


MAX_MATCHES = 10_000  # functions one pattern may name


def is_pattern(symbol: str) -> bool:
    """A shell-style pattern ('str*', 'parse_?', 'mem[cs]*'), as perf probe and funccount take."""
    return any(c in symbol for c in "*?[")


def functions_matching(image: ElfImage, pattern: str, loaded: LoadedIn | None = None) -> list[Function]:
    """The functions of `image` whose name (or demangled name) matches the shell-style
    `pattern`, one per address (of aliases, the name shown: malloc, not __libc_malloc), in
    address order; old versions of a name (exp@GLIBC_2.2.5) only when the pattern has an '@'."""
    found: dict[int, Function] = {}
    versions = "@" in pattern
    for func in callable_functions(image, loaded):
        if func.addr in found or ("@" in func.name and not versions):
            continue
        if any(fnmatch.fnmatchcase(n, pattern) for n in names_of(func.name)):
            found[func.addr] = func
    return list(found.values())


def expand_pattern(
    text: str,
    main_exe: str,
    maps: list[Mapping] | None = None,
    libraries: Callable[[], dict[str, str]] | None = None,
    memory: Memory | None = None,
) -> list[tuple[str, str]]:
    """The locations a location with a pattern ('libc:str*', 'parse_*+4') names, with the name
    of each function: 'PATH:NAME[+OFF]' for each of its `functions_matching`, or
    'PATH:0xFILEOFFSET' for a name several functions have (static functions of different
    files). SymbolError if none does, or more than MAX_MATCHES."""
    path_part, sep, what = split_location(text)
    path = find_file(path_part, maps, libraries) if sep else main_exe
    image = load_elf(path)
    pattern, offset = parse_symbol_offset(what)
    found = functions_matching(image, pattern, loaded_in(image, maps, memory))
    if not found:
        raise SymbolError(f"no function of {image.path} matches {pattern!r}")
    if len(found) > MAX_MATCHES:
        raise SymbolError(
            f"{len(found):,} functions of {image.path} match {pattern!r}, more than {MAX_MATCHES:,} probes "
            "from one pattern: narrow it"
        )
    suffix = f"+{offset:#x}" if offset else ""
    located = []
    for func in found:
        file_offset = image.vaddr_to_offset(func.addr + offset)
        if func.name in image.shared_names and file_offset is not None:
            located.append((f"{image.path}:{file_offset:#x}", func.name))
        else:
            located.append((f"{image.path}:{func.name}{suffix}", func.name))
    return located


def resolve_address(addr: int, maps: list[Mapping]) -> Location:
    """An absolute address in the target -> the file location it maps."""
    for m in maps:
        if m.start <= addr < m.end:
            if not m.path.startswith("/") or not m.executable:
                raise SymbolError(f"{addr:#x} is not in executable code mapped from a file")
            image = load_elf(m.path)
            return resolve_file_offset(image, addr - m.start + m.offset)
    raise SymbolError(f"{addr:#x} is not mapped in the target")
