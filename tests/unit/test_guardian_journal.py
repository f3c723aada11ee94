"""The guardian's undo journal (ptrace/guardian.py): what it holds is what the guardian would put
back, read from the shared memory alone, as the guardian reads it."""

from __future__ import annotations

import struct

from dynprobe.ptrace.journal import Journal
from dynprobe.ptrace.procfs import identity
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.shadow import entries_in, swap_slots, through_entry_points, trampoline_point

JMP = bytes.fromhex("e9 00 10 00 00")
REGION = bytes.fromhex("55 48 89 e5 90")  # push rbp; mov rbp,rsp; nop


def test_spans_grow_shrink_and_go() -> None:
    journal = Journal(capacity=8)
    journal.record(1, 0x1000, REGION[:1])  # an int3
    assert journal.spans() == {1: [(0x1000, REGION[:1])]}
    journal.record(1, 0x1000, REGION)  # optimized: the jump covers the region
    assert journal.spans() == {1: [(0x1000, REGION)]} and journal.length(1, 0x1000) == 5
    journal.record(1, 0x1000, REGION[:1])  # back to a trap: only the int3 differs
    assert journal.spans() == {1: [(0x1000, REGION[:1])]}
    journal.drop(1, 0x1000)
    assert journal.spans() == {} and journal.length(1, 0x1000) == 0


def test_entries_are_reused_and_kept_apart_by_process() -> None:
    journal = Journal(capacity=4)  # two processes: each one's start time, and a span
    journal.record(1, 0x1000, b"\x55")
    journal.record(2, 0x1000, b"\x53")
    journal.drop(1, 0x1000)
    journal.record(1, 0x2000, REGION)  # the freed entry
    assert journal.spans() == {2: [(0x1000, b"\x53")], 1: [(0x2000, REGION)]}
    assert journal.identities() == {1: identity(1), 2: identity(2)}
    assert not journal.full
    told: list[bool] = []
    journal.on_full = lambda: told.append(True)
    journal.record(3, 0x3000, b"\x90")  # no entry left: not journaled, and said so (once)
    journal.record(3, 0x4000, b"\x90")
    assert journal.full and 3 not in journal.spans() and told == [True]


def test_fork_and_exec() -> None:
    journal = Journal(capacity=8)
    journal.record(1, 0x1000, b"\x55")
    journal.record(1, 0x2000, REGION)
    journal.inherit(1, 7)  # a forked child has a copy of the parent's code
    assert sorted(journal.spans()[7]) == [(0x1000, b"\x55"), (0x2000, REGION)]
    journal.forget(1)  # the parent exec'd
    assert set(journal.spans()) == {7}


def test_recording_the_file_s_own_bytes_drops_the_span() -> None:
    journal = Journal(capacity=4)
    journal.record(1, 0x1000, JMP)
    journal.record(1, 0x1000, b"")
    assert journal.spans() == {}


def test_hooked_returns_are_journaled_apart_from_code() -> None:
    journal = Journal(capacity=8)
    journal.record_returns(1, 0x7000_0004, 0x40_0000)
    journal.record_returns(1, 0x7000_0004, 0x40_0000)  # once per process
    assert journal.returns() == {1: (0x7000_0004, 0x40_0000)} and journal.spans() == {}
    assert journal.empty  # a detach has put them back: no rescue needed for them alone
    journal.inherit(1, 7)
    assert journal.returns() == {1: (0x7000_0004, 0x40_0000), 7: (0x7000_0004, 0x40_0000)}
    journal.forget(1)
    assert journal.returns() == {7: (0x7000_0004, 0x40_0000)}


def test_a_doorbell_is_journaled_for_the_guardian_to_ring_first() -> None:
    """The GONE word of a process's upcall doorbell (core/upcalls.py): one per process, inherited
    by a fork child (the page is shared), gone with an exec; no code to put back for it alone."""
    journal = Journal(capacity=8)
    journal.record_doorbell(1, 0x7F00_0008)
    journal.record_doorbell(1, 0x7F00_0008)
    assert journal.doorbells() == {1: 0x7F00_0008} and journal.spans() == {} and journal.empty
    journal.inherit(1, 7)
    assert journal.doorbells() == {1: 0x7F00_0008, 7: 0x7F00_0008}
    journal.forget(1)
    assert journal.doorbells() == {7: 0x7F00_0008}


def test_return_addresses_go_back_through_a_chain_of_hooks() -> None:
    """Two return probes on one call: the slot holds entry point 1, whose original is entry
    point 0, whose original is the caller. A slot that no longer holds its entry point (the
    frame returned, something else is there) is left."""
    points = 0x7000_0004
    shadow = bytearray(3 * L.SHADOW_ENTRY)
    for k, slot, original in ((0, 0x1000, 0x401234), (1, 0x1000, trampoline_point(points, 0)), (2, 0x2000, 0x405678)):
        struct.pack_into("<QQ", shadow, k * L.SHADOW_ENTRY + L.ENTRY_SLOT, slot, original)
    memory = {0x1000: trampoline_point(points, 1), 0x2000: 0xDEAD}
    entries = entries_in(bytes(shadow))
    assert entries == [(0, 0x1000, 0x401234), (1, 0x1000, trampoline_point(points, 0)), (2, 0x2000, 0x405678)]
    swaps = [(k, slot, trampoline_point(points, k), original) for k, slot, original in entries]
    assert swap_slots(swaps, memory.__getitem__, memory.__setitem__) == {0, 1}
    assert memory == {0x1000: 0x401234, 0x2000: 0xDEAD}


def test_a_return_address_through_entry_points_ends_at_an_address_that_is_none() -> None:
    """A return address that is entry point k is entry k's original, and so on to an address
    that is none (the entries gone through named); an address between two entry points is
    none; entry points of a chain the target scribbled into a loop are gone through once each."""
    points = 0x7000_0000
    originals = {0: 0x401234, 1: trampoline_point(points, 0), 2: trampoline_point(points, 1)}
    assert through_entry_points(trampoline_point(points, 2), points, originals.__getitem__) == ({0, 1, 2}, 0x401234)
    assert through_entry_points(0x401234, points, originals.__getitem__) == (set(), 0x401234)
    assert through_entry_points(points + 1, points, originals.__getitem__) == (set(), points + 1)
    looped = [0]

    def scribbled(k: int) -> int:
        looped[0] += 1
        return trampoline_point(points, k)  # entry k returns through entry point k

    assert through_entry_points(trampoline_point(points, 3), points, scribbled) == ({3}, trampoline_point(points, 3))
    assert looped[0] == 1  # once: the loop is seen at once
