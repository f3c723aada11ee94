"""arch/x86_64/unwind.py: CFI compiled into rows (byte tables, then every row of real libraries
against pyelftools' decoding), and walk steps over rows with a fake stack."""

from __future__ import annotations

import io
import struct

import pytest
from elftools.dwarf.callframe import FDE, RegisterRule
from elftools.elf.elffile import ELFFile

from dynprobe.arch.x86_64.unwind import (
    RBP,
    RSP,
    BpRule,
    Frame,
    Kind,
    Row,
    compile_cfi,
    pack,
    step,
    unpack,
)
from dynprobe.symbols.loader import ld_cache


def uleb(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def entry(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


def cie(initial: bytes, augmentation: bytes = b"zR", data: bytes = b"\x1b") -> bytes:
    """A CIE as GCC writes it: code alignment 1, data alignment -8, return address r16, FDE
    pointers pc-relative sdata4; `initial`: its instructions."""
    aug = uleb(len(data)) + data if augmentation.startswith(b"z") else b""
    return entry(b"\0\0\0\0\x01" + augmentation + b"\0\x01\x78\x10" + aug + initial)


CIE_INITIAL = bytes([0x0C, 0x07, 0x08, 0x90, 0x01])  # def_cfa rsp+8; offset r16 at cfa-8


def fde(section: bytes, vaddr: int, start: int, size: int, program: bytes) -> bytes:
    """An FDE appended to `section` (its CIE first, at offset 0) for [start, start+size)."""
    at = len(section)
    pc_field = vaddr + at + 8
    return entry(struct.pack("<Iii", at + 4, start - pc_field, size) + b"\0" + program)


def table_of(*programs: tuple[int, int, bytes], initial: bytes = CIE_INITIAL, augmentation: bytes = b"zR",
             vaddr: int = 0x2000) -> list[tuple[int, Row | None]]:  # fmt: skip
    section = cie(initial, augmentation)
    for start, size, program in programs:
        section += fde(section, vaddr, start, size, program)
    table = compile_cfi(section + b"\0\0\0\0", vaddr)
    assert table.skipped == 0
    return [(start, unpack(row) if row != pack(Row(Kind.NONE, RSP, 0, BpRule.LOST, 0)) else None)
            for start, row in zip(table.starts, table.rows, strict=True)]  # fmt: skip


def cfa(base: int, offset: int, bp: BpRule = BpRule.SAME, bp_offset: int = 0) -> Row:
    return Row(Kind.CFA, base, offset, bp, bp_offset)


def test_a_function_with_frame_pointer_prologue() -> None:
    """push rbp; mov rbp, rsp; ... leave; ret: GCC's CFI for it, row by row."""
    program = bytes([
        0x41, 0x0E, 0x10, 0x86, 0x02,  # advance 1; def_cfa_offset 16; rbp at cfa-16
        0x43, 0x0D, 0x06,  # advance 3; def_cfa_register rbp
        0x4A, 0x0C, 0x07, 0x08,  # advance 10; def_cfa rsp+8 (after leave)
    ])  # fmt: skip
    assert table_of((0x1000, 0x20, program)) == [
        (0x1000, cfa(RSP, 8)),
        (0x1001, cfa(RSP, 16, BpRule.SAVED, -16)),
        (0x1004, cfa(RBP, 16, BpRule.SAVED, -16)),
        (0x100E, cfa(RSP, 8, BpRule.SAVED, -16)),
        (0x1020, None),
    ]


def test_remember_and_restore_state_and_restore_a_register() -> None:
    program = bytes([
        0x41, 0x0E, 0x10, 0x86, 0x02,  # advance 1: cfa rsp+16, rbp saved
        0x0A,  # remember
        0x42, 0x0E, 0x08, 0xC6,  # advance 2: cfa rsp+8, restore rbp (the CIE has no rule: same)
        0x41, 0x0B,  # advance 1: restore state
    ])  # fmt: skip
    assert table_of((0x1000, 0x10, program)) == [
        (0x1000, cfa(RSP, 8)),
        (0x1001, cfa(RSP, 16, BpRule.SAVED, -16)),
        (0x1003, cfa(RSP, 8)),
        (0x1004, cfa(RSP, 16, BpRule.SAVED, -16)),
        (0x1010, None),
    ]


def test_descriptions_next_to_each_other_and_apart() -> None:
    """A gap between two descriptions has no row; touching ones leave none between them."""
    rows = table_of((0x1000, 0x10, b""), (0x1010, 0x10, b""), (0x1040, 0x8, b""))
    assert rows == [(0x1000, cfa(RSP, 8)), (0x1020, None), (0x1040, cfa(RSP, 8)), (0x1048, None)]


def test_undefined_return_address_is_the_outermost_frame() -> None:
    assert table_of((0x1000, 4, bytes([0x07, 0x10])))[0] == (0x1000, Row(Kind.END, RSP, 0, BpRule.LOST, 0))


def test_a_signal_frame() -> None:
    rows = table_of((0x1000, 9, b""), augmentation=b"zRS")
    assert rows[0] == (0x1000, Row(Kind.SIGNAL, RSP, 0, BpRule.LOST, 0))


def test_the_plt_expression_and_other_expressions() -> None:
    """GNU ld's PLT CFA (rsp+8, 8 more from byte 11 of each 16-byte stub) is a row kind; any
    other CFA expression leaves the addresses without a row (frame pointers are tried)."""
    plt = bytes([0x0F, 11, 0x77, 0x08, 0x80, 0x00, 0x3F, 0x1A, 0x3B, 0x2A, 0x33, 0x24, 0x22])
    assert table_of((0x1000, 0x30, plt))[0] == (0x1000, Row(Kind.PLT, RSP, 8, BpRule.SAME, 11))
    other = bytes([0x0F, 2, 0x77, 0x08])
    assert table_of((0x1000, 0x30, other)) == [(0x1000, None)]


@pytest.mark.parametrize("program", [
    bytes([0x0B]),  # restore_state with nothing remembered
    bytes([0x3F]),  # an opcode no compiler writes
    bytes([0x0C, 0x07]),  # an operand cut off
    bytes([0x0A] * 65),  # states remembered without bound
])  # fmt: skip
def test_a_description_that_cannot_be_read_is_skipped(program: bytes) -> None:
    section = cie(CIE_INITIAL)
    section += fde(section, 0x2000, 0x1000, 0x10, program)
    section += fde(section, 0x2000, 0x1010, 0x10, b"")
    table = compile_cfi(section, 0x2000)
    assert table.skipped == 1 and table.find(0x1010) == cfa(RSP, 8) and table.find(0x1000) is None


@pytest.mark.parametrize("section", [
    b"", b"\xff" * 3, struct.pack("<I", 1 << 30) + b"\0" * 8,  # a length past the end
    entry(b"\0\0\0\0\x09zR\0"),  # a version that is not one
    entry(struct.pack("<I", 0x7FFF_FFF0) + b"\0" * 12),  # an FDE whose CIE is outside
])  # fmt: skip
def test_sections_that_are_not_cfi_give_no_rows(section: bytes) -> None:
    table = compile_cfi(section, 0x2000)
    assert table.find(0x1000) is None and table.find(0) is None


def test_debug_frame() -> None:
    """.debug_frame: CIE id all ones, CIE pointers section offsets, addresses absolute."""
    cie_body = b"\xff\xff\xff\xff\x01\0\x01\x78\x10" + CIE_INITIAL
    section = entry(cie_body)
    section += entry(struct.pack("<IQQ", 0, 0x1000, 0x10) + bytes([0x41, 0x0E, 0x10]))
    table = compile_cfi(section, 0, debug_frame=True)
    assert table.find(0x1000) == cfa(RSP, 8) and table.find(0x1001) == cfa(RSP, 16) and table.find(0x1010) is None


def test_rows_pack_and_unpack() -> None:
    for row in (cfa(RBP, -(1 << 31), BpRule.SAVED, -(1 << 15)), cfa(RSP, (1 << 31) - 1, BpRule.LOST, (1 << 15) - 1),
                Row(Kind.PLT, RSP, 8, BpRule.SAME, 11)):  # fmt: skip
        assert unpack(pack(row)) == row
    with pytest.raises(ValueError):
        pack(cfa(RSP, 1 << 31))


@pytest.mark.parametrize("soname", ["libc.so.6", "libstdc++.so.6", "ld-linux-x86-64.so.2"])
def test_every_row_of_a_library_is_pyelftools(soname: str) -> None:
    """Each row pyelftools decodes, at its address: the same CFA, rbp and return address rules
    (or no row, for the rules a walk does not follow)."""
    path = ld_cache().get(soname)
    if path is None:
        pytest.skip(f"no {soname} here")
    with open(path, "rb") as f:
        elf = ELFFile(io.BytesIO(f.read()))
    section = elf.get_section_by_name(".eh_frame")
    table = compile_cfi(section.data(), section["sh_addr"])
    assert table.skipped == 0
    checked = 0
    for description in elf.get_dwarf_info().EH_CFI_entries():
        if not isinstance(description, FDE):
            continue
        try:
            decoded = description.get_decoded()
        except Exception:  # (pyelftools knows fewer opcodes: libc has one it cannot read)
            continue
        signal = b"S" in description.cie.header.get("augmentation", b"")
        for rule in decoded.table:
            checked += 1
            assert table.find(rule["pc"]) == expected_row(rule, signal=signal), hex(rule["pc"])
    assert checked > 1000


def expected_row(rule: dict[object, object], *, signal: bool) -> Row | None:
    cfa_rule, ra, bp = rule["cfa"], rule.get(16), rule.get(6)
    if signal:
        return Row(Kind.SIGNAL, RSP, 0, BpRule.LOST, 0)
    if isinstance(ra, RegisterRule) and ra.type == RegisterRule.UNDEFINED:
        return Row(Kind.END, RSP, 0, BpRule.LOST, 0)
    if cfa_rule.expr is not None:  # type: ignore[attr-defined]
        return Row(Kind.PLT, RSP, 8, BpRule.SAME, 11)  # (the only expression libraries have)
    if cfa_rule.reg not in (RSP, RBP) or not (isinstance(ra, RegisterRule) and ra.type == "OFFSET" and ra.arg == -8):  # type: ignore[attr-defined]
        return None
    if bp is None or bp.type == RegisterRule.SAME_VALUE:  # type: ignore[attr-defined]
        bp_rule, bp_offset = BpRule.SAME, 0
    elif bp.type == RegisterRule.OFFSET:  # type: ignore[attr-defined]
        bp_rule, bp_offset = BpRule.SAVED, bp.arg  # type: ignore[attr-defined]
    else:
        bp_rule, bp_offset = BpRule.LOST, 0
    return Row(Kind.CFA, cfa_rule.reg, cfa_rule.offset, bp_rule, bp_offset)  # type: ignore[attr-defined]


class FakeStack:
    def __init__(self, words: dict[int, int]) -> None:
        self.words = words

    def __call__(self, addr: int) -> int:
        if addr not in self.words:
            raise OSError("unmapped")
        return self.words[addr]


def test_steps() -> None:
    memory = FakeStack({0x7000: 0x401234, 0x7010: 0x7100, 0x7018: 0x405678, 0x7100 + 8: 0x40AAAA, 0x7100: 0})
    at_entry = Frame(0x400000, 0x7000, 0x7100, exact=True)
    assert step(at_entry, cfa(RSP, 8), memory) == Frame(0x401234, 0x7008, 0x7100, exact=False)
    in_body = Frame(0x400010, 0x7000, 0x7010, exact=True)
    assert step(in_body, cfa(RBP, 16, BpRule.SAVED, -16), memory) == Frame(0x405678, 0x7020, 0x7100, exact=False)
    assert step(in_body, cfa(RBP, 16, BpRule.LOST), memory) == Frame(0x405678, 0x7020, None, exact=False)
    lost = Frame(0x400010, 0x7000, None, exact=False)
    assert step(lost, cfa(RBP, 16), memory) is None  # (rbp unknown past a frame that lost it)
    assert step(in_body, None, memory) == Frame(0x405678, 0x7020, 0x7100, exact=False)  # frame pointers
    assert step(Frame(0, 0x7000, 0x6000, exact=True), None, memory) is None  # rbp below rsp: no frame
    assert step(at_entry, Row(Kind.END, RSP, 0, BpRule.LOST, 0), memory) is None
    assert step(Frame(0x400000, 0x9000, 0, exact=True), cfa(RSP, 8), memory) is None  # unreadable
    plt = Row(Kind.PLT, RSP, 8, BpRule.SAME, 11)
    assert step(Frame(0x40100A, 0x7010, 1, exact=True), plt, memory) == Frame(0x7100, 0x7018, 1, exact=False)
    assert step(Frame(0x40100B, 0x7010, 1, exact=True), plt, memory) == Frame(0x405678, 0x7020, 1, exact=False)


def test_a_signal_frame_step_reads_the_ucontext() -> None:
    sp = 0x8000
    gregs = sp + 40
    memory = FakeStack({gregs + 8 * 10: 0x7FF0, gregs + 8 * 15: 0x7F00, gregs + 8 * 16: 0x401111})
    assert step(Frame(0x500000, sp, None, exact=False), Row(Kind.SIGNAL, RSP, 0, BpRule.LOST, 0), memory) == Frame(
        0x401111, 0x7F00, 0x7FF0, exact=True
    )
