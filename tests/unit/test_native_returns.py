"""Return probes run natively in this process: a function patched with a detour whose entry part
takes a shadow-stack entry and hooks the return (codegen.shadow_push, hook_targets, enter_tail),
the process's return trampoline, and the probe's return code, as a target runs them. What each
call leaves in the thread area (records, counters, histogram, the shadow stack) is checked word
by word, and every call must return what the function returns unprobed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import iced_x86 as iced
import pytest

from dynprobe.actions.filter import parse_filter
from dynprobe.actions.model import ActionKind, Program, record_fields
from dynprobe.arch.x86_64.codegen.clock import read_tsc_code
from dynprobe.arch.x86_64.codegen.detours import build_detour
from dynprobe.arch.x86_64.codegen.returns import build_return_code
from dynprobe.core.probe import CALLER_ARG
from dynprobe.errors import OptimizeRefusal
from dynprobe.ringbuf import layout as L
from dynprobe.spec.parser import parse_probe
from tests.unit.native import ADD, ESCAPE, PEEK, PUSHING, THEN, WHOAMI, NativeArea, field, one_cpu, sum_to

LAYOUT = L.AreaLayout(max_probes=16, max_hists=4, ring_bytes=1 << 16, record_size=128)
NS_PER_TICK = 1 << 32  # tsc_mult: a nanosecond a tick


class Returns:
    """A process's return machinery in this one: the trampoline, and return probes on functions."""

    def __init__(self, native: NativeArea) -> None:
        self.native = native
        self.layout = native.layout
        self.trampoline = native.trampoline

    def probe(self, function: int, length: int, *programs: Program, maxactive: int = L.SHADOW_CAPACITY) -> None:
        """Return probes running `programs` at the return of the function at `function`
        (`length`: its bytes), entered through one detour."""
        native, layout = self.native, self.layout
        plan = native.plan(function, length)
        entries = []
        for prog in programs:

            def return_code(at: int, prog: Program = prog) -> bytes:
                code = build_return_code(prog, layout, at, self.trampoline, NS_PER_TICK)
                assert isinstance(code, bytes), code
                return code

            entry = prog.return_entry(maxactive, native.place(return_code))
            entries.append(dataclasses.replace(prog, entry=entry))

        def detour(at: int) -> bytes:
            built = build_detour(plan, entries, layout, at, function_entry=True, trampoline=self.trampoline)
            assert not isinstance(built, OptimizeRefusal), built
            return built.code

        native.patch(function, native.place(detour))

    def assert_settled(self, *probes: int) -> None:
        """Every call has returned: no entry pending, none taken, the stack empty and free."""
        native = self.native
        assert native.word(L.SHADOW_TOP) == 0 and native.word(L.SHADOW_BUSY) == 0
        assert [native.counter(p, L.PENDING) for p in probes] == [0] * len(probes)


@pytest.fixture
def native() -> Iterator[NativeArea]:
    made = NativeArea(LAYOUT)
    yield made
    made.close()


def record_program(index: int, spec: str, *, filter_text: str | None = None) -> Program:
    args = parse_probe(spec).args
    keep = parse_filter(filter_text, args) if filter_text else None
    return Program(index, ActionKind.RECORD, record_fields([CALLER_ARG, *args]), filter=keep)


def values(prog: Program, record: bytes) -> dict[str, int]:
    return {f.arg.name: field(record, f.offset) for f in prog.fields}


def test_a_return_record_has_the_entry_s_arguments_the_return_value_and_the_latency(native: NativeArea) -> None:
    """add() clears its argument registers before it returns: $arg1/$arg2 are the entry's,
    kept in its shadow entry; the caller is the address the call returns to; the latency is the
    entry's stamp to the return's (one CPU: ordered), at most the whole call's."""
    returns = Returns(native)
    add = native.place(ADD)
    prog = record_program(3, "r add a=$arg1 b=$arg2 ret=$retval ns=$latency:u64")
    returns.probe(add, len(ADD), prog)
    caller = native.place(THEN)  # then(add, add, x): two calls from one frame
    clock = native.place(read_tsc_code())
    with one_cpu():
        before = native.call_at(clock)
        assert native.call_at(caller, add, add, 20) == 40
        after = native.call_at(clock)
    first, second = native.records()
    for record in (first, second):
        got = values(prog, record)
        assert field(record, L.RECORD_PROBE, 2) == 3 and field(record, L.RECORD_FAULTS, 4) == 0
        assert (got["a"], got["b"], got["ret"]) == (20, 20, 40)
        assert 0 < got["ns"] < after - before
        assert before < field(record, L.RECORD_TSC) < after
    assert [values(prog, r)["__caller"] for r in (first, second)] == [caller + 0x1F, caller + 0x2F]  # after each call
    assert native.counter(3, L.HITS) == 2 and native.counter(3, L.MISSED) == 0
    returns.assert_settled(3)
    assert native.shadow_word(0, L.ENTRY_SLOT) == 0  # the entry both calls took, free


@pytest.mark.parametrize("below", [0, 1000], ids=["at the bottom", "entries 1000 up"])
def test_return_probes_of_one_call_each_take_an_entry_and_return_in_turn(native: NativeArea, below: int) -> None:
    """Three return probes on one function: the second and third find the slot taken by this
    very call (the return address leads to the entry: through entry points and the entries'
    return addresses) and take entries of their own above; the returns run the last-placed
    first, each with the real caller and %ip. (Above `below` entries of callers' frames.)"""
    returns = Returns(native)
    add = native.place(ADD)
    progs = [record_program(k, "r add ret=$retval b=$arg2 ip=%ip") for k in (1, 2, 3)]
    returns.probe(add, len(ADD), *progs)
    caller = native.place(THEN)
    if below:
        native.set_word(L.SHADOW_TOP, below)
        native.set_word(native.layout.shadow + (below - 1) * L.SHADOW_ENTRY, 1 << 62)  # a caller's slot
    assert native.call_at(caller, add, add, 7) == 14
    records = native.records()
    assert [values(progs[0], r)["ip"] for r in records] == [caller + 0x1F] * 3 + [caller + 0x2F] * 3
    assert [field(r, L.RECORD_PROBE, 2) for r in records] == [3, 2, 1, 3, 2, 1]
    assert [values(progs[0], r)["ret"] for r in records] == [14] * 6
    assert [values(progs[0], r)["b"] for r in records] == [7] * 6
    assert [values(progs[0], r)["__caller"] for r in records] == [caller + 0x1F] * 3 + [caller + 0x2F] * 3
    assert native.word(L.SHADOW_TOP) == below
    assert [native.counter(p, L.PENDING) for p in (1, 2, 3)] == [0, 0, 0]


def test_recursion_returns_innermost_first_each_with_its_own_entry(native: NativeArea) -> None:
    returns = Returns(native)
    summing = native.place(sum_to)
    prog = record_program(0, "r sum n=$arg1 ret=$retval")
    returns.probe(summing, 16, prog)
    assert native.call_at(summing, 5) == 15
    got = [values(prog, r) for r in native.records()]
    assert [(v["n"], v["ret"]) for v in got] == [(0, 0), (1, 1), (2, 3), (3, 6), (4, 10), (5, 15)]
    assert {v["__caller"] for v in got[:-1]} == {summing + 25}  # back into sum, after its call
    assert not summing <= got[-1]["__caller"] < summing + 64
    assert native.counter(0, L.HITS) == 6
    returns.assert_settled(0)
    assert [native.shadow_word(k, L.ENTRY_SLOT) for k in range(7)] == [0] * 7
    # the entries were stacked: the outermost call's is entry 0, its slot the highest
    assert [native.shadow_word(k, L.ENTRY_DATA) for k in range(6)] == [5, 4, 3, 2, 1, 0]


def test_maxactive_pending_instances_on_a_thread_and_the_rest_missed(native: NativeArea) -> None:
    returns = Returns(native)
    summing = native.place(sum_to)
    prog = record_program(2, "r sum n=$arg1")
    returns.probe(summing, 16, prog, maxactive=2)
    assert native.call_at(summing, 5) == 15
    assert [values(prog, r)["n"] for r in native.records()] == [4, 5]  # the outer two
    assert (native.counter(2, L.HITS), native.counter(2, L.MISSED)) == (2, 4)
    returns.assert_settled(2)


def test_an_entry_left_by_longjmp_is_taken_over_by_the_next_call_in_its_slot(native: NativeArea) -> None:
    """escape() leaves as longjmp does: its return is never run, its entry stays. The next call
    from the same frame has the same return-address slot: the entry there is stale (the return
    address is no entry point) and is taken over, its probe's pending count given back."""
    returns = Returns(native)
    escapes = [native.place(ESCAPE) for _ in range(2)]
    for index, function in zip((4, 5), escapes, strict=True):
        returns.probe(function, len(ESCAPE), record_program(index, "r escape r=$retval"))
    caller = native.place(THEN)
    assert native.call_at(caller, escapes[0], escapes[0], 1) == 2
    assert native.word(L.SHADOW_TOP) == 1 and native.counter(4, L.PENDING) == 1
    slot = native.shadow_word(0, L.ENTRY_SLOT)
    assert native.shadow_word(0, L.ENTRY_RET) == caller + 0x2F  # the second call's
    assert native.call_at(caller, escapes[0], escapes[1], 1) == 2
    assert native.word(L.SHADOW_TOP) == 1 and native.shadow_word(0, L.ENTRY_SLOT) == slot
    assert (native.counter(4, L.PENDING), native.counter(5, L.PENDING)) == (0, 1)
    assert native.shadow_word(0, L.ENTRY_PROBE) == 5 and native.shadow_word(0, L.ENTRY_HANDLER) != 0
    assert native.records() == [] and native.counter(5, L.MISSED) == 0


def test_a_call_takes_the_topmost_free_entry_above_its_callers(native: NativeArea) -> None:
    """Scanning down from the top: free entries (slot 0) and entries of deeper frames that are
    gone (a lower slot) are passed; the first entry of a caller (a higher slot) ends the scan.
    The call takes the topmost free entry it passed, else a new one on top; its return point is
    that entry's, and its return frees it and every free entry on top."""
    returns = Returns(native)
    whoami = native.place(WHOAMI)
    returns.probe(whoami, len(WHOAMI), Program(6, ActionKind.COUNT))
    caller_slot = 1 << 62  # above any stack: an older frame's entry
    tramp = returns.trampoline
    for top, slots, taken, top_after in [
        (1, [caller_slot], 1, 1),
        (3, [caller_slot, 0, 0], 2, 1),
        (3, [caller_slot, 0, 8], 1, 3),  # entry 2: a deeper frame gone, passed
        (2, [caller_slot, 8], 2, 2),
        (3, [0, caller_slot, 0], 2, 2),  # the scan ends at entry 1: entry 0 is not looked at
        (2, [8, 0], 1, 1),  # down to the bottom: entry 1 free
        (1, [8], 1, 1),  # down to the bottom: none free
    ]:
        native.set_word(L.SHADOW_TOP, top)
        for k, slot in enumerate(slots):
            native.set_word(native.layout.shadow + k * L.SHADOW_ENTRY + L.ENTRY_SLOT, slot)
        assert native.call_at(whoami) == tramp.point(taken), (top, slots)
        assert native.word(L.SHADOW_TOP) == top_after and native.shadow_word(taken, L.ENTRY_SLOT) == 0
        assert native.counter(6, L.PENDING) == 0 and native.word(L.SHADOW_BUSY) == 0
    assert native.counter(6, L.HITS) == 7 and native.counter(6, L.MISSED) == 0


@pytest.mark.parametrize("why", ["full", "busy"])
def test_no_entry_to_take_is_a_missed_hit_and_the_return_is_not_hooked(native: NativeArea, why: str) -> None:
    returns = Returns(native)
    whoami = native.place(WHOAMI)
    returns.probe(whoami, len(WHOAMI), Program(6, ActionKind.COUNT))
    if why == "full":
        native.set_word(L.SHADOW_TOP, L.SHADOW_CAPACITY)
        native.set_word(native.layout.shadow + (L.SHADOW_CAPACITY - 1) * L.SHADOW_ENTRY, 1 << 62)
    else:  # the thread is changing its shadow stack (a signal arrived in the middle)
        native.set_word(L.SHADOW_BUSY, 1)
    returned_to = native.call_at(whoami)
    assert not returns.trampoline.table <= returned_to < returns.trampoline.end
    assert (native.counter(6, L.HITS), native.counter(6, L.MISSED), native.counter(6, L.PENDING)) == (0, 1, 0)
    assert native.word(L.SHADOW_BUSY) == (why == "busy")
    assert native.word(L.SHADOW_TOP) == (L.SHADOW_CAPACITY if why == "full" else 0)


def test_return_filter_and_histogram_of_the_return_value(native: NativeArea) -> None:
    returns = Returns(native)
    add = native.place(ADD)
    value, first = parse_probe("r add v=$retval:s64 a=$arg1").args
    counted = Program(7, ActionKind.COUNT, filter=parse_filter("v > 10 and a < 100", [value, first]))
    returns.probe(add, len(ADD), Program(8, ActionKind.HIST, value=value, hist_index=3), counted)
    sums = [0, 1, 5, 11, 40, 198, 300, (1 << 64) - 2]  # a + a
    for total in sums:
        assert native.call_at(add, total // 2, total - total // 2) == total
    assert native.counter(7, L.HITS) == 3  # 11, 40, 198 (a = 99); not 300 (a = 150), nor -2
    expected = [0] * L.HIST_BUCKETS
    for bucket in (0, 1, 3, 4, 6, 8, 9, 0):  # 0 and -2 in bucket 0; v in [2^(k-1), 2^k) in k
        expected[bucket] += 1
    assert native.hist(3) == expected and native.counter(8, L.HITS) == len(sums)
    returns.assert_settled(7, 8)


def test_a_return_s_stack_pointer_is_the_caller_s_and_its_latency_the_record_s_time(native: NativeArea) -> None:
    """At a return, %sp is where the caller's stack is after it (the word its caller pushed is
    +0(%sp)), and $latency in a record is the record's time stamp less the entry's, to the tick
    (a nanosecond a tick here)."""
    returns = Returns(native)
    add = native.place(ADD)
    prog = record_program(2, "r add above=+0(%sp):u64 ns=$latency:u64")
    returns.probe(add, len(ADD), prog)
    assert native.call_at(native.place(PUSHING), add, 3, 4) == 7
    (record,) = native.records()
    got = values(prog, record)
    assert got["above"] == 0x1234
    assert got["ns"] == field(record, L.RECORD_TSC) - native.shadow_word(0, L.ENTRY_TSC)


@pytest.mark.parametrize(("hooked", "below"), [(True, 0), (True, 1000), (False, 0)])
def test_a_hooked_function_is_entered_through_its_trampoline_entry_s_call(
    native: NativeArea, hooked: bool, below: int
) -> None:
    """Below a hooked return address the function finds the call of its trampoline entry (the
    `call` that pushed the entry point, so the CPU predicts the return), whatever the entry's
    number; a return that could not be hooked (no entry free) finds 0 there, written over what
    was, and the function is entered directly."""
    returns = Returns(native)
    peek = native.place(PEEK)
    returns.probe(peek, len(PEEK), Program(1, ActionKind.COUNT))
    if not hooked:
        native.set_word(L.SHADOW_BUSY, 1)
    if below:
        native.set_word(L.SHADOW_TOP, below)
        native.set_word(native.layout.shadow + (below - 1) * L.SHADOW_ENTRY, 1 << 62)  # a caller's slot
    junk_below = native.place(bytes.fromhex("48c74424f0ffffffffffd7c3"))  # mov qword [rsp-16],-1; call rdi; ret
    expected = returns.trampoline.table + below * L.TRAMPOLINE_STRIDE if hooked else 0
    assert native.call_at(junk_below, peek) == expected


def test_a_slot_s_entry_whose_chain_ends_elsewhere_is_stale(native: NativeArea) -> None:
    """The slot's topmost entry i, and a return address that leads through another entry j to
    an address that is no entry point: i's frame is gone (j is this call's, hooked by earlier
    code) and i is taken over, its probe's instance given back. (A stub makes that state:
    entry j's original return address is the stub's, the return address entry point j.)"""
    returns = Returns(native)
    whoami = native.place(WHOAMI)
    returns.probe(whoami, len(WHOAMI), Program(1, ActionKind.COUNT))
    tramp, shadow = returns.trampoline, native.layout.shadow
    i, j = 1, 0
    native.set_word(L.SHADOW_TOP, 2)
    native.set_word(shadow + i * L.SHADOW_ENTRY + L.ENTRY_PROBE, 9)
    native.set_word(shadow + j * L.SHADOW_ENTRY + L.ENTRY_PROBE, 8)
    native.set_word(shadow + j * L.SHADOW_ENTRY + L.ENTRY_HANDLER, tramp.finish)  # (its return: nothing to do)
    native.set_word(native.layout.counter(9, L.PENDING), 1)
    native.set_word(native.layout.counter(8, L.PENDING), 1)

    def gs(offset: int) -> iced.MemoryOperand:
        return iced.MemoryOperand(displ=shadow + offset, displ_size=4, seg=iced.Register.GS)

    def stub(at: int, resume: int = 0) -> bytes:
        """resume = R (its `ret`): j's return address R, the return address point j, i's and
        j's slot that one; then on into whoami (rdi)."""
        R, C = iced.Register, iced.Code
        entry_i, entry_j = i * L.SHADOW_ENTRY, j * L.SHADOW_ENTRY
        encoder, here = iced.Encoder(64), at
        for insn in (
            iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RAX, iced.MemoryOperand(R.RIP, displ=resume or at)),
            iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs(entry_j + L.ENTRY_RET), R.RAX),
            iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, tramp.point(j)),
            iced.Instruction.create_reg(C.PUSH_R64, R.RAX),
            iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs(entry_i + L.ENTRY_SLOT), R.RSP),
            iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs(entry_j + L.ENTRY_SLOT), R.RSP),
            iced.Instruction.create_reg(C.JMP_RM64, R.RDI),
            iced.Instruction.create(C.RETNQ),
        ):
            here += encoder.encode(insn, here)
        code = bytes(encoder.take_buffer())
        return code if resume else stub(at, at + len(code) - 1)

    assert native.call(stub, whoami) == tramp.point(i)  # entry i taken over, not a new one
    assert (native.counter(9, L.PENDING), native.counter(8, L.PENDING), native.counter(1, L.PENDING)) == (0, 0, 0)
    assert native.word(L.SHADOW_TOP) == 0 and native.counter(1, L.HITS) == 1


def test_a_return_probe_interrupted_at_every_instruction_keeps_its_shadow_stack(native: NativeArea) -> None:
    """A signal handler calls the probed function again after each instruction of the first
    call's detour, trampoline and return code: inside the windows where the shadow stack is
    being changed its call is missed (counted, its return left alone), outside it is probed
    whole; every call returns what it returns unprobed, each record has its own call's
    argument, and the stack is settled after."""
    start = native.base + native.used
    returns = Returns(native)
    add = native.place(ADD)
    prog = record_program(4, "r add a=$arg1")
    returns.probe(add, len(ADD), prog)
    end = native.base + native.used
    nested = native.call_interrupted(add, 0xABC, within=(start, end))
    missed = native.counter(4, L.MISSED)
    got = [values(prog, record)["a"] for record in native.records()]
    assert 0 < missed < nested
    assert len(got) + missed == nested + 1  # (a call missed at its entry is no hit: no return seen)
    assert sorted(got) == sorted({*got} & {0xABC, *range(1, nested + 1)}) and 0xABC in got
    returns.assert_settled(4)
