"""A bpftrace program's printf() records as the tracer prints them (core/programs.py's
`on_records`): formatted, in the order they were written across threads, and a target's
scribbles (a number no printf has, a string length past its field) neither printed nor trusted."""

from __future__ import annotations

import numpy as np

from dynprobe.core.programs import PlacedProgram
from dynprobe.lang.maps import Clock
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.consumer import RecordBatch

SOURCE = 'uprobe:libc:strlen { printf("%s said %d\\n", comm, arg0); printf("[%s]\\n", str(arg0, 3)); }'


def batch(tid: int, records: list[tuple[int, bytes]]) -> RecordBatch:
    """(time, payload) records of thread `tid`, in 256-byte records."""
    raw = np.zeros((len(records), 256), dtype=np.uint8)
    for row, (_, payload) in zip(raw, records, strict=True):
        row[L.RECORD_HEADER : L.RECORD_HEADER + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    n = len(records)
    return RecordBatch(0, 100, tid, raw, np.array([t for t, _ in records]), np.zeros(n, np.uint16),
                       np.zeros(n, np.uint32), np.arange(n, dtype=np.uint64))  # fmt: skip


def word(value: int) -> bytes:
    return (value & ((1 << 64) - 1)).to_bytes(8, "little")


def string(length: int, text: bytes) -> bytes:
    return length.to_bytes(2, "little") + b"\0\0" + text.ljust(L.STRING_CAPACITY, b"\0")


def test_records_print_in_the_order_they_were_written() -> None:
    program = PlacedProgram(SOURCE, "stdin", clock=Clock(1, 0, 0), process=lambda pid: None,
                            comm=lambda pid, tid: f"t{tid}", stack_at=lambda pid, slot: None)  # fmt: skip
    printed: list[str] = []
    program.write = printed.append
    first = batch(7, [(30, word(0) + word(-5)), (10, word(1) + string(2, b"ab")), (50, word(99) + word(1))])
    second = batch(8, [(20, word(1) + string(60000, b"abcdef")), (40, word(0) + word(1 << 63))])
    program.on_records([first, second])
    assert printed == ["[ab]\n", "[abc]\n", "t7 said -5\n", f"t8 said {-(1 << 63)}\n"]
