"""The generated stack walker (codegen/stacks.py) run natively (tests/unit/native.py) over stacks
and unwind tables laid out in this process: frame for frame as the rows say, a walk cut where it
must be, never a crash on memory it cannot read, and the same frames as the Python walk's steps
(arch/x86_64/unwind.py)."""

from __future__ import annotations

import ctypes
import itertools
import mmap
from collections.abc import Iterator

import iced_x86 as iced
import numpy as np
import pytest

from dynprobe.arch.x86_64.codegen.asm import Asm, C, R
from dynprobe.arch.x86_64.codegen.stacks import (
    AT_ENTRY,
    BLOCK_SHIFT,
    CUT,
    DIR_BYTES,
    DIR_ENTRY,
    EXACT_FRAME,
    FRAME_ADDRESS,
    HASH_MULTIPLIER,
    MAX_MODULES,
    MODULE_SHIFT,
    SLOT_COUNT,
    SLOT_FRAMES,
    SLOT_FRAMES_CUT,
    SLOT_PROBE,
    SLOT_READY,
    SLOT_SIZE,
    SLOT_SUM,
    TABLE_PROBES,
    build_stack_walker,
    emit_stack_count,
)
from dynprobe.arch.x86_64.unwind import (
    GREG_RBP,
    GREG_RIP,
    GREG_RSP,
    RBP,
    RSP,
    UCONTEXT_GREGS,
    BpRule,
    Frame,
    Kind,
    Row,
    pack,
    step,
)
from dynprobe.core.stackmaps import block_bounds
from dynprobe.ringbuf import layout as L

from .native import NativeArea, libc

LAYOUT = L.AreaLayout(ring_bytes=1 << 12)
MODULE = 0x7100_0000_0000  # where the fake module's code is said to be (never run)
SIGNAL_AT = MODULE + 0x800


def placed_walker(area: NativeArea, directory: int) -> int:
    """The walker over the modules' directory at `directory`, placed (its fix-ups known)."""
    asm = Asm()
    build_stack_walker(asm, directory=directory, shadow=LAYOUT.shadow)
    walker = area.place(lambda at: asm.encode(at)[0])
    area.add_fixups(asm.encode(walker)[1])
    return walker


def calling(area: NativeArea, walker: int, tail: bytes) -> int:
    """Code that calls the walker, then runs `tail`: ret (its hash), or mov rax, rdx; ret (its count)."""
    return area.place(lambda at: b"\xe8" + (walker - at - 5).to_bytes(4, "little", signed=True) + tail)


COUNT = bytes.fromhex("4889d0c3")  # mov rax, rdx; ret


class Scene:
    """A fake module's table, a stack in this process's memory, and the walker placed to walk
    them; `walk(pc, sp, bp)` runs it: (frames, cut, hash)."""

    def __init__(
        self, area: NativeArea, rows: list[tuple[int, Row | None]], *, points: int | None = None, blocks: bool = True
    ) -> None:
        self.area = area
        self.table = rows
        self.stack = np.zeros(1 << 12, dtype=np.uint64)  # 32 KiB
        self.base = self.stack.ctypes.data
        self.ips = np.array([at - MODULE for at, _ in rows], dtype=np.uint32)
        none = pack(Row(Kind.NONE, RSP, 0, BpRule.LOST, 0))
        self.rows = np.array([pack(row) if row is not None else none for _, row in rows], dtype=np.int64)
        self.blocks = block_bounds(self.ips)
        self.directory = np.zeros(2 + DIR_ENTRY // 8, dtype=np.uint64)
        self.directory[:10] = (1, points or 0, MODULE, 0x10000, MODULE, self.ips.ctypes.data, self.rows.ctypes.data,
                               len(rows), self.blocks.ctypes.data, len(self.blocks) if blocks else 0)  # fmt: skip
        walker = placed_walker(area, self.directory.ctypes.data)
        self.out = np.zeros(64, dtype=np.uint64)
        self.hash_of, self.count_of = calling(area, walker, b"\xc3"), calling(area, walker, COUNT)

    def at(self, index: int) -> int:
        """The address of stack word `index`."""
        return self.base + 8 * index

    def walk(self, pc: int, sp: int, bp: int, max_frames: int = 32, seed: int = 5) -> tuple[list[int], bool, int]:
        args = (pc, sp, bp, self.out.ctypes.data, max_frames, seed)
        digest = self.area.call_at(self.hash_of, *args)
        count = self.area.call_at(self.count_of, *args)
        n = count & ~CUT
        assert self.out[0] & EXACT_FRAME or not n
        assert digest == hashed([int(x) for x in self.out[:n]], seed)
        listed = self.directory[0] == 1  # (the fake module: entry 0 of the directory, when it has one)
        for word in self.out[:n].tolist():
            in_module = listed and MODULE <= word & FRAME_ADDRESS < MODULE + 0x10000
            assert word >> MODULE_SHIFT & 0x1FF == (1 if in_module else 0)
        return [int(x) & FRAME_ADDRESS for x in self.out[:n]], bool(count & CUT), digest


def hashed(frames: list[int], seed: int = 5) -> int:
    digest = seed
    for pc in frames:
        digest = ((digest ^ pc) * HASH_MULTIPLIER) & ((1 << 64) - 1)
    return digest


@pytest.fixture
def area() -> Iterator[NativeArea]:
    native = NativeArea(LAYOUT)
    try:
        yield native
    finally:
        native.close()


def cfa(base: int, offset: int, bp: BpRule = BpRule.SAME, bp_offset: int = 0) -> Row:
    return Row(Kind.CFA, base, offset, bp, bp_offset)


# Functions of the fake module: a (entry row, rbp row after its prologue), b (no frame
# pointer: CFA rsp+32), c (the outermost: return address undefined), a signal trampoline, and
# a gap with no row at 0x900.
ROWS = [
    (MODULE + 0x100, cfa(RSP, 8)),
    (MODULE + 0x104, cfa(RBP, 16, BpRule.SAVED, -16)),
    (MODULE + 0x200, cfa(RSP, 32)),
    (MODULE + 0x300, Row(Kind.END, RSP, 0, BpRule.LOST, 0)),
    (MODULE + 0x400, Row(Kind.PLT, RSP, 8, BpRule.SAME, 11)),
    (SIGNAL_AT - 1, Row(Kind.SIGNAL, RSP, 0, BpRule.LOST, 0)),
    (MODULE + 0x900, None),
]


def reference(scene: Scene, pc: int, sp: int, bp: int, max_frames: int = 32) -> tuple[list[int], bool]:
    """The Python walk's steps over the same rows and memory (core/stacks.py's loop)."""
    words = {scene.base + 8 * i: int(w) for i, w in enumerate(scene.stack)}

    def read(addr: int) -> int:
        if addr not in words:
            raise OSError
        return words[addr]

    def row_at(addr: int) -> Row | None:
        i = int(np.searchsorted(scene.ips, addr - MODULE, side="right")) - 1
        return None if i < 0 or not 0 <= addr - MODULE < 0x10000 else scene.table[i][1]

    frame: Frame | None = Frame(pc, sp, bp, exact=True)
    frames: list[int] = []
    cut = False
    while frame is not None:
        frames.append(frame.pc)
        if len(frames) >= max_frames:
            return frames, True
        row = row_at(frame.lookup)
        caller = step(frame, row, read)
        if caller is None:
            return frames, cut or row is None or row.kind != Kind.END
        if row is None or row.kind == Kind.NONE:
            cut = True
        if not caller.exact and caller.sp <= frame.sp:
            return frames, True
        frame = caller if caller.pc else None
    return frames, cut


def test_frames_by_their_rows(area: NativeArea) -> None:
    """a+0x10 (rbp-based) called from b, called from c (the outermost)."""
    scene = Scene(area, ROWS)
    sp, bp = scene.at(100), scene.at(104)
    scene.stack[104:106] = (scene.at(200), MODULE + 0x210)  # a's saved rbp, its return address into b
    scene.stack[106 + 3] = MODULE + 0x310  # b's CFA: rsp (106) + 32 bytes: its return address below it
    frames, cut, _ = scene.walk(MODULE + 0x110, sp, bp)
    assert (frames, cut) == ([MODULE + 0x110, MODULE + 0x210, MODULE + 0x310], False)
    assert reference(scene, MODULE + 0x110, sp, bp) == (frames, cut)


@pytest.mark.parametrize("blocks", [True, False])
def test_every_row_is_found_with_and_without_blocks(area: NativeArea, blocks: bool) -> None:
    """The row of each address around each row's start, searched between its block's bounds
    or in the whole table: the frame pointer walk where the gap is, the row's step elsewhere."""
    scene = Scene(area, ROWS, blocks=blocks)
    scene.stack[100] = MODULE + 0x310  # (at rsp: a's return address, read by the CFA rows of rsp+8)
    scene.stack[101 + 3] = MODULE + 0x310  # (b's, at rsp+32)
    for at, row in ROWS:
        for pc in (at - 1, at, at + 1):
            frames, cut, _ = scene.walk(pc, scene.at(100), 0)
            assert (frames, cut) == reference(scene, pc, scene.at(100), 0)[:2], (hex(pc), row)


def test_the_callers_rbp_is_the_one_saved(area: NativeArea) -> None:
    """a called from a: the caller's CFA is its rbp, which the callee saved at CFA-16."""
    scene = Scene(area, ROWS)
    scene.stack[104:106] = (scene.at(150), MODULE + 0x120)  # the saved rbp: the caller's
    scene.stack[150:152] = (0, MODULE + 0x310)
    frames, cut, _ = scene.walk(MODULE + 0x110, scene.at(100), scene.at(104))
    assert (frames, cut) == ([MODULE + 0x110, MODULE + 0x120, MODULE + 0x310], False)
    assert reference(scene, MODULE + 0x110, scene.at(100), scene.at(104)) == (frames, cut)


def test_at_a_function_entry_and_cut_at_max_frames(area: NativeArea) -> None:
    scene = Scene(area, ROWS)
    scene.stack[100] = MODULE + 0x210  # a's return address at rsp (its entry)
    scene.stack[101 + 3] = MODULE + 0x310
    assert scene.walk(MODULE + 0x100, scene.at(100), 0)[:2] == ([MODULE + 0x100, MODULE + 0x210, MODULE + 0x310], False)
    assert scene.walk(MODULE + 0x100, scene.at(100), 0, max_frames=2)[:2] == ([MODULE + 0x100, MODULE + 0x210], True)


def test_frame_pointers_where_no_row_says(area: NativeArea) -> None:
    """A pc in the gap (or in no module): rbp's chain, and the stack marked as possibly cut."""
    scene = Scene(area, ROWS)
    scene.stack[110:112] = (scene.at(120), MODULE + 0x910)  # saved rbp, return address (no row either)
    scene.stack[120:122] = (0, MODULE + 0x310)
    for pc in (MODULE + 0x910, 0x1234):
        frames, cut, _ = scene.walk(pc, scene.at(100), scene.at(110))
        assert (frames, cut) == ([pc, MODULE + 0x910, MODULE + 0x310], True)
        assert reference(scene, pc, scene.at(100), scene.at(110)) == (frames, cut)


def test_a_first_frame_at_a_function_entry_without_a_row(area: NativeArea) -> None:
    """AT_ENTRY: the return address at rsp (frame pointers would skip the caller); for the
    first frame only."""
    scene = Scene(area, ROWS)
    scene.stack[100] = MODULE + 0x910  # the caller, in the gap too: then by frame pointers
    scene.stack[110:112] = (0, MODULE + 0x310)
    pc, sp, bp = MODULE + 0x900, scene.at(100), scene.at(110)
    assert scene.walk(pc, sp, bp, max_frames=32 | AT_ENTRY)[:2] == ([pc, MODULE + 0x910, MODULE + 0x310], True)
    assert scene.walk(pc, sp, bp)[:2] == ([pc, MODULE + 0x310], True)


def test_a_signal_frame(area: NativeArea) -> None:
    """The handler returns to the signal trampoline: the interrupted rip, rsp and rbp come from
    the ucontext, and the interrupted frame is looked up at its own address."""
    scene = Scene(area, ROWS)
    scene.stack[100] = SIGNAL_AT  # the handler (at its entry)'s return address
    uc = 101 + 5  # the ucontext at the trampoline's rsp; gregs 40 bytes in
    scene.stack[uc + 10], scene.stack[uc + 15], scene.stack[uc + 16] = scene.at(300), scene.at(290), MODULE + 0x300
    frames, cut, _ = scene.walk(MODULE + 0x100, scene.at(100), 0)
    assert (frames, cut) == ([MODULE + 0x100, SIGNAL_AT, MODULE + 0x300], False)
    assert [bool(x & EXACT_FRAME) for x in scene.out[:3]] == [True, False, True]  # (the interrupted: exact)
    assert reference(scene, MODULE + 0x100, scene.at(100), 0) == (frames, cut)


def test_the_interrupted_frame_goes_on_by_its_registers(area: NativeArea) -> None:
    """After a signal frame, the interrupted function's rbp-based row uses the rbp and rsp the
    ucontext held (a at 0x110, its caller c)."""
    scene = Scene(area, ROWS)
    scene.stack[100] = SIGNAL_AT
    uc = 101 + 5
    scene.stack[uc + 10], scene.stack[uc + 15], scene.stack[uc + 16] = scene.at(300), scene.at(290), MODULE + 0x110
    scene.stack[300:302] = (0, MODULE + 0x310)  # at the interrupted rbp: the saved rbp, the return address
    frames, cut, _ = scene.walk(MODULE + 0x100, scene.at(100), 0)
    assert (frames, cut) == ([MODULE + 0x100, SIGNAL_AT, MODULE + 0x110, MODULE + 0x310], False)
    assert reference(scene, MODULE + 0x100, scene.at(100), 0) == (frames, cut)


def test_a_return_address_at_a_rows_start_is_named_by_the_call(area: NativeArea) -> None:
    """A call that is its function's last instruction returns to the next function's first:
    the row of the address before it is the caller's (b's CFA rsp+32, not c's END)."""
    scene = Scene(area, ROWS)
    scene.stack[100] = MODULE + 0x300  # a's return address: c's first byte, b's call before it
    scene.stack[101 + 3] = MODULE + 0x310
    assert scene.walk(MODULE + 0x100, scene.at(100), 0)[:2] == ([MODULE + 0x100, MODULE + 0x300, MODULE + 0x310], False)


def test_frames_in_a_second_module(area: NativeArea) -> None:
    """Two entries in the directory: a frame in the second is found by its range, its rows
    searched from its own base, its tag its entry's number + 1."""
    scene = Scene(area, ROWS)
    other = 0x7200_0000_0000
    ips = np.array([0x10, 0x40], dtype=np.uint32)  # at other + 0x10: CFA rsp+16; + 0x40: the outermost
    rows = np.array([pack(cfa(RSP, 16)), pack(Row(Kind.END, RSP, 0, BpRule.LOST, 0))], dtype=np.int64)
    blocks = block_bounds(ips)
    entry = (other, 0x1000, other, ips.ctypes.data, rows.ctypes.data, 2, blocks.ctypes.data, len(blocks))
    directory = np.zeros(2 + 2 * DIR_ENTRY // 8, dtype=np.uint64)
    directory[:10] = scene.directory[:10]
    directory[0] = 2
    directory[2 + DIR_ENTRY // 8 : 2 + DIR_ENTRY // 8 + 8] = entry
    walker = placed_walker(area, directory.ctypes.data)
    scene.stack[100] = other + 0x20  # a (at its entry) called from the other module's function
    scene.stack[101 + 1] = other + 0x50  # its CFA rsp+16: its return address, into the outermost
    out = np.zeros(8, dtype=np.uint64)
    count = area.call_at(calling(area, walker, COUNT), MODULE + 0x100, scene.at(100), 0, out.ctypes.data, 16, 5)
    assert count == 3 and [int(w) & FRAME_ADDRESS for w in out[:3]] == [MODULE + 0x100, other + 0x20, other + 0x50]
    assert [int(w) >> MODULE_SHIFT & 0x1FF for w in out[:3]] == [1, 2, 2]


def test_the_table_is_a_power_of_two_slots() -> None:
    for slots in (1, 3, 6):
        with pytest.raises(AssertionError):
            emit_stack_count(Asm(), walker=0, table=0, slots=slots, max_frames=1, probe_index=0, site=0, frame=0,
                             missed=0, at_entry=False, add_value=False)  # fmt: skip


def test_frame_pointers_need_an_aligned_rbp_above_rsp(area: NativeArea) -> None:
    scene = Scene(area, ROWS)
    scene.stack[110:112] = (0, MODULE + 0x310)
    for misaligned in (1, 4):
        assert scene.walk(0x1234, scene.at(100), scene.at(110) + misaligned)[:2] == ([0x1234], True)
    assert scene.walk(0x1234, scene.at(120), scene.at(110))[:2] == ([0x1234], True)  # (below rsp)
    assert scene.walk(0x1234, scene.at(100), scene.at(110))[:2] == ([0x1234, MODULE + 0x310], True)


def test_a_plt_stub(area: NativeArea) -> None:
    """Before the stub's push (pc & 15 < 11) the return address is at rsp, after it above."""
    scene = Scene(area, ROWS)
    scene.stack[100:102] = (MODULE + 0x310, 0x77)
    assert scene.walk(MODULE + 0x40A, scene.at(100), 0)[:2] == ([MODULE + 0x40A, MODULE + 0x310], False)
    scene.stack[100:102] = (0x77, MODULE + 0x310)
    assert scene.walk(MODULE + 0x40B, scene.at(100), 0)[:2] == ([MODULE + 0x40B, MODULE + 0x310], False)


def test_memory_that_cannot_be_read_cuts_the_walk(area: NativeArea) -> None:
    """A stack pointer into a page that cannot be read, and rbp's chain into it: cut, no crash."""
    scene = Scene(area, ROWS)
    unreadable = area.guarded(b"") + 64
    assert scene.walk(MODULE + 0x100, unreadable, 0)[:2] == ([MODULE + 0x100], True)
    assert scene.walk(0x1234, scene.at(100), unreadable & ~7)[:2] == ([0x1234], True)


def test_a_caller_frame_below_its_callee_cuts_the_walk(area: NativeArea) -> None:
    scene = Scene(area, ROWS)
    scene.stack[104:106] = (scene.at(10), MODULE + 0x110)  # a's caller: a again, with rbp far below
    frames, cut, _ = scene.walk(MODULE + 0x110, scene.at(100), scene.at(104))
    assert cut and frames == [MODULE + 0x110, MODULE + 0x110]
    assert reference(scene, MODULE + 0x110, scene.at(100), scene.at(104)) == (frames, cut)


def test_a_hostile_directory_is_not_read_past_its_bounds(area: NativeArea) -> None:
    scene = Scene(area, ROWS)
    scene.directory[0] = MAX_MODULES + 1
    assert scene.walk(MODULE + 0x100, scene.at(100), 0)[:2] == ([MODULE + 0x100], True)
    scene.directory[0] = 1
    scene.directory[7] = 1 << 30  # rows: more than any table has
    assert scene.walk(MODULE + 0x100, scene.at(100), 0)[:2] == ([MODULE + 0x100], True)
    scene.directory[7] = len(ROWS)
    scene.blocks[:] = 0xFFFF_FFFF  # bounds past the table: the search stays within it
    scene.stack[100] = MODULE + 0x310
    assert scene.walk(MODULE + 0x100, scene.at(100), 0)[0][0] == MODULE + 0x100


def test_return_addresses_through_the_trampoline(area: NativeArea) -> None:
    """A return address that is entry point k of the trampoline is the original its shadow
    entry holds (through a chain of them); one inside an entry point ends the walk."""
    trampoline = area.trampoline
    scene = Scene(area, ROWS, points=trampoline.points)
    scene.stack[100] = trampoline.point(3)
    area.set_word(LAYOUT.shadow + 3 * L.SHADOW_ENTRY + L.ENTRY_RET, trampoline.point(7))
    area.set_word(LAYOUT.shadow + 7 * L.SHADOW_ENTRY + L.ENTRY_RET, MODULE + 0x310)
    scene.stack[101 + 3] = 0
    assert scene.walk(MODULE + 0x100, scene.at(100), 0)[:2] == ([MODULE + 0x100, MODULE + 0x310], False)
    scene.stack[100] = trampoline.point(3) + 1
    assert scene.walk(MODULE + 0x100, scene.at(100), 0)[:2] == ([MODULE + 0x100], True)
    scene.stack[100] = trampoline.point(3)
    scene.directory[1] = 0  # (a trampoline the directory does not name yet: its entry point is a frame)
    assert scene.walk(MODULE + 0x100, scene.at(100), 0)[0][:2] == [MODULE + 0x100, trampoline.point(3)]


def test_no_frames_stored_without_a_buffer(area: NativeArea) -> None:
    """With no buffer (the first of the two runs) the walk only hashes and counts."""
    scene = Scene(area, ROWS)
    scene.stack[100] = MODULE + 0x310
    at = scene.hash_of
    digest = area.call_at(at, MODULE + 0x100, scene.at(100), 0, 0, 32, 5)
    assert digest == hashed([EXACT_FRAME | 1 << MODULE_SHIFT | MODULE + 0x100, 1 << MODULE_SHIFT | MODULE + 0x310])
    assert not scene.out.any()


def test_an_empty_directory_names_no_module(area: NativeArea) -> None:
    """A count of 0: the entry after it is not looked at (the pc is in no module)."""
    scene = Scene(area, ROWS)
    scene.directory[0] = 0
    scene.stack[100] = MODULE + 0x310
    assert scene.walk(MODULE + 0x100, scene.at(100), 0)[:2] == ([MODULE + 0x100], True)


def test_the_last_of_the_most_modules_is_found(area: NativeArea) -> None:
    """A directory of MAX_MODULES entries fills DIR_BYTES (placed before a page that cannot be
    read): the last entry is looked at, its tag MAX_MODULES."""
    scene = Scene(area, ROWS)
    directory = guarded_words(area, DIR_BYTES)
    directory[0] = MAX_MODULES
    last = 2 + (MAX_MODULES - 1) * DIR_ENTRY // 8
    directory[last : last + 8] = scene.directory[2:10]
    walker = placed_walker(area, directory.ctypes.data)
    scene.stack[100] = MODULE + 0x310
    out = np.zeros(4, dtype=np.uint64)
    count = area.call_at(calling(area, walker, COUNT), MODULE + 0x100, scene.at(100), 0, out.ctypes.data, 16, 5)
    assert count == 2 and [int(w) & FRAME_ADDRESS for w in out[:2]] == [MODULE + 0x100, MODULE + 0x310]
    assert [int(w) >> MODULE_SHIFT & 0x1FF for w in out[:2]] == [MAX_MODULES, MAX_MODULES]


@pytest.mark.parametrize("far", [1 << 31, 1 << 32])
def test_table_addresses_are_32_bit_offsets_from_the_base(area: NativeArea, far: int) -> None:
    """An address 2^31 or more past its table's base is found; 2^32 or more is past any table
    (frame pointers then)."""
    scene = Scene(area, ROWS, blocks=False)
    scene.directory[4] = MODULE - far
    scene.ips += np.uint32(far & 0xFFFF_FFFF)
    scene.stack[100] = MODULE + 0x310
    frames, cut, _ = scene.walk(MODULE + 0x100, scene.at(100), 0)
    assert (frames, cut) == (([MODULE + 0x100, MODULE + 0x310], False) if far < 1 << 32 else ([MODULE + 0x100], True))


def test_the_search_keeps_within_its_blocks_bounds(area: NativeArea) -> None:
    """The rows searched for an address are those between its block's bounds. The target can
    write them: whatever they say, the row is one of the table's, never read from outside it."""
    scene = Scene(area, ROWS)
    pc, sp, bp = MODULE + 0x210, scene.at(100), scene.at(110)
    scene.stack[100], scene.stack[103] = 0x1000, 0x2000  # the return address if CFA rsp+8, if rsp+32
    scene.stack[110:112] = (0, 0x3000)  # if CFA rbp+16
    block = 0x210 >> BLOCK_SHIFT

    def second_frame(low: int, high: int) -> int:
        scene.blocks[block : block + 2] = (low, high)
        return scene.walk(pc, sp, bp)[0][1]

    assert second_frame(3, 4) == 0x2000  # the true bounds: b's row (CFA rsp+32)
    assert second_frame(1, 2) == 0x3000  # a's second row (rbp-based)
    assert second_frame(5, 6) == 0x1000  # the PLT stub's (before its push)
    assert second_frame(0xFFFF_FFFF, 2) == 0x3000  # a low bound above the high one: the high one
    assert second_frame(0, 0xFFFF_FFFF) == 0x2000  # a high bound past the table: the table's end


def test_an_address_below_the_tables_first_has_no_row(area: NativeArea) -> None:
    scene = Scene(area, ROWS)
    padded = np.concatenate((np.array([pack(cfa(RSP, 8))], dtype=np.int64), scene.rows))
    scene.directory[6] = padded.ctypes.data + 8  # (a row before the table's first: never to be read)
    scene.stack[100] = 0x1000
    scene.stack[110:112] = (0, 0x3000)
    assert scene.walk(MODULE + 0x50, scene.at(100), scene.at(110))[:2] == ([MODULE + 0x50, 0x3000], True)


# Rows of the rbp rules: A clobbers rbp, B saves it (at CFA-16), D keeps it (CFA rsp+32), C's CFA
# is rbp-based, E the outermost, and a gap with no row at 0x500.
BP_ROWS = [
    (MODULE + 0x100, cfa(RSP, 16, BpRule.LOST)),
    (MODULE + 0x200, cfa(RSP, 16, BpRule.SAVED, -16)),
    (MODULE + 0x280, cfa(RSP, 32)),
    (MODULE + 0x300, cfa(RBP, 16, BpRule.SAVED, -16)),
    (MODULE + 0x400, Row(Kind.END, RSP, 0, BpRule.LOST, 0)),
    (MODULE + 0x500, None),
]


def test_an_rbp_lost_then_saved_again(area: NativeArea) -> None:
    """A (rbp lost) called from B, which saved the rbp it was called with: C, further up,
    finds its CFA by that rbp."""
    scene = Scene(area, BP_ROWS)
    scene.stack[101] = MODULE + 0x210  # A's return address (CFA rsp+16)
    scene.stack[102:104] = (scene.at(120), MODULE + 0x290)  # B's saved rbp (CFA-16), its return address
    scene.stack[107] = MODULE + 0x310  # D's (CFA rsp+32)
    scene.stack[120:122] = (0, MODULE + 0x410)  # at C's rbp
    frames, cut, _ = scene.walk(MODULE + 0x110, scene.at(100), 0)
    assert (frames, cut) == ([MODULE + 0x110, MODULE + 0x210, MODULE + 0x290, MODULE + 0x310, MODULE + 0x410], False)
    assert reference(scene, MODULE + 0x110, scene.at(100), 0) == (frames, cut)


@pytest.mark.parametrize("caller", [MODULE + 0x310, MODULE + 0x510])
def test_an_rbp_lost_cuts_a_walk_that_needs_it(area: NativeArea, caller: int) -> None:
    """A (rbp lost) called from C (its CFA rbp-based) or from code with no row (frame
    pointers): the rbp at hand is not the caller's, so the walk is cut there."""
    scene = Scene(area, BP_ROWS)
    scene.stack[101] = caller
    scene.stack[120:122] = (0, MODULE + 0x410)  # (what the rbp at hand points at)
    frames, cut, _ = scene.walk(MODULE + 0x110, scene.at(100), scene.at(120))
    assert (frames, cut) == ([MODULE + 0x110, caller], True)
    assert reference(scene, MODULE + 0x110, scene.at(100), scene.at(120)) == (frames, cut)


def test_an_rbp_saved_at_any_offset(area: NativeArea) -> None:
    """The saved rbp's offset from the CFA is followed whatever it is (2 here: LOST's number)."""
    rows = [(MODULE + 0x200, cfa(RSP, 16, BpRule.SAVED, int(BpRule.LOST))), *BP_ROWS[2:]]
    scene = Scene(area, rows)
    scene.stack[101] = MODULE + 0x310  # B's return address, into C
    saved = np.frombuffer(scene.at(120).to_bytes(8, "little"), np.uint8)
    scene.stack.view(np.uint8)[8 * 102 + 2 : 8 * 102 + 10] = saved  # at B's CFA + 2
    scene.stack[120:122] = (0, MODULE + 0x410)
    frames, cut, _ = scene.walk(MODULE + 0x210, scene.at(100), 0)
    assert (frames, cut) == ([MODULE + 0x210, MODULE + 0x310, MODULE + 0x410], False)


def test_after_frame_pointers_the_callers_rsp_is_above_the_saved_rbp(area: NativeArea) -> None:
    """From the gap by rbp's chain into b, whose CFA is rsp-based: its rsp is rbp + 16."""
    scene = Scene(area, ROWS)
    scene.stack[110:112] = (0, MODULE + 0x210)
    scene.stack[112 + 3] = MODULE + 0x310  # b's CFA: rsp + 32
    frames, cut, _ = scene.walk(MODULE + 0x910, scene.at(100), scene.at(110))
    assert (frames, cut) == ([MODULE + 0x910, MODULE + 0x210, MODULE + 0x310], True)
    assert reference(scene, MODULE + 0x910, scene.at(100), scene.at(110)) == (frames, cut)


def test_after_a_plt_stub_the_callers_rsp_is_its_cfa(area: NativeArea) -> None:
    scene = Scene(area, ROWS)
    scene.stack[100] = MODULE + 0x210  # the stub (before its push) called from b (CFA rsp+32)
    scene.stack[104] = MODULE + 0x310
    frames, cut, _ = scene.walk(MODULE + 0x400, scene.at(100), 0)
    assert (frames, cut) == ([MODULE + 0x400, MODULE + 0x210, MODULE + 0x310], False)
    assert reference(scene, MODULE + 0x400, scene.at(100), 0) == (frames, cut)


def test_a_plt_row_with_its_cfa_below_rsp_cuts_the_walk(area: NativeArea) -> None:
    scene = Scene(area, [(MODULE + 0x300, Row(Kind.END, RSP, 0, BpRule.LOST, 0)),
                         (MODULE + 0x400, Row(Kind.PLT, RSP, -64, BpRule.SAME, 11))])  # fmt: skip
    scene.stack[91] = MODULE + 0x310  # (below rsp: never a return address)
    assert scene.walk(MODULE + 0x400, scene.at(100), 0)[:2] == ([MODULE + 0x400], True)


def ucontext(scene: Scene, at: int, *, rip: int, rsp: int, rbp: int) -> None:
    """The interrupted registers of a signal frame whose ucontext is at stack word `at`."""
    gregs = at + UCONTEXT_GREGS // 8
    scene.stack[gregs + GREG_RIP], scene.stack[gregs + GREG_RSP], scene.stack[gregs + GREG_RBP] = rip, rsp, rbp


def test_the_interrupted_frame_goes_on_by_its_rsp(area: NativeArea) -> None:
    """After a signal frame, b (CFA rsp+32) interrupted: its CFA from the ucontext's rsp."""
    scene = Scene(area, ROWS)
    scene.stack[100] = SIGNAL_AT
    ucontext(scene, 101, rip=MODULE + 0x210, rsp=scene.at(290), rbp=0)
    scene.stack[293] = MODULE + 0x310
    frames, cut, _ = scene.walk(MODULE + 0x100, scene.at(100), 0)
    assert (frames, cut) == ([MODULE + 0x100, SIGNAL_AT, MODULE + 0x210, MODULE + 0x310], False)
    assert reference(scene, MODULE + 0x100, scene.at(100), 0) == (frames, cut)


def test_a_signal_frame_gives_the_rbp_back(area: NativeArea) -> None:
    """A handler that clobbered rbp: the interrupted frame's rbp is the ucontext's, so its
    rbp-based CFA is found."""
    rows = [(MODULE + 0x100, cfa(RSP, 8, BpRule.LOST)), *ROWS[1:]]
    scene = Scene(area, rows)
    scene.stack[100] = SIGNAL_AT
    ucontext(scene, 101, rip=MODULE + 0x110, rsp=scene.at(290), rbp=scene.at(300))
    scene.stack[300:302] = (0, MODULE + 0x310)
    frames, cut, _ = scene.walk(MODULE + 0x100, scene.at(100), 0)
    assert (frames, cut) == ([MODULE + 0x100, SIGNAL_AT, MODULE + 0x110, MODULE + 0x310], False)
    assert reference(scene, MODULE + 0x100, scene.at(100), 0) == (frames, cut)


def test_a_chain_of_shadow_entries_is_bounded(area: NativeArea) -> None:
    """Entry points translated through a chain of SHADOW_CAPACITY - 1 shadow entries (the
    highest entry point among them); one more, or a loop, cuts the walk."""
    trampoline = area.trampoline
    scene = Scene(area, ROWS, points=trampoline.points)
    scene.stack[101 + 3] = 0

    def ret_of(entry: int, address: int) -> None:
        area.set_word(LAYOUT.shadow + entry * L.SHADOW_ENTRY + L.ENTRY_RET, address)

    def through(entries: list[int]) -> tuple[list[int], bool]:
        for entry, following in itertools.pairwise(entries):
            ret_of(entry, trampoline.point(following))
        ret_of(entries[-1], MODULE + 0x310)
        scene.stack[100] = trampoline.point(entries[0])
        return scene.walk(MODULE + 0x100, scene.at(100), 0)[:2]

    highest = L.SHADOW_CAPACITY - 1
    assert through(list(range(highest, 0, -1))) == ([MODULE + 0x100, MODULE + 0x310], False)
    assert through(list(range(highest, -1, -1))) == ([MODULE + 0x100], True)
    ret_of(1, trampoline.point(2))  # (a loop: 1 and 2 return to each other)
    ret_of(2, trampoline.point(1))
    scene.stack[100] = trampoline.point(1)
    assert scene.walk(MODULE + 0x100, scene.at(100), 0)[:2] == ([MODULE + 0x100], True)


def counting(scene: Scene, area: NativeArea, table: np.ndarray, slots: int, probe_index: int, *,
             summing: bool = False) -> int:  # fmt: skip
    """A function u64 f(sp, bp, value) that counts a hit at MODULE+0x100 by its stack, rsp and
    rbp the given ones (the scene's stack) while it runs (`summing`: adding `value` up too).
    It returns what the count changed of what it must keep: rsp, rbp and r8-r11 (0: nothing)."""
    walker = placed_walker(area, scene.directory.ctypes.data)
    body = Asm()
    kept = (R.R8, R.R9, R.R10, R.R11)
    for reg in (R.RBP, R.RBX, R.R12, R.R13):
        body.add(iced.Instruction.create_reg(C.PUSH_R64, reg))
    body.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RBX, R.RSP))
    body.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RSP, R.RDI))
    body.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.R12, R.RDI))
    body.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RBP, R.RSI))
    body.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.R13, R.RSI))
    body.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, R.RDX))
    for n, reg in enumerate(kept, 1):
        body.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, reg, 0x1111 * n))
    emit_stack_count(body, walker=walker, table=table.ctypes.data, slots=slots, max_frames=16,
                     probe_index=probe_index, site=MODULE + 0x100, frame=0,
                     missed=LAYOUT.counter(probe_index, L.MISSED), at_entry=False, add_value=summing)  # fmt: skip
    body.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, R.RSP))
    body.add(iced.Instruction.create_reg_reg(C.SUB_R64_RM64, R.RAX, R.R12))
    body.add(iced.Instruction.create_reg_reg(C.OR_R64_RM64, R.RAX, R.RBP))
    body.add(iced.Instruction.create_reg_reg(C.XOR_R64_RM64, R.RAX, R.R13))
    for n, reg in enumerate(kept, 1):
        body.add(iced.Instruction.create_reg_i32(C.XOR_RM64_IMM32, reg, 0x1111 * n))
        body.add(iced.Instruction.create_reg_reg(C.OR_R64_RM64, R.RAX, reg))
    body.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RSP, R.RBX))
    for reg in (R.R13, R.R12, R.RBX, R.RBP):
        body.add(iced.Instruction.create_reg(C.POP_R64, reg))
    body.add(iced.Instruction.create(C.RETNQ))
    at = area.place(lambda here: body.encode(here)[0])
    area.add_fixups(body.encode(at)[1])
    return at


def slots_of(table: np.ndarray, slots: int) -> list[tuple[int, int, list[int], bool]]:
    """(probe, count, frames, cut) of each ready slot."""
    words = table.view(np.uint64)
    out = []
    for i in range(slots):
        at = i * SLOT_SIZE // 8
        probe = int(words[at + SLOT_PROBE // 8])
        if probe & SLOT_READY:
            n = int(words[at + SLOT_FRAMES_CUT // 8])
            stored = [int(x) for x in words[at + SLOT_FRAMES // 8 : at + SLOT_FRAMES // 8 + (n & ~CUT)]]
            assert int(words[at]) == hashed(stored, seed=(probe & 0xFFFF_FFFF) + 1) | 1  # (the key)
            frames = [int(x) & FRAME_ADDRESS for x in words[at + SLOT_FRAMES // 8 : at + SLOT_FRAMES // 8 + (n & ~CUT)]]
            out.append((probe & 0xFFFF_FFFF, int(words[at + SLOT_COUNT // 8]), frames, bool(n & CUT)))
    return sorted(out)


def guarded_words(area: NativeArea, size: int) -> np.ndarray:
    """`size` bytes of u64 words that end where a page that cannot be touched begins: a read
    or write past them faults, it never lands in other memory."""
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    area.pages.append(page := mmap.mmap(-1, (pages + 1) * mmap.PAGESIZE))
    at = ctypes.addressof(ctypes.c_char.from_buffer(page))
    assert libc.mprotect(ctypes.c_void_p(at + pages * mmap.PAGESIZE), mmap.PAGESIZE, 0) == 0
    return np.frombuffer(page, dtype=np.uint64, count=size // 8, offset=pages * mmap.PAGESIZE - size)


def test_hits_counted_by_stack(area: NativeArea) -> None:
    """Two stacks of probe 3, two of probe 4: a slot each, counted; a table too small for a
    fifth: the hit counted as missed, nothing overwritten."""
    scene = Scene(area, ROWS)
    slots = 4
    table = guarded_words(area, slots * SLOT_SIZE)  # (a slot past the last: a fault, the hit lost)
    three, four = counting(scene, area, table, slots, 3), counting(scene, area, table, slots, 4)
    sp = scene.at(100)
    scene.stack[100] = MODULE + 0x310  # a stack: entry of a, called from c
    scene.stack[200] = MODULE + 0x210  # another: a called from b (CFA rsp+32), from c
    scene.stack[201 + 3] = MODULE + 0x310
    for _ in range(3):
        assert area.call_at(three, sp, 0, 0) == 0  # (rsp, rbp and r8-r11 as they were)
    assert area.call_at(three, scene.at(200), 0, 0) == 0
    assert area.call_at(four, sp, 0, 0) == 0
    assert slots_of(table, slots) == [
        (3, 1, [MODULE + 0x100, MODULE + 0x210, MODULE + 0x310], False),
        (3, 3, [MODULE + 0x100, MODULE + 0x310], False),
        (4, 1, [MODULE + 0x100, MODULE + 0x310], False),
    ]
    assert area.counter(3, L.MISSED) == area.counter(4, L.MISSED) == 0
    area.call_at(four, scene.at(200), 0)  # the fourth slot
    scene.stack[500] = 0  # a fifth stack: [a] alone
    area.call_at(four, scene.at(500), 0)
    assert area.counter(4, L.MISSED) == 1 and len(slots_of(table, slots)) == 4
    assert area.word(L.STACK_SLOT) == 0  # (the missed hit's record: no stack)
    area.call_at(four, sp, 0)
    slot = area.word(L.STACK_SLOT)  # (a counted hit's: its slot's address, for its record)
    assert (slot - table.ctypes.data) % SLOT_SIZE == 0 and 0 <= slot - table.ctypes.data < slots * SLOT_SIZE
    assert int(table[(slot - table.ctypes.data + SLOT_PROBE) // 8]) == SLOT_READY | 4


def test_a_value_summed_by_stack(area: NativeArea) -> None:
    scene = Scene(area, ROWS)
    slots = 4
    table = np.zeros(slots * SLOT_SIZE // 8, dtype=np.uint64)
    summing = counting(scene, area, table, slots, 7, summing=True)
    scene.stack[100] = MODULE + 0x310
    for value in (5, 10, (1 << 64) - 3):  # (-3 as a signed value: the sum wraps as it does in 64 bits)
        assert area.call_at(summing, scene.at(100), 0, value) == 0
    [(probe, count, frames, cut)] = slots_of(table, slots)
    at = next(i for i in range(slots) if table[i * SLOT_SIZE // 8 + SLOT_PROBE // 8])
    assert (probe, count, frames, cut) == (7, 3, [MODULE + 0x100, MODULE + 0x310], False)
    assert int(table[at * SLOT_SIZE // 8 + SLOT_SUM // 8]) == 12


def test_a_counted_stack_walks_from_the_threads_rbp(area: NativeArea) -> None:
    """a (at its entry) called from a's body, whose CFA is rbp-based: the walker gets the
    thread's rbp, and the stack stored is the one walked."""
    scene = Scene(area, ROWS)
    table = np.zeros(2 * SLOT_SIZE // 8, dtype=np.uint64)
    count = counting(scene, area, table, 2, 9)
    scene.stack[600] = MODULE + 0x110
    scene.stack[610:612] = (0, MODULE + 0x310)
    assert area.call_at(count, scene.at(600), scene.at(610), 0) == 0
    assert slots_of(table, 2) == [(9, 1, [MODULE + 0x100, MODULE + 0x110, MODULE + 0x310], False)]


def test_a_stack_looks_for_its_slot_from_the_one_its_hash_names(area: NativeArea) -> None:
    """Its slot is the hash's top bits, or, when that one is another stack's, the first free
    one of the TABLE_PROBES from there; past them the hit is missed."""
    scene = Scene(area, ROWS)
    slots = 64
    table = np.zeros(slots * SLOT_SIZE // 8, dtype=np.uint64)
    keys = table[:: SLOT_SIZE // 8]
    count = counting(scene, area, table, slots, 2)
    scene.stack[100] = MODULE + 0x310
    area.call_at(count, scene.at(100), 0, 0)
    [home] = np.flatnonzero(keys).tolist()
    key = int(keys[home])
    assert home == key >> 58 and key != 3
    for free in (TABLE_PROBES - 1, TABLE_PROBES):
        table[:] = 0
        keys[:] = 3  # (another stack's key in every slot but one)
        keys[(home + free) % slots] = 0
        missed = area.counter(2, L.MISSED)
        area.call_at(count, scene.at(100), 0, 0)
        counted = free < TABLE_PROBES
        assert (int(keys[(home + free) % slots]) == key, area.counter(2, L.MISSED) - missed) == (counted, 1 - counted)


def test_a_counted_stack_is_cut_at_its_max_frames(area: NativeArea) -> None:
    """16 frames (the count's max_frames) of a deeper stack, marked cut."""
    scene = Scene(area, ROWS)
    table = np.zeros(2 * SLOT_SIZE // 8, dtype=np.uint64)
    count = counting(scene, area, table, 2, 1)
    scene.stack[100] = MODULE + 0x910  # into the gap: then rbp's chain, 20 frames of it
    for i in range(20):
        scene.stack[110 + 2 * i : 112 + 2 * i] = (scene.at(112 + 2 * i), MODULE + 0x910)
    assert area.call_at(count, scene.at(100), scene.at(110), 0) == 0
    [(probe, hits, frames, cut)] = slots_of(table, 2)
    assert (probe, hits, len(frames), cut) == (1, 1, 16, True)


def test_the_shared_counts_are_atomic() -> None:
    """Threads count in the same slots: the claim is a lock cmpxchg, the count a lock inc and
    the sum a lock add (the missed count, in the thread's own area, needs none)."""
    asm = Asm()
    emit_stack_count(asm, walker=0x1000, table=0x2000, slots=4, max_frames=8, probe_index=1, site=0, frame=0,
                     missed=0x40, at_entry=False, add_value=True)  # fmt: skip
    code = asm.encode(0x10000)[0]
    writes = [
        (insn.code, insn.has_lock_prefix)
        for insn in iced.Decoder(64, code, ip=0x10000)
        if insn.code in (C.CMPXCHG_RM64_R64, C.INC_RM64, C.ADD_RM64_R64) and insn.op0_kind == iced.OpKind.MEMORY
    ]
    assert sorted(writes) == sorted([(C.CMPXCHG_RM64_R64, True), (C.INC_RM64, True), (C.ADD_RM64_R64, True),
                                     (C.INC_RM64, False)])  # fmt: skip


@pytest.mark.parametrize("by_this_stack", [True, False])
def test_a_slot_claimed_by_another_thread_meanwhile(area: NativeArea, by_this_stack: bool) -> None:
    """Between reading a free slot and claiming it, another thread claims it: for the same stack
    (the hit is counted there, the other thread writes the frames), or for another (the next
    slot is claimed)."""
    scene = Scene(area, ROWS)
    slots = 4
    table = np.zeros(slots * SLOT_SIZE // 8, dtype=np.uint64)
    keys = table[:: SLOT_SIZE // 8]
    count = counting(scene, area, table, slots, 2)
    sp = scene.at(3000)  # (the signal frames of the steps go below: 24 KiB of the scene's stack)
    scene.stack[3000] = MODULE + 0x310
    area.call_at(count, sp, 0, 0)
    [home] = np.flatnonzero(keys).tolist()
    key = int(keys[home])
    table[:] = 0
    claim = next(insn.ip for insn in iced.Decoder(64, ctypes.string_at(count, 4096), ip=count)
                 if insn.code == C.CMPXCHG_RM64_R64)  # fmt: skip
    other = key if by_this_stack else 3
    writer = area.place(
        bytes.fromhex("48b8") + other.to_bytes(8, "little")  # mov rax, other
        + bytes.fromhex("48a3") + keys[home:].ctypes.data.to_bytes(8, "little")  # mov [the home slot's key], rax
        + b"\xc3"
    )  # fmt: skip
    run = area.place(
        bytes.fromhex("48bf") + sp.to_bytes(8, "little")  # mov rdi, sp
        + bytes.fromhex("31f6" "31d2")  # xor esi, esi; xor edx, edx
        + bytes.fromhex("48b8") + count.to_bytes(8, "little") + bytes.fromhex("ffe0")  # mov rax, count; jmp rax
    )  # fmt: skip
    assert area.call_interrupted(run, 0, within=(claim, claim + 1), handler=writer) >= 1
    counts = table[SLOT_COUNT // 8 :: SLOT_SIZE // 8]
    if by_this_stack:
        assert (int(keys[home]), int(counts[home]), slots_of(table, slots)) == (key, 1, [])
        assert area.word(L.STACK_SLOT) == keys[home:].ctypes.data
    else:
        following = (home + 1) % slots
        assert (int(keys[home]), int(counts[home]), int(keys[following])) == (3, 0, key)
        assert slots_of(table, slots) == [(2, 1, [MODULE + 0x100, MODULE + 0x310], False)]
