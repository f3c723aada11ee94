"""Reading an ELF file with pyelftools: its headers, symbol tables and relocations (the tables
decoded in bulk with numpy: pyelftools parses a row at a time, ~50 us each, which is seconds for
a binary with 10^5 functions). symbols/elf.py loads this module only when what it keeps of a file
on disk (symbols/elf_cache.py) does not answer.
"""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from elftools.common.exceptions import DWARFError, ELFError
from elftools.construct.core import ConstructError
from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile
from elftools.elf.gnuversions import GNUVerDefSection
from elftools.elf.sections import Section, SymbolTableSection

ERRORS = (ELFError, DWARFError, ConstructError)  # pyelftools' own, for a malformed file
SYM = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"), ("value", "<u8"), ("size", "<u8")])
RELA = np.dtype([("offset", "<u8"), ("info", "<u8"), ("addend", "<i8")])
_STT_OBJECT, _STT_FUNC, _STT_TLS, _STT_GNU_IFUNC = 1, 2, 6, 10
_VER_FLG_BASE = 1  # a version definition that names the file itself, not a version


class Elf(ELFFile):
    """pyelftools' ELFFile, making a section only when it is asked for: its own map of names made
    every section, and making a hash section parses its whole table (libc's .hash: ~15 ms)."""

    @functools.cached_property
    def _section_name_map(self) -> dict[str, int]:
        return {self._get_section_name(self._get_section_header(i)): i for i in range(self.num_sections())}

    def iter_sections(self, type: str | None = None) -> Iterator[Section]:  # (pyelftools' names)
        for i in range(self.num_sections()):
            header = self._get_section_header(i)
            if type is None or header["sh_type"] == type:
                yield self._make_section(header)


def open_elf(data: bytes) -> Elf:
    return Elf(io.BytesIO(data))


def build_id(elf: ELFFile) -> str | None:
    for section in elf.iter_sections("SHT_NOTE"):
        for note in section.iter_notes():  # type: ignore[attr-defined]
            if note["n_type"] == "NT_GNU_BUILD_ID":
                return str(note["n_desc"])
    return None


def dynamic(elf: ELFFile) -> tuple[list[str], list[str], list[str], str | None]:
    """DT_NEEDED names, DT_RPATH and DT_RUNPATH directories (in their order), DT_SONAME."""
    needed: list[str] = []
    rpath: list[str] = []
    runpath: list[str] = []
    soname: list[str] = []
    into = {"DT_NEEDED": needed, "DT_RPATH": rpath, "DT_RUNPATH": runpath, "DT_SONAME": soname}
    section = elf.get_section_by_name(".dynamic")
    if isinstance(section, DynamicSection):
        for tag in section.iter_tags():
            kind = tag.entry.d_tag
            if kind in into:  # pyelftools sets the string as .needed, .rpath, .runpath, .soname
                value = str(getattr(tag, kind[3:].lower()))
                into[kind] += value.split(":") if kind in ("DT_RPATH", "DT_RUNPATH") else [value]
    return needed, rpath, runpath, soname[0] if soname else None


def symbols(elf: ELFFile) -> tuple[list[tuple[str, int, int]], dict[str, int], dict[str, int], dict[str, str]]:
    """Functions (name, address, size: one of each name at each address), data symbols (name ->
    address, for @SYM), indirect functions (name -> resolver: symbols/ifunc.py) of .symtab and
    .dynsym, and the default version of each versioned name ('exp' -> 'GLIBC_2.29')."""
    seen: dict[tuple[str, int], int] = {}
    objects: dict[str, int] = {}
    ifuncs: dict[str, int] = {}
    defaults: dict[str, str] = {}
    for table in (".symtab", ".dynsym"):
        section = elf.get_section_by_name(table)
        if not isinstance(section, SymbolTableSection) or section["sh_entsize"] != SYM.itemsize:
            continue
        old, default = versions(elf) if table == ".dynsym" else ({}, {})
        strtab = elf.get_section(section["sh_link"]).data()
        syms = np.frombuffer(section.data(), dtype=SYM)
        kind = syms["info"] & 0xF
        defined = (syms["shndx"] != 0) & (syms["value"] != 0)
        for into, rows in (
            # Not STT_GNU_IFUNC: its address is the resolver, which runs once at load time.
            (None, np.nonzero(defined & (kind == _STT_FUNC))[0]),
            (objects, np.nonzero((syms["shndx"] != 0) & np.isin(kind, (_STT_OBJECT, _STT_TLS)))[0]),
            (ifuncs, np.nonzero(defined & (kind == _STT_GNU_IFUNC))[0]),
        ):
            for row, name_off, value, size in zip(
                rows.tolist(), syms["name"][rows].tolist(), syms["value"][rows].tolist(),
                syms["size"][rows].tolist(), strict=True,
            ):  # fmt: skip
                end = strtab.find(b"\0", name_off)
                name = strtab[name_off : end if end >= 0 else len(strtab)].decode("utf-8", "replace")
                # A name's default version is the name ('exp@@GLIBC_2.29' in .symtab); an
                # older one keeps its version ('exp@GLIBC_2.2.5'): programs linked today call
                # the default, and a probe on the name must be there.
                clean, _, version = name.partition("@@")
                if row in old:
                    clean = f"{name}@{old[row]}"
                elif version or row in default:
                    defaults.setdefault(clean, version or default[row])
                if into is None:
                    seen.setdefault((clean, value), size)
                else:
                    into.setdefault(clean, value)
    return [(name, value, size) for (name, value), size in seen.items()], objects, ifuncs, defaults


def versions(elf: ELFFile) -> tuple[dict[int, str], dict[int, str]]:
    """.dynsym index -> the version of each symbol that is not its name's default (hidden in
    .gnu.version: a compatibility symbol such as memcpy@GLIBC_2.2.5 or exp@GLIBC_2.2.5), and
    of each that is (exp@@GLIBC_2.29, as `nm -D` prints it). Symbols this file defines only:
    versions it needs from others are not in .gnu.version_d."""
    versym = elf.get_section_by_name(".gnu.version")
    verdef = elf.get_section_by_name(".gnu.version_d")
    if versym is None or not isinstance(verdef, GNUVerDefSection):
        return {}, {}
    names: dict[int, str] = {}
    for definition, auxiliaries in verdef.iter_versions():
        first = next(iter(auxiliaries), None)
        if first is not None and not definition["vd_flags"] & _VER_FLG_BASE:
            names[definition["vd_ndx"]] = first.name
    indices = np.frombuffer(versym.data(), dtype="<u2")
    old: dict[int, str] = {}
    default: dict[int, str] = {}
    for i in np.nonzero(np.isin(indices & 0x7FFF, list(names)))[0].tolist():
        index = int(indices[i])
        (old if index & 0x8000 else default)[i] = names[index & 0x7FFF]
    for i in np.nonzero(indices & 0x8000)[0].tolist():
        old.setdefault(i, "old")
    return old, default


def relocations(elf: ELFFile) -> Iterator[tuple[np.ndarray, Callable[[int], str]]]:
    """Each SHT_RELA section's rows, and the name of a symbol of its symbol table by index."""
    for section in elf.iter_sections("SHT_RELA"):
        if section["sh_entsize"] != RELA.itemsize:
            continue
        table = elf.get_section(section["sh_link"]) if section["sh_link"] else None
        symbols = np.frombuffer(table.data(), dtype=SYM) if isinstance(table, SymbolTableSection) else None
        strtab = elf.get_section(table["sh_link"]).data() if symbols is not None and table else b""

        def name(index: int, symbols: np.ndarray | None = symbols, strtab: bytes = strtab) -> str:
            if symbols is None or index >= len(symbols):
                return ""
            start = int(symbols["name"][index])
            end = strtab.find(b"\0", start)
            return strtab[start : end if end >= 0 else len(strtab)].decode("utf-8", "replace")

        yield np.frombuffer(section.data(), dtype=RELA), name


def headers(elf: ELFFile) -> dict[str, Any]:
    """The fields of symbols/elf.py's Headers (its segments as dicts of Segment's fields)."""
    segments = list(elf.iter_segments())
    interp = next((s for s in segments if s["p_type"] == "PT_INTERP"), None)
    link = elf.get_section_by_name(".gnu_debuglink")
    needed, rpath, runpath, soname = dynamic(elf)
    return dict(
        machine=str(elf["e_machine"]), is_pie=elf["e_type"] == "ET_DYN",
        segments=[{"vaddr": s["p_vaddr"], "offset": s["p_offset"], "filesz": s["p_filesz"], "memsz": s["p_memsz"],
                   "executable": bool(s["p_flags"] & 1), "writable": bool(s["p_flags"] & 2)}
                  for s in segments if s["p_type"] == "PT_LOAD"],
        interp=None if interp is None else interp.get_interp_name(),  # type: ignore[attr-defined]
        build_id=build_id(elf), entry=int(elf["e_entry"]),
        is_go=any(elf.get_section_by_name(n) is not None for n in (".go.buildinfo", ".gopclntab")),
        needed=needed, rpath=rpath, runpath=runpath, soname=soname,
        has_symtab=elf.get_section_by_name(".symtab") is not None,
        debuglink=None if link is None else os.fsdecode(link.data().split(b"\0", 1)[0]),
    )  # fmt: skip
