"""Source lines of code addresses, from DWARF line tables (`file:line` in stacks).

A file's own debug information, or its separate debug file's (`ElfImage.debug_file`). Looked
up lazily and by compilation unit: .debug_aranges says which unit holds an address, and only
that unit's line program is decoded (libc's whole table would take seconds; one unit takes
milliseconds). A file is untrusted: anything pyelftools cannot read is no line, never an error.
"""

from __future__ import annotations

import bisect
import functools
import io

from elftools.common.exceptions import DWARFError, ELFError
from elftools.construct.core import ConstructError
from elftools.dwarf.dwarfinfo import DWARFInfo
from elftools.elf.elffile import ELFFile

from dynprobe.debug import debug as _debug
from dynprobe.errors import DynprobeError
from dynprobe.output.files import read_regular
from dynprobe.symbols.elf import MAX_FILE_SIZE, load_elf

_UNREADABLE = (ELFError, DWARFError, ConstructError, KeyError, ValueError, IndexError, AssertionError,
               OverflowError, TypeError, AttributeError, ZeroDivisionError, OSError, DynprobeError)  # fmt: skip


class _Lines:
    """One file's DWARF: its units' line tables, decoded as they are asked for."""

    def __init__(self, dwarf: DWARFInfo) -> None:
        self.dwarf = dwarf
        self.aranges = dwarf.get_aranges()
        self.units: dict[int, tuple[list[int], list[tuple[str, int]]]] = {}

    def at(self, vaddr: int) -> tuple[str, int] | None:
        offset = self.aranges.cu_offset_at_addr(vaddr) if self.aranges is not None else None
        if offset is None:
            return None
        if offset not in self.units:
            self.units[offset] = self._unit(offset)
        addresses, lines = self.units[offset]
        i = bisect.bisect_right(addresses, vaddr) - 1
        return lines[i] if i >= 0 else None

    def _unit(self, offset: int) -> tuple[list[int], list[tuple[str, int]]]:
        """The unit's rows by address: (file, line) from each row's address on."""
        unit = self.dwarf.get_CU_at(offset)
        program = self.dwarf.line_program_for_CU(unit)
        if program is None:
            return [], []
        header = program.header
        files = header["file_entry"]
        first = 0 if header["version"] >= 5 else 1  # (file numbers: from 0 in DWARF 5, from 1 before)
        rows: list[tuple[int, tuple[str, int]]] = []
        for entry in program.get_entries():
            state = entry.state
            if state is None or state.end_sequence:
                continue
            index = state.file - first
            name = files[index].name.decode("utf-8", "replace") if 0 <= index < len(files) else "?"
            rows.append((state.address, (name, state.line)))
        rows.sort(key=lambda row: row[0])
        return [a for a, _ in rows], [line for _, line in rows]


@functools.lru_cache(maxsize=32)  # (a file's DWARF is held while it is used: not every file's forever)
def _lines_of(path: str) -> _Lines | None:
    try:
        image = load_elf(path)
        for candidate in (path, image.debug_file):
            if candidate is None:
                continue
            elf = ELFFile(io.BytesIO(read_regular(candidate, MAX_FILE_SIZE)))
            if elf.has_dwarf_info() and elf.get_section_by_name(".debug_line") is not None:
                return _Lines(elf.get_dwarf_info())
    except _UNREADABLE as exc:
        _debug(f"{path}: no line tables read: {exc}")
    return None


@functools.lru_cache(maxsize=1 << 16)
def source_line(path: str, vaddr: int) -> str | None:
    """`file:line` of the code at link-time address `vaddr` of the file at `path`, when it or
    its debug file has line tables."""
    lines = _lines_of(path)
    if lines is None:
        return None
    try:
        found = lines.at(vaddr)
    except _UNREADABLE as exc:
        _debug(f"{path}: no line for {vaddr:#x}: {exc}")
        return None
    return f"{found[0]}:{found[1]}" if found is not None else None
