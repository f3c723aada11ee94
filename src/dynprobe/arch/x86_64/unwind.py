"""x86-64 call-frame information as dynprobe walks stacks with it: a module's .eh_frame (or
.debug_frame) compiled into rows, as the kernel's ORC tables and binutils' SFrame hold it (from
an address on: where the CFA is, whether the return address is at CFA-8, where the caller's rbp
was saved), and one step of a walk over a row. Pure: section bytes in, rows out; a walk reads
memory through the function it is given.

The CFI interpreter is ours: pyelftools decodes one field at a time through `construct`, which
takes seconds for python3's tables (the tests check our rows against its decoding). A file is
untrusted: every count and offset is bounded by the section, a frame description that cannot be
read is skipped (counted), never an exception.
"""

from __future__ import annotations

import bisect
import enum
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

RSP, RBP, RA = 7, 6, 16  # DWARF register numbers (System V x86-64 psABI)


class Kind(enum.IntEnum):
    """What a row says about the frames of its addresses."""

    NONE = 0  # nothing known (no rule dynprobe follows): frame pointers are tried
    CFA = 1  # CFA = base register + offset; return address at CFA-8
    END = 2  # the return address is undefined: the outermost frame (_start, a thread's start)
    SIGNAL = 3  # a signal frame (__restore_rt): the interrupted registers are in the ucontext at rsp
    PLT = 4  # a PLT stub: CFA = rsp + offset, 8 more once (rip & 15) >= the threshold (the push)


class BpRule(enum.IntEnum):
    SAME = 0  # the caller's rbp is this frame's
    SAVED = 1  # saved at CFA + bp_offset
    LOST = 2  # undefined, or a rule not followed: a caller's CFA based on rbp cannot be found


class Row(NamedTuple):
    kind: Kind
    base: int  # RSP or RBP
    cfa_offset: int
    bp_rule: BpRule
    bp_offset: int  # (Kind.PLT: the threshold)


def pack(row: Row) -> int:
    """A row as one signed 64-bit number: kind 3 bits, base 1, rbp rule 2, rbp offset 16 (at
    bit 16), CFA offset 32 (at bit 32). ValueError when an offset does not fit."""
    if not -(1 << 31) <= row.cfa_offset < 1 << 31 or not -(1 << 15) <= row.bp_offset < 1 << 15:
        raise ValueError("offset out of range")
    return row.cfa_offset << 32 | (row.bp_offset & 0xFFFF) << 16 | row.bp_rule << 4 | (row.base == RBP) << 3 | row.kind


def unpack(packed: int) -> Row:
    bp_offset = (packed >> 16) & 0xFFFF
    return Row(
        Kind(packed & 7),
        RBP if packed & 8 else RSP,
        packed >> 32,
        BpRule((packed >> 4) & 3),
        bp_offset - (1 << 16) if bp_offset >= 1 << 15 else bp_offset,
    )


_NONE = pack(Row(Kind.NONE, RSP, 0, BpRule.LOST, 0))


@dataclass
class UnwindTable:
    """Rows by address (link-time): row i holds from starts[i] to starts[i + 1]; an address
    below the first or in a gap between descriptions has no row."""

    starts: array[int]  # 'Q'
    rows: array[int]  # 'q', packed (see pack)
    skipped: int  # frame descriptions that could not be read

    def find(self, addr: int) -> Row | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i < 0 or self.rows[i] == _NONE:
            return None
        return unpack(self.rows[i])

    def __len__(self) -> int:
        return len(self.starts)


class _Malformed(Exception):
    """A description that runs past its bounds or says what no compiler writes."""


class _Reader:
    __slots__ = ("at", "data", "end")

    def __init__(self, data: bytes, at: int, end: int) -> None:
        self.data, self.at, self.end = data, at, end

    def take(self, size: int) -> int:
        at = self.at
        if at + size > self.end:
            raise _Malformed
        self.at = at + size
        return int.from_bytes(self.data[at : at + size], "little")

    def signed(self, size: int) -> int:
        value = self.take(size)
        return value - (1 << 8 * size) if value >> (8 * size - 1) else value

    def uleb(self) -> int:
        data, at, end = self.data, self.at, self.end
        value = shift = 0
        while True:
            if at >= end or shift > 63:
                raise _Malformed
            byte = data[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                self.at = at
                return value

    def sleb(self) -> int:
        start = self.at
        value = self.uleb()
        bits = 7 * (self.at - start)
        return value - (1 << bits) if value >> (bits - 1) & 1 else value

    def cstring(self) -> bytes:
        end = self.data.find(b"\0", self.at, self.end)
        if end < 0:
            raise _Malformed
        text = self.data[self.at : end]
        self.at = end + 1
        return text

    def block(self) -> bytes:
        size = self.uleb()
        if self.at + size > self.end:
            raise _Malformed
        self.at += size
        return self.data[self.at - size : self.at]

    def pointer(self, encoding: int, vaddr: int | None) -> int:
        """An encoded pointer (DW_EH_PE_*) whose field is at section offset `self.at`, the
        section at `vaddr`: absolute or pc-relative (the two a linker writes for x86-64). With
        `vaddr` None the pointer is only stepped over (its value is not used), whatever its
        application."""
        field = self.at
        form = encoding & 0x0F
        if form == 0x00:
            value = self.take(8)
        elif form == 0x01:
            value = self.uleb()
        elif form in (0x02, 0x03, 0x04):
            value = self.take(1 << (form - 1))
        elif form == 0x09:
            value = self.sleb()
        elif form in (0x0A, 0x0B, 0x0C):
            value = self.signed(1 << (form - 9))
        else:
            raise _Malformed
        application = encoding & 0x70
        if vaddr is None:
            return 0
        if application == 0x10:
            value += vaddr + field
        elif application != 0:
            raise _Malformed
        return value & ((1 << 64) - 1)


@dataclass
class _Cie:
    """The parts of a CIE that its FDEs' rows need."""

    code_align: int
    data_align: int
    ra_register: int
    fde_encoding: int
    has_augmentation_data: bool
    signal: bool
    initial: tuple[int, int]  # the initial instructions: section offsets [start, end)


class _Rule(NamedTuple):
    kind: str  # "same", "offset", "undefined", "other"
    offset: int = 0


_SAME = _Rule("same")
_MAX_STATES = 64  # remembered states (DW_CFA_remember_state) a description may stack
_PLT_EXPRESSION = (bytes.fromhex("80003f1a"), bytes.fromhex("2a332422"))  # around the threshold's lit


class _State:
    __slots__ = ("cfa_offset", "cfa_plt", "cfa_reg", "rules")

    def __init__(self) -> None:
        self.cfa_reg = RSP
        self.cfa_offset = 8
        self.cfa_plt: int | None = None  # the threshold, when the CFA is the PLT expression
        self.rules: dict[int, _Rule] = {}

    def copy(self) -> _State:
        other = _State()
        other.cfa_reg, other.cfa_offset, other.cfa_plt = self.cfa_reg, self.cfa_offset, self.cfa_plt
        other.rules = dict(self.rules)
        return other

    def packed(self, signal: bool) -> int:
        if signal:
            return pack(Row(Kind.SIGNAL, RSP, 0, BpRule.LOST, 0))
        ra = self.rules.get(RA, _SAME)
        if ra.kind == "undefined":
            return pack(Row(Kind.END, RSP, 0, BpRule.LOST, 0))
        if ra != _Rule("offset", -8) or self.rules.get(RSP, _SAME) != _SAME:
            return _NONE
        bp = self.rules.get(RBP, _SAME)
        if bp.kind == "same":
            bp_rule, bp_offset = BpRule.SAME, 0
        elif bp.kind == "offset" and -(1 << 15) <= bp.offset < 1 << 15:
            bp_rule, bp_offset = BpRule.SAVED, bp.offset
        else:
            bp_rule, bp_offset = BpRule.LOST, 0
        try:
            if self.cfa_plt is not None:
                return pack(Row(Kind.PLT, RSP, self.cfa_offset, BpRule.SAME, self.cfa_plt))
            if self.cfa_reg not in (RSP, RBP):
                return _NONE
            return pack(Row(Kind.CFA, self.cfa_reg, self.cfa_offset, bp_rule, bp_offset))
        except ValueError:
            return _NONE


def _plt_threshold(expression: bytes) -> tuple[int, int] | None:
    """(rsp offset, threshold) of the expression GNU ld writes for PLT stubs: rsp + offset, plus
    8 once the stub has pushed (rip & 15 >= threshold); None for any other."""
    if len(expression) < 2 or expression[0] != 0x77:  # DW_OP_breg7 (rsp)
        return None
    reader = _Reader(expression, 1, len(expression))
    try:
        offset = reader.sleb()
    except _Malformed:
        return None
    head, tail = _PLT_EXPRESSION
    rest = expression[reader.at :]
    if len(rest) != len(head) + 1 + len(tail) or not rest.startswith(head) or not rest.endswith(tail):
        return None
    lit = rest[len(head)]
    return (offset, lit - 0x30) if 0x30 <= lit <= 0x4F else None


def _execute(reader: _Reader, state: _State, cie: _Cie, *, initial: _State | None, at: int,
             emit: Callable[[int, _State], None], section_vaddr: int | None) -> None:  # fmt: skip
    """Run the CFI program `reader` holds from location `at`, calling `emit(location, state)`
    before each advance and at the end (the state holds from that location on). `initial` is
    the CIE's state (None while running the CIE's own instructions: DW_CFA_restore then means
    no rule). `section_vaddr`: where the section is (None: .debug_frame, absolute pointers)."""
    remembered: list[_State] = []
    code_align, data_align = cie.code_align, cie.data_align

    def restore(register: int) -> None:
        rule = initial.rules.get(register) if initial is not None else None
        if rule is None:
            state.rules.pop(register, None)
        else:
            state.rules[register] = rule

    def advance(delta: int) -> None:
        nonlocal at
        emit(at, state)
        at += delta * code_align

    while reader.at < reader.end:
        op = reader.take(1)
        high, low = op & 0xC0, op & 0x3F
        if high == 0x40:
            advance(low)
        elif high == 0x80:
            state.rules[low] = _Rule("offset", reader.uleb() * data_align)
        elif high == 0xC0:
            restore(low)
        elif op == 0x00:  # nop
            pass
        elif op == 0x01:  # set_loc
            target = reader.pointer(cie.fde_encoding, section_vaddr) if section_vaddr is not None else reader.take(8)
            if target < at:
                raise _Malformed  # (rows go forward: the tables are searched in order)
            emit(at, state)
            at = target
        elif op in (0x02, 0x03, 0x04):  # advance_loc1/2/4
            advance(reader.take(1 << (op - 2)))
        elif op in (0x05, 0x11, 0x14, 0x15, 0x2F):  # offset_extended(_sf), val_offset(_sf), GNU negative
            register = reader.uleb()
            offset = (reader.sleb() if op in (0x11, 0x15) else reader.uleb()) * data_align
            if op == 0x2F:
                offset = -offset
            state.rules[register] = _Rule("offset", offset) if op in (0x05, 0x11, 0x2F) else _Rule("other")
        elif op == 0x06:  # restore_extended
            restore(reader.uleb())
        elif op == 0x07:  # undefined
            state.rules[reader.uleb()] = _Rule("undefined")
        elif op == 0x08:  # same_value
            state.rules[reader.uleb()] = _SAME
        elif op == 0x09:  # register
            register = reader.uleb()
            state.rules[register] = _Rule("other") if reader.uleb() != register else _SAME
        elif op == 0x0A:  # remember_state
            if len(remembered) >= _MAX_STATES:
                raise _Malformed
            remembered.append(state.copy())
        elif op == 0x0B:  # restore_state
            if not remembered:
                raise _Malformed
            saved = remembered.pop()
            state.cfa_reg, state.cfa_offset, state.cfa_plt, state.rules = (
                saved.cfa_reg, saved.cfa_offset, saved.cfa_plt, saved.rules
            )  # fmt: skip
        elif op in (0x0C, 0x12):  # def_cfa(_sf)
            state.cfa_reg = reader.uleb()
            state.cfa_offset = reader.sleb() * data_align if op == 0x12 else reader.uleb()
            state.cfa_plt = None
        elif op == 0x0D:  # def_cfa_register
            state.cfa_reg, state.cfa_plt = reader.uleb(), None
        elif op in (0x0E, 0x13):  # def_cfa_offset(_sf)
            state.cfa_offset = reader.sleb() * data_align if op == 0x13 else reader.uleb()
        elif op == 0x0F:  # def_cfa_expression
            plt = _plt_threshold(reader.block())
            state.cfa_reg = RSP if plt is not None else -1
            state.cfa_offset, state.cfa_plt = plt if plt is not None else (0, None)
        elif op in (0x10, 0x16):  # expression, val_expression
            register = reader.uleb()
            reader.block()
            state.rules[register] = _Rule("other")
        elif op == 0x2E:  # GNU_args_size
            reader.uleb()
        else:
            raise _Malformed
    emit(at, state)


def _read_cie(data: bytes, start: int, end: int) -> _Cie:
    reader = _Reader(data, start, end)
    version = reader.take(1)
    if version not in (1, 3, 4):
        raise _Malformed
    augmentation = reader.cstring()
    if version == 4:
        if reader.take(1) != 8:  # address size
            raise _Malformed
        reader.take(1)  # segment selector size
    if b"eh" in augmentation:
        reader.take(8)
    code_align, data_align = reader.uleb(), reader.sleb()
    ra_register = reader.take(1) if version == 1 else reader.uleb()
    fde_encoding = 0x00  # (absolute, unless the augmentation says)
    signal = False
    has_data = augmentation.startswith(b"z")
    if has_data:
        size = reader.uleb()
        aug = _Reader(data, reader.at, reader.at + size)
        if aug.end > end:
            raise _Malformed
        for letter in augmentation[1:]:
            if letter == ord("R"):
                fde_encoding = aug.take(1)
            elif letter == ord("L"):
                aug.take(1)
            elif letter == ord("P"):
                aug.pointer(aug.take(1), None)  # (the personality routine: stepped over)
            elif letter == ord("S"):
                signal = True
            elif letter not in b"BG":
                raise _Malformed
        reader.at += size
    elif augmentation not in (b"", b"eh"):
        raise _Malformed
    if ra_register != RA or code_align == 0:
        raise _Malformed
    return _Cie(code_align, data_align, ra_register, fde_encoding, has_data, signal, (reader.at, end))


class CfiSection(NamedTuple):
    """A section rows are compiled from: its bytes, its link-time address, which kind."""

    data: bytes
    vaddr: int
    debug_frame: bool = False  # .debug_frame: absolute pointers, CIE pointers section offsets


def compile_cfi(data: bytes, vaddr: int, *, debug_frame: bool = False) -> UnwindTable:
    """The rows of a .eh_frame section's bytes (at link-time address `vaddr`), or of a
    .debug_frame's."""
    return compile_sections([CfiSection(data, vaddr, debug_frame)])


def compile_sections(sections: list[CfiSection]) -> UnwindTable:
    """One table of several sections' rows (a file's .eh_frame, then the .debug_frame of code
    built without unwind tables): a description of addresses an earlier section describes is
    left out (the same function told twice), not counted as skipped."""
    described: list[tuple[int, int, list[tuple[int, int]]]] = []
    skipped = 0
    for section in sections:
        earlier = _union([(start, end) for start, end, _ in described])
        starts = [start for start, _ in earlier]
        found, unread = _descriptions(section)
        skipped += unread
        described += [(start, end, rows) for start, end, rows in found if not _overlaps(earlier, starts, start, end)]
    return _merge(described, skipped)


def _union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The addresses `ranges` cover, as sorted ranges that do not meet."""
    union: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if union and start <= union[-1][1]:
            union[-1] = (union[-1][0], max(union[-1][1], end))
        else:
            union.append((start, end))
    return union


def _overlaps(ranges: list[tuple[int, int]], starts: list[int], start: int, end: int) -> bool:
    """Whether [start, end) meets one of `ranges` (a `_union`; `starts`: theirs)."""
    i = bisect.bisect_right(starts, start)  # (the ranges before it start at or before `start`)
    return (i > 0 and ranges[i - 1][1] > start) or (i < len(ranges) and ranges[i][0] < end)


def _descriptions(section: CfiSection) -> tuple[list[tuple[int, int, list[tuple[int, int]]]], int]:
    """(start, end, rows) of each frame description of a section, and how many could not be read."""
    data, vaddr, debug_frame = section
    described: list[tuple[int, int, list[tuple[int, int]]]] = []  # (start, end, rows) per description
    cies: dict[int, _Cie | None] = {}
    skipped = 0
    at = 0
    while at + 4 <= len(data):
        length = int.from_bytes(data[at : at + 4], "little")
        header = 4
        if length == 0xFFFFFFFF:
            if at + 12 > len(data):
                break  # (a 64-bit length cut off: no entry)
            length, header = int.from_bytes(data[at + 4 : at + 12], "little"), 12
        if length == 0:
            if debug_frame:
                at += header
                continue
            break  # .eh_frame's terminator
        start, end = at + header, at + header + length
        if end > len(data):
            break
        id_size = 8 if header == 12 else 4
        cie_id = int.from_bytes(data[start : start + id_size], "little")
        is_cie = cie_id == (((1 << 8 * id_size) - 1) if debug_frame else 0)
        body = start + id_size
        if is_cie:
            try:
                cies[at] = _read_cie(data, body, end)
            except _Malformed:
                cies[at] = None
        else:
            cie_at = cie_id if debug_frame else start - cie_id
            if cie_at not in cies:
                try:
                    cies[cie_at] = _cie_at(data, cie_at, debug_frame=debug_frame)
                except _Malformed:
                    cies[cie_at] = None
            cie = cies[cie_at]
            try:
                if cie is None:
                    raise _Malformed
                described.append(_describe(data, body, end, cie, vaddr=vaddr, debug_frame=debug_frame))
            except _Malformed:
                skipped += 1
        at = end
    return described, skipped


def _cie_at(data: bytes, at: int, *, debug_frame: bool) -> _Cie:
    """The CIE at section offset `at` (one an FDE names before it was read: .debug_frame may
    put CIEs after their FDEs)."""
    if not 0 <= at <= len(data) - 8:
        raise _Malformed
    length, header = int.from_bytes(data[at : at + 4], "little"), 4
    if length == 0xFFFFFFFF:
        length, header = int.from_bytes(data[at + 4 : at + 12], "little"), 12
    id_size = 8 if header == 12 else 4
    start, end = at + header, at + header + length
    if end > len(data):
        raise _Malformed
    cie_id = int.from_bytes(data[start : start + id_size], "little")
    if cie_id != (((1 << 8 * id_size) - 1) if debug_frame else 0):
        raise _Malformed
    return _read_cie(data, start + id_size, end)


def _describe(data: bytes, body: int, end: int, cie: _Cie, *, vaddr: int, debug_frame: bool
              ) -> tuple[int, int, list[tuple[int, int]]]:  # fmt: skip
    """(start, end, [(address, packed row)]) of the FDE whose fields begin at `body`."""
    reader = _Reader(data, body, end)
    section_vaddr = None if debug_frame else vaddr
    start = reader.take(8) if debug_frame else reader.pointer(cie.fde_encoding, vaddr)
    size = reader.take(8) if debug_frame else reader.pointer(cie.fde_encoding & 0x0F, vaddr)
    if cie.has_augmentation_data:
        reader.at += reader.uleb()
    if reader.at > end or size <= 0 or start + size >= 1 << 64:
        raise _Malformed
    rows: list[tuple[int, int]] = []

    def emit(location: int, state: _State) -> None:
        if not start <= location < start + size:
            return
        packed = state.packed(cie.signal)
        if rows and rows[-1][0] == location:
            rows[-1] = (location, packed)
            if len(rows) > 1 and rows[-2][1] == packed:
                rows.pop()
        elif not rows or rows[-1][1] != packed:
            rows.append((location, packed))

    state = _State()
    _execute(_Reader(data, *cie.initial), state, cie, initial=None, at=start, emit=lambda *_: None,
             section_vaddr=section_vaddr)  # fmt: skip
    initial = state.copy()
    _execute(reader, state, cie, initial=initial, at=start, emit=emit, section_vaddr=section_vaddr)
    return start, start + size, rows  # (its first row is at `start`: the first emit is there)


def _merge(described: list[tuple[int, int, list[tuple[int, int]]]], skipped: int) -> UnwindTable:
    """One table of every description's rows; a description overlapping the one before it is
    skipped (a file that describes one address twice says nothing sure about it)."""
    described.sort(key=lambda d: d[0])
    starts: array[int] = array("Q")
    rows: array[int] = array("q")
    last_end = -1
    for start, end, described_rows in described:
        if start < last_end:
            skipped += 1
            continue
        if starts and starts[-1] == start and rows[-1] == _NONE:
            starts.pop()
            rows.pop()
        for address, packed in [*described_rows, (end, _NONE)]:
            if not rows or rows[-1] != packed:  # (a row the same as the one before adds nothing)
                starts.append(address)
                rows.append(packed)
        last_end = end
    return UnwindTable(starts, rows, skipped)


class Frame(NamedTuple):
    """A frame of a walk: where it runs, its rsp and rbp (None: not known past a frame whose
    rule lost it), and whether `pc` is where the thread was (the first frame, a frame a signal
    interrupted) rather than a return address (looked up at pc - 1: the call may be a function's
    last instruction)."""

    pc: int
    sp: int
    bp: int | None
    exact: bool

    @property
    def lookup(self) -> int:
        return self.pc if self.exact else self.pc - 1


# The interrupted registers of a signal frame: in the ucontext_t at rsp when the handler has
# returned to __restore_rt, at uc_mcontext.gregs (REG_RBP 10, REG_RSP 15, REG_RIP 16).
UCONTEXT_GREGS = 40
GREG_RBP, GREG_RSP, GREG_RIP = 10, 15, 16


def step(frame: Frame, row: Row | None, read_u64: Callable[[int], int]) -> Frame | None:
    """The caller of `frame` by `row` (the row of its lookup address; None: frame pointers are
    followed), or None where the walk ends: the outermost frame, or a caller that cannot be
    found. `read_u64` raises OSError for memory it cannot read."""
    try:
        if row is None or row.kind == Kind.NONE:
            if frame.bp is None or frame.bp < frame.sp or frame.bp & 7:
                return None
            return Frame(read_u64(frame.bp + 8), frame.bp + 16, read_u64(frame.bp), exact=False)
        if row.kind == Kind.END:
            return None
        if row.kind == Kind.SIGNAL:
            gregs = frame.sp + UCONTEXT_GREGS
            return Frame(read_u64(gregs + 8 * GREG_RIP), read_u64(gregs + 8 * GREG_RSP),
                         read_u64(gregs + 8 * GREG_RBP), exact=True)  # fmt: skip
        if row.kind == Kind.PLT:
            cfa = frame.sp + row.cfa_offset + (8 if frame.pc & 15 >= row.bp_offset else 0)
            return Frame(read_u64(cfa - 8), cfa, frame.bp, exact=False)
        base = frame.sp if row.base == RSP else frame.bp
        if base is None:
            return None
        cfa = base + row.cfa_offset
        if row.bp_rule == BpRule.SAVED:
            bp: int | None = read_u64(cfa + row.bp_offset)
        else:
            bp = frame.bp if row.bp_rule == BpRule.SAME else None
        return Frame(read_u64(cfa - 8), cfa, bp, exact=False)
    except OSError:
        return None
