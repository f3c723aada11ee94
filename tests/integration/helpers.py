"""Helpers for integration tests: symbol addresses of test targets, running them plainly."""

from __future__ import annotations

import subprocess

from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection


def symbols(path: str) -> dict[str, int]:
    """Every named symbol of an ELF file -> its value (link-time address)."""
    with open(path, "rb") as f:
        elf = ELFFile(f)
        table = elf.get_section_by_name(".symtab")
        assert isinstance(table, SymbolTableSection)
        return {s.name: s["st_value"] for s in table.iter_symbols() if s.name}


def run_plain(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
