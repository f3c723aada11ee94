"""The function tracer's generated code run natively in this process: functions patched with
tracer sites (codegen.build_tracer_site) calling a tracer instance's code (build_ops_code) or a
list trampoline of several (build_list_trampoline), in flat and graph mode, with a depth, a time
threshold and recorded values. The records each call leaves, and the shadow stack, are checked
record by record; every call must return what the function returns untraced.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import NamedTuple

import pytest

from dynprobe.arch.x86_64.codegen import (
    DATA_CUT,
    DATA_END,
    DATA_NULL,
    FRAME_SHIFT,
    TRACE_DATA,
    TRACE_EXIT,
    Captures,
    OpsCode,
    build_list_trampoline,
    build_ops_code,
    build_tracer_site,
)
from dynprobe.errors import OptimizeRefusal
from dynprobe.ringbuf import layout as L
from dynprobe.spec.argspec import STRING_PIECES, parse_values
from tests.unit.native import ADD, OUTER, SPIN, THEN, NativeArea, one_cpu, sum_to

LAYOUT = L.AreaLayout(max_probes=16, max_hists=4, ring_bytes=1 << 16, record_size=16)


class Record(NamedTuple):
    ops: int
    kind: int
    held: int  # the function's id; a data record's bytes and flags
    value: int  # the time stamp; a data record's value or piece


@pytest.fixture
def native() -> Iterator[NativeArea]:
    made = NativeArea(LAYOUT)
    yield made
    made.close()


def records(native: NativeArea) -> list[Record]:
    return [
        Record(*(int.from_bytes(r[a:b], "little") for a, b in ((0, 2), (2, 4), (4, 8), (8, 16))))
        for r in native.records()
    ]


def calls(native: NativeArea) -> list[tuple[str, int, int]]:
    """The records as (entry or exit, function id, frame), data records left out."""
    return [
        ("exit" if r.kind & TRACE_EXIT else "entry", r.held, r.kind >> FRAME_SHIFT)
        for r in records(native)
        if not r.kind & TRACE_DATA
    ]


class Tracer:
    """One tracer instance's code in this process (graph mode: with the return trampoline)."""

    def __init__(
        self, native: NativeArea, index: int, *, graph: bool, depth: int | None = None, threshold: int = 0,
        captures: Captures | None = None,
    ) -> None:  # fmt: skip
        self.native, self.index = native, index
        trampoline = native.trampoline if graph else None

        def build(at: int) -> tuple[bytes, OpsCode]:
            return build_ops_code(LAYOUT, index, trampoline, at, depth, threshold, captures)

        at = native.place(lambda here: build(here)[0])
        self.code = build(at)[1]
        assert self.code.entry == at

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
    """then(add, spin, ticks): add() ends at once, spin() and then() last `ticks`. add's entry
    is taken back (and its exit never written); the others are published with their exits."""
    threshold = 1 << 20
    tracer = Tracer(native, 3, graph=True, threshold=threshold)
    add, spin, then = native.place(ADD), native.place(SPIN), native.place(THEN)
    for function, length, number in ((add, len(ADD), 1), (spin, len(SPIN), 2), (then, len(THEN), 3)):
        tracer.trace(function, length, number)
    with one_cpu():
        native.call_at(then, add, spin, 2 * threshold)
        assert calls(native) == [("entry", 3, 1), ("entry", 2, 2), ("exit", 2, 2), ("exit", 3, 1)]
        native.call_at(then, add, add, 0)  # nothing lasts: nothing at all
        assert len(records(native)) == 4 and settled(native, 3)
        native.call_at(spin, threshold // 4)
        assert len(records(native)) == 4 and settled(native, 3)
    exit_spin, entry_spin = records(native)[2], records(native)[1]
    assert exit_spin.value - entry_spin.value >= 2 * threshold
    assert native.counter(3, L.HITS) == 7


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


def test_entry_and_exit_records_carry_the_values_asked_for(native: NativeArea) -> None:
    """arg1, arg2 as a string (NUL-terminated: its length; a null pointer; 8 bytes, a whole
    piece and an empty one; longer than STRING_PIECES pieces: cut), and the return value."""
    captures = Captures(tuple(parse_values("arg1,arg2/s", retval=False)), tuple(parse_values("retval", retval=True)))
    tracer = Tracer(native, 6, graph=True, captures=captures)
    add = native.place(ADD)
    tracer.trace(add, len(ADD), 9)
    texts = [b"hello", b"", b"abcdefgh", b"x" * (8 * STRING_PIECES + 3)]
    buffers = [ctypes.create_string_buffer(t) for t in texts]
    pointers = [ctypes.addressof(b) for b in buffers] + [0]
    for number, pointer in enumerate(pointers):
        assert native.call_at(add, number, pointer) == number + pointer
    got = records(native)
    by_call: list[list[Record]] = []
    for r in got:
        if not r.kind & TRACE_DATA and not r.kind & TRACE_EXIT:
            by_call.append([])
        by_call[-1].append(r)
    assert len(by_call) == len(pointers)
    for number, (pointer, call) in enumerate(zip(pointers, by_call, strict=True)):
        entry, *values, exit_, retval = call
        assert (entry.held, exit_.held, exit_.kind & TRACE_EXIT) == (9, 9, TRACE_EXIT)
        assert {r.ops for r in call} == {6}
        assert (values[0].kind, values[0].held, values[0].value) == (TRACE_DATA | 0, 8, number)
        assert (retval.kind, retval.held, retval.value) == (TRACE_DATA | 0, 8, number + pointer)
        pieces = values[1:]
        assert {r.kind for r in pieces} == {TRACE_DATA | 1}
        text = b"".join(r.value.to_bytes(8, "little")[: r.held & 0xFF] for r in pieces)
        flags = [r.held & ~0xFF for r in pieces]
        if pointer == 0:
            assert [(r.held, r.value) for r in pieces] == [(DATA_NULL, 0)]
        elif len(texts[number]) > 8 * STRING_PIECES:
            assert len(pieces) == STRING_PIECES and text == texts[number][: 8 * STRING_PIECES]
            assert flags == [0] * (STRING_PIECES - 1) + [DATA_CUT]
        else:
            assert text == texts[number] and flags == [0] * (len(pieces) - 1) + [DATA_END]
            assert len(pieces) == len(texts[number]) // 8 + 1
    assert settled(native, 6)
