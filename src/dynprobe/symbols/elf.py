"""An ELF file as dynprobe needs it: functions with sizes, load segments, build-id, code bytes.

Function ranges come from .symtab and .dynsym (FUNC symbols with a size); for addresses no symbol
covers (stripped binaries), the .eh_frame unwind table gives function ranges too.

One concept in one module (its length: the symbol tables, the unwind tables' ranges, the debug
file, versions and the branch scan are all views of one file).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import os
import struct
import sys
from array import array
from collections.abc import Callable, Container, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from dynprobe.arch.x86_64.unwind import CfiSection, UnwindTable, compile_sections
from dynprobe.debug import debug as _debug
from dynprobe.errors import ElfError, OptimizeRefusal, SymbolError
from dynprobe.frozen import frozen
from dynprobe.gcpause import gc_paused
from dynprobe.output.files import FileTooLarge, NotRegularFile, read_regular
from dynprobe.symbols import elf_cache, files, unwind_cache
from dynprobe.symbols.demangle import names_of

if TYPE_CHECKING:
    from iced_x86 import Instruction

    from dynprobe.arch.x86_64.optimize import OptimizePlan
    from dynprobe.symbols.elfparse import Elf

if TYPE_CHECKING:
    import numpy as np
else:
    from dynprobe.deferred import numpy as np


class Function(NamedTuple):
    """A function's symbol (a tuple: a library has thousands, made at every start)."""

    name: str
    addr: int  # link-time virtual address
    size: int

    @property
    def end(self) -> int:
        return self.addr + self.size


@frozen
class Segment:
    """A PT_LOAD segment: where it is in the file and in memory, and its permissions."""

    vaddr: int
    offset: int
    filesz: int
    memsz: int
    executable: bool
    writable: bool


_R_X86_64_IRELATIVE = 37
_ADDRESS_RELOCATIONS = (8, _R_X86_64_IRELATIVE)  # R_X86_64_RELATIVE: the addend is an address in the file
_SYMBOL_RELOCATIONS = (1, 6, 7)  # R_X86_64_64, GLOB_DAT, JUMP_SLOT
_PLT_SECTIONS = (".plt", ".plt.sec", ".plt.got")
DEBUG_ROOT = "/usr/lib/debug"  # separate debug files (gdb's debug-file-directory)


def _symbol_order(func: Function) -> tuple[int, int, bool, int, str]:
    """Functions by address; of aliases at one address, the longest, then a public name
    (malloc before __libc_malloc), then the shortest (strtol before strtoimax, strtold before
    strtof64x: the plain name programs call): the first is the one shown."""
    return func.addr, -func.size, func.name.startswith("_"), len(func.name), func.name


MAX_FILE_SIZE = 1 << 31  # bytes: a larger "ELF file" is refused, not read


def _read_file(path: str) -> bytes:
    """The bytes of a regular file: a device (/dev/zero), a FIFO or a directory is refused
    without a read."""
    try:
        return read_regular(path, MAX_FILE_SIZE)
    except FileTooLarge:
        raise ElfError(f"{path} is larger than {MAX_FILE_SIZE >> 30} GiB: not read as an ELF file") from None
    except NotRegularFile as exc:
        if exc.strerror == "a directory":
            raise SymbolError(f"{path} is a directory, not an ELF file") from None
        raise ElfError(f"{path} is not a regular file: name an ELF file (a program or a shared library)") from None
    except FileNotFoundError:
        raise SymbolError(f"no such file: {path}") from None
    except OSError as exc:
        raise SymbolError(f"cannot read {path}: {exc.strerror}") from None


# What arithmetic on the fields of a file raises for a malformed one: a file comes from
# anywhere, and its counts, offsets and sizes can be anything.
_MALFORMED = (KeyError, ValueError, IndexError, AssertionError, OverflowError, TypeError, struct.error)


def _malformed() -> tuple[type[Exception], ...]:
    """What a malformed file makes the code reading it raise: pyelftools' errors too, once it is
    loaded (symbols/elfparse.py)."""
    parser = sys.modules.get("dynprobe.symbols.elfparse")
    return _MALFORMED if parser is None else _MALFORMED + parser.ERRORS


@contextlib.contextmanager
def _parsing(path: str) -> Iterator[None]:
    """A malformed file's error, whatever pyelftools raised, as one ElfError."""
    try:
        yield
    except _malformed() as exc:
        why = str(exc).strip().split("\n", 1)[0][:200] or type(exc).__name__
        raise ElfError(f"{path} is not a valid ELF file: {why}") from exc


@frozen
class Headers:
    """What an ELF file's headers say that dynprobe needs."""

    machine: str
    is_pie: bool
    segments: list[Segment]
    interp: str | None
    build_id: str | None
    entry: int  # where the program starts: no caller, no return address
    is_go: bool  # Go's runtime moves goroutine stacks: return probes are refused on its programs
    needed: list[str]
    rpath: list[str]
    runpath: list[str]
    soname: str | None
    has_symtab: bool
    debuglink: str | None  # the name .gnu_debuglink gives


# functions (sorted: `_symbol_order`), data symbols, indirect functions, default versions
SymbolTables = tuple[list[Function], dict[str, int], dict[str, int], dict[str, str]]


def _headers(fields: dict[str, Any]) -> Headers:
    """Headers from their fields, its segments as dicts (TypeError: not Headers' fields, or
    not of their types: what the cache gives back is checked as a file's bytes are)."""
    headers = Headers(**(fields | {"segments": [Segment(**segment) for segment in fields["segments"]]}))
    segments = headers.segments
    texts = (headers.machine, *headers.needed, *headers.rpath, *headers.runpath)
    maybe = (headers.interp, headers.build_id, headers.soname, headers.debuglink)
    flags = (headers.is_pie, headers.is_go, headers.has_symtab, *(s.executable for s in segments),
             *(s.writable for s in segments))  # fmt: skip
    numbers = (headers.entry, *(n for s in segments for n in (s.vaddr, s.offset, s.filesz, s.memsz)))
    if not (all(type(t) is str for t in texts) and all(t is None or type(t) is str for t in maybe)
            and all(type(f) is bool for f in flags) and all(type(n) is int and n >= 0 for n in numbers)):  # fmt: skip
        raise TypeError("not Headers' fields")
    return headers


def _functions(rows: Iterable[tuple[str, int, int]]) -> list[Function]:
    """Functions (name, address, size), sorted by `_symbol_order`."""
    return sorted(itertools.starmap(Function, rows), key=_symbol_order)


def _kept(headers: Headers | None, tables: SymbolTables) -> elf_cache.Kept:
    """`headers` and `tables` as symbols/elf_cache.py keeps them."""
    functions, objects, ifuncs, defaults = tables
    meta = {} if headers is None else {"headers": dataclasses.asdict(headers)}
    arrays = {
        "addrs": array("Q", [f.addr for f in functions]), "sizes": array("Q", [f.size for f in functions]),
        "objects": array("Q", objects.values()), "ifuncs": array("Q", ifuncs.values()),
    }  # fmt: skip
    strings = {
        "names": [f.name for f in functions], "objects": list(objects), "ifuncs": list(ifuncs),
        "defaults": list(defaults), "versions": list(defaults.values()),
    }  # fmt: skip
    return meta, arrays, strings


def _from_kept(kept: elf_cache.Kept) -> tuple[Headers | None, SymbolTables]:
    """What `_kept` made, back (TypeError, ValueError or KeyError: not what it makes)."""
    meta, arrays, strings = kept
    headers = _headers(meta["headers"]) if "headers" in meta else None
    names, addrs, sizes = strings["names"], arrays["addrs"], arrays["sizes"]
    if not len(names) == len(addrs) == len(sizes):
        raise ValueError("not as many names as functions")
    tables = (
        list(map(Function, names, addrs, sizes)),
        dict(zip(strings["objects"], arrays["objects"], strict=True)),
        dict(zip(strings["ifuncs"], arrays["ifuncs"], strict=True)),
        dict(zip(strings["defaults"], strings["versions"], strict=True)),
    )  # fmt: skip
    return headers, tables


_Analysis = tuple[Headers | None, SymbolTables]


def _analysis(key: str, parse: Callable[[], _Analysis], *, headers: bool) -> _Analysis:
    """What `parse` reads of a file (with its `headers`, or without), kept on disk under `key`
    (symbols/elf_cache.py)."""
    kept = elf_cache.load(key)
    if kept is not None:
        with contextlib.suppress(TypeError, ValueError, KeyError, OverflowError):
            found = _from_kept(kept)
            if (found[0] is not None) == headers:
                return found
    found = parse()
    elf_cache.store(key, *_kept(*found))
    return found


def _identity(path: str) -> str:
    """A name for the file at `path` as it is now (its inode, size, times), for what is kept of a
    file that is not read whole (a separate debug file): a file changed in any way is another."""
    st = os.stat(path)
    return f"{path}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _debug_build_id(path: str, identity: str) -> str | None:
    """The build-id of the separate debug file at `path` (its `_identity`), kept on disk."""
    key = elf_cache.key_of("debug file", identity)
    kept = elf_cache.load(key)
    if kept is not None and isinstance(kept[0].get("build_id", 0), str | None):
        return kept[0]["build_id"]  # type: ignore[no-any-return]
    from dynprobe.symbols import elfparse

    data = read_regular(path, MAX_FILE_SIZE)
    with _parsing(path):
        found = elfparse.build_id(elfparse.open_elf(data))
    elf_cache.store(key, {"build_id": found}, {}, {})
    return found


class ElfImage:
    """One ELF file on disk, read once (use `load_elf` for the cached instance). What is worked
    out of its headers and symbols is kept on disk (symbols/elf_cache.py), named by a hash of
    its bytes; pyelftools parses the file only when that is not there, or for a section nothing
    keeps."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.data = _read_file(path)
        if self.data[:4] != b"\x7fELF":
            raise ElfError(f"{path} is not an ELF file")
        if self.data[4] != 2:
            raise ElfError(f"{path} is a 32-bit ELF file; dynprobe traces x86-64 programs only")
        self.digest = hashlib.sha256(self.data).hexdigest()
        headers, self._own_symbol_tables = _analysis(elf_cache.key_of(self.digest, "headers"), self._parse,
                                                     headers=True)  # fmt: skip
        assert headers is not None  # (headers=True)
        if headers.machine != "EM_X86_64":
            raise ElfError(f"{path} is built for {headers.machine}, not x86-64")
        self.headers = headers
        self.is_pie, self.segments, self.interp = headers.is_pie, headers.segments, headers.interp
        self.entry, self.build_id, self.is_go = headers.entry, headers.build_id, headers.is_go
        self.needed, self.rpath, self.runpath = headers.needed, headers.rpath, headers.runpath
        self.soname, self.has_symtab = headers.soname, headers.has_symtab
        self._eh_ranges: list[tuple[int, int]] | None = None
        self._branch_targets: BranchTargets | None = None
        self._by_demangled: dict[str, dict[int, Function]] | None = None
        # A separate debug file is read when a symbol only it may have is asked for (libc's
        # takes ~40 ms): a name the file itself gives is found without it (`own_function`).

    def _parse(self) -> tuple[Headers, SymbolTables]:
        from dynprobe.symbols import elfparse

        with _parsing(self.path):
            functions, objects, ifuncs, defaults = elfparse.symbols(self._elf)
            return _headers(elfparse.headers(self._elf)), (_functions(functions), objects, ifuncs, defaults)

    @functools.cached_property
    def _elf(self) -> Elf:
        """The file, parsed by pyelftools (a section at a time, as it is asked for)."""
        from dynprobe.symbols import elfparse

        with _parsing(self.path):
            return elfparse.open_elf(self.data)

    @functools.cached_property
    def _debug(self) -> tuple[str, str] | None:
        """The file's separate debug file, where gdb looks for it: by build-id under
        /usr/lib/debug (Debian's -dbg and -dbgsym packages), then by its .gnu_debuglink name next
        to it, in .debug/ there, and under /usr/lib/debug; one with another build-id is not it.
        Its path and `_identity`, or None."""
        candidates = []
        if self.build_id and len(self.build_id) > 2:
            candidates.append(f"{DEBUG_ROOT}/.build-id/{self.build_id[:2]}/{self.build_id[2:]}.debug")
        name = self.headers.debuglink
        if name is not None:
            where = os.path.dirname(self.path)
            candidates += [os.path.join(where, name), os.path.join(where, ".debug", name)]
            candidates.append(f"{DEBUG_ROOT}{where}/{name}")
        for candidate in candidates:
            try:
                if not os.path.isfile(candidate) or os.path.samefile(candidate, self.path):
                    continue
                identity = _identity(candidate)
                build_id = _debug_build_id(candidate, identity)
            except (OSError, ElfError) as exc:
                _debug(f"{candidate}: not read as a debug file: {exc}")
                continue
            if self.build_id in (None, build_id):
                return candidate, identity
        return None

    @property
    def debug_file(self) -> str | None:
        """The file's separate debug file (see `_debug`), or None."""
        return None if self._debug is None else self._debug[0]

    @functools.cached_property
    def _symbol_tables(self) -> SymbolTables:
        if self.has_symtab or self._debug is None:  # (with .symtab: it names what the debug file does)
            return self._own_symbol_tables
        path, identity = self._debug
        try:
            _, tables = _analysis(elf_cache.key_of(self.digest, "with debug symbols", identity),
                                  lambda: (None, self._add_debug_symbols(path)), headers=False)  # fmt: skip
        except (OSError, ElfError):
            return self._own_symbol_tables  # gone, replaced or damaged since: the file's own symbols only
        return tables

    def _add_debug_symbols(self, debug_file: str) -> SymbolTables:
        """The file's own symbols with those only the debug file names (static functions, an
        indirect function's implementations, data symbols); addresses the file's own symbols
        name keep their names."""
        from dynprobe.symbols import elfparse

        data = read_regular(debug_file, MAX_FILE_SIZE)
        with _parsing(debug_file):
            theirs, their_objects, their_ifuncs, _ = elfparse.symbols(elfparse.open_elf(data))
        functions, objects, ifuncs, defaults = self._own_symbol_tables
        named = {f.addr for f in functions}
        mine = [(f.name, f.addr, f.size) for f in functions]
        functions = _functions([*mine, *(row for row in theirs if row[1] not in named)])
        objects = objects | {name: at for name, at in their_objects.items() if name not in objects}
        ifuncs = ifuncs | {name: at for name, at in their_ifuncs.items() if name not in ifuncs}
        return functions, objects, ifuncs, defaults

    @functools.cached_property
    def _own_by_name(self) -> dict[str, Function | None]:
        """The file's own function symbols by name; None for a name of several addresses."""
        by_name: dict[str, Function | None] = {}
        for func in self.own_functions:
            first = by_name.setdefault(func.name, func)
            if first is not None and first.addr != func.addr:
                by_name[func.name] = None
        return by_name

    def own_object(self, name: str) -> int | None:
        """The address of a data symbol the file's own symbols name (see `own_function`)."""
        return self._own_symbol_tables[1].get(name)

    def own_function(self, name: str) -> Function | None:
        """The one function the file's own symbols (not a separate debug file's) name `name`,
        unless it is an indirect function: what a name a library exports means, found without
        reading its debug file."""
        own = self._own_symbol_tables
        return None if name in own[2] else self._own_by_name.get(name)

    @property
    def own_functions(self) -> list[Function]:
        """The function symbols of the file itself (not its debug file's), sorted by address."""
        return self._own_symbol_tables[0]

    @property
    def functions(self) -> list[Function]:
        """Function symbols, sorted by address (the debug file's too: `_add_debug_symbols`)."""
        return self._symbol_tables[0]

    @property
    def objects(self) -> dict[str, int]:
        """Data symbols: name -> address (for @SYM)."""
        return self._symbol_tables[1]

    @property
    def ifuncs(self) -> dict[str, int]:
        """Indirect functions: name -> resolver (symbols/ifunc.py)."""
        return self._symbol_tables[2]

    @property
    def default_versions(self) -> dict[str, str]:
        """The default version of each versioned name ('exp' -> 'GLIBC_2.29')."""
        return self._own_symbol_tables[3]

    @functools.cached_property
    def by_name(self) -> dict[str, Function]:
        by_name: dict[str, Function] = {}
        for func in self.functions:
            by_name.setdefault(func.name, func)
        return by_name

    @functools.cached_property
    def _starts(self) -> list[int]:
        return [f.addr for f in self.functions]

    # --- address arithmetic -----------------------------------------------------------------
    @property
    def first_page(self) -> int:
        """The link-time address of the file's first mapped page: where it is mapped, minus
        this, is its load bias."""
        return min((s.vaddr for s in self.segments), default=0) & ~0xFFF

    def vaddr_to_offset(self, vaddr: int) -> int | None:
        for seg in self.segments:
            if seg.vaddr <= vaddr < seg.vaddr + seg.filesz:
                return vaddr - seg.vaddr + seg.offset
        return None

    def offset_to_vaddr(self, offset: int) -> int | None:
        for seg in self.segments:
            if seg.offset <= offset < seg.offset + seg.filesz:
                return offset - seg.offset + seg.vaddr
        return None

    def is_executable(self, vaddr: int) -> bool:
        return any(s.executable and s.vaddr <= vaddr < s.vaddr + s.filesz for s in self.segments)

    def code(self, vaddr: int, size: int) -> bytes:
        off = self.vaddr_to_offset(vaddr)
        if off is None:
            return b""
        return self.data[off : off + size]

    def read(self, vaddr: int, size: int, *, constant: bool = False) -> bytes | None:
        """The file's `size` bytes at link-time address `vaddr`, if one segment holds them all
        (`constant`: one the program cannot write, where they stay as the file has them)."""
        for seg in self.segments:
            if seg.vaddr <= vaddr and vaddr + size <= seg.vaddr + seg.filesz and not (constant and seg.writable):
                data = self.data[seg.offset + vaddr - seg.vaddr : seg.offset + vaddr - seg.vaddr + size]
                return data if len(data) == size else None
        return None

    def padding_after(self, end: int) -> bytes:
        """The bytes from `end` (a function's end) to the next 16-byte boundary, cut where a
        function starts: what a tiny function's jump may cover (optimize.py checks they are
        padding)."""
        stop = (end + 15) & ~15
        i = bisect.bisect_left(self._starts, end)
        if i < len(self._starts):
            stop = min(stop, self._starts[i])
        return self.code(end, stop - end) if stop > end and self.is_executable(end) else b""

    def jump_plan(self, addr: int, size: int, site: int, *, bias: int = 0, other_probes: Container[int] = frozenset(),
                  take_along: bool = True) -> OptimizePlan | OptimizeRefusal:  # fmt: skip
        """Whether `site` (where it runs, `bias` above its link-time address) of the function at
        link-time `addr` (`size` bytes) can take a jump: arch/x86_64/optimize.py's rules over this
        file's bytes (its switch tables, the padding after the function) and where its code may
        land. The jump replaces `plan.overwritten` bytes: `self.code(addr, size) +
        self.padding_after(addr + size)` from the site on. `take_along`: the direct branches into
        those bytes from elsewhere may be re-aimed (the plan's `moved`), else they refuse it."""
        from dynprobe.arch.x86_64.decode import decode_one
        from dynprobe.arch.x86_64.optimize import can_optimize

        def branches_to(at: int) -> list[tuple[Instruction, int]] | None:
            """The branches landing at run-time `at`, decoded where they run (see BranchTargets)."""
            found = self.branch_targets().branches_to(at - bias)
            moved = []
            for source, room in found or ():
                insn = decode_one(self.code(source, 15), source + bias)
                if insn is None:
                    return None
                moved.append((insn, room or insn.len))
            return None if found is None else moved

        return can_optimize(
            self.code(addr, size), addr + bias, site, other_probes=other_probes, module_targets=self.branch_targets(),
            bias=bias, read=lambda at, count: self.read(at - bias, count, constant=True),
            padding=self.padding_after(addr + size),
            is_code=lambda at: self.is_executable(at - bias),
            branches_to=branches_to if take_along else None,
        )  # fmt: skip

    # --- functions ----------------------------------------------------------------------------
    def function_at(self, vaddr: int) -> Function | None:
        """The function (symbol with a size, else an unwind-table range) containing `vaddr`."""
        i = bisect.bisect_right(self._starts, vaddr)
        while i > 0:
            func = self.functions[i - 1]
            if func.addr <= vaddr < func.end:  # the first of its aliases: the name shown
                first = bisect.bisect_left(self._starts, func.addr)
                return next(f for f in self.functions[first:i] if f.addr <= vaddr < f.end)
            if vaddr - func.addr > (1 << 24):
                break
            i -= 1
        for start, end in self.eh_frame_ranges():
            if start <= vaddr < end:
                # (named by a symbol without a size in the range, if one is: __restore_rt)
                i = bisect.bisect_right(self._starts, vaddr)
                if i and self._starts[i - 1] >= start:
                    first = bisect.bisect_left(self._starts, self._starts[i - 1])
                    named = next((f for f in self.functions[first:i] if not f.size), None)
                    if named is not None:
                        return Function(named.name, named.addr, end - named.addr)
                return Function(f"fde_{start:x}", start, end - start)
        return None

    @functools.cached_property
    def unwind_table(self) -> UnwindTable:
        """The rows stacks are walked with (arch/x86_64/unwind.py), from the file's .eh_frame,
        then a .debug_frame (its own, or its debug file's) for code built without unwind tables;
        empty when it has neither. Kept on disk (symbols/unwind_cache.py)."""
        sections = self._cfi_sections()
        if not sections:
            return compile_sections([])
        key = unwind_cache.key_of(sections)
        table = unwind_cache.load(key)
        if table is None:
            table = compile_sections(sections)
            unwind_cache.store(key, table)
        return table

    def _cfi_sections(self) -> list[CfiSection]:
        """The .eh_frame and .debug_frame the unwind rows come from (each from the file, else
        from its debug file)."""
        found: dict[str, CfiSection] = {}
        from dynprobe.symbols import elfparse

        for path in (self.path, self.debug_file):
            if path is None:
                continue
            try:
                with _parsing(path):
                    elf = self._elf if path == self.path else elfparse.open_elf(read_regular(path, MAX_FILE_SIZE))
                    for name in (".eh_frame", ".debug_frame"):
                        section = elf.get_section_by_name(name)
                        # (not NOBITS: a debug file's copy; lld's .eh_frame is SHT_X86_64_UNWIND)
                        if name not in found and section is not None and section["sh_type"] != "SHT_NOBITS" \
                                and section["sh_size"]:  # fmt: skip
                            found[name] = CfiSection(section.data(), int(section["sh_addr"]), name == ".debug_frame")
            except (OSError, ElfError) as exc:
                _debug(f"{path}: no unwind table read: {exc}")
        return list(found.values())

    def eh_frame_ranges(self) -> list[tuple[int, int]]:
        """(start, end) of every function the unwind tables describe, sorted."""
        if self._eh_ranges is None:
            with _parsing(self.path):
                self._eh_ranges = self._eh_frame_hdr_ranges()
        if self._eh_ranges is None:
            ranges: list[tuple[int, int]] = []
            try:
                if self._elf.has_dwarf_info() or self._elf.get_section_by_name(".eh_frame"):
                    dwarf = self._elf.get_dwarf_info()
                    if dwarf.has_EH_CFI():
                        for entry in dwarf.EH_CFI_entries():
                            header = getattr(entry, "header", {})
                            if "initial_location" in header:
                                start = header["initial_location"]
                                ranges.append((start, start + header["address_range"]))
            except _malformed():
                ranges = []
            self._eh_ranges = sorted(ranges)
        return self._eh_ranges

    def _eh_frame_hdr_ranges(self) -> list[tuple[int, int]] | None:
        """The ranges from .eh_frame_hdr's sorted table (start, FDE) and each FDE's range, in
        bulk: parsing .eh_frame with pyelftools costs ~0.6 s for libc. Only the encodings
        GCC and clang write for x86-64 (4-byte data-relative table, 4-byte FDE addresses);
        None otherwise (the caller parses .eh_frame then)."""
        hdr, frames = self._elf.get_section_by_name(".eh_frame_hdr"), self._elf.get_section_by_name(".eh_frame")
        if hdr is None or frames is None:
            return None
        data = hdr.data()
        # version 1; eh_frame_ptr pcrel|sdata4; fde_count udata4; table datarel|sdata4
        if len(data) < 12 or tuple(data[:4]) != (1, 0x1B, 0x03, 0x3B):
            return None
        count = int.from_bytes(data[8:12], "little")
        if len(data) < 12 + 8 * count:
            return None
        table = np.frombuffer(data, dtype="<i4", count=2 * count, offset=12).reshape(-1, 2).astype(np.int64)
        starts = table[:, 0] + hdr["sh_addr"]
        # An FDE: length (u32), CIE pointer (u32), pc_begin (pcrel|sdata4), pc_range (udata4).
        at = table[:, 1] + hdr["sh_addr"] - frames["sh_addr"] + frames["sh_offset"] + 12
        if count and (at.min() < 0 or at.max() + 4 > len(self.data)):
            return None
        raw = np.frombuffer(self.data, dtype=np.uint8)
        sizes = raw[at] | raw[at + 1].astype(np.int64) << 8 | raw[at + 2].astype(np.int64) << 16
        sizes |= raw[at + 3].astype(np.int64) << 24
        return sorted(zip(starts.tolist(), (starts + sizes).tolist(), strict=True))

    @functools.cached_property
    def shared_names(self) -> dict[str, list[int]]:
        """Names several functions have (static functions of different source files), with
        their addresses: a bare name would mean one of them."""
        addresses: dict[str, set[int]] = {}
        for func in self.functions:
            addresses.setdefault(func.name, set()).add(func.addr)
        return {name: sorted(where) for name, where in addresses.items() if len(where) > 1}

    def functions_named(self, name: str) -> list[Function]:
        """The functions a name means: the symbol itself, else those whose demangled name it
        is, simple ('ns::Class::method') or full, spaces aside ('ns::f(long,int)'),
        one per address (overloads: several)."""
        func = self.by_name.get(name)
        if func is not None:
            return [func]
        if self._by_demangled is None:
            self._by_demangled = {}
            for f in self.functions:
                for alias in {d.replace(" ", "") for d in names_of(f.name)[1:]}:
                    self._by_demangled.setdefault(alias, {}).setdefault(f.addr, f)
        return list(self._by_demangled.get(name.replace(" ", ""), {}).values())

    def address_of(self, name: str) -> int | None:
        """Link-time address of a data or function symbol (for @SYM fetch arguments)."""
        if name in self.objects:
            return self.objects[name]
        func = self.by_name.get(name)
        return func.addr if func else None

    @functools.cached_property
    def irelative(self) -> dict[int, list[int]]:
        """The file's R_X86_64_IRELATIVE relocations: resolver (the addend) -> the GOT slots the
        loader fills with what it returns (symbols/ifunc.py). Decoded in bulk."""
        out: dict[int, list[int]] = {}
        with _parsing(self.path):
            for rows, _ in self._relocations():
                mine = rows[(rows["info"] & 0xFFFF_FFFF) == _R_X86_64_IRELATIVE]
                for slot, resolver in zip(mine["offset"].tolist(), mine["addend"].tolist(), strict=True):
                    out.setdefault(resolver, []).append(slot)
        return out

    @functools.cached_property
    def symbol_slots(self) -> dict[str, list[int]]:
        """name -> the slots (GOT entries, function pointers: R_X86_64_GLOB_DAT, JUMP_SLOT, 64)
        where the loader writes the address of that symbol of another module. Decoded in bulk."""
        out: dict[str, list[int]] = {}
        with _parsing(self.path):
            for rows, names in self._relocations():
                kind = rows["info"] & 0xFFFF_FFFF
                mine = rows[np.isin(kind, _SYMBOL_RELOCATIONS) & (rows["info"] >> np.uint64(32) != 0)]
                for slot, index in zip(mine["offset"].tolist(), (mine["info"] >> np.uint64(32)).tolist(), strict=True):
                    name = names(index)
                    if name:
                        out.setdefault(name, []).append(slot)
        return out

    @functools.cached_property
    def plt_stubs(self) -> list[Function]:
        """The stubs of .plt, .plt.sec and .plt.got, each a Function named after the symbol whose
        slot it jumps through (the library function the file calls), one entry long."""
        from dynprobe.arch.x86_64.optimize import plt_slot

        by_slot = {slot: name for name, slots in self.symbol_slots.items() for slot in slots}
        stubs = []
        with _parsing(self.path):
            for section in self._elf.iter_sections("SHT_PROGBITS"):
                if section.name not in _PLT_SECTIONS:
                    continue
                entry = section["sh_entsize"] if section["sh_entsize"] in (8, 16) else 16
                start, end = section["sh_addr"], section["sh_addr"] + min(section["sh_size"], len(self.data))
                for at in range(start, end - entry + 1, entry):
                    slot = plt_slot(self.code(at, entry), at)
                    name = by_slot.get(slot) if slot is not None else None
                    if name:
                        stubs.append(Function(name, at, entry))
        return stubs

    def _relocations(self) -> Iterator[tuple[np.ndarray, Callable[[int], str]]]:
        """Each SHT_RELA section's rows, and the name of a symbol of its symbol table by index."""
        from dynprobe.symbols import elfparse

        return elfparse.relocations(self._elf)

    def branch_targets(self) -> BranchTargets:
        """Where the file's direct branches land (made once, kept on disk): `addr in targets`."""
        if self._branch_targets is None:
            key = elf_cache.key_of(self.digest, "branches")
            scan = self._kept_scan(key)
            if scan is None:
                scan = BranchTargets.scan(self)
                ranges = self.eh_frame_ranges()
                with contextlib.suppress(OverflowError):  # (an unwind table's range past 2^63)
                    eh_starts, eh_ends = array("q", [s for s, _ in ranges]), array("q", [e for _, e in ranges])
                    arrays = {"sources": scan.sources, "targets": scan.targets, "taken": scan.taken,
                              "eh_starts": eh_starts, "eh_ends": eh_ends}  # fmt: skip
                    elf_cache.store(key, {"scanned": scan.scanned, "everything": scan.everything}, arrays, {})
            self._branch_targets = BranchTargets(self, scan)
        return self._branch_targets

    def _kept_scan(self, key: str) -> Scan | None:
        """The scan of `branch_targets` kept on disk, with the unwind tables' ranges, if it is."""
        kept = elf_cache.load(key)
        if kept is None:
            return None
        meta, arrays, _ = kept
        try:
            scan = Scan(arrays["sources"], arrays["targets"], arrays["taken"], meta["scanned"], meta["everything"])
            ranges = list(zip(arrays["eh_starts"], arrays["eh_ends"], strict=True))
        except (KeyError, TypeError, ValueError):
            return None
        if type(scan.scanned) is not int or type(scan.everything) is not bool \
                or len(scan.sources) != len(scan.targets):  # fmt: skip
            return None
        self._eh_ranges = ranges
        return scan

    def symbolize(self, vaddr: int) -> str | None:
        func = self.function_at(vaddr)
        if func is None:
            return None
        off = vaddr - func.addr
        return f"{func.name}+{off:#x}" if off else func.name


class Scan(NamedTuple):
    """What BranchTargets finds in a file's bytes (kept on disk: symbols/elf_cache.py)."""

    sources: array[int]  # where a rel32 branch may start, in the order of `targets`
    targets: array[int]  # where it lands, sorted
    taken: array[int]  # the code addresses the file takes, sorted
    scanned: int  # bytes of code
    everything: bool  # read as branches everywhere: every address is a target


def _int64s(values: np.ndarray) -> array[int]:
    return array("q", values.astype("<i8").tobytes())


class BranchTargets:
    """The link-time addresses a file's code may land on, as a container: where its direct
    branches land, and the code addresses it takes (an indirect jump's targets: the addends of
    its RELATIVE and IRELATIVE relocations, the targets of its RIP-relative `lea`s, numpy taking
    any byte that could start one as one; a file that is not position-independent holds absolute
    addresses with no relocation: `_absolute_addresses`). The branches are found without
    decoding the whole file at every run. A branch
    with a 32-bit displacement (call, jmp, jcc)
    may come from anywhere: numpy takes every byte of executable code that could start one as
    one, a superset of the real ones; when one lands on an address asked about, the function it
    is in (a symbol's or an unwind-table range) is decoded to see whether it is a branch (one in
    no function counts). One with an 8-bit displacement comes from at most 129 bytes away: the
    functions there are decoded. Each function is decoded at most once. Past LOOKUPS questions,
    and one for every 16 functions of a big file (many probes placed in one file: decoding every
    function is then a small part of the work), the answers come from the set of every target:
    the same answers (a function's code, decoded whole, is the truth the candidates are weighed
    against), without the tens of candidates each question weighs."""

    _SCAN = 1 << 20  # bytes of code scanned at a time: the scan's memory stays bounded
    _ANY_FILE = 1 << 16  # places a rel32 branch may start at in any file (past them: one byte of code in 8)
    LOOKUPS = 64
    FUNCTIONS_PER_LOOKUP = 16

    def __init__(self, image: ElfImage, scan: Scan) -> None:
        self.image = image
        self.sources, self.targets, self.taken = scan.sources, scan.targets, scan.taken
        self.everything = scan.everything
        # (The file's own symbols: a function only its debug file names has an unwind-table
        # range as a rule, and a candidate in no range counts as a branch, so a probe may stay a
        # trap, never go wrong: not worth reading the debug file, ~30 ms for libc's.)
        own = image.own_functions
        self.ranges = sorted({(f.addr, f.end) for f in own if f.size} | set(image.eh_frame_ranges()))
        self._reach = list(itertools.accumulate((end for _, end in self.ranges), max))  # the furthest end so far
        self._decoded: dict[tuple[int, int], list[tuple[int, int]]] = {}  # a function range -> its branches
        self._landed: dict[tuple[int, int], frozenset[int]] = {}  # a function range -> its branches' targets
        # Ranges may nest (a hostile symbol table: thousands around one place): what is decoded is
        # bounded too, by the code's size (then every address is a target).
        self._may_decode = 8 * scan.scanned + self._ANY_FILE
        self._lookups = 0
        self._all: frozenset[int] | None = None  # every target, once LOOKUPS questions were asked

    @classmethod
    def scan(cls, image: ElfImage) -> Scan:
        """The candidates of a file's bytes (numpy's work: see the class)."""
        # A file is untrusted: segments that map its bytes many times over, or code that reads as
        # branches everywhere (real code: one byte in 30), make every address a target (probes
        # stay traps) rather than take memory without bound.
        found: list[tuple[np.ndarray, np.ndarray]] = []
        leas: list[np.ndarray] = [np.zeros(0, np.int64)]
        places = scanned = 0
        everything = False
        for seg in image.segments:
            if not seg.executable or everything or seg.vaddr + seg.filesz >= 1 << 47:
                continue  # (no user-space code is mapped above 2^47)
            size = max(0, min(seg.filesz, len(image.data) - seg.offset))
            scanned += size
            for at in range(0, size, cls._SCAN):  # (overlapping by a branch's length)
                code = image.data[seg.offset + at : seg.offset + min(size, at + cls._SCAN + 6)]
                found.append(_rel32_branches(np.frombuffer(code, dtype=np.uint8), seg.vaddr + at))
                leas.append(_rip_leas(np.frombuffer(code, dtype=np.uint8), seg.vaddr + at))
                places += len(found[-1][0]) + len(leas[-1])
                if places > scanned // 8 + cls._ANY_FILE or scanned > 4 * len(image.data):
                    everything, found, leas = True, [], []
                    break
        sources = np.concatenate([np.zeros(0, np.int64), *(where for where, _ in found)])
        targets = np.concatenate([np.zeros(0, np.int64), *(to for _, to in found)])
        order = np.argsort(targets, kind="stable")
        with _parsing(image.path):
            addends = [rows["addend"][np.isin(rows["info"] & 0xFFFF_FFFF, _ADDRESS_RELOCATIONS)]
                       for rows, _ in image._relocations()]  # fmt: skip
        absolute = [] if image.is_pie or everything else _absolute_addresses(image, scanned // 8 + cls._ANY_FILE)
        if absolute is None:
            everything, absolute = True, []
        # (sorted for is_taken's search; not np.unique, whose first call imports numpy.ma)
        taken = np.sort(np.concatenate([np.zeros(0, np.int64), *leas, *(a.astype(np.int64) for a in addends),
                                        *absolute]))  # fmt: skip
        return Scan(_int64s(sources[order]), _int64s(targets[order]), _int64s(taken), scanned, everything)

    def __contains__(self, addr: object) -> bool:
        if self.everything:
            return True
        if not isinstance(addr, int):
            return False
        return self.is_taken(addr) or self._branched_to(addr)

    def is_taken(self, addr: int) -> bool:
        """Whether the file takes the address `addr` (an indirect jump may land there)."""
        at = bisect.bisect_left(self.taken, addr)
        return at < len(self.taken) and self.taken[at] == addr

    def _branched_to(self, addr: int) -> bool:
        self._lookups += 1
        if self._all is None and self._lookups > max(self.LOOKUPS, len(self.ranges) // self.FUNCTIONS_PER_LOOKUP):
            self._all = self._every_target()
        if self._all is not None:
            return addr in self._all or self.everything
        low, high = bisect.bisect_left(self.targets, addr), bisect.bisect_right(self.targets, addr)
        for source in self.sources[low:high].tolist():
            around = list(self._around(source, source))
            if not around or any(addr in self._targets(r) for r in around):
                return True
        found = any(addr in self._targets(r) for r in self._around(addr - 129, addr + 127))
        return found or self.everything

    def _every_target(self) -> frozenset[int]:
        """The targets of every function's branches, and of the candidates in no function."""
        every: set[int] = set()
        for bounds in self.ranges:
            every |= self._targets(bounds)
        for source, target in zip(self.sources.tolist(), self.targets.tolist(), strict=True):
            if next(self._around(source, source), None) is None:
                every.add(target)
        return frozenset(every)

    def _around(self, low: int, high: int) -> Iterator[tuple[int, int]]:
        """The function ranges with a byte in [low, high] (ranges may nest: an alias, an FDE)."""
        ranges = self.ranges
        for index in range(bisect.bisect_right(self._reach, low), len(ranges)):  # (a slice would copy the rest)
            start, end = ranges[index]
            if start > high:
                break
            if end > low:
                yield start, end

    def _targets(self, bounds: tuple[int, int]) -> frozenset[int]:
        found = self._landed.get(bounds)
        if found is None:
            found = self._landed[bounds] = frozenset(target for _, target in self._branches(bounds))
        return found

    def _branches(self, bounds: tuple[int, int]) -> list[tuple[int, int]]:
        """(where, where to) of the direct branches of a function range, decoded once."""
        branches = self._decoded.get(bounds)
        if branches is None:
            from dynprobe.arch.x86_64.optimize import branches_in

            start, end = bounds
            self._may_decode -= end - start
            if self._may_decode < 0:
                self.everything = True
                return []
            with _parsing(self.image.path):
                branches = self._decoded[bounds] = branches_in(self.image.code(start, end - start), start)
        return branches

    @functools.cached_property
    def _starts(self) -> frozenset[int]:
        return frozenset(f.addr for f in self.image.own_functions)

    def branches_to(self, addr: int) -> list[tuple[int, int]] | None:
        """The direct branches that land at link-time `addr`: where each starts, and for a `jmp
        rel8` the bytes from there that no other code runs (its own, and the nops and int3s that
        follow it where nothing lands and no function starts, as many as a `jmp rel32` needs;
        0 for other branches: they keep their length). None when something else may land
        there: an address the file takes, a branch found by the scan in no function, or a file
        read as branches everywhere."""
        from dynprobe.arch.x86_64.optimize import padding_length, short_jump

        if self.everything or self.is_taken(addr):
            return None
        low, high = bisect.bisect_left(self.targets, addr), bisect.bisect_right(self.targets, addr)
        ranges = set(self._around(addr - 129, addr + 127))
        for source in self.sources[low:high].tolist():
            around = list(self._around(source, source))
            if not around:
                return None
            ranges.update(around)
        starts = self._starts
        found: dict[int, int] = {}
        for bounds in sorted(ranges):
            for source, target in self._branches(bounds):
                if target != addr or source in found:
                    continue
                length = short_jump(self.image.code(source, 15), source)
                if length is None:  # (a rel32 branch keeps its length)
                    found[source] = 0
                    continue
                end = source + length
                dead = min(padding_length(self.image.code(end, 16), end), 5 - length)  # (a jmp rel32: 5 bytes)
                if any(at in starts or at in self for at in range(end, end + dead)):
                    dead = 0
                found[source] = length + dead
        return None if self.everything else sorted(found.items())


def _absolute_addresses(image: ElfImage, most: int) -> list[np.ndarray] | None:
    """Of a file that is not position-independent, the addresses of its code it holds with no
    relocation: 4 bytes at a 4-byte boundary of its data (a table of addresses, a pointer's
    low half), and the immediate of any byte of its code that could start a `mov r32, imm32`,
    `push imm32` or `mov r/m, imm32` (how such code puts a label's address in a register or in
    memory), that read as an address of its code. None past `most` of them (a file made to
    read as addresses everywhere: every address is then a target)."""
    found: list[np.ndarray] = []
    total = 0
    code = [(seg.vaddr, seg.vaddr + seg.filesz) for seg in image.segments if seg.executable]
    for seg in image.segments:
        size = max(0, min(seg.filesz, len(image.data) - seg.offset))
        for at in range(0, size, BranchTargets._SCAN):
            chunk = np.frombuffer(image.data[seg.offset + at : seg.offset + min(size, at + BranchTargets._SCAN + 15)],
                                  dtype=np.uint8)  # fmt: skip
            places = _immediates(chunk) if seg.executable else np.arange(0, len(chunk) - 3, 4)
            places = places[places + 4 <= len(chunk)]
            words = np.zeros(len(places), dtype=np.int64)
            for byte in range(4):
                words |= chunk[places + byte].astype(np.int64) << (8 * byte)
            inside = np.zeros(len(words), dtype=bool)
            for low, high in code:
                inside |= (words >= low) & (words < high)
            found.append(np.unique(words[inside]))
            total += len(found[-1])
            if total > most:
                return None
    return found


def _rel32_branches(code: np.ndarray, vaddr: int) -> tuple[np.ndarray, np.ndarray]:
    """(where, where to) of a `call`/`jmp rel32` (E8, E9), a `jcc rel32` (0F 80-8F) or an `xbegin
    rel32` (C7 F8) starting at any byte of `code` (at `vaddr`)."""
    n = len(code)
    sources, targets = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for length in (5, 6):  # (E8/E9 rel32; 0F 8x or C7 F8, rel32)
        if n < length:
            continue
        head = code[: n - length + 1]
        if length == 5:
            at = np.flatnonzero((head == 0xE8) | (head == 0xE9))
        else:  # (and XBEGIN, C7 F8 rel32, whose abort lands there too)
            second = code[1 : n - length + 2]
            at = np.flatnonzero(((head == 0x0F) & ((second & 0xF0) == 0x80)) | ((head == 0xC7) & (second == 0xF8)))
        displacement = np.zeros(len(at), dtype=np.int64)
        for byte in range(4):
            displacement |= code[at + length - 4 + byte].astype(np.int64) << (8 * byte)
        displacement -= (displacement >= 1 << 31) * (1 << 32)
        sources.append(vaddr + at)
        targets.append(vaddr + at + length + displacement)
    return np.concatenate(sources), np.concatenate(targets)


def _immediates(code: np.ndarray) -> np.ndarray:
    """Where the imm32 of a `mov r32, imm32` (B8-BF), a `push imm32` (68) or a `mov r/m, imm32`
    (C7 /0: after its ModRM, SIB and displacement) starting at any byte of `code` would be."""
    n = len(code)
    if n < 6:
        return np.zeros(0, np.int64)
    head = code[: n - 5].astype(np.int64)
    short = np.flatnonzero(((head >= 0xB8) & (head <= 0xBF)) | (head == 0x68)) + 1
    modrm = code[1 : n - 4].astype(np.int64)
    at = np.flatnonzero((head == 0xC7) & ((modrm >> 3) & 7 == 0))
    mod, rm = modrm[at] >> 6, modrm[at] & 7
    sib = (mod != 3) & (rm == 4)
    base = np.where(sib, code[np.minimum(at + 2, n - 1)] & 7, 0)
    displacement = np.select([mod == 1, mod == 2, (mod == 0) & ((rm == 5) | (sib & (base == 5)))], [1, 4, 4], 0)
    return np.concatenate([short, at + 2 + sib + displacement])


def _rip_leas(code: np.ndarray, vaddr: int) -> np.ndarray:
    """Where a `lea reg, [rip+disp32]` starting at any byte of `code` (at `vaddr`) points."""
    n = len(code)
    out = [np.zeros(0, np.int64)]
    for rex in (True, False):
        length = 7 if rex else 6
        if n < length:
            continue
        first = code[: n - length + 1]
        if rex:  # (REX.W, any of R, X, B: 48-4F), 8D, a ModRM of [rip+disp32]
            at = np.flatnonzero(((first & 0xF8) == 0x48) & (code[1 : n - length + 2] == 0x8D)
                                & ((code[2 : n - length + 3] & 0xC7) == 0x05))  # fmt: skip
        else:
            at = np.flatnonzero((first == 0x8D) & ((code[1 : n - length + 2] & 0xC7) == 0x05))
        displacement = np.zeros(len(at), dtype=np.int64)
        for byte in range(4):
            displacement |= code[at + length - 4 + byte].astype(np.int64) << (8 * byte)
        displacement -= (displacement >= 1 << 31) * (1 << 32)
        out.append(vaddr + at + length + displacement)
    return np.concatenate(out)


_CACHE: dict[tuple[str, int, int, int, int], ElfImage] = {}
_CACHE_SIZE = 64


def load_elf(path: str) -> ElfImage:
    """The parsed ELF at `path`, cached while the file is unchanged (same inode, size and
    modification time: a replaced or rewritten file is parsed again). Keyed by the path too: an
    image names its file by the path it was read through, and one file reached through another
    process's root (/proc/PID/root/...) is gone with that process."""
    try:
        st = files.stat(path)
    except FileNotFoundError as exc:
        raise SymbolError(f"no such file: {path}") from exc
    except PermissionError as exc:
        raise SymbolError(f"cannot read {path}: permission denied") from exc
    real = files.real_path(path)
    key = (real, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
    image = _CACHE.get(key)
    if image is None:
        with gc_paused():
            image = ElfImage(real)
        if len(_CACHE) >= _CACHE_SIZE:
            del _CACHE[next(iter(_CACHE))]
        _CACHE[key] = image
    return image
