"""Detour code generation: its shape (byte level), and its actions run natively in this process.

The action part of a detour (everything before the relocated region) is run here as a C function
(ctypes), with this thread's GS base pointed at a numpy buffer laid out as a thread area:
the counters, histogram buckets and ring records it writes are checked value by value.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator

import iced_x86 as iced
import numpy as np
import pytest

from dynprobe.actions.filter import parse_filter
from dynprobe.actions.model import ActionKind, Program, record_fields
from dynprobe.arch.x86_64.codegen import actions as codegen_actions
from dynprobe.arch.x86_64.codegen.asm import RSEQ_CPU_ID, SYS_FUTEX, Trampoline
from dynprobe.arch.x86_64.codegen.clock import read_tsc_code, tsc_readings_code
from dynprobe.arch.x86_64.codegen.detours import build_detour, build_trap_actions
from dynprobe.arch.x86_64.codegen.returns import build_entry_stamp, build_return_code
from dynprobe.arch.x86_64.codegen.upcall import UpcallReturns, build_upcall
from dynprobe.arch.x86_64.decode import iter_instructions
from dynprobe.arch.x86_64.optimize import OptimizePlan, can_optimize, relocate_region_map
from dynprobe.arch.x86_64.regs import Regs
from dynprobe.core.upcalls import native
from dynprobe.errors import OptimizeRefusal
from dynprobe.ptrace import syscalls as sc
from dynprobe.ringbuf import layout as L
from dynprobe.spec.parser import parse_spec
from tests.unit.native import ARCH_GET_FS, ARCH_PRCTL, NativeArea, asleep_in, field, libc, one_cpu

FUNC = bytes.fromhex("554889e5897dfc8b45fc5dc3")  # push rbp; mov rbp,rsp; mov [rbp-4],edi; ...; ret
AT = 0x50_0000  # within rel32 reach of the function at 0x401000
LAYOUT = L.AreaLayout(max_probes=64, max_hists=4, ring_bytes=1 << 12, record_size=128)


def plan() -> OptimizePlan:
    made = can_optimize(FUNC, 0x401000, 0x401000)
    assert isinstance(made, OptimizePlan)
    return made


def mnemonics(code: bytes) -> list[str]:
    fmt = iced.Formatter(iced.FormatterSyntax.INTEL)
    return [fmt.format(i) for i in iter_instructions(code, AT)]


def test_count_detour_keeps_flags_without_pushf_and_ends_with_the_region() -> None:
    detour = build_detour(plan(), [Program(3, ActionKind.COUNT)], LAYOUT, AT, function_entry=True)
    assert not isinstance(detour, OptimizeRefusal)
    text = mnemonics(detour.code)
    hits = LAYOUT.counter(3, L.HITS)
    assert text == [
        "push rax", "seto al", "lahf", f"inc qword ptr gs:[{hits:X}h]", "add al,7Fh", "sahf", "pop rax",
        "push rbp", "mov rbp,rsp", "mov [rbp-4],edi", "jmp 0000000000401007h",
    ]  # fmt: skip
    assert detour.fixups == {}
    assert len(detour.code) <= 64


def test_red_zone_is_stepped_over_away_from_a_function_entry() -> None:
    detour = build_detour(plan(), [Program(0, ActionKind.COUNT)], LAYOUT, AT, function_entry=False)
    assert not isinstance(detour, OptimizeRefusal)
    text = mnemonics(detour.code)
    assert text[0] == "lea rsp,[rsp-80h]" and text[8] == "lea rsp,[rsp+80h]"


def test_loads_from_target_addresses_are_listed_as_fixups() -> None:
    spec = parse_spec("p f a=+8(%di):u32 s=+0(%si):string r=%dx")
    prog = Program(1, ActionKind.RECORD, record_fields(spec.args))
    detour = build_detour(plan(), [prog], LAYOUT, AT, function_entry=True)
    assert not isinstance(detour, OptimizeRefusal)
    by_addr = {int(i.ip): i for i in iter_instructions(detour.code, AT)}
    assert len(detour.fixups) == 2  # the u32 load and the string's byte load; %dx needs none
    for load, fixup in detour.fixups.items():
        assert by_addr[load].op1_kind == iced.OpKind.MEMORY and by_addr[load].memory_segment == iced.Register.DS
        assert AT < fixup < AT + detour.action_bytes


@pytest.mark.parametrize(("ring_bytes", "ahead"), [(1 << 12, 1 << 11), (1 << 13, 1 << 12), (1 << 26, 1 << 12)])
def test_a_record_prefetches_the_ring_a_page_ahead_within_the_ring(ring_bytes: int, ahead: int) -> None:
    layout = L.AreaLayout(max_probes=64, max_hists=4, ring_bytes=ring_bytes, record_size=32)
    spec = parse_spec("p f a=%di")
    detour = build_detour(plan(), [Program(0, ActionKind.RECORD, record_fields(spec.args))], layout, AT, True)
    assert not isinstance(detour, OptimizeRefusal)
    insns = list(iter_instructions(detour.code, AT))
    at = next(i for i, insn in enumerate(insns) if insn.mnemonic == iced.Mnemonic.PREFETCHW)
    shl, lea, wrap, prefetch = insns[at - 3 : at + 1]
    # rsi: the record's offset in the ring; the line `ahead` bytes on, wrapped in the ring
    assert str(shl) == "shl rsi,5" and str(lea) == f"lea rax,[rsi+{ahead:X}h]"
    assert wrap.mnemonic == iced.Mnemonic.AND and wrap.immediate(1) == ring_bytes - 1
    assert prefetch.memory_segment == iced.Register.GS and prefetch.memory_base == iced.Register.RAX
    assert prefetch.memory_displacement == layout.ring


@pytest.mark.parametrize(
    "spec",
    ["p f x=%fs_base", "p f x=@nowhere", "p f x=+0(@nowhere):u8", "p f x=@nowhere:string", "r f x=$retval",
     "r f x=$latency:u64"],
)  # fmt: skip
def test_fetches_with_no_form_in_the_target_stay_traps(spec: str) -> None:
    """Segment bases, a symbol the process does not have, and at an entry what only a return has
    (a return probe's detour is built with `entry` set, as returns.py does)."""
    prog = Program(0, ActionKind.RECORD, record_fields(parse_spec(spec).args))
    assert build_detour(plan(), [prog], LAYOUT, AT, True) == OptimizeRefusal.FETCH_UNSUPPORTED


@pytest.mark.parametrize(("fields", "fits"), [(32, True), (33, False)])
def test_a_record_has_at_most_32_fields(fields: int, fits: bool) -> None:
    """One fault bit each in the record header's u32; a longer record stays a trap (at an entry,
    and in a return probe's return code)."""
    spec = parse_spec("p f " + " ".join(f"a{i}=%di" for i in range(fields)))
    layout = L.AreaLayout(max_probes=64, max_hists=4, ring_bytes=1 << 16, record_size=512)
    prog = Program(0, ActionKind.RECORD, record_fields(spec.args))
    built = build_detour(plan(), [prog], layout, AT, True)
    assert (built != OptimizeRefusal.FETCH_UNSUPPORTED) is fits
    returning = build_return_code(prog, layout, AT, Trampoline(AT, AT, AT), 1 << 32)
    assert (returning != OptimizeRefusal.FETCH_UNSUPPORTED) is fits


def test_read_tsc_code() -> None:
    assert mnemonics(read_tsc_code()) == ["rdtsc", "shl rdx,20h", "or rax,rdx", "ret"]


# --- the actions, run natively ---------------------------------------------------------------------
@pytest.fixture
def area() -> Iterator[NativeArea]:
    made = NativeArea(LAYOUT)
    yield made
    made.close()


def run(area: NativeArea, programs: list[Program], *args: int, rseq_offset_at: int | None = None) -> None:
    """Run the actions of a detour for `programs` as f(args...) on this thread."""

    def actions(base: int) -> bytes:
        detour = build_detour(plan(), programs, LAYOUT, base, function_entry=True, rseq_offset_at=rseq_offset_at)
        assert not isinstance(detour, OptimizeRefusal)
        area.add_fixups(detour.fixups)
        return detour.code[: detour.action_bytes] + b"\xc3"  # the actions, then ret

    area.call(actions, *args)


def test_native_count_and_filter(area: NativeArea) -> None:
    spec = parse_spec("p f a=%di b=%si:s32")
    keep = parse_filter("a == 5 or (b < -2 and a != 7)", spec.args)
    progs = [Program(0, ActionKind.COUNT), Program(1, ActionKind.COUNT, filter=keep)]
    calls: list[tuple[int, int]] = [(5, 0), (7, -3), (1, -3), (1, 2), (5, 2**32 - 1)]
    for a, b in calls:
        run(area, progs, a, b & (2**64 - 1))
    assert area.counter(0, L.HITS) == len(calls)
    # b is s32: 2**32-1 is -1 (not < -2); (5, ...) passes on a == 5
    assert area.counter(1, L.HITS) == 3  # (5,0), (1,-3), (5,-1)


def test_native_histogram(area: NativeArea) -> None:
    value = parse_spec("p f v=%di:s64").args[0]
    prog = Program(0, ActionKind.HIST, value=value, hist_index=2)
    for v in (0, 1, 2, 3, 4, 1000, 2**63 - 1, -5 & (2**64 - 1)):
        run(area, [prog], v)
    buckets = area.words[LAYOUT.hist(2) // 8 : LAYOUT.hist(2) // 8 + L.HIST_BUCKETS]
    expected = np.zeros(L.HIST_BUCKETS, dtype=np.uint64)
    for k in (0, 1, 2, 2, 3, 10, 63, 0):  # zero and negative -> 0; v in [2^(k-1), 2^k) -> k
        expected[k] += 1
    assert buckets.tolist() == expected.tolist()


def test_native_record(area: NativeArea) -> None:
    area.fill_ring(0xEE)  # every byte of a record must be written
    text = ctypes.create_string_buffer(b"hello")
    long_text = ctypes.create_string_buffer(b"y" * 100)
    spec = parse_spec("p f n=%di s=+0(%si):string k=+4(%dx):u16 c=$comm")
    prog = Program(9, ActionKind.RECORD, record_fields(spec.args))
    words = (ctypes.c_uint16 * 4)(1, 2, 0xBEEF, 4)
    run(area, [prog], 42, ctypes.addressof(text), ctypes.addressof(words))
    run(area, [prog], 2**64 - 1, ctypes.addressof(long_text), ctypes.addressof(words))
    first, second = area.records()
    for rec in (first, second):
        assert int.from_bytes(rec[0:2], "little") == 9
        assert int.from_bytes(rec[4:8], "little") == 0  # nothing faulted
    assert int.from_bytes(second[8:16], "little") > int.from_bytes(first[8:16], "little") > 0  # tsc
    n, s, k = (f.offset for f in prog.fields[:3])
    assert int.from_bytes(first[n : n + 8], "little") == 42
    assert first[s : s + 2] == (5).to_bytes(2, "little") and first[s + 2 : s + 4] == b"\0\0"
    assert first[s + 4 : s + 9] == b"hello"
    assert int.from_bytes(first[k : k + 8], "little") == 0xBEEF
    assert int.from_bytes(second[s : s + 2], "little") == L.STRING_CAPACITY
    assert int.from_bytes(second[s + 2 : s + 4], "little") == L.STRING_TRUNCATED
    assert prog.fields[3].size == 0  # $comm is the consumer's
    assert area.counter(9, L.HITS) == 2 and area.counter(9, L.LOST) == 0


def test_native_record_of_addresses_symbols_the_stack_and_registers(area: NativeArea) -> None:
    """@ADDR, @SYM+OFFS (the resolver's address), $stackN, %sp (the thread's, at the site),
    %ip (the site), %flags (pushed: the caller's carry), an offset beyond a disp32."""
    words = (ctypes.c_uint64 * 4)(0x1111_2222_3333_4444, 0x5555_6666_7777_8888, 0xCDAB, 0)
    at = ctypes.addressof(words)
    spec = parse_spec(
        f"p f a=@{at:#x}:u32 s=@table+8:u16 s1=$stack1 s2=$stack2 up=+8(%sp):u64 ip=%ip fl=%flags"
        " far=+0x100000000(%si):u8 a1=$arg1 a2=$arg2 st=$stack sp=%sp"
    )
    prog = Program(1, ActionKind.RECORD, record_fields(spec.args))
    resolve = {"table": at}.get

    def stub_then_actions(base: int) -> bytes:
        # push 0x2222; push 0x1111 (so $stack1 = 0x1111, $stack2 = 0x2222); stc; call the
        # actions (at base + 64); add rsp, 16; ret
        stub = bytes.fromhex("68222200006811110000f9e8") + (64 - 16).to_bytes(4, "little") + bytes.fromhex("4883c410c3")
        detour = build_detour(plan(), [prog], LAYOUT, base + 64, function_entry=True, symbol_address=resolve)
        assert not isinstance(detour, OptimizeRefusal)
        return stub.ljust(64, b"\xcc") + detour.code[: detour.action_bytes] + b"\xc3"

    area.call(stub_then_actions, 0, (at + 16 - (1 << 32)) & (2**64 - 1))
    (record,) = area.records()
    got = {f.arg.name: int.from_bytes(record[f.offset : f.offset + 8], "little") for f in prog.fields}
    assert int.from_bytes(record[4:8], "little") == 0  # nothing faulted
    assert (got["a"], got["s"], got["s1"], got["s2"]) == (0x3333_4444, 0x8888, 0x1111, 0x2222)
    assert got["up"] == 0x1111 and got["ip"] == plan().site and got["fl"] & 1 and got["far"] == 0xAB
    assert (got["a1"], got["a2"]) == (0, (at + 16 - (1 << 32)) & (2**64 - 1)) and got["st"] == got["sp"]


def test_native_loads_that_fault(area: NativeArea) -> None:
    """Loads from unmapped memory go on at their fix-ups (as the tracer sends them): a record's
    value is 0 with its bit in the faults, a string that runs into unmapped memory keeps what
    was read (truncated), one with nothing readable is empty and faulted; a histogram's value
    goes to the faulted bucket; a filter's comparison is false (its `or` goes on). Every byte
    of the record is written (the ring was junk)."""
    area.fill_ring(0xEE)
    unreadable = area.guarded(b"")
    partial = area.guarded(b"abc")
    spec = parse_spec("p f ok=%di bad=+0(%si):u64 part=+0(%cx):string w=+1(%cx):u16 s=+0(%dx):string")
    prog = Program(3, ActionKind.RECORD, record_fields(spec.args[:4]))
    empty = Program(7, ActionKind.RECORD, record_fields([spec.args[0], spec.args[4]]))
    hist = Program(4, ActionKind.HIST, value=spec.args[1], hist_index=1)
    either = Program(5, ActionKind.COUNT, filter=parse_filter("bad > 0 or ok == 7", spec.args))
    both = Program(6, ActionKind.COUNT, filter=parse_filter("ok == 7 and w > 0", spec.args))
    run(area, [prog, empty, hist, either, both], 7, unreadable, unreadable, partial)
    record, emptied = area.records()
    at = {f.arg.name: f.offset for f in prog.fields}
    assert int.from_bytes(record[4:8], "little") == 0b10  # bad
    assert int.from_bytes(record[at["ok"] : at["ok"] + 8], "little") == 7
    assert record[at["bad"] : at["bad"] + 8] == bytes(8)
    assert int.from_bytes(emptied[4:8], "little") == 0b10  # s, with nothing readable
    s_at = empty.fields[1].offset
    assert emptied[s_at : s_at + 4] == bytes(4)  # length 0, no flag
    length, flags = (int.from_bytes(record[at["part"] + i : at["part"] + i + 2], "little") for i in (0, 2))
    assert (length, flags, record[at["part"] + 4 : at["part"] + 7]) == (3, L.STRING_TRUNCATED, b"abc")
    assert int.from_bytes(record[at["w"] : at["w"] + 8], "little") == 0x6362  # "bc": right up to the page's end
    assert area.hist(1)[L.HIST_FAULTED] == 1 and sum(area.hist(1)) == 1
    assert (area.counter(5, L.HITS), area.counter(6, L.HITS)) == (1, 1)
    run(area, [either], 8, unreadable)
    assert area.counter(5, L.HITS) == 1  # bad faulted, ok != 7


ARITHMETIC_FLAGS = 0x8D5  # CF PF AF ZF SF OF
# pushfq; pop rax; and rax, ARITHMETIC_FLAGS; ret: return the flags the code before left
RETURN_FLAGS = bytes.fromhex("9c584825") + ARITHMETIC_FLAGS.to_bytes(4, "little") + b"\xc3"


@pytest.mark.parametrize(
    ("fields", "condition"),
    [("", None), ("", "a > 3"), ("a=%di", None), ("a=%di fl=%flags", None), ("", "fl > 0")],
    ids=["count", "filter", "record", "record of the flags", "filter on the flags"],
)
def test_native_actions_keep_the_flags(area: NativeArea, fields: str, condition: str | None) -> None:
    """The code at a site runs between two instructions of the program: the flags after it are
    the flags before (seto/lahf/sahf, or pushfq/popfq where a probe reads %flags)."""
    keep = parse_filter(condition, parse_spec("p f a=%di fl=%flags").args) if condition else None
    recorded = record_fields(parse_spec(f"p f {fields}").args)
    prog = Program(2, ActionKind.RECORD if recorded else ActionKind.COUNT, recorded, filter=keep)

    def flags_around_actions(base: int) -> bytes:
        # push rdi; popfq; call the actions (at base + 64); then RETURN_FLAGS
        stub = bytes.fromhex("579d") + b"\xe8" + (64 - 7).to_bytes(4, "little") + RETURN_FLAGS
        detour = build_detour(plan(), [prog], LAYOUT, base + 64, function_entry=True)
        assert not isinstance(detour, OptimizeRefusal)
        return stub.ljust(64, b"\xcc") + detour.code[: detour.action_bytes] + b"\xc3"

    stub = area.place(flags_around_actions)
    for flags in (ARITHMETIC_FLAGS, 0, 0x801, 0x0C4, 0x011, 0x800, 0x001):
        assert area.call_at(stub, flags | 2) == flags, hex(flags)


def test_native_offsets_at_the_edges_of_a_disp32(area: NativeArea) -> None:
    """+OFFS(%reg) with OFFS at 2^31 - 1 and -2^31 (one lea) and at 2^31 (an imm64 add); a
    dereference of a dereference."""
    words = (ctypes.c_uint64 * 2)(0x0102_0304_0506_0708, 0)
    at = ctypes.addressof(words)
    words[1] = at  # a pointer to the first word
    spec = parse_spec(
        "p f top=+0x7fffffff(%di):u64 bottom=-0x80000000(%si):u64 past=+0x80000000(%dx):u64 twice=+0(+8(%cx)):u64"
        " under=-0x80000001(%r8):u64"
    )
    prog = Program(0, ActionKind.RECORD, record_fields(spec.args))
    mask = 2**64 - 1
    bases = [at - 0x7FFF_FFFF, at + 0x8000_0000, at - 0x8000_0000, at, at + 0x8000_0001]
    run(area, [prog], *(base & mask for base in bases))
    (record,) = area.records()
    got = [int.from_bytes(record[f.offset : f.offset + 8], "little") for f in prog.fields]
    assert got == [0x0102_0304_0506_0708] * 5


def test_native_record_full_ring_counts_losses(area: NativeArea) -> None:
    prog = Program(4, ActionKind.RECORD, record_fields(parse_spec("p f n=%di").args))
    slots = LAYOUT.ring_slots
    for i in range(slots + 5):
        run(area, [prog], i)
    assert int(area.words[L.HEAD // 8]) == slots
    assert area.counter(4, L.LOST) == 5 and area.counter(4, L.HITS) == slots + 5
    area.words[L.TAIL // 8] = 3  # the consumer took three
    run(area, [prog], 777)
    assert int(area.words[L.HEAD // 8]) == slots + 1
    rec = area.records()[0]  # slot 0 again (head % slots == 0 before the write)
    assert int.from_bytes(rec[16:24], "little") == 777


def test_native_flight_recorder_gives_up_its_oldest_records(area: NativeArea) -> None:
    """A flight recorder's full ring (OVERWRITE): the writer moves TAIL past the oldest record
    itself, never waits (WAIT_TICKS set, no reader) and never loses."""
    prog = Program(4, ActionKind.RECORD, record_fields(parse_spec("p f n=%di").args))
    slots = LAYOUT.ring_slots
    area.set_word(L.OVERWRITE, 1)
    area.set_word(L.WAIT_TICKS, 1 << 40)
    for i in range(slots + 5):
        run(area, [prog], i)
    assert (area.word(L.HEAD), area.word(L.TAIL)) == (slots + 5, 5)
    assert area.counter(4, L.LOST) == 0 and area.counter(4, L.HITS) == slots + 5
    assert area.word(L.WAITS) == 0 and area.word(L.WAIT_UNTIL) == 0 and area.word(L.BUSY) == 0
    assert [field(r, 16) for r in area.records(5)] == list(range(5, slots + 5))
    area.set_word(L.TAIL, slots + 7)  # scribbled ahead of head: the writer puts it right
    run(area, [prog], 999)
    assert (area.word(L.HEAD), area.word(L.TAIL)) == (slots + 6, 6)  # a full ring again
    assert field(area.records(slots + 5)[0], 16) == 999


def _full_ring(area: NativeArea) -> int:
    """A record probe's actions (probe 4, n=%di), placed, and the ring full: their address."""
    prog = Program(4, ActionKind.RECORD, record_fields(parse_spec("p f n=%di").args))
    detour = build_detour(plan(), [prog], LAYOUT, area.base + area.used, function_entry=True)
    assert not isinstance(detour, OptimizeRefusal)
    actions = area.place(detour.code[: detour.action_bytes] + b"\xc3")
    for word in (L.HEAD, L.RESERVE):
        area.set_word(word, LAYOUT.ring_slots)
    area.set_word(L.WAIT_SPIN, 1 << 62)  # (a writer that waits spins: the tests of its sleep say otherwise)
    return actions


def _once_waiting(area: NativeArea, offset: int, value: int) -> threading.Thread:
    """A thread that sets the area's word at `offset` to `value` once the writer waits (its
    WAIT_UNTIL set): the reader taking records, or the tracer leaving. (ctypes lets the GIL go
    while the generated code runs.)"""

    def once_waiting() -> None:
        while not area.word(L.WAIT_UNTIL):
            os.sched_yield()
        area.set_word(offset, value)

    thread = threading.Thread(target=once_waiting)
    thread.start()
    return thread


def test_native_record_waits_for_the_reader_to_make_room(area: NativeArea) -> None:
    """A full ring, a writer allowed to wait: it waits (WAIT_UNTIL set), the reader takes one
    record, and the record is written into that room, counted as waited, not lost."""
    actions = _full_ring(area)
    area.set_word(L.WAIT_TICKS, 1 << 36)  # (tens of seconds: the reader decides)
    reader = _once_waiting(area, L.TAIL, 1)
    area.call_at(actions, 777)
    reader.join()
    assert area.word(L.HEAD) == LAYOUT.ring_slots + 1 and area.word(L.WAITS) == 1
    assert area.counter(4, L.LOST) == 0 and area.counter(4, L.HITS) == 1
    assert field(area.records(LAYOUT.ring_slots)[0], 16) == 777
    assert area.word(L.BUSY) == 0


def test_native_writer_paused_by_a_snapshot_goes_on_overwriting(area: NativeArea) -> None:
    """A flight recorder's full ring while the reader copies it (OVERWRITE cleared): the writer
    waits; once the copy is over (OVERWRITE set again) it gives up the oldest record and writes
    its own: not lost, not counted as waited."""
    actions = _full_ring(area)
    area.set_word(L.WAIT_TICKS, 1 << 36)
    reader = _once_waiting(area, L.OVERWRITE, 1)
    area.call_at(actions, 777)
    reader.join()
    assert (area.word(L.HEAD), area.word(L.TAIL)) == (LAYOUT.ring_slots + 1, 1)
    assert area.counter(4, L.LOST) == 0 and area.word(L.WAITS) == 0 and area.word(L.BUSY) == 0
    assert field(area.records(LAYOUT.ring_slots)[0], 16) == 777


def test_native_writer_sleeps_until_the_reader_wakes_it(area: NativeArea) -> None:
    """Past its spin (none here) a writer waiting for room sleeps on TAIL, WAIT_SLEEPING set: the
    reader takes a record and wakes it (as the consumer does, on its own mapping), and the
    record is written into that room."""
    _asleep_until(area, L.TAIL, 1)()
    assert area.word(L.HEAD) == LAYOUT.ring_slots + 1 and area.word(L.WAITS) == 1
    assert area.word(L.WAIT_SLEEPING) == 0 and area.counter(4, L.LOST) == 0
    assert field(area.records(LAYOUT.ring_slots)[0], 16) == 777


def _asleep_until(area: NativeArea, offset: int, value: int) -> Callable[[], None]:
    """A full ring whose writer sleeps at once, and a thread that, once it sleeps in the futex
    call, sets the area's word at `offset` to `value` and wakes it (as the consumer does, on its
    own mapping): a function that writes a record so, and checks that the writer said it slept
    and that the wake woke it (a wait on another word, or none, would have slept its second
    out: the wake would have woken none)."""
    actions = _full_ring(area)
    area.set_word(L.WAIT_SPIN, 0)
    area.set_word(L.WAIT_TICKS, 1 << 62)
    area.set_word(L.AREA_SELF, area.mem.ctypes.data)
    area.set_word(L.SLEEP_TIMEOUT, 1)
    writer = threading.get_native_id()
    seen: list[tuple[int, int]] = []  # (WAIT_SLEEPING while asleep, how many the wake woke)

    def waker() -> None:
        while not asleep_in(writer, SYS_FUTEX):
            os.sched_yield()
        sleeping = area.word(L.WAIT_SLEEPING)
        area.set_word(offset, value)
        seen.append((sleeping, sc.futex_wake(area.mem.ctypes.data + L.TAIL, 1)))

    def write() -> None:
        thread = threading.Thread(target=waker)
        thread.start()
        area.call_at(actions, 777)
        thread.join()
        assert seen == [(1, 1)]

    return write


def test_native_writer_finding_room_as_it_lies_down_does_not_sleep(area: NativeArea) -> None:
    """The reader takes a record just as the writer, its spin over, says it sleeps: the writer's
    last look at TAIL (after the fence that orders it behind WAIT_SLEEPING) sees the room, and
    it writes the record without a futex call (which would sleep: no one would wake it)."""
    actions = _full_ring(area)
    area.set_word(L.WAIT_SPIN, 0)
    area.set_word(L.WAIT_TICKS, 1 << 62)
    area.set_word(L.AREA_SELF, area.mem.ctypes.data)
    area.set_word(L.SLEEP_TIMEOUT, 3600)
    code = ctypes.string_at(actions, 4096)
    fence = next(
        insn
        for insn in iced.Decoder(64, code, ip=actions)
        if insn.has_lock_prefix and insn.code == iced.Code.OR_RM64_IMM8
    )
    reader = area.place(
        bytes.fromhex("b801000000")  # mov eax, 1
        + bytes.fromhex("48a3") + (area.mem.ctypes.data + L.TAIL).to_bytes(8, "little")  # mov [TAIL], rax
        + b"\xc3"
    )  # fmt: skip
    writer = threading.get_native_id()
    slept: list[int] = []
    done = threading.Event()

    def watcher() -> None:  # (wakes a writer that sleeps, so that a broken one fails, not hangs)
        while not done.is_set():
            if area.word(L.WAIT_SLEEPING) and asleep_in(writer, SYS_FUTEX):  # (not the GIL's futex)
                slept.append(sc.futex_wake(area.mem.ctypes.data + L.TAIL, 1))
            os.sched_yield()

    thread = threading.Thread(target=watcher)
    thread.start()
    try:
        assert area.call_interrupted(actions, 777, within=(fence.ip, fence.next_ip), handler=reader) == 1
    finally:
        done.set()
        thread.join()
    assert slept == [] and area.word(L.WAIT_SLEEPING) == 0
    assert area.word(L.HEAD) == LAYOUT.ring_slots + 1 and area.word(L.WAITS) == 1
    assert area.counter(4, L.LOST) == 0 and field(area.records(LAYOUT.ring_slots)[0], 16) == 777


def test_native_writer_asleep_goes_on_when_the_tracer_leaves(area: NativeArea) -> None:
    """The tracer, leaving, ends the waits (WAIT_TICKS 0) and wakes the sleepers: lost, at once."""
    _asleep_until(area, L.WAIT_TICKS, 0)()
    assert area.word(L.HEAD) == LAYOUT.ring_slots and area.counter(4, L.LOST) == 1
    assert area.word(L.WAIT_SLEEPING) == 0 and area.word(L.WAITS) == 0


def test_native_writer_asleep_during_a_snapshot_overwrites_once_it_ends(area: NativeArea) -> None:
    """A flight recorder's ring paused for a copy: its writer sleeps; the copy over (OVERWRITE
    set again, a wake), it gives up the oldest record and writes its own."""
    _asleep_until(area, L.OVERWRITE, 1)()
    assert (area.word(L.HEAD), area.word(L.TAIL)) == (LAYOUT.ring_slots + 1, 1)
    assert area.counter(4, L.LOST) == 0 and area.word(L.WAIT_SLEEPING) == 0


def test_native_writer_that_waited_in_vain_waits_again_only_once_the_reader_came(area: NativeArea) -> None:
    """A wait that ran out leaves WAIT_GAVE_UP: the next record that finds the ring full is lost
    without waiting (the reader is stopped or gone: the program is not slowed down a whole wait
    a record), until the reader moves TAIL; then a full ring is waited on again."""
    actions = _full_ring(area)
    area.set_word(L.WAIT_TICKS, 1 << 20)
    area.set_word(L.WAIT_SPIN, 1 << 62)  # (never asleep)
    area.call_at(actions, 1)
    assert area.counter(4, L.LOST) == 1 and area.word(L.WAIT_GAVE_UP) == 1
    area.set_word(L.WAIT_UNTIL, 0)
    area.call_at(actions, 2)
    assert area.counter(4, L.LOST) == 2 and area.word(L.WAIT_UNTIL) == 0  # (lost at once)
    area.set_word(L.TAIL, 1)  # the reader took one; a record came in its room
    for word in (L.HEAD, L.RESERVE):
        area.set_word(word, LAYOUT.ring_slots + 1)
    area.call_at(actions, 3)
    assert area.counter(4, L.LOST) == 3 and area.word(L.WAIT_UNTIL) != 0 and area.word(L.WAIT_GAVE_UP) == 2
    assert area.word(L.WAITS) == 0 and area.word(L.BUSY) == 0


@pytest.mark.parametrize("how", ["lossy", "its time runs out", "the tracer leaves"])
def test_native_record_that_waited_in_vain_is_lost(area: NativeArea, how: str) -> None:
    """No reader comes: the record is lost at once when waiting is off (it never even reads
    the clock: WAIT_UNTIL stays 0), once WAIT_TICKS have passed (not before), or at once when
    the tracer sets WAIT_TICKS to 0 (as it does when it leaves) while the writer waits."""
    actions = _full_ring(area)
    ticks = {"lossy": 0, "its time runs out": 1 << 24, "the tracer leaves": 1 << 62}[how]
    area.set_word(L.WAIT_TICKS, ticks)
    leaving = _once_waiting(area, L.WAIT_TICKS, 0) if how == "the tracer leaves" else None
    clock = area.place(read_tsc_code())
    with one_cpu():  # (two readings of the clock ordered)
        before = area.call_at(clock)
        area.call_at(actions, 777)
        waited = area.call_at(clock) - before
    if leaving is not None:
        leaving.join()
    assert area.word(L.HEAD) == LAYOUT.ring_slots and area.word(L.WAITS) == 0
    assert area.counter(4, L.LOST) == 1 and area.word(L.BUSY) == 0
    assert (area.word(L.WAIT_UNTIL) == 0) == (how == "lossy")
    if how == "its time runs out":
        assert waited >= ticks


def test_native_record_reentry_is_missed(area: NativeArea) -> None:
    prog = Program(2, ActionKind.RECORD, record_fields(parse_spec("p f n=%di").args))
    area.words[L.BUSY // 8] = 1  # as if a signal handler interrupted a record being written
    run(area, [prog], 1)
    assert area.counter(2, L.MISSED) == 1 and int(area.words[L.HEAD // 8]) == 0


def test_native_record_interrupted_at_every_instruction_loses_no_record_silently(area: NativeArea) -> None:
    """A signal handler that hits the same probe while the thread writes a record, after each
    instruction of the actions in turn: inside the window where the record's slot is taken its
    record is missed (counted), outside it is written whole; never a slot written twice, nor a
    record published unwritten. The flag is clear after: the next record is written."""
    area.fill_ring(0xEE)
    prog = Program(2, ActionKind.RECORD, record_fields(parse_spec("p f n=%di").args))
    detour = build_detour(plan(), [prog], LAYOUT, area.base + area.used, function_entry=True)
    assert not isinstance(detour, OptimizeRefusal)
    actions = area.place(detour.code[: detour.action_bytes] + b"\xc3")
    nested = area.call_interrupted(actions, 0xABC, within=(actions, actions + detour.action_bytes))
    area.call_at(actions, 0xDEF)
    missed = area.counter(2, L.MISSED)
    values = [field(record, prog.fields[0].offset) for record in area.records()]
    assert 0 < missed < nested  # some handlers came inside the window, some outside
    assert len(values) + missed == nested + 2 == area.counter(2, L.HITS)
    assert sorted(values) == sorted({*values} & {0xABC, 0xDEF, *range(1, nested + 1)})
    assert {0xABC, 0xDEF} <= set(values) and values[-1] == 0xDEF
    assert area.word(L.BUSY) == 0


def test_native_filter_agrees_with_the_tracer(area: NativeArea) -> None:
    """The same filter in the detour and in trap mode (actions.filter.matches) on the same values,
    call by call: every signed and unsigned width, registers with junk above the width."""
    from dynprobe.actions.filter import matches

    spec = parse_spec("p f a=%di:s8 b=%si:s16 c=%dx:s32 d=%cx:u8 e=%r8:u16 f=%r9:u32 u=%di:u64")
    texts = [f"{name} {test}" for name in "abcdef" for test in ("< -2", ">= 0", "> 200", "== 253")]
    texts.append("u == -1 or (c < -2 and d > 200) or (u < 5 and c >= 0)")
    programs = [Program(i, ActionKind.COUNT, filter=parse_filter(text, spec.args)) for i, text in enumerate(texts)]
    junk = 0xDEAD_BEEF_0000_0000
    for low in (0, 1, 0xFD, 0xFFFD, 0xFFFF_FFFD, 0x8000_0000, 0x7F, 2**64 - 1):
        registers = [(junk | low) & (2**64 - 1) if low < 2**32 else low for _ in range(6)]
        values = {}
        for arg, register in zip(spec.args, [*registers, registers[0]], strict=True):
            bits = arg.type.bits
            value = register & ((1 << bits) - 1)
            values[arg.name] = value - (1 << bits) if arg.type.kind == "s" and value >> (bits - 1) else value
        before = [area.counter(i, L.HITS) for i in range(len(texts))]
        run(area, programs, *registers)
        for i, text in enumerate(texts):
            counted = area.counter(i, L.HITS) - before[i]
            assert counted == matches(programs[i].filter, values), (text, hex(low), values)


def _rseq_offset_address() -> int | None:
    try:
        return ctypes.addressof(ctypes.c_int64.in_dll(libc, "__rseq_offset"))
    except ValueError:
        return None


@pytest.mark.parametrize(
    "source", ["rseq", "rseq says 5", "rseq unregistered", "no rseq offset", "no rseq area", "rdpid", "rdtscp"]
)
def test_native_record_cpu_number(area: NativeArea, source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record's CPU: from the thread's rseq area (this process's glibc registered one; a
    fake one saying 5 is believed), by rdpid when that area says it is not registered (a
    negative CPU) or a load faults (__rseq_offset or the area unmapped), by rdpid alone, or by
    rdtscp on a CPU without rdpid."""
    rseq_offset_at = _rseq_offset_address()
    if rseq_offset_at is None:
        pytest.skip("this glibc has no __rseq_offset (glibc < 2.35)")
    fs = ctypes.c_uint64()
    assert libc.syscall(ARCH_PRCTL, ARCH_GET_FS, ctypes.byref(fs)) == 0
    fake = ctypes.c_int64(0)
    fake_area = {"rseq says 5": 5, "rseq unregistered": -2}.get(source)
    if fake_area is not None:
        rseq = (ctypes.c_int32 * 2)(0, fake_area)  # cpu_id_start, cpu_id
        fake.value = ctypes.addressof(rseq) - fs.value
        rseq_offset_at = ctypes.addressof(fake)
    elif source == "no rseq offset":
        rseq_offset_at = area.guarded(b"")
    elif source == "no rseq area":
        fake.value = area.guarded(b"") - RSEQ_CPU_ID - fs.value
        rseq_offset_at = ctypes.addressof(fake)
    if source == "rdtscp":
        monkeypatch.setattr(codegen_actions, "has_rdpid", lambda: False)
    prog = Program(0, ActionKind.RECORD, record_fields(parse_spec("p f n=%di").args))
    at = None if source in ("rdpid", "rdtscp") else rseq_offset_at
    code = build_detour(plan(), [prog], LAYOUT, AT, True, rseq_offset_at=at)
    assert not isinstance(code, OptimizeRefusal)
    loads = [i for i in iter_instructions(code.code, AT) if i.memory_segment == iced.Register.FS]
    assert len(loads) == (0 if at is None else 1)
    if loads:  # a load that faults (no thread pointer yet) goes on to rdpid
        rdpid = next(i for i in iter_instructions(code.code, AT) if i.mnemonic == iced.Mnemonic.RDPID)
        assert code.fixups[int(loads[0].ip)] == int(rdpid.ip)
    allowed = os.sched_getaffinity(0)
    try:
        for cpu in sorted(allowed):
            os.sched_setaffinity(0, {cpu})
            run(area, [prog], rseq_offset_at=at)
            said = 5 if source == "rseq says 5" else cpu
            assert int.from_bytes(area.records()[-1][2:4], "little") == said
    finally:
        os.sched_setaffinity(0, allowed)


def test_native_entry_stamp(area: NativeArea) -> None:
    """A thread resuming from a trap entry through the entry stamp: the named words get the
    time-stamp counter (unused targets name DISCARD), the registers are as they were, it goes on
    at the resume address (here: code returning rdi + rsi + rdx) with the stack as it was, and
    STAMP_BUSY is clear after."""
    stamp = build_entry_stamp()
    resume_at = 256
    targets = [LAYOUT.shadow + 3 * L.SHADOW_ENTRY + L.ENTRY_TSC, LAYOUT.shadow + L.ENTRY_TSC]
    w = area.words
    w[L.STAMP_TARGETS // 8 : L.STAMP_TARGETS // 8 + L.STAMP_TARGETS_MAX] = targets + [L.STAMP_DISCARD] * 2
    w[L.STAMP_BUSY // 8] = 1

    def code_at(base: int) -> bytes:
        w[L.STAMP_RESUME // 8] = base + resume_at
        sum_of_args = bytes.fromhex("488d04374801d0c3")  # lea rax,[rdi+rsi]; add rax,rdx; ret
        return stamp.ljust(resume_at, b"\xcc") + sum_of_args

    clock = area.place(read_tsc_code())
    with one_cpu():
        tsc_before = area.call_at(clock)
        assert area.call(code_at, 1, 20, 300) == 321
        tsc_after = area.call_at(clock)
    assert w[L.STAMP_BUSY // 8] == 0
    first, second = (int(w[t // 8]) for t in targets)
    assert first == second == int(w[L.STAMP_DISCARD // 8]) and tsc_before < first < tsc_after


def test_native_latency_of_a_return_stamped_before_its_entry_is_zero(area: NativeArea) -> None:
    """$latency at a return whose entry's time stamp is later than the return's (the stamps are
    not ordered; the thread may have moved to a CPU whose counter is behind) is 0, never a huge
    wrapped value; an entry stamped 2^40 ticks earlier (less where the counter is younger) gives
    2^40 ns and a little more (the time to get there) with mult 2^32 (1 ns a tick). The return code runs as
    the trampoline runs it: the entry's offset above the six saved registers, then a jump to
    `finish` (here: pop them, return)."""
    value = parse_spec("r f ns=$latency:u64").args[0]
    prog = Program(0, ActionKind.HIST, value=value, hist_index=1)
    entry = 2 * L.SHADOW_ENTRY
    prologue = bytes.fromhex("57") + bytes.fromhex("4883ec30")  # push rdi (the entry offset); sub rsp,48
    epilogue = bytes.fromhex("4883c438c3")  # add rsp,56; ret

    def code_at(base: int) -> bytes:
        finish = base + 512
        code = build_return_code(prog, LAYOUT, base + len(prologue), Trampoline(0, finish, 0), 1 << 32)
        assert isinstance(code, bytes)
        return (prologue + code).ljust(512, b"\xcc") + epilogue

    now = area.call(lambda base: read_tsc_code())
    power = min(40, now.bit_length() - 2)  # a counter that started less than 2^41 ticks ago
    at = (LAYOUT.shadow + entry + L.ENTRY_TSC) // 8
    for stamp in (now + (1 << power), now - (1 << power)):
        area.words[at] = stamp
        area.call(code_at, entry)
    buckets = area.words[LAYOUT.hist(1) // 8 : LAYOUT.hist(1) // 8 + L.HIST_BUCKETS].tolist()
    assert buckets[0] == 1 and buckets[power + 1] == 1 and sum(buckets) == 2  # [2^power, 2^(power+1)) ns


def test_native_tsc_readings(area: NativeArea) -> None:
    """Readings back to back, each where it belongs and none past the last: on one CPU they
    never go back, and lie between a reading before and one after (all 64 bits)."""
    out = np.zeros(1001, dtype=np.uint64)
    out[1000] = 7
    clock = area.place(read_tsc_code())
    with one_cpu():
        before = area.call_at(clock)
        area.call(tsc_readings_code(), 1000, out.ctypes.data)
        after = area.call_at(clock)
    readings = out[:1000].tolist()
    assert out[1000] == 7 and readings == sorted(readings) and before <= readings[0] and readings[-1] <= after
    assert readings[-1] > readings[0]  # (1000 readings take far longer than a step of any clock)


def test_native_trap_actions_record_then_resume(area: NativeArea) -> None:
    """A trap hit's actions run in the target: the record of the registers at the hit, then on
    at gs:[STAMP_RESUME] (here: code returning rdi + rsi) with every register, the flags and the
    stack as they were, and STAMP_BUSY clear. A filter that fails records nothing."""
    spec = parse_spec("p f a=%di b=%si")
    prog = Program(5, ActionKind.RECORD, record_fields(spec.args), filter=parse_filter("a != 3", spec.args))
    resume_at = 1024
    sum_of_args = bytes.fromhex("488d0437c3")  # lea rax,[rdi+rsi]; ret

    def code_at(base: int) -> bytes:
        built = build_trap_actions([prog], LAYOUT, 0x401000, base)
        assert not isinstance(built, OptimizeRefusal) and not built.fixups and len(built.code) <= resume_at
        area.words[L.STAMP_RESUME // 8] = base + resume_at
        area.words[L.STAMP_BUSY // 8] = 1
        return built.code.ljust(resume_at, b"\xcc") + sum_of_args

    assert area.call(code_at, 40, 2) == 42
    assert area.words[L.STAMP_BUSY // 8] == 0
    assert area.call(code_at, 3, 9) == 12  # filtered out: no record, same resume
    (record,) = area.records()
    a, b = (f.offset for f in prog.fields)
    assert int.from_bytes(record[a : a + 8], "little") == 40 and int.from_bytes(record[b : b + 8], "little") == 2
    assert area.counter(5, L.HITS) == 1


@pytest.mark.parametrize("spec", ["p f a=%di", "p f a=%di fl=%flags"])
def test_native_trap_actions_keep_the_flags(area: NativeArea, spec: str) -> None:
    """A trap hit's actions give the thread back its flags too, as they were at the hit."""
    prog = Program(5, ActionKind.RECORD, record_fields(parse_spec(spec).args))

    def code_at(base: int) -> bytes:
        # push rdi; popfq; jmp the actions (at base + 64), which go on at base + 1024: RETURN_FLAGS
        jump = b"\xe9" + (64 - 7).to_bytes(4, "little")
        built = build_trap_actions([prog], LAYOUT, 0x401000, base + 64)
        assert not isinstance(built, OptimizeRefusal) and len(built.code) <= 1024 - 64
        area.words[L.STAMP_RESUME // 8] = base + 1024
        area.words[L.STAMP_BUSY // 8] = 1
        return (bytes.fromhex("579d") + jump).ljust(64, b"\xcc") + built.code.ljust(1024 - 64, b"\xcc") + RETURN_FLAGS

    stub = area.place(code_at)
    for flags in (ARITHMETIC_FLAGS, 0, 0x801, 0x0C4):
        assert area.call_at(stub, flags | 2) == flags, hex(flags)
        area.words[L.STAMP_BUSY // 8] = 1
    assert area.counter(5, L.HITS) == 4


def _upcall_site(
    area: NativeArea, doorbell: int, *, returns: UpcallReturns | None = None
) -> tuple[int, dict[int, int]]:
    """FUNC placed and entered through an upcall detour: its address, and where each address of
    its region is in the detour's copy (what the tracer puts in the frame's rip)."""
    function = area.place(FUNC)
    region = area.plan(function, len(FUNC))
    detour = build_upcall(region, 2, LAYOUT, area.base + area.used, doorbell, returns=returns)
    assert not isinstance(detour, OptimizeRefusal)
    at = area.place(detour.code)
    moved = relocate_region_map(region, at + detour.action_bytes)
    assert moved is not None
    area.patch(function, at)
    area.set_word(L.AREA_SELF, area.mem.ctypes.data)
    area.set_word(L.SLEEP_TIMEOUT + 8, 1_000_000)  # 1 ms waits
    area.set_word(L.MAGIC, L.AREA_MAGIC)
    return function, moved[1]


def _answer(area: NativeArea, handler: Callable[[Regs], None], resume: dict[int, int]) -> threading.Thread:
    """A tracer's server in a thread, as core/upcalls.py's: waits for the request, runs `handler`
    on a copy of the frame, writes back what it changed (rip only if it moved the thread: where
    to in the detour's copy of the region, if there; else the thread goes on at the copy of its
    instruction), answers."""

    def serve() -> None:
        while area.word(L.UPCALL_STATE) != L.UPCALL_REQUEST:
            time.sleep(0.0001)
        regs = Regs.from_buffer_copy(area.mem, L.UPCALL_FRAME)
        asked_at = int(regs.rip)
        handler(regs)
        if regs.rip != asked_at:
            regs.rip = resume.get(int(regs.rip), int(regs.rip))
        native.answer(area.mem, -1, regs)

    thread = threading.Thread(target=serve)
    thread.start()
    return thread


def test_native_upcall_hands_the_registers_over_and_takes_them_back(area: NativeArea) -> None:
    doorbell = np.zeros(mmap.PAGESIZE // 8, dtype=np.uint64)
    function, resume = _upcall_site(area, doorbell.ctypes.data)
    seen: list[tuple[int, int, int]] = []

    def handler(regs: Regs) -> None:
        seen.append((int(regs.rdi), int(regs.rip), int(regs.rsp) % 16))
        regs.rdi = 42  # FUNC returns its argument: now 42

    server = _answer(area, handler, resume)
    assert area.call_at(function, 7) == 42
    server.join()
    assert seen == [(7, function, 8)] and doorbell[L.DOORBELL_RING // 8] == 1
    assert area.word(L.UPCALL_STATE) == L.UPCALL_IDLE and area.word(L.UPCALL_BUSY) == 0


def test_native_upcall_at_a_return_probes_entry_takes_its_shadow_entry_first(area: NativeArea) -> None:
    """At a return probe's entry the detour takes the shadow entry before it asks (its offset in
    UPCALL_ENTRIES; the return address, the stub, the probe, the arguments in the entry; the
    return address pointed at the trampoline's entry point), and stamps its time once answered.
    (The handler here puts the real return address back: there is no trampoline.)"""
    doorbell = np.zeros(mmap.PAGESIZE // 8, dtype=np.uint64)
    stub, points = 0x7E00_0000_1000, 0x7E00_0000_2000
    returns = UpcallReturns(((2, 10),), LAYOUT, stub, points)
    function, resume = _upcall_site(area, doorbell.ctypes.data, returns=returns)
    seen: list[tuple[int, ...]] = []

    def handler(regs: Regs) -> None:
        word = area.word(L.UPCALL_ENTRIES)
        assert word >> 32 == 2  # (the probe's index)
        offset = word & 0xFFFF_FFFF
        k, entry = offset // L.SHADOW_ENTRY, LAYOUT.shadow + offset
        slot = ctypes.c_uint64.from_address(int(regs.rsp))
        fields = (L.ENTRY_SLOT, L.ENTRY_RET, L.ENTRY_HANDLER, L.ENTRY_PROBE, L.ENTRY_DATA)
        seen.append((k, slot.value - points, *(area.word(entry + f) for f in fields), int(regs.rsp)))
        slot.value = area.word(entry + L.ENTRY_RET)  # (the real return address back)
        area.set_word(entry + L.ENTRY_TSC, 0)

    server = _answer(area, handler, resume)
    assert area.call_at(function, 7) == 7
    server.join()
    ((k, point, slot, ret, to, probe, arg1, rsp),) = seen
    assert point == k * L.TRAMPOLINE_STRIDE and slot == rsp and ret != 0
    assert (to, probe, arg1) == (stub, 2, 7) and area.counter(2, L.PENDING) == 1
    assert area.word(LAYOUT.shadow + k * L.SHADOW_ENTRY + L.ENTRY_TSC) != 0  # (stamped once answered)
    assert area.word(L.UPCALL_ENTRIES + 8) == L.ENTRIES_END  # (one return probe: the end after it)
    assert area.word(L.UPCALL_ENTRIES + 16) == 0  # (and nothing past)


def test_native_upcall_without_return_probes_ends_the_entry_words_at_once(area: NativeArea) -> None:
    """A detour made before a return probe came to its site (a thread still in it asks for the
    site's probes as they are now) writes ENTRIES_END first: no word an earlier upcall left is
    taken for an entry of this one."""
    doorbell = np.zeros(mmap.PAGESIZE // 8, dtype=np.uint64)
    function, resume = _upcall_site(area, doorbell.ctypes.data)
    for i in range(L.UPCALL_ENTRIES_MAX):
        area.set_word(L.UPCALL_ENTRIES + 8 * i, 2 << 32)  # (probe 2's entry 0, left by another site)
    seen: list[int] = []
    server = _answer(area, lambda regs: seen.append(area.word(L.UPCALL_ENTRIES)), resume)
    assert area.call_at(function, 7) == 7
    server.join()
    assert seen == [L.ENTRIES_END]


def test_native_upcall_goes_where_the_handler_sends_it(area: NativeArea) -> None:
    doorbell = np.zeros(mmap.PAGESIZE // 8, dtype=np.uint64)
    function, resume = _upcall_site(area, doorbell.ctypes.data)

    def handler(regs: Regs) -> None:  # 'return 5' done by the handler
        regs.rax = 5
        regs.rip = int(np.frombuffer(ctypes.string_at(int(regs.rsp), 8), dtype=np.uint64)[0])
        regs.rsp += 8

    server = _answer(area, handler, resume)
    assert area.call_at(function, 7) == 5
    server.join()


def _answer_when(
    area: NativeArea, asked: Callable[[], bool], resume: dict[int, int], *, wake: bool
) -> threading.Thread:
    """A server that answers once `asked()` holds (looked at for 5 s at most, then answered
    anyway: the test fails on what it saw), waking the thread only if `wake`."""

    def serve() -> None:
        deadline = time.monotonic() + 5
        while not asked() and time.monotonic() < deadline:
            time.sleep(0.0001)
        regs = Regs.from_buffer_copy(area.mem, L.UPCALL_FRAME)
        regs.rip = resume[int(regs.rip)]
        area.mem[L.UPCALL_FRAME : L.UPCALL_FRAME + ctypes.sizeof(Regs)] = np.frombuffer(bytes(regs), dtype=np.uint8)
        area.set_word(L.UPCALL_STATE, L.UPCALL_ANSWERED)
        if wake:
            sc.futex_wake(area.mem.ctypes.data + L.UPCALL_STATE)

    thread = threading.Thread(target=serve)
    thread.start()
    return thread


def test_native_upcall_spins_for_its_answer_when_the_server_runs_elsewhere(area: NativeArea) -> None:
    """With SPIN ticks to spare and the server on another CPU, a thread that asked looks for
    its answer and never sleeps: an answer with no wake-up reaches it at once."""
    doorbell = np.zeros(mmap.PAGESIZE // 8, dtype=np.uint64)
    doorbell[L.DOORBELL_SPIN // 8] = 1 << 40  # (minutes)
    doorbell[L.DOORBELL_CPU // 8] = (1 << 64) - 1  # (no CPU)
    function, resume = _upcall_site(area, doorbell.ctypes.data)
    area.set_word(L.SLEEP_TIMEOUT, 5)  # (a thread that slept, never woken, would go on in 5 s)
    slept: list[int] = []

    def asked() -> bool:  # (and, 50 ms on, still not asleep)
        if area.word(L.UPCALL_STATE) != L.UPCALL_REQUEST:
            return False
        deadline = time.monotonic() + 0.05
        while time.monotonic() < deadline and not area.word(L.UPCALL_SLEEPING):
            time.sleep(0.001)
        slept.append(area.word(L.UPCALL_SLEEPING))
        return True

    server = _answer_when(area, asked, resume, wake=False)
    assert area.call_at(function, 7) == 7
    server.join()
    assert slept == [0]
    assert area.word(L.UPCALL_CPU) in os.sched_getaffinity(0)
    assert area.word(L.UPCALL_STATE) == L.UPCALL_IDLE and area.word(L.UPCALL_SLEEPING) == 0


def test_native_upcall_on_the_servers_cpu_sleeps_at_once(area: NativeArea) -> None:
    """A thread that asks on the CPU the server runs on does not spin (it would keep the server
    from running): it says it sleeps, and is woken by the answer."""
    cpu = min(os.sched_getaffinity(0))
    doorbell = np.zeros(mmap.PAGESIZE // 8, dtype=np.uint64)
    doorbell[L.DOORBELL_SPIN // 8] = 1 << 40
    doorbell[L.DOORBELL_CPU // 8] = cpu
    function, resume = _upcall_site(area, doorbell.ctypes.data)
    area.set_word(L.SLEEP_TIMEOUT, 60)  # (asleep until woken)
    slept: list[int] = []

    def asked() -> bool:
        slept.append(area.word(L.UPCALL_SLEEPING))
        return slept[-1] == 1

    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        server = _answer_when(area, asked, resume, wake=True)
        os.sched_setaffinity(server.native_id or 0, allowed)
        started = time.monotonic()
        assert area.call_at(function, 7) == 7
        waited = time.monotonic() - started
    finally:
        os.sched_setaffinity(0, allowed)
    server.join()
    assert slept[-1] == 1 and waited < 30  # (asleep, then woken: not the wait's 60 s)
    assert area.word(L.UPCALL_CPU) == cpu and area.word(L.UPCALL_SLEEPING) == 0


def test_native_upcall_with_no_tracer_goes_on_unheard(area: NativeArea) -> None:
    doorbell = np.zeros(mmap.PAGESIZE // 8, dtype=np.uint64)
    doorbell[L.DOORBELL_GONE // 8] = 1
    function, _ = _upcall_site(area, doorbell.ctypes.data)
    assert area.call_at(function, 7) == 7
    assert area.word(L.UPCALL_STATE) == L.UPCALL_IDLE and area.word(L.UPCALL_BUSY) == 0


def test_native_upcall_through_a_gs_base_not_ours_touches_nothing(area: NativeArea) -> None:
    """The program set its own GS base after its area was given: the thread goes on without
    asking, and writes nothing there (no frame, no state)."""
    doorbell = np.zeros(mmap.PAGESIZE // 8, dtype=np.uint64)
    function, _ = _upcall_site(area, doorbell.ctypes.data)
    area.set_word(L.MAGIC, 0)
    before = bytes(area.mem[: L.HEADER_BYTES])
    assert area.call_at(function, 7) == 7
    assert bytes(area.mem[: L.HEADER_BYTES]) == before and doorbell[L.DOORBELL_RING // 8] == 0
    assert doorbell[L.DOORBELL_FOREIGN // 8] == 1


def test_native_upcall_nested_runs_no_handler_and_counts_a_miss(area: NativeArea) -> None:
    doorbell = np.zeros(mmap.PAGESIZE // 8, dtype=np.uint64)
    function, _ = _upcall_site(area, doorbell.ctypes.data)
    area.set_word(L.UPCALL_BUSY, 1)  # (as in a signal handler during an upcall)
    assert area.call_at(function, 9) == 9
    assert area.counter(2, L.MISSED) == 1 and area.word(L.UPCALL_STATE) == L.UPCALL_IDLE
