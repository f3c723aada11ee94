"""The tracer's own stack walk (core/stacks.py) at its edges, over a process laid out here: a
stack read a page at a time (a word across two pages, pages outside user space or past the
walk's budget), frames named or not, walks cut where they must be; and DWARF that pyelftools
cannot read names no line instead of failing (symbols/lines.py)."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from dynprobe.arch.x86_64 import Regs
from dynprobe.core import stacks
from dynprobe.core.stacks import Stack, StackFrame, walk
from dynprobe.symbols.lines import inlined_at, source_line
from dynprobe.symbols.maps import Mapping

PAGE = 4096


def test_a_frame_without_a_symbol_is_its_address_and_module() -> None:
    assert str(StackFrame(0x1234, "/usr/lib/libx.so")) == "0x1234 (libx.so)"
    assert str(StackFrame(0x1234)) == "0x1234"
    assert str(StackFrame(0x1234, "/a/b", "f", 0x10)) == "f+0x10 (b)"
    assert str(Stack((StackFrame(1), StackFrame(2)), cut=True)).splitlines() == ["0x1", "0x2", "..."]


def test_the_stack_is_read_a_page_at_a_time_and_within_bounds() -> None:
    reads: list[int] = []

    def read(addr: int, size: int) -> bytes:
        reads.append(addr)
        return bytes((addr // PAGE + i) & 0xFF for i in range(size))

    memory = stacks._StackMemory(read)
    base = 0x7000_0000
    assert memory.u64(base + 8) == int.from_bytes(read(base, PAGE)[8:16], "little")
    across = memory.u64(base + PAGE - 3)  # (3 bytes of one page, 5 of the next)
    assert across == int.from_bytes(read(base, PAGE)[-3:] + read(base + PAGE, PAGE)[:5], "little")
    assert sorted(set(reads)) == [base, base + PAGE]
    for outside in (0, 1 << 47):
        with pytest.raises(OSError):
            memory.u64(outside)
    for page in range(stacks._MAX_PAGES - 2):
        memory.u64(0x1000_0000 + page * PAGE)
    with pytest.raises(OSError):  # (the walk's budget of pages spent)
        memory.u64(0x2000_0000)


def test_walks_cut_where_they_must_be(tmp_path: Path) -> None:
    """A leaf called from main, in a binary laid out at 0x400000 (no PIE): the walk stops at a
    return address into no code (cut), at max_frames (cut), and at a caller below its callee."""
    source = tmp_path / "w.c"
    source.write_text("__attribute__((noinline)) int leaf(int x) { return x + 1; }\n"
                      "int main(void) { return leaf(1); }\n")  # fmt: skip
    binary = tmp_path / "w"
    subprocess.run(["gcc", "-O0", "-g", "-no-pie", "-fno-omit-frame-pointer", "-o", str(binary), str(source)],
                   check=True)  # fmt: skip
    with open(binary, "rb") as f:
        symbols = {s.name: s["st_value"] for s in ELFFile(f).get_section_by_name(".symtab").iter_symbols()}
    text = [Mapping(0x400000, 0x402000, "r-xp", 0, 0, 0, str(binary))]
    leaf, main = symbols["leaf"], symbols["main"]
    sp = 0x7FFF_0000_0000

    def stack_of(words: dict[int, int], *, max_frames: int = 16) -> Stack:
        def read(addr: int, size: int) -> bytes:
            return b"".join(struct.pack("<Q", words.get(addr + i, 0)) for i in range(0, size, 8))

        regs = Regs(rip=leaf, rsp=sp, rbp=0)
        return walk(regs, text, read, real_return=lambda a: a, max_frames=max_frames, at_entry=True)

    into_nothing = stack_of({sp: 0x9999_0000})
    assert [f.function for f in into_nothing] == ["leaf"] and into_nothing.cut
    called = stack_of({sp: main + 8, sp + 8: 0})  # main's CFA rbp-based: rbp 0, so no further
    assert [f.function for f in called][:2] == ["leaf", "main"] and called.cut
    assert len(stack_of({sp: main + 8}, max_frames=1)) == 1 and stack_of({sp: main + 8}, max_frames=1).cut


def test_dwarf_pyelftools_cannot_read_names_no_line(tmp_path: Path) -> None:
    """The line table and the DIEs scribbled over: no line, no inlined function, no error."""
    source = tmp_path / "d.c"
    source.write_text("int main(void) {\n  return 0;\n}\n")
    binary = tmp_path / "d"
    subprocess.run(["gcc", "-O0", "-g", "-o", str(binary), str(source)], check=True)
    data = bytearray(binary.read_bytes())
    with open(binary, "rb") as f:
        elf = ELFFile(f)
        for name in (".debug_line", ".debug_info"):
            section = elf.get_section_by_name(name)
            start = section["sh_offset"] + 4
            data[start + 8 : section["sh_offset"] + section["sh_size"]] = b"\xff" * (section["sh_size"] - 12)
        main = next(s["st_value"] for s in elf.get_section_by_name(".symtab").iter_symbols() if s.name == "main")
    binary.write_bytes(data)
    assert source_line(str(binary), main) is None
    assert inlined_at(str(binary), main) == ()
