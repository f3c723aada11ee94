"""The guardian's undo journal (ptrace/guardian.py): what it holds is what the guardian would put
back, read from the shared memory alone, as the guardian reads it."""

from __future__ import annotations

from dynprobe.ptrace.guardian import Journal

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
    journal = Journal(capacity=2)
    journal.record(1, 0x1000, b"\x55")
    journal.record(2, 0x1000, b"\x53")
    journal.drop(1, 0x1000)
    journal.record(1, 0x2000, REGION)  # the freed entry
    assert journal.spans() == {2: [(0x1000, b"\x53")], 1: [(0x2000, REGION)]}
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
