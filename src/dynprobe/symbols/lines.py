"""Source lines of code addresses, and the functions inlined there, from DWARF (stacks).

A file's own debug information, or its separate debug file's (`ElfImage.debug_file`). Looked
up lazily and by compilation unit: .debug_aranges says which unit holds an address, and only
that unit's line program is decoded (libc's whole table would take seconds; one unit takes
milliseconds); the functions inlined at an address come from that unit's DIEs (its
DW_TAG_inlined_subroutine entries whose ranges hold it). A file is untrusted: anything
pyelftools cannot read is no line, never an error.
"""

from __future__ import annotations

import bisect
import functools
import io
import threading
from collections.abc import Iterator

from elftools.dwarf.die import DIE
from elftools.dwarf.dwarfinfo import DWARFInfo
from elftools.dwarf.ranges import BaseAddressEntry, RangeEntry
from elftools.elf.elffile import ELFFile

from dynprobe.debug import debug as _debug
from dynprobe.output.files import read_regular
from dynprobe.symbols.demangle import display
from dynprobe.symbols.elf import MAX_FILE_SIZE, load_elf

# (one lookup at a time: the tracing thread walks stacks at stops, the consumer names records'
# stacks, and a file's DWARF is read through one stream)
_LOCK = threading.Lock()


_MAX_DEPTH = 64  # DIEs nested in a unit that a lookup goes into (a file's own may nest without end)


class _Unit:
    """One compilation unit: its line table by address, and its file names."""

    def __init__(self, dwarf: DWARFInfo, offset: int) -> None:
        self.cu = dwarf.get_CU_at(offset)
        self.files: list[str] = []
        self.first_file = 1
        self.addresses: list[int] = []
        self.lines: list[tuple[str, int]] = []
        program = dwarf.line_program_for_CU(self.cu)
        if program is None:
            return
        header = program.header
        self.files = [f.name.decode("utf-8", "replace") for f in header["file_entry"]]
        self.first_file = 0 if header["version"] >= 5 else 1  # (file numbers: from 0 in DWARF 5, 1 before)
        rows: list[tuple[int, tuple[str, int]]] = []
        for entry in program.get_entries():
            state = entry.state
            if state is None or state.end_sequence:
                continue
            rows.append((state.address, (self.file(state.file), state.line)))
        rows.sort(key=lambda row: row[0])
        self.addresses, self.lines = [a for a, _ in rows], [line for _, line in rows]

    def file(self, number: int) -> str:
        index = number - self.first_file
        return self.files[index] if 0 <= index < len(self.files) else "?"


class _Lines:
    """One file's DWARF: its units, decoded as they are asked for."""

    def __init__(self, dwarf: DWARFInfo) -> None:
        self.dwarf = dwarf
        self.aranges = dwarf.get_aranges()
        self.units: dict[int, _Unit] = {}
        self.range_lists = dwarf.range_lists()

    def unit(self, vaddr: int) -> _Unit | None:
        offset = self.aranges.cu_offset_at_addr(vaddr) if self.aranges is not None else None
        if offset is None:
            return None
        if offset not in self.units:
            self.units[offset] = _Unit(self.dwarf, offset)
        return self.units[offset]

    def at(self, vaddr: int) -> tuple[str, int] | None:
        unit = self.unit(vaddr)
        if unit is None:
            return None
        i = bisect.bisect_right(unit.addresses, vaddr) - 1
        return unit.lines[i] if i >= 0 else None

    def inlined(self, vaddr: int) -> list[tuple[str, str | None]]:
        """The functions inlined at `vaddr`, outermost first: (name, where it was called from
        as `file:line`)."""
        unit = self.unit(vaddr)
        if unit is None:
            return []
        chain: list[tuple[str, str | None]] = []
        top = unit.cu.get_top_DIE()
        base = top.attributes["DW_AT_low_pc"].value if "DW_AT_low_pc" in top.attributes else 0
        die: DIE | None = top
        depth = 0
        while die is not None and depth < _MAX_DEPTH:
            inside = next((child for child in _children(die) if child.tag in _SCOPES
                           and self._holds(child, vaddr, base, unit)), None)  # fmt: skip
            if inside is not None and inside.tag == "DW_TAG_inlined_subroutine":
                attrs = inside.attributes
                call = (f"{unit.file(attrs['DW_AT_call_file'].value)}:{attrs['DW_AT_call_line'].value}"
                        if "DW_AT_call_file" in attrs and "DW_AT_call_line" in attrs else None)  # fmt: skip
                chain.append((_name(inside), call))
            die, depth = inside, depth + 1
        return chain

    def _holds(self, die: DIE, vaddr: int, base: int, unit: _Unit) -> bool:
        attrs = die.attributes
        if "DW_AT_low_pc" in attrs and "DW_AT_high_pc" in attrs:
            low, high = attrs["DW_AT_low_pc"].value, attrs["DW_AT_high_pc"]
            end = high.value if high.form == "DW_FORM_addr" else low + high.value
            return bool(low <= vaddr < end)
        if "DW_AT_ranges" not in attrs or self.range_lists is None:
            return False
        for entry in self.range_lists.get_range_list_at_offset(attrs["DW_AT_ranges"].value, cu=unit.cu):
            if isinstance(entry, BaseAddressEntry):
                base = entry.base_address
                continue
            begin, end = (0, 0) if not isinstance(entry, RangeEntry) else (entry.begin_offset, entry.end_offset)
            if not entry.is_absolute:
                begin, end = base + begin, base + end
            if begin <= vaddr < end:
                return True
        return False


_SCOPES = ("DW_TAG_subprogram", "DW_TAG_inlined_subroutine", "DW_TAG_lexical_block", "DW_TAG_namespace")
_MAX_CHILDREN = 1 << 16  # a DIE's children looked at


def _children(die: DIE) -> Iterator[DIE]:
    """A DIE's children, each further on in the unit than the one before and at most
    _MAX_CHILDREN of them (a file's sibling links may go round)."""
    last = die.offset
    for count, child in enumerate(die.iter_children()):
        if count >= _MAX_CHILDREN or child.offset <= last:
            return
        last = child.offset
        yield child


def _name(die: DIE) -> str:
    """An inlined function's name, as its abstract origin (or what that specifies) gives it,
    as gdb shows it: a C++ linkage name demangled (qualified), else the name."""
    for _ in range(8):
        attrs = die.attributes
        for key in ("DW_AT_linkage_name", "DW_AT_MIPS_linkage_name"):
            if key in attrs and attrs[key].value.startswith(b"_Z"):
                return display(attrs[key].value.decode("utf-8", "replace"))
        if "DW_AT_name" in attrs:
            return str(attrs["DW_AT_name"].value.decode("utf-8", "replace"))
        origin = next((k for k in ("DW_AT_abstract_origin", "DW_AT_specification") if k in attrs), None)
        if origin is None:
            break
        die = die.get_DIE_from_attribute(origin)
    return "?"


@functools.lru_cache(maxsize=128)  # (a file's DWARF is held while it is used: not every file's forever)
def _lines_of(path: str) -> _Lines | None:
    try:
        image = load_elf(path)
        for candidate in (path, image.debug_file):
            if candidate is None:
                continue
            elf = ELFFile(io.BytesIO(read_regular(candidate, MAX_FILE_SIZE)))
            if elf.has_dwarf_info() and elf.get_section_by_name(".debug_line") is not None:
                return _Lines(elf.get_dwarf_info())
    except Exception as exc:  # (a file is untrusted: whatever pyelftools raises is no line)
        _debug(f"{path}: no line tables read: {exc!r}")
    return None


@functools.lru_cache(maxsize=1 << 16)
def source_line(path: str, vaddr: int) -> str | None:
    """`file:line` of the code at link-time address `vaddr` of the file at `path`, when it or
    its debug file has line tables."""
    with _LOCK:
        lines = _lines_of(path)
        if lines is None:
            return None
        try:
            found = lines.at(vaddr)
        except Exception as exc:  # (see _lines_of; RecursionError too, from a DIE tree deep enough)
            _debug(f"{path}: no line for {vaddr:#x}: {exc!r}")
            return None
    return f"{found[0]}:{found[1]}" if found is not None else None


@functools.lru_cache(maxsize=1 << 16)
def inlined_at(path: str, vaddr: int) -> tuple[tuple[str, str | None], ...]:
    """The functions inlined at link-time address `vaddr` of the file at `path`, outermost
    first, each with the `file:line` it was called from (none without DWARF)."""
    with _LOCK:
        lines = _lines_of(path)
        if lines is None:
            return ()
        try:
            return tuple(lines.inlined(vaddr))
        except Exception as exc:  # (see _lines_of; dwz's references to another file included)
            _debug(f"{path}: no inlined functions for {vaddr:#x}: {exc!r}")
            return ()
