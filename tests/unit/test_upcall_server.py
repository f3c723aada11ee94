"""core/upcalls.c, the upcall server's C steps, on memory of our own: which thread it finds
asking and when, what it writes back, how it answers."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
from array import array
from collections.abc import Iterator

import pytest

from dynprobe.arch.x86_64 import Regs
from dynprobe.core.upcalls import NATIVE_LAYOUT, SPIN, Doorbell, native
from dynprobe.ringbuf import layout as L

AREA_BYTES = 0x400  # (the header's upcall words, and room after)


class Bell:
    """A doorbell page and thread areas, as the server sees them."""

    def __init__(self, threads: int) -> None:
        self.bell = Doorbell.over(0, mmap.mmap(-1, mmap.PAGESIZE))
        self.words = self.bell.words
        self.watched = array("Q", [self.bell.ring, 0])
        self.pool = mmap.mmap(-1, threads * AREA_BYTES)
        whole = memoryview(self.pool)
        self.areas = [whole[i * AREA_BYTES : (i + 1) * AREA_BYTES].cast("Q") for i in range(threads)]
        whole.release()

    def ask(self, thread: int) -> None:
        """What a detour does: REQUEST, then the ring."""
        self.areas[thread][L.UPCALL_STATE // 8] = L.UPCALL_REQUEST
        self.words[L.DOORBELL_RING // 8] += 1

    def next(self, start: int = 0) -> int:
        return native.next_request(self.watched, self.areas, start)


def test_a_thread_that_asks_is_found_at_once_and_each_in_turn() -> None:
    bell = Bell(3)
    bell.ask(0)
    bell.ask(2)
    assert bell.next(0) == 0
    assert bell.next(1) == 2  # (from where the last answer left off: no thread waits behind another)
    assert bell.next(0) == 0  # (still asking: not answered)


def test_nothing_rung_within_the_spin_is_minus_one() -> None:
    bell = Bell(2)
    started = time.monotonic()
    assert bell.next() == -1
    assert time.monotonic() - started >= SPIN


def test_a_ring_with_no_known_thread_asking_is_minus_two_and_seen() -> None:
    """A thread the server does not know of yet rang: it is told, to look at its world again;
    the ring is seen, so the next wait waits for the next ring."""
    bell = Bell(1)
    bell.words[L.DOORBELL_RING // 8] += 1
    assert bell.next() == -2
    assert bell.watched[1] == 1
    assert bell.next() == -1


@pytest.fixture
def long_spin() -> Iterator[float]:
    """The wait's spin made 60 s long for the test (core/upcalls.py's layout, but for the time)."""
    native.set_layout(**{**NATIVE_LAYOUT, "spin_ns": 60 * 10**9})
    try:
        yield 60
    finally:
        native.set_layout(**NATIVE_LAYOUT)


def test_a_request_made_while_it_waits_ends_the_wait(long_spin: float) -> None:
    """The ring ends the wait it comes in (the GIL let go meanwhile: the ringing thread runs)."""
    bell = Bell(2)
    later = threading.Timer(0.05, bell.ask, args=(1,))
    later.start()
    started = time.monotonic()
    assert bell.next() == 1
    assert time.monotonic() - started < long_spin / 2
    later.join()


def test_an_area_let_go_is_a_value_error() -> None:
    bell = Bell(2)
    bell.areas[1].release()
    with pytest.raises(ValueError):
        bell.next()


def test_the_answer_writes_back_what_a_handler_changed_and_nothing_else() -> None:
    area = bytearray(range(256)) * (AREA_BYTES // 256)
    area[L.UPCALL_STATE : L.UPCALL_STATE + 8] = L.UPCALL_REQUEST.to_bytes(8, "little")
    area[L.UPCALL_SLEEPING : L.UPCALL_SLEEPING + 8] = bytes(8)
    before = bytes(area)
    regs = Regs.from_buffer_copy(area, L.UPCALL_FRAME)
    regs.rax, regs.rip = 7, 0x1000
    assert native.answer(area, 0, regs) is False
    end = L.UPCALL_FRAME + ctypes.sizeof(Regs)
    assert area[L.UPCALL_FRAME : end] == bytes(regs)
    state = slice(L.UPCALL_STATE, L.UPCALL_STATE + 8)
    assert area[state] == L.UPCALL_ANSWERED.to_bytes(8, "little")
    area[state] = before[state]
    assert area[: L.UPCALL_FRAME] == before[: L.UPCALL_FRAME] and area[end:] == before[end:]
    assert native.answer(area, 0, None) is False and area[L.UPCALL_FRAME : end] == bytes(regs)


def test_the_answer_wakes_only_a_thread_that_sleeps_and_tells_its_cpu() -> None:
    area = memoryview(bytearray(AREA_BYTES)).cast("Q")
    area[L.UPCALL_STATE // 8] = L.UPCALL_REQUEST
    area[L.UPCALL_CPU // 8] = 3
    assert native.answer(area, 3, None) is False  # (it spun: it did not ask on the server's CPU)
    assert area[L.UPCALL_STATE // 8] == L.UPCALL_ANSWERED
    area[L.UPCALL_SLEEPING // 8] = 1
    assert native.answer(area, 3, None) is True and native.answer(area, 2, None) is False
    with pytest.raises(ValueError):
        native.answer(memoryview(bytearray(16)).cast("Q"), 3, None)  # (not a whole area)
