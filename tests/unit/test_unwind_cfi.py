"""The CFI interpreter (arch/x86_64/unwind.py) instruction by instruction, header by header: each
DW_CFA opcode, each pointer encoding, each CIE form, the bounds a row can hold, and the sections
it must refuse (a description skipped and counted, never a wrong row). Byte tables written here;
test_unwind.py checks whole libraries against pyelftools."""

from __future__ import annotations

import struct

import pytest

from dynprobe.arch.x86_64.unwind import (
    RBP,
    RSP,
    BpRule,
    CfiSection,
    Frame,
    Kind,
    Row,
    UnwindTable,
    compile_cfi,
    compile_sections,
    pack,
    step,
    unpack,
)

from .test_unwind import CIE_INITIAL, cfa, cie, entry, fde, table_of, uleb

SAVED, LOST = BpRule.SAVED, BpRule.LOST
PLT = [0x0F, 11, 0x77, 0x08, 0x80, 0x00, 0x3F, 0x1A, 0x3B, 0x2A, 0x33, 0x24, 0x22]  # GNU ld's, threshold 11


def sleb(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        done = (value == 0 and not byte & 0x40) or (value == -1 and byte & 0x40)
        out.append(byte | (0 if done else 0x80))
        if done:
            return bytes(out)


INSTRUCTIONS = [
    ("offset", [0x86, 0x02], cfa(RSP, 8, SAVED, -16)),
    ("restore", [0x86, 0x02, 0xC6], cfa(RSP, 8)),
    ("nop", [0x00, 0x86, 0x02, 0x00], cfa(RSP, 8, SAVED, -16)),
    ("offset_extended", [0x05, 0x06, 0x02], cfa(RSP, 8, SAVED, -16)),
    ("offset_extended_sf", [0x11, 0x06, *sleb(-2)], cfa(RSP, 8, SAVED, 16)),
    ("val_offset", [0x14, 0x06, 0x02], cfa(RSP, 8, LOST)),
    ("val_offset_sf", [0x15, 0x06, *sleb(-2)], cfa(RSP, 8, LOST)),
    ("GNU_negative_offset_extended", [0x2F, 0x06, 0x02], cfa(RSP, 8, SAVED, 16)),
    ("restore_extended", [0x86, 0x02, 0x06, 0x06], cfa(RSP, 8)),
    ("undefined rbp", [0x07, 0x06], cfa(RSP, 8, LOST)),
    ("same_value", [0x86, 0x02, 0x08, 0x06], cfa(RSP, 8)),
    ("register: in another", [0x09, 0x06, 0x03], cfa(RSP, 8, LOST)),
    ("register: in itself", [0x86, 0x02, 0x09, 0x06, 0x06], cfa(RSP, 8)),
    ("def_cfa", [0x0C, 0x06, 0x10], cfa(RBP, 16)),
    ("def_cfa_sf", [0x12, 0x07, *sleb(-2)], cfa(RSP, 16)),
    ("def_cfa_register", [0x0D, 0x06], cfa(RBP, 8)),
    ("def_cfa_offset", [0x0E, 0x20], cfa(RSP, 32)),
    ("def_cfa_offset_sf", [0x13, *sleb(-4)], cfa(RSP, 32)),
    ("a CFA register neither rsp nor rbp", [0x0D, 0x03], None),
    ("expression", [0x10, 0x06, 0x01, 0x00], cfa(RSP, 8, LOST)),
    ("val_expression", [0x16, 0x06, 0x01, 0x00], cfa(RSP, 8, LOST)),
    ("GNU_args_size", [0x2E, 0x10], cfa(RSP, 8)),
    ("the return address elsewhere", [0x90, 0x02], None),
    ("the return address restored to the CIE's rule", [0x90, 0x02, 0xD0], cfa(RSP, 8)),
    ("the return address undefined", [0x07, 0x10], Row(Kind.END, RSP, 0, LOST, 0)),
    ("rsp with a rule", [0x87, 0x01], None),
    ("rbp saved as far below as a row holds", [0x86, *uleb(4096)], cfa(RSP, 8, SAVED, -32768)),
    ("rbp saved farther below", [0x86, *uleb(4097)], cfa(RSP, 8, LOST)),
    ("rbp saved as far above as a row holds", [0x11, 0x06, *sleb(-4095)], cfa(RSP, 8, SAVED, 32760)),
    ("rbp saved farther above", [0x11, 0x06, *sleb(-4096)], cfa(RSP, 8, LOST)),
    ("a CFA offset a row cannot hold", [0x0E, *uleb(1 << 31)], None),
    ("the largest CFA offset a row holds", [0x0E, *uleb((1 << 31) - 1)], cfa(RSP, (1 << 31) - 1)),
    ("the PLT expression", PLT, Row(Kind.PLT, RSP, 8, BpRule.SAME, 11)),
    ("the PLT expression, then def_cfa", [*PLT, 0x0C, 0x07, 0x10], cfa(RSP, 16)),
    ("the PLT expression, then def_cfa_register", [*PLT, 0x0D, 0x06], cfa(RBP, 8)),
    ("the PLT expression at threshold 0", [*PLT[:8], 0x30, *PLT[9:]], Row(Kind.PLT, RSP, 8, BpRule.SAME, 0)),
    ("the PLT expression at threshold 31", [*PLT[:8], 0x4F, *PLT[9:]], Row(Kind.PLT, RSP, 8, BpRule.SAME, 31)),
    ("the PLT expression with a literal past 31", [*PLT[:8], 0x50, *PLT[9:]], None),
    ("the PLT expression with a literal below 0", [*PLT[:8], 0x2F, *PLT[9:]], None),
    ("a uleb ending at 0x7f", [0x0E, 0x7F], cfa(RSP, 127)),
    ("a sleb of -1", [0x12, 0x07, *sleb(-1)], cfa(RSP, 8)),
    ("a sleb of 63", [0x12, 0x07, *sleb(63)], cfa(RSP, -504)),
    ("a sleb of 64 (two bytes)", [0x12, 0x07, *sleb(64)], cfa(RSP, -512)),
    ("a sleb of -64", [0x12, 0x07, *sleb(-64)], cfa(RSP, 512)),
    ("a sleb of -65 (two bytes)", [0x12, 0x07, *sleb(-65)], cfa(RSP, 520)),
    ("a uleb of 2^63 (ten bytes)", [0x0E, *uleb(1 << 63)], None),
    ("the PLT expression at rsp+24", [*PLT[:3], 0x18, *PLT[4:]], Row(Kind.PLT, RSP, 24, BpRule.SAME, 11)),
    ("an expression on another register", [*PLT[:2], 0x76, *PLT[3:]], None),
    ("an expression one byte short", [0x0F, 10, *PLT[2:-1]], None),
    ("an expression with another tail", [*PLT[:-1], 0x23], None),
    ("an expression with another head", [*PLT[:4], 0x81, *PLT[5:]], None),
    ("an expression whose offset is cut off", [0x0F, 2, 0x77, 0x80], None),
]  # fmt: skip


@pytest.mark.parametrize(("program", "row"), [(bytes(p), r) for _, p, r in INSTRUCTIONS],
                         ids=[n for n, _, _ in INSTRUCTIONS])  # fmt: skip
def test_each_instruction(program: bytes, row: Row | None) -> None:
    assert table_of((0x1000, 0x10, program))[0] == (0x1000, row)


@pytest.mark.parametrize(("advance", "size"), [([0x45], 5), ([0x02, 5], 5), ([0x03, 5, 1], 0x105),
                                               ([0x04, 5, 0, 1, 0], 0x10005)])  # fmt: skip
def test_each_advance(advance: list[int], size: int) -> None:
    """advance_loc (in the opcode), advance_loc1, 2 and 4: the rule after it holds from there."""
    assert table_of((0x1000, 0x20000, bytes([*advance, 0x0E, 0x10]))) == [
        (0x1000, cfa(RSP, 8)), (0x1000 + size, cfa(RSP, 16)), (0x21000, None),
    ]  # fmt: skip


def test_advances_are_in_code_alignment_units() -> None:
    section = entry(b"\0\0\0\0\x01zR\0\x04\x78\x10\x01\x1b" + CIE_INITIAL)  # code alignment 4
    section += fde(section, 0x2000, 0x1000, 0x20, bytes([0x42, 0x0E, 0x10, 0x03, 2, 0, 0x0E, 0x18]))
    table = compile_cfi(section, 0x2000)
    assert [table.find(a) for a in (0x1007, 0x1008, 0x100F, 0x1010)] == [
        cfa(RSP, 8), cfa(RSP, 16), cfa(RSP, 16), cfa(RSP, 24),
    ]  # fmt: skip


def set_loc_program(section: bytes, vaddr: int, target: int) -> bytes:
    """A program that sets the location to `target` (pc-relative sdata4, as GCC's CIE says),
    then rsp+16: in the FDE fde() appends to `section`, its operand 18 bytes in."""
    field = vaddr + len(section) + 18
    return bytes([0x01]) + struct.pack("<i", target - field) + bytes([0x0E, 0x10])


def test_set_loc_forward_and_back() -> None:
    section = cie(CIE_INITIAL)
    section += fde(section, 0x2000, 0x1000, 0x20, set_loc_program(section, 0x2000, 0x1008))
    table = compile_cfi(section, 0x2000)
    assert (table.find(0x1007), table.find(0x1008), table.skipped) == (cfa(RSP, 8), cfa(RSP, 16), 0)
    section = cie(CIE_INITIAL)
    section += fde(section, 0x2000, 0x1000, 0x20, set_loc_program(section, 0x2000, 0x0FFF))  # (backwards)
    assert compile_cfi(section, 0x2000).skipped == 1


@pytest.mark.parametrize("program", [bytes([0x03, 5]), bytes([0x10, 0x06, 0x05, 0x00]), bytes([0x01, 0, 0])],
                         ids=["advance_loc2 cut off", "a block past the end", "set_loc cut off"])  # fmt: skip
def test_an_operand_past_the_description_skips_it(program: bytes) -> None:
    section = cie(CIE_INITIAL)
    section += fde(section, 0x2000, 0x1000, 0x10, program)
    assert compile_cfi(section, 0x2000).skipped == 1


def test_a_uleb_past_64_bits_skips_the_description() -> None:
    section = cie(CIE_INITIAL)
    section += fde(section, 0x2000, 0x1000, 0x10, bytes([0x0E, *uleb(1 << 63)]))
    assert compile_cfi(section, 0x2000).skipped == 0  # (ten bytes: read, a CFA offset no row holds)
    section = cie(CIE_INITIAL)
    section += fde(section, 0x2000, 0x1000, 0x10, bytes([0x0E, *([0x80] * 10), 0x01]))
    assert compile_cfi(section, 0x2000).skipped == 1  # (eleven)


def test_set_loc_to_where_it_is() -> None:
    section = cie(CIE_INITIAL)
    section += fde(section, 0x2000, 0x1000, 0x20, set_loc_program(section, 0x2000, 0x1000))
    table = compile_cfi(section, 0x2000)
    assert (table.find(0x1000), table.skipped) == (cfa(RSP, 16), 0)


def test_a_cie_without_a_cfa_rule_is_the_call_s() -> None:
    """A CIE that says only where the return address is: the CFA is rsp+8, as at a call."""
    assert table_of((0x1000, 0x10, b""), initial=bytes([0x90, 0x01]))[0] == (0x1000, cfa(RSP, 8))


def test_rows_at_the_end_and_replaced() -> None:
    """A rule from the description's end on adds no row; rules at one address, the last holds
    (at its start too); a row that ends up equal to the one before it adds none."""
    assert table_of((0x1000, 4, bytes([0x44, 0x0E, 0x10]))) == [(0x1000, cfa(RSP, 8)), (0x1004, None)]
    assert table_of((0x1000, 4, bytes([0x40, 0x0E, 0x10]))) == [(0x1000, cfa(RSP, 16)), (0x1004, None)]
    assert table_of((0x1000, 8, bytes([0x41, 0x0E, 0x10, 0x41, 0x0E, 0x18, 0x40, 0x0E, 0x20]))) == [
        (0x1000, cfa(RSP, 8)), (0x1001, cfa(RSP, 16)), (0x1002, cfa(RSP, 32)), (0x1008, None),
    ]  # fmt: skip


def test_rules_past_the_description_end_add_no_row() -> None:
    assert table_of((0x1000, 4, bytes([0x48, 0x0E, 0x10]))) == [(0x1000, cfa(RSP, 8)), (0x1004, None)]


def test_a_row_at_an_advance_of_zero_replaces_the_one_before() -> None:
    """Two rules at one address: the last holds; one that ends up as the row before it adds none."""
    assert table_of((0x1000, 0x10, bytes([0x41, 0x0E, 0x10, 0x40, 0x0E, 0x18]))) == [
        (0x1000, cfa(RSP, 8)), (0x1001, cfa(RSP, 24)), (0x1010, None),
    ]  # fmt: skip
    assert table_of((0x1000, 0x10, bytes([0x41, 0x0E, 0x10, 0x40, 0x0E, 0x08]))) == [
        (0x1000, cfa(RSP, 8)), (0x1010, None),
    ]  # fmt: skip


# --- headers --------------------------------------------------------------------------------------
def cie_of(*, version: int = 1, augmentation: bytes = b"zR", data: bytes = b"\x1b", code_align: int = 1,
           ra: int = 16, address_size: int = 8, eh: bytes = b"", initial: bytes = CIE_INITIAL) -> bytes:  # fmt: skip
    fields = bytes([version]) + augmentation + b"\0"
    if version == 4:
        fields += bytes([address_size, 0])
    fields += eh + uleb(code_align) + sleb(-8) + (bytes([ra]) if version == 1 else uleb(ra))
    if augmentation.startswith(b"z"):
        fields += uleb(len(data)) + data
    return entry(b"\0\0\0\0" + fields + initial)


def fde_encoded(section: bytes, encoding: int, *, start: int = 0x1000, size: int = 0x10, vaddr: int = 0x2000,
                augmentation: bytes = b"\0", program: bytes = b"\x0e\x10") -> bytes:  # fmt: skip
    """An FDE appended to `section` (CIE at offset 0), its start and size in `encoding`."""
    at = len(section)

    def encoded(value: int, field: int, application: bool) -> bytes:
        if application and encoding & 0x70 == 0x10:
            value -= vaddr + field
        form = encoding & 0x0F
        if form in (0x01, 0x09):
            return uleb(value) if form == 0x01 else sleb(value)
        fmt = {0x00: "<Q", 0x02: "<H", 0x03: "<I", 0x04: "<Q", 0x0A: "<h", 0x0B: "<i", 0x0C: "<q"}[form]
        return struct.pack(fmt, value)

    pc = encoded(start, at + 8, True)
    body = struct.pack("<I", at + 4) + pc + encoded(size, at + 8 + len(pc), False) + augmentation + program
    return entry(body)


ENCODINGS = [0x00, 0x01, 0x02, 0x03, 0x04, 0x09, 0x0A, 0x0B, 0x0C, 0x10, 0x12, 0x13, 0x14, 0x1A, 0x1B, 0x1C]


@pytest.mark.parametrize("encoding", ENCODINGS, ids=[f"{e:#04x}" for e in ENCODINGS])
def test_each_pointer_encoding(encoding: int) -> None:
    section = cie_of(data=bytes([encoding]))
    section += fde_encoded(section, encoding, start=0x7000)  # (above the section: every form holds it)
    table = compile_cfi(section, 0x2000)
    assert (table.find(0x7000), table.find(0x7010), table.skipped) == (cfa(RSP, 16), None, 0)


@pytest.mark.parametrize("encoding", [0x05, 0x0D, 0x23, 0x33, 0x43, 0x53])
def test_an_encoding_no_linker_writes_is_refused(encoding: int) -> None:
    """A form (0x05, 0x0D) or an application (text, data, function-relative, aligned) no linker
    writes for x86-64: the FDE is skipped (read as absolute, it would have had a row)."""
    section = cie_of(data=bytes([encoding]))
    if encoding & 0x0F in (0x05, 0x0D):
        section += entry(struct.pack("<I", len(section) + 4) + b"\0" * 24)
    else:
        section += fde_encoded(section, encoding & 0x0F)
    assert compile_cfi(section, 0x2000).skipped == 1


def test_pc_relative_addresses_wrap_at_2_64() -> None:
    """A section high in the address space, its FDE's pc-relative start past 2^64: it wraps."""
    vaddr = (1 << 64) - 0x100
    section = cie(CIE_INITIAL)
    at = len(section)
    field = vaddr + at + 8
    section += entry(struct.pack("<Iii", at + 4, 0x500 + (1 << 64) - field, 0x10) + b"\0" + bytes([0x0E, 0x10]))
    table = compile_cfi(section, vaddr)
    assert (table.find(0x500), table.skipped) == (cfa(RSP, 16), 0)


def test_fdes_as_high_as_addresses_go() -> None:
    """An FDE past 2^63 is read (udata8); one that would end past 2^64 is skipped."""
    section = cie_of(data=b"\x04")
    section += fde_encoded(section, 0x04, start=(1 << 63) + 0x1000, size=0x10)
    assert compile_cfi(section, 0x2000).find((1 << 63) + 0x1000) == cfa(RSP, 16)


HEADERS = [
    ("version 3 (the return address register a uleb)", cie_of(version=3)),
    ("version 4 (address and segment sizes)", cie_of(version=4)),
    ("the eh augmentation (a pointer of old GCCs)", cie_of(augmentation=b"eh", eh=b"\0" * 8)),
    ("a personality and an LSDA", cie_of(augmentation=b"zPLR", data=b"\x9b\0\0\0\0\x00\x1b")),
    ("version 3, the return address register in two bytes",
     entry(b"\0\0\0\0\x03zR\0\x01\x78\x90\x00\x01\x1b" + CIE_INITIAL)),
    ("an absolute personality", cie_of(augmentation=b"zPLR", data=b"\x00" + b"\0" * 8 + b"\x1b\x1b")),
    ("B and G", cie_of(augmentation=b"zRBG")),
]  # fmt: skip


@pytest.mark.parametrize("header", [h for _, h in HEADERS], ids=[n for n, _ in HEADERS])
def test_each_cie_form(header: bytes) -> None:
    augmented = b"zPLR" in header
    section = header
    section += fde_encoded(section, 0x1B if b"zR" in header or augmented else 0x00,
                           augmentation=(b"\x04\0\0\0\0" if augmented else (b"\0" if b"\0z" in header[8:10] or
                                                                            b"zR" in header else b"")))  # fmt: skip
    table = compile_cfi(section, 0x2000)
    assert (table.find(0x1000), table.skipped) == (cfa(RSP, 16), 0)


REFUSED = [
    ("version 2", cie_of(version=2)),
    ("version 4, addresses of 4 bytes", cie_of(version=4, address_size=4)),
    ("an augmentation letter no one knows", cie_of(augmentation=b"zRX")),
    ("an augmentation without z", cie_of(augmentation=b"R", data=b"")),
    ("the return address in another register", cie_of(ra=15)),
    ("a code alignment of 0", cie_of(code_align=0)),
    ("augmentation data past the CIE", entry(b"\0\0\0\0\x01zR\0\x01\x78\x10\x7f")),
    ("augmentation data one byte past the CIE", entry(b"\0\0\0\0\x01zR\0\x01\x78\x10\x02\x1b")),
    ("an augmentation string never ended", entry(b"\0\0\0\0\x01zR")),
    ("a uleb longer than 64 bits", entry(b"\0\0\0\0\x01zR\0" + b"\x80" * 10 + b"\x01\x78\x10\x01\x1b")),
]  # fmt: skip


@pytest.mark.parametrize("header", [h for _, h in REFUSED], ids=[n for n, _ in REFUSED])
def test_a_cie_that_cannot_be_read_skips_its_descriptions(header: bytes) -> None:
    section = header
    section += fde(section, 0x2000, 0x1000, 0x10, b"")
    table = compile_cfi(section, 0x2000)
    assert (table.find(0x1000), table.skipped) == (None, 1)


def test_an_augmentation_without_z_that_is_not_eh() -> None:
    """(Its FDE, absolute and without augmentation data, would read well.)"""
    section = cie_of(augmentation=b"X")
    section += fde_encoded(section, 0x00, augmentation=b"")
    assert compile_cfi(section, 0x2000).skipped == 1
    section = cie_of(augmentation=b"")
    section += fde_encoded(section, 0x00, augmentation=b"")
    assert compile_cfi(section, 0x2000).find(0x1000) == cfa(RSP, 16)


def test_an_fde_that_cannot_be_read_is_skipped() -> None:
    for start, size, augmentation in ((0x1000, 0, b"\0"), (0x1000, -1, b"\0"), (0x1000, 0x10, b"\x7f")):
        section = cie(CIE_INITIAL)
        section += fde_encoded(section, 0x1B, start=start, size=size, augmentation=augmentation, program=b"")
        assert compile_cfi(section, 0x2000).skipped == 1, (start, size, augmentation)
    section = cie_of(data=b"\x04")  # (udata8: an FDE that would end past 2^64)
    section += fde_encoded(section, 0x04, start=(1 << 64) - 8, size=8)
    assert compile_cfi(section, 0x2000).skipped == 1


def test_a_cie_pointer_outside_the_section_or_at_an_fde() -> None:
    section = cie(CIE_INITIAL)
    section += fde(section, 0x2000, 0x1000, 0x10, b"")
    other = len(section)
    section += entry(struct.pack("<I", other + 4 - 8) + b"\0" * 13)  # (its CIE pointer: the FDE before it)
    table = compile_cfi(section, 0x2000)
    assert table.skipped == 1 and table.find(0x1000) == cfa(RSP, 8)


def test_overlapping_descriptions_keep_the_first() -> None:
    section = cie(CIE_INITIAL)
    section += fde(section, 0x2000, 0x1000, 0x10, bytes([0x0E, 0x10]))
    section += fde(section, 0x2000, 0x1008, 0x10, bytes([0x0E, 0x18]))
    section += fde(section, 0x2000, 0x1010, 0x10, bytes([0x0E, 0x20]))
    table = compile_cfi(section, 0x2000)
    assert table.skipped == 1
    assert [table.find(a) for a in (0x1000, 0x100F, 0x1010, 0x1020)] == [cfa(RSP, 16), cfa(RSP, 16), cfa(RSP, 32), None]
    assert list(table.starts) == [0x1000, 0x1010, 0x1020]


# --- .debug_frame -------------------------------------------------------------------------------
def debug_cie(*, wide: bool = False) -> bytes:
    body = b"\x01\0\x01\x78\x10" + CIE_INITIAL
    if wide:
        return b"\xff\xff\xff\xff" + struct.pack("<Q", 8 + len(body)) + b"\xff" * 8 + body
    return entry(b"\xff\xff\xff\xff" + body)


def test_debug_frame_cie_after_its_fde_and_64_bit_entries() -> None:
    fde_size = 4 + 4 + 16 + 2
    section = entry(struct.pack("<IQQ", fde_size, 0x1000, 0x10) + bytes([0x0E, 0x10])) + debug_cie()
    assert compile_cfi(section, 0, debug_frame=True).find(0x1000) == cfa(RSP, 16)
    wide = debug_cie(wide=True)
    body = struct.pack("<QQQ", 0, 0x3000, 0x10) + bytes([0x0E, 0x18])
    section = wide + b"\xff\xff\xff\xff" + struct.pack("<Q", len(body)) + body
    section += b"\0\0\0\0"  # (a zero length: .debug_frame's padding, stepped over)
    section += entry(struct.pack("<IQQ", 0xFFFF_FFF0, 0x4000, 0x10))  # (a CIE pointer past the section)
    table = compile_cfi(section, 0, debug_frame=True)
    assert (table.find(0x3000), table.find(0x4000), table.skipped) == (cfa(RSP, 24), None, 1)


def test_debug_frame_cie_pointers_to_what_is_not_a_cie() -> None:
    """A 64-bit CIE after the FDE that names it; an FDE whose CIE pointer names an FDE; a 64-bit
    length cut off at the end."""
    fde_size = 4 + 4 + 16 + 2
    section = entry(struct.pack("<IQQ", 2 * fde_size - 2, 0x1000, 0x10) + bytes([0x0E, 0x10]))  # (its CIE: last)
    section += entry(struct.pack("<IQQ", 0, 0x2000, 0x10))  # (its CIE pointer: the FDE at 0)
    section += debug_cie(wide=True) + bytes([0xFF, 0xFF, 0xFF, 0xFF, 0x01])
    table = compile_cfi(section, 0, debug_frame=True)
    assert (table.find(0x1000), table.find(0x2000), table.skipped) == (cfa(RSP, 16), None, 1)


def test_a_debug_frame_adds_what_the_eh_frame_does_not_describe() -> None:
    """Sections in order: a later one's description of addresses an earlier one describes
    (wholly, or in part, even where the earlier ones overlap each other) is left out, not
    counted as skipped; the rest of it adds rows."""
    eh = cie(CIE_INITIAL)
    eh += fde(eh, 0x2000, 0x1000, 0x20, bytes([0x0E, 0x10]))
    eh += fde(eh, 0x2000, 0x1010, 0x20, bytes([0x0E, 0x30]))  # (overlaps the one before: skipped)
    debug = debug_cie()
    described = ((0x1000, 0x10, 0x18), (0x1018, 0x10, 0x18), (0x1040, 0x10, 0x20), (0x1020, 0x8, 0x28),
                 (0x1030, 0x8, 0x28))  # fmt: skip
    for start, size, offset in described:
        debug += entry(struct.pack("<IQQ", 0, start, size) + bytes([0x0E, offset]))
    table = compile_sections([CfiSection(eh, 0x2000), CfiSection(debug, 0, debug_frame=True)])
    assert table.skipped == 1
    found = [table.find(a) for a in (0x1000, 0x101F, 0x1020, 0x1030, 0x1037, 0x1038, 0x1040, 0x1050)]
    assert found == [cfa(RSP, 16), cfa(RSP, 16), None, cfa(RSP, 40), cfa(RSP, 40), None, cfa(RSP, 32), None]
    assert compile_sections([]).find(0x1000) is None


def test_what_a_later_section_may_add_between_earlier_descriptions() -> None:
    """The earlier section's descriptions, touching or nested, make one set of addresses: a
    later description is kept only where it meets none of them (touching is not meeting)."""
    eh = cie(CIE_INITIAL)
    for start, size in ((0x1000, 0x20), (0x1020, 0x10), (0x1040, 0x10), (0x2000, 0x100), (0x2010, 0x10)):
        eh += fde(eh, 0x2000, start, size, bytes([0x0E, 0x10]))
    later = debug_cie()
    tried = {0x1030: 0x10, 0x0FF0: 0x10, 0x1050: 0x10, 0x102F: 0x2, 0x0FE0: 0x21, 0x1010: 0x8, 0x2050: 0x10}
    for start, size in tried.items():
        later += entry(struct.pack("<IQQ", 0, start, size) + bytes([0x0E, 0x28]))
    table = compile_sections([CfiSection(eh, 0x2000), CfiSection(later, 0, debug_frame=True)])
    added = {start for start in tried if table.find(start) == cfa(RSP, 40)}
    assert added == {0x1030, 0x0FF0, 0x1050}  # (0x102F, 0x0FE0 and 0x1010 meet the first ones; 0x2050 the nest)
    assert table.skipped == 1  # (the nested description: the later ones met are left out, not skipped)


def test_an_empty_section_is_an_empty_table() -> None:
    table = compile_cfi(cie(CIE_INITIAL), 0)
    assert isinstance(table, UnwindTable) and table.find(0x1000) is None and len(table) == 0


def test_what_follows_the_terminator_or_runs_past_the_end_is_not_read() -> None:
    section = cie(CIE_INITIAL)
    section += fde(section, 0x2000, 0x1000, 0x10, b"")
    section += b"\0\0\0\0"  # .eh_frame's terminator: what follows is not the section's
    section += fde(section, 0x2000, 0x2000, 0x10, b"")
    assert compile_cfi(section, 0x2000).find(0x2000) is None
    section = cie(CIE_INITIAL)
    last = fde(section, 0x2000, 0x1000, 0x10, bytes([0x0E, 0x10]))
    section += struct.pack("<I", len(last) - 4 + 1) + last[4:]  # (its length: one byte past the section)
    assert compile_cfi(section, 0x2000).find(0x1000) is None


def test_augmentation_data_up_to_the_fde_end() -> None:
    section = cie(CIE_INITIAL)
    section += fde_encoded(section, 0x1B, augmentation=b"\x02\0\0", program=b"")
    assert compile_cfi(section, 0x2000).find(0x1000) == cfa(RSP, 8)


def test_descriptions_merged_in_address_order() -> None:
    """One inside another: the one that starts first is kept; one at address 0 too; three in a
    row leave no gap between them."""
    section = cie(CIE_INITIAL)
    section += fde(section, 0x2000, 0x1010, 0x10, bytes([0x0E, 0x18]))
    section += fde(section, 0x2000, 0x1000, 0x30, bytes([0x0E, 0x10]))
    section += fde(section, 0x2000, 0, 0x10, bytes([0x0E, 0x20]))
    table = compile_cfi(section, 0x2000)
    assert [table.find(a) for a in (0, 0x1000, 0x1018, 0x1030)] == [cfa(RSP, 32), cfa(RSP, 16), cfa(RSP, 16), None]
    assert table.skipped == 1
    rows = table_of((0x1000, 0x10, bytes([0x0E, 0x10])), (0x1010, 0x10, bytes([0x0E, 0x18])),
                    (0x1020, 0x10, bytes([0x0E, 0x20])))  # fmt: skip
    assert rows == [(0x1000, cfa(RSP, 16)), (0x1010, cfa(RSP, 24)), (0x1020, cfa(RSP, 32)), (0x1030, None)]


def test_rows_pack_within_their_bounds() -> None:
    for offset in (-(1 << 31), (1 << 31) - 1):
        assert unpack(pack(cfa(RSP, offset))) == cfa(RSP, offset)
    for bp_offset in (-(1 << 15), (1 << 15) - 1):
        assert unpack(pack(cfa(RBP, 16, SAVED, bp_offset))) == cfa(RBP, 16, SAVED, bp_offset)
    for row in (cfa(RSP, -(1 << 31) - 1), cfa(RSP, 1 << 31), cfa(RBP, 16, SAVED, 1 << 15),
                cfa(RBP, 16, SAVED, -(1 << 15) - 1)):  # fmt: skip
        with pytest.raises(ValueError):
            pack(row)


def test_a_frame_is_looked_up_at_its_call() -> None:
    assert Frame(0x1005, 0, 0, exact=False).lookup == 0x1004 and Frame(0x1005, 0, 0, exact=True).lookup == 0x1005


def test_frame_pointers_at_rsp_and_misaligned() -> None:
    memory = {0x7000: 0x7100, 0x7008: 0x401000}

    def read(addr: int) -> int:
        return memory[addr]

    assert step(Frame(0x400000, 0x7000, 0x7000, exact=True), None, read) == Frame(0x401000, 0x7010, 0x7100, exact=False)
    for misaligned in (0x7004, 0x7001):
        assert step(Frame(0x400000, 0x7000, misaligned, exact=True), None, read) is None
