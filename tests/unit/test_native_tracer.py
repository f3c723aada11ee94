"""The function tracer's generated code run natively in this process: functions patched with
tracer sites (codegen.build_tracer_site) calling a tracer instance's code (build_ops_code) or a
list trampoline of several (build_list_trampoline), in flat and graph mode, with a depth, a time
threshold and recorded values. The records each call leaves, and the shadow stack, are checked
record by record; every call must return what the function returns untraced.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import pytest

from dynprobe.arch.x86_64.codegen.ftrace import (
    Captures,
    OpsCode,
    build_list_trampoline,
    build_ops_code,
    build_tracer_site,
)
from dynprobe.errors import OptimizeRefusal
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.consumer import TscClock
from dynprobe.ringbuf.layout import DATA_CUT, DATA_END, DATA_FAULTED, DATA_NULL, FRAME_SHIFT, TRACE_DATA, TRACE_EXIT
from dynprobe.spec.argspec import STRING_PIECES, parse_values
from dynprobe.tracefile import record_dtype
from tests.unit.native import ADD, HEAD_NOW, OUTER, PEEK, SPIN, THEN, NativeArea, one_cpu, sum_to

LAYOUT = L.AreaLayout(max_probes=16, max_hists=4, ring_bytes=1 << 16, record_size=16)


class Record(NamedTuple):
    ops: int
    kind: int
    held: int  # the function's id; a data record's bytes and flags
    value: int  # the time stamp; a data record's value or piece


@pytest.fixture
def native() -> Iterator[NativeArea]:
    made = NativeArea(LAYOUT)
    made.fill_ring(0xEE)  # junk: every field of a record must be written
    yield made
    made.close()


def records(native: NativeArea, first: int = 0) -> list[Record]:
    """The records numbered `first` up to HEAD (the ring wrapped), read as a trace file's are."""
    rows = np.frombuffer(b"".join(native.records(first)), dtype=record_dtype(LAYOUT.record_size))
    return [Record(*map(int, (row["ops"], row["kind"], row["func"], row["tsc"]))) for row in rows]


def calls(native: NativeArea, first: int = 0) -> list[tuple[str, int, int]]:
    """The records as (entry or exit, function id, frame), data records left out."""
    return [
        ("exit" if r.kind & TRACE_EXIT else "entry", r.held, r.kind >> FRAME_SHIFT)
        for r in records(native, first)
        if not r.kind & TRACE_DATA
    ]


class Tracer:
    """One tracer instance's code in this process (graph mode: with the return trampoline)."""

    def __init__(
        self, native: NativeArea, index: int, *, graph: bool, depth: int | None = None, threshold: int = 0,
        captures: Captures | None = None, snapshot_over: int = 0,
    ) -> None:  # fmt: skip
        self.native, self.index = native, index
        trampoline = native.trampoline if graph else None

        def build(at: int) -> tuple[bytes, OpsCode]:
            return build_ops_code(
                LAYOUT, index, trampoline, at, depth=depth, threshold=threshold, captures=captures,
                snapshot_over=snapshot_over,
            )  # fmt: skip

        at = native.place(lambda here: build(here)[0])
        self.code = build(at)[1]
        assert self.code.entry == at
        native.add_fixups(self.code.fixups)

    def trace(self, function: int, length: int, function_id: int) -> None:
        site(self.native, function, length, function_id, self.code.entry)


def site(native: NativeArea, function: int, length: int, function_id: int, target: int) -> None:
    """Patch the function at `function` with a tracer site calling `target`."""
    plan = native.plan(function, length)

    def detour(at: int) -> bytes:
        built = build_tracer_site(plan, function_id, target, at)
        assert not isinstance(built, OptimizeRefusal), built
        return built

    native.patch(function, native.place(detour))


def settled(native: NativeArea, *tracers: int) -> bool:
    return (
        native.word(L.SHADOW_TOP) == 0
        and native.word(L.BUSY) == 0
        and native.word(L.RESERVE) == native.word(L.HEAD)
        and all(native.counter(t, L.PENDING) == 0 for t in tracers)
    )


@pytest.mark.parametrize("graph", [False, True], ids=["flat", "graph"])
def test_nested_calls_leave_their_entries_and_in_graph_mode_their_exits(native: NativeArea, graph: bool) -> None:
    tracer = Tracer(native, 2, graph=graph)
    add, outer = native.place(ADD), native.place(OUTER)
    tracer.trace(add, len(ADD), 11)
    tracer.trace(outer, len(OUTER), 12)
    with one_cpu():
        assert native.call_at(outer, add, 20) == 41
        assert native.call_at(add, 1, 2) == 3
    got = records(native)
    assert {r.ops for r in got} == {2}
    stamps = [r.value for r in got]
    assert stamps == sorted(stamps) and stamps[0] > 0
    if graph:  # frames: entry k + 1; an exit names its call's
        assert calls(native) == [
            ("entry", 12, 1), ("entry", 11, 2), ("exit", 11, 2), ("exit", 12, 1), ("entry", 11, 1), ("exit", 11, 1),
        ]  # fmt: skip
    else:
        assert calls(native) == [("entry", 12, 0), ("entry", 11, 0), ("entry", 11, 0)]
    assert native.counter(2, L.HITS) == 3 and native.counter(2, L.MISSED) == 0
    assert settled(native, 2)


def test_recursion_in_graph_mode_nests_frame_by_frame(native: NativeArea) -> None:
    tracer = Tracer(native, 0, graph=True)
    summing = native.place(sum_to)
    tracer.trace(summing, 16, 5)
    assert native.call_at(summing, 3) == 6
    assert calls(native) == [("entry", 5, k) for k in (1, 2, 3, 4)] + [("exit", 5, k) for k in (4, 3, 2, 1)]
    assert settled(native, 0)


def test_a_depth_records_the_outermost_calls_only(native: NativeArea) -> None:
    tracer = Tracer(native, 1, graph=True, depth=2)
    summing = native.place(sum_to)
    tracer.trace(summing, 16, 5)
    assert native.call_at(summing, 4) == 10
    assert calls(native) == [("entry", 5, 1), ("entry", 5, 2), ("exit", 5, 2), ("exit", 5, 1)]
    assert native.counter(1, L.HITS) == 2 and native.counter(1, L.MISSED) == 0
    assert settled(native, 1)


def test_a_time_threshold_takes_back_the_calls_that_end_sooner(native: NativeArea) -> None:
    """then(add, spin, ticks): add() ends at once, spin() and then() last `ticks`. A call is
    published, with its exit, when it lasted the threshold or more: spin() and then() always;
    add() only if the thread was held up in it (switched out: its records then say so), else
    its entry is taken back and its exit never written. A step whose whole run, timed around
    it, is shorter than the threshold publishes nothing. (The ring has been round three times:
    the records' numbers are past its size.)"""
    threshold = 1 << 20
    tracer = Tracer(native, 3, graph=True, threshold=threshold)
    add, spin, then = native.place(ADD), native.place(SPIN), native.place(THEN)
    for function, length, number in ((add, len(ADD), 1), (spin, len(SPIN), 2), (then, len(THEN), 3)):
        tracer.trace(function, length, number)
    start = 3 * LAYOUT.ring_slots
    for word in (L.HEAD, L.TAIL, L.RESERVE):
        native.set_word(word, start)
    clock = TscClock()

    def published(first: int) -> list[tuple[str, int, int]]:
        """The calls published from record `first` on, but add's, whose each lasted the threshold."""
        stamps = [r.value for r in records(native, first) if r.held == 1]  # add's entries and exits
        assert all(out - into >= threshold for into, out in zip(stamps[::2], stamps[1::2], strict=True))
        return [c for c in calls(native, first) if c[1] != 1]

    def quick(*args: int) -> None:
        """A step of calls each shorter than the threshold unless held up: run until the step as
        a whole took less than the threshold, when it must publish nothing."""
        for _ in range(100):
            head, began = native.word(L.HEAD), clock.read()
            native.call_at(*args)
            if clock.read() - began < threshold:
                assert native.word(L.HEAD) == head and settled(native, 3)
                return
        raise AssertionError("held up 100 times in a row running calls shorter than the threshold")

    with one_cpu():
        native.call_at(then, add, spin, 2 * threshold)
        assert published(start) == [("entry", 3, 1), ("entry", 2, 2), ("exit", 2, 2), ("exit", 3, 1)]
        quick(then, add, add, 0)  # nothing lasts: nothing at all
        quick(spin, threshold // 4)
        # after a long untraced stretch (spin, not traced here) add still ends at once: its time
        # is its own entry's, not the record's before it
        head = native.word(L.HEAD)
        native.call_at(then, native.place(SPIN), add, 2 * threshold)
        assert published(head) == [("entry", 3, 1), ("exit", 3, 1)] and settled(native, 3)
    entry_spin, exit_spin = [r for r in records(native, start) if r.held == 2][:2]
    assert exit_spin.value - entry_spin.value >= 2 * threshold
    assert native.counter(3, L.MISSED) == 0


@pytest.mark.parametrize("threshold", [0, 1, 1 << 40])
def test_entries_are_published_at_once_unless_a_threshold_holds_them_back(native: NativeArea, threshold: int) -> None:
    """Inside a traced call, its entry record is visible to the reader (HEAD passed it), unless
    a threshold holds it until the call has lasted long enough."""
    tracer = Tracer(native, 1, graph=True, threshold=threshold)
    head_now = native.place(HEAD_NOW)
    tracer.trace(head_now, len(HEAD_NOW), 2)
    assert native.call_at(head_now) == (0 if threshold else 1)


def test_a_held_back_entry_that_is_lost_or_missed_leaves_no_exit(native: NativeArea) -> None:
    """With a threshold: an entry lost to a full ring leaves its exit unwritten (not lost as
    well); a call traced while the thread is writing a record (a signal handler's) misses both
    and leaves the writer's flag as it was."""
    tracer = Tracer(native, 4, graph=True, threshold=1 << 40)
    add = native.place(ADD)
    tracer.trace(add, len(ADD), 1)
    native.set_word(L.HEAD, LAYOUT.ring_slots)
    native.set_word(L.RESERVE, LAYOUT.ring_slots)
    assert native.call_at(add, 1, 2) == 3
    assert (native.counter(4, L.LOST), native.counter(4, L.MISSED)) == (1, 0)
    native.set_word(L.BUSY, 1)
    assert native.call_at(add, 1, 2) == 3
    assert (native.counter(4, L.LOST), native.counter(4, L.MISSED), native.word(L.BUSY)) == (1, 2, 1)
    assert native.word(L.RESERVE) == native.word(L.HEAD) == LAYOUT.ring_slots


def test_an_entry_another_writer_published_gets_its_exit(native: NativeArea) -> None:
    """outer() is short, but a flat tracer's record of add() (called by it) published outer's
    held-back entry: outer's exit is written after it, not taken back."""
    held, flat = Tracer(native, 1, graph=True, threshold=1 << 40), Tracer(native, 2, graph=False)
    add, outer = native.place(ADD), native.place(OUTER)
    held.trace(outer, len(OUTER), 7)
    flat.trace(add, len(ADD), 8)
    for turn in range(LAYOUT.ring_slots):  # (past the ring's end: the records' numbers wrap)
        assert native.call_at(outer, add, 2) == 5
        assert [(r.ops, r.kind, r.held) for r in records(native, 3 * turn)] == [
            (1, 1 << FRAME_SHIFT, 7), (2, 0, 8), (1, 1 << FRAME_SHIFT | TRACE_EXIT, 7),
        ]  # fmt: skip
        native.set_word(L.TAIL, native.word(L.HEAD))  # read
    assert settled(native, 1, 2)


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "flat"])
def test_a_traced_function_is_entered_through_its_trampoline_entry_s_call(native: NativeArea, graph: bool) -> None:
    """As for return probes: below the return address, the call of the trampoline entry that
    returns for it (graph mode), or 0 (flat: nothing hooked)."""
    tracer = Tracer(native, 1, graph=graph)
    peek = native.place(PEEK)
    tracer.trace(peek, len(PEEK), 1)
    assert native.call_at(peek) == (native.trampoline.table if graph else 0)


def test_two_tracers_on_one_function_through_a_list_trampoline(native: NativeArea) -> None:
    first, second = Tracer(native, 4, graph=True), Tracer(native, 5, graph=False)
    add, outer = native.place(ADD), native.place(OUTER)
    listing = native.place(
        lambda at: build_list_trampoline([first.code.body, second.code.body], at, native.trampoline.points)
    )
    site(native, add, len(ADD), 7, listing)
    first.trace(outer, len(OUTER), 8)
    assert native.call_at(outer, add, 4) == 9
    assert [(r.ops, r.kind, r.held) for r in records(native)] == [
        (4, 1 << FRAME_SHIFT, 8), (4, 2 << FRAME_SHIFT, 7), (5, 0, 7),
        (4, 2 << FRAME_SHIFT | TRACE_EXIT, 7), (4, 1 << FRAME_SHIFT | TRACE_EXIT, 8),
    ]  # fmt: skip
    assert settled(native, 4, 5)


def by_call(native: NativeArea) -> list[list[Record]]:
    """The records, one list per entry record: it, its data records, then (graph mode) what
    follows up to the next entry."""
    found: list[list[Record]] = []
    for r in records(native):
        if not r.kind & TRACE_DATA and not r.kind & TRACE_EXIT:
            found.append([])
        found[-1].append(r)
    return found


def test_entry_and_exit_records_carry_the_values_asked_for(native: NativeArea) -> None:
    """arg1, arg2 as a string (NUL-terminated: its length; a null pointer; 8 bytes, a whole
    piece and an empty one; longer than STRING_PIECES pieces: cut; unmapped at once: faulted,
    with the pointer; running into unmapped memory: faulted, with what was read), and the
    return value."""
    captures = Captures(tuple(parse_values("arg1,arg2/s", retval=False)), tuple(parse_values("retval", retval=True)))
    tracer = Tracer(native, 6, graph=True, captures=captures)
    add = native.place(ADD)
    tracer.trace(add, len(ADD), 9)
    texts = [b"hello", b"", b"abcdefgh", b"x" * (8 * STRING_PIECES + 3)]
    buffers = [ctypes.create_string_buffer(t) for t in texts]
    pointers = [ctypes.addressof(b) for b in buffers] + [0, native.guarded(b""), native.guarded(b"0123456789A")]
    for number, pointer in enumerate(pointers):
        assert native.call_at(add, number, pointer) == number + pointer
    calls = by_call(native)
    assert len(calls) == len(pointers)
    for number, (pointer, call) in enumerate(zip(pointers, calls, strict=True)):
        entry, *values, exit_, retval = call
        assert (entry.held, exit_.held, exit_.kind & TRACE_EXIT) == (9, 9, TRACE_EXIT)
        assert {r.ops for r in call} == {6}
        assert (values[0].kind, values[0].held, values[0].value) == (TRACE_DATA | 0, 8, number)
        assert (retval.kind, retval.held, retval.value) == (TRACE_DATA | 0, 8, number + pointer)
        pieces = values[1:]
        assert {r.kind for r in pieces} == {TRACE_DATA | 1}
        assert [r.held for r in pieces[:-1]] == [8] * (len(pieces) - 1)  # whole pieces
        last, text = pieces[-1], b"".join(r.value.to_bytes(8, "little")[: r.held & 0xFF] for r in pieces)
        if pointer == 0:
            assert [(r.held, r.value) for r in pieces] == [(DATA_NULL, 0)]
        elif number == 5:  # nothing readable: the pointer instead
            assert [(r.held, r.value) for r in pieces] == [(DATA_FAULTED, pointer)]
        elif number == 6:
            assert text == b"0123456789A" and last.held == DATA_FAULTED | 3
        elif len(texts[number]) > 8 * STRING_PIECES:
            assert len(pieces) == STRING_PIECES and text == texts[number][: 8 * STRING_PIECES]
            assert last.held == 8 | DATA_CUT
        else:
            assert text == texts[number] and last.held & ~0xFF == DATA_END
            assert len(pieces) == len(texts[number]) // 8 + 1
            assert last.value >> 8 * (last.held & 0xFF) == 0  # the NUL, and nothing after it
    assert settled(native, 6)


def test_values_from_every_kind_of_place(native: NativeArea) -> None:
    """Arguments in the registers the tracer saves, in those it does not (r8 is read from its
    push, r9 in place), on the stack (arg7) and in xmm0 (fparg1); through a list trampoline too
    (its own frame on the stack)."""
    captures = Captures(tuple(parse_values("arg3,arg4,arg5,arg6,arg7,arg8,fparg1/f64", retval=False)), ())
    first, second = Tracer(native, 1, graph=False, captures=captures), Tracer(native, 2, graph=True, captures=captures)
    add, listed = native.place(ADD), native.place(ADD)
    first.trace(add, len(ADD), 3)
    bodies = [first.code.body, second.code.body]
    site(
        native,
        listed,
        len(ADD),
        4,
        native.place(lambda at: build_list_trampoline(bodies, at, native.trampoline.points)),
    )
    for function in (add, listed):
        assert native.call_at(function, 1, 2, 3, 4, 5, 6, 7, 8, 1.5) == 3
    expected = [3, 4, 5, 6, 7, 8, struct.unpack("<Q", struct.pack("<d", 1.5))[0]]
    calls = by_call(native)
    assert [c[0].ops for c in calls] == [1, 1, 2]
    for call in calls:
        assert [r.value for r in call[1:8]] == expected, call
        assert [r.kind for r in call[1:8]] == [TRACE_DATA | n for n in range(7)]


def test_a_flight_recorder_gives_up_as_many_old_records_as_a_call_needs(native: NativeArea) -> None:
    """A flight recorder's full ring: an entry with two values takes the room of the three
    oldest records (TAIL moved); nothing is lost."""
    captures = Captures(tuple(parse_values("arg1,arg2", retval=False)), ())
    tracer = Tracer(native, 3, graph=False, captures=captures)
    add = native.place(ADD)
    tracer.trace(add, len(ADD), 5)
    slots = LAYOUT.ring_slots
    native.set_word(L.OVERWRITE, 1)
    for word in (L.HEAD, L.RESERVE):
        native.set_word(word, slots)  # full: TAIL 0
    assert native.call_at(add, 10, 20) == 30
    assert (native.word(L.HEAD), native.word(L.TAIL)) == (slots + 3, 3)
    assert native.counter(3, L.LOST) == 0
    assert [(r.kind, r.value) for r in records(native, slots)][1:] == [(TRACE_DATA | 0, 10), (TRACE_DATA | 1, 20)]


def test_a_call_that_lasts_pauses_a_flight_recorder_and_asks_for_a_snapshot(native: NativeArea) -> None:
    """A snapshot threshold: a call that lasted it (spin) pauses the ring (OVERWRITE cleared) and
    asks for a snapshot (SNAPSHOT_DUE) once its exit is written; a call timed shorter than it
    (add, from its own entry: not from the record before it) asks nothing."""
    threshold = 1 << 22
    tracer = Tracer(native, 3, graph=True, snapshot_over=threshold)
    add, spin = native.place(ADD), native.place(SPIN)
    tracer.trace(add, len(ADD), 1)
    tracer.trace(spin, len(SPIN), 2)
    native.set_word(L.OVERWRITE, 1)
    clock = TscClock()
    with one_cpu():
        native.call_at(native.place(SPIN), 2 * threshold)  # (untraced: a long time since the last record)
        for _ in range(100):
            began = clock.read()
            assert native.call_at(add, 1, 2) == 3
            if clock.read() - began < threshold:
                break
            native.set_word(L.OVERWRITE, 1)  # held up in add: it did last
            native.set_word(L.SNAPSHOT_DUE, 0)
        else:
            raise AssertionError("held up 100 times in a row running add()")
        assert (native.word(L.SNAPSHOT_DUE), native.word(L.OVERWRITE)) == (0, 1)
        head = native.word(L.HEAD)
        native.call_at(spin, threshold)
    assert (native.word(L.SNAPSHOT_DUE), native.word(L.OVERWRITE)) == (1, 0)
    assert calls(native, head) == [("entry", 2, 1), ("exit", 2, 1)]
    assert settled(native, 3)


def test_a_record_with_values_is_written_whole_or_lost(native: NativeArea) -> None:
    """The entry and its data records go in the ring together, wrapping at its end; with room
    for fewer, none goes (lost, counted) and the call runs on."""
    captures = Captures(tuple(parse_values("arg1,arg2", retval=False)), ())
    tracer = Tracer(native, 3, graph=False, captures=captures)
    add = native.place(ADD)
    tracer.trace(add, len(ADD), 5)
    slots = LAYOUT.ring_slots
    for word in (L.HEAD, L.TAIL, L.RESERVE):
        native.set_word(word, slots - 1)  # the next record is the ring's last slot
    assert native.call_at(add, 10, 20) == 30
    assert native.word(L.HEAD) == slots + 2
    ring = records(native, slots - 1)  # the ring's last slot, then its first two
    assert [(r.kind, r.held) for r in ring] == [(0, 5), (TRACE_DATA | 0, 8), (TRACE_DATA | 1, 8)]
    assert [ring[1].value, ring[2].value] == [10, 20]
    native.set_word(L.TAIL, native.word(L.HEAD) - slots + 2)  # room for two records: not three
    assert native.call_at(add, 1, 2) == 3
    assert native.word(L.HEAD) == slots + 2 and native.counter(3, L.LOST) == 1
    native.set_word(L.TAIL, native.word(L.HEAD) - slots + 3)  # room for three: just enough
    assert native.call_at(add, 1, 2) == 3
    assert native.word(L.HEAD) == slots + 5 and native.counter(3, L.LOST) == 1
    plain = Tracer(native, 4, graph=False)  # no values: a record needs room for one
    other = native.place(ADD)
    plain.trace(other, len(ADD), 6)
    native.set_word(L.TAIL, native.word(L.HEAD) - slots + 1)
    assert native.call_at(other, 1, 2) == 3
    assert native.word(L.HEAD) == slots + 6 and native.counter(4, L.LOST) == 0


@pytest.mark.parametrize("threshold", [0, 1], ids=["published at once", "held back"])
def test_a_traced_call_interrupted_at_every_instruction_leaves_whole_pairs(native: NativeArea, threshold: int) -> None:
    """A signal handler calls the traced function again after each instruction of the first
    call's site, tracer code and trampoline: a nested call inside a window where the thread
    writes a record or changes its shadow stack is missed (counted), any other is traced whole;
    the records are entry/exit pairs nested as the calls were, and everything is settled after."""
    start = native.base + native.used
    tracer = Tracer(native, 5, graph=True, threshold=threshold)
    add = native.place(ADD)
    tracer.trace(add, len(ADD), 7)
    nested = native.call_interrupted(add, 0xABC, within=(start, native.base + native.used))
    missed = native.counter(5, L.MISSED)
    got = calls(native)
    open_frames: list[int] = []  # (a nested call's frame is 2 while the first call's entry is on the shadow stack)
    for kind, function, frame in got:
        assert function == 7 and frame in (1, 2)
        if kind == "entry":
            open_frames.append(frame)
        else:
            assert open_frames.pop() == frame
    assert not open_frames
    assert native.counter(5, L.HITS) == nested + 1
    unrecorded = nested + 1 - len(got) // 2
    assert 0 < unrecorded < nested and missed >= unrecorded  # (a missed entry's exit is counted too)
    assert settled(native, 5)
