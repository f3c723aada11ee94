"""The consumer: ring reading with wrap-around, bulk decoding, and a target that scribbles over
its shared memory (hazard 26): random contents give clear errors, never a crash or a bad read."""

from __future__ import annotations

import io
import itertools
import mmap
import os
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynprobe.ptrace import syscalls as sc
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.areas import ThreadAreas
from dynprobe.ringbuf.consumer import (
    Consumer,
    RecordBatch,
    RingCorrupted,
    TscClock,
    decode_fields,
    decode_string,
    snapshot_records,
    spool_records,
    take_records,
    time_windows,
)

from .native import asleep_in

LAYOUT = L.AreaLayout(max_probes=16, max_hists=2, ring_bytes=1 << 12, record_size=32)
CLOCK = TscClock()


def make_areas() -> ThreadAreas:
    return ThreadAreas(1, LAYOUT, lambda tid, size: (0x1000, mmap.mmap(-1, size)), lambda tid, addr: None)


def write_record(areas: ThreadAreas, tid: int, probe: int, value: int, *, cpu: int = 0, tsc: int | None = None) -> None:
    """A record as the target's code writes it: time stamped now, unless told otherwise."""
    area = areas.by_tid[tid]
    words = area.cells
    head = int(words[L.HEAD // 8])
    slot = head % LAYOUT.ring_slots
    base = area.offset + LAYOUT.ring + slot * LAYOUT.record_size
    view = area.pool.view
    view[base : base + 2] = probe.to_bytes(2, "little")
    view[base + 2 : base + 4] = cpu.to_bytes(2, "little")
    view[base + 8 : base + 16] = (CLOCK.read() if tsc is None else tsc).to_bytes(8, "little")
    view[base + 16 : base + 24] = value.to_bytes(8, "little")
    words[L.HEAD // 8] = head + 1


def test_take_records_wraps_around() -> None:
    areas = make_areas()
    area = areas.assign(7)
    words = area.cells
    slots = LAYOUT.ring_slots
    words[L.HEAD // 8] = words[L.TAIL // 8] = slots - 2  # the next records wrap
    for v in range(5):
        write_record(areas, 7, 1, v)
    records = take_records(words, memoryview(area.pool.view), area.offset, LAYOUT)
    assert [int.from_bytes(bytes(r[16:24]), "little") for r in records] == [0, 1, 2, 3, 4]
    assert int(words[L.TAIL // 8]) == int(words[L.HEAD // 8])


def test_a_flight_recorder_s_snapshot_takes_what_it_did_not_read_and_counts_what_gave_way() -> None:
    """The writer alone moves TAIL: a snapshot copies from TAIL or from where the last one read
    (READ), whichever is later, to HEAD (wrapped), never moves TAIL, and counts the records that
    gave way before it read them; nothing new, nothing; HEAD a ring past TAIL, corrupted."""
    areas = make_areas()
    area = areas.assign(7)
    words, view, slots = area.cells, memoryview(area.pool.view), LAYOUT.ring_slots

    def values(records: np.ndarray) -> list[int]:
        return [int.from_bytes(bytes(r[16:24]), "little") for r in records]

    for v in range(slots + 3):  # a full ring whose writer gave up its 3 oldest (as _take_oldest does)
        write_record(areas, 7, 1, v)
    words[L.TAIL // 8] = 3
    records, gave_way = snapshot_records(words, view, area.offset, LAYOUT)
    assert values(records) == list(range(3, slots + 3)) and gave_way == 3
    assert (int(words[L.READ // 8]), int(words[L.TAIL // 8])) == (slots + 3, 3)
    assert snapshot_records(words, view, area.offset, LAYOUT)[1] == 0  # nothing new
    for v in range(slots + 3, slots + 8):
        write_record(areas, 7, 1, v)
    words[L.TAIL // 8] = 8  # 5 more, 5 given up: all read before, none lost unread
    records, gave_way = snapshot_records(words, view, area.offset, LAYOUT)
    assert values(records) == list(range(slots + 3, slots + 8)) and gave_way == 0
    words[L.HEAD // 8] = int(words[L.READ // 8]) + 2 * slots  # scribbled
    with pytest.raises(RingCorrupted, match="of a ring of"):
        snapshot_records(words, view, area.offset, LAYOUT)


def test_spool_records_writes_both_pieces_of_a_wrapped_ring() -> None:
    areas = make_areas()
    area = areas.assign(7)
    words = area.cells
    words[L.HEAD // 8] = words[L.TAIL // 8] = LAYOUT.ring_slots - 3
    for v in range(6):
        write_record(areas, 7, 1, v)
    sink = io.BytesIO()
    header = lambda n: b"H" + bytes([n])  # noqa: E731
    assert spool_records(words, memoryview(area.pool.view), area.offset, LAYOUT, sink, header) == 6
    data = sink.getvalue()
    assert data[:2] == b"H\x06"  # the header counts what follows
    data = data[2:]
    assert len(data) == 6 * LAYOUT.record_size
    values = [int.from_bytes(data[i * 32 + 16 : i * 32 + 24], "little") for i in range(6)]
    assert values == [0, 1, 2, 3, 4, 5] and int(words[L.TAIL // 8]) == int(words[L.HEAD // 8])


@pytest.mark.parametrize(("head", "tail"), [(5, 6), (10_000, 0), (2**64 - 1, 0)])
def test_impossible_head_and_tail_are_refused(head: int, tail: int) -> None:
    areas = make_areas()
    area = areas.assign(7)
    words = area.cells
    words[L.HEAD // 8], words[L.TAIL // 8] = head, tail
    with pytest.raises(RingCorrupted):
        take_records(words, memoryview(area.pool.view), area.offset, LAYOUT)


def test_decode_sign_and_width() -> None:
    raw = np.zeros((2, 32), dtype=np.uint8)
    raw[0, 16:24] = np.frombuffer((0xFFFF_FFFF_FFFF_FF80).to_bytes(8, "little"), dtype=np.uint8)
    raw[1, 16:24] = np.frombuffer((0x1234_5678_9ABC_DEF0).to_bytes(8, "little"), dtype=np.uint8)
    batch = RecordBatch(
        0,
        1,
        1,
        raw,
        np.zeros(2, np.int64),
        np.zeros(2, np.uint16),
        np.zeros(2, np.uint32),
        np.arange(2, dtype=np.uint64),
    )
    cols = decode_fields(batch, [(0, 16, "s", 8), (1, 16, "u", 16), (2, 16, "x", 64)])
    assert cols[0].tolist() == [-128, -16]
    assert cols[1].tolist() == [0xFF80, 0xDEF0]
    assert cols[2].tolist() == [0xFFFF_FFFF_FFFF_FF80, 0x1234_5678_9ABC_DEF0]


def test_string_length_past_capacity_is_clamped() -> None:
    raw = np.zeros((1, 128), dtype=np.uint8)
    raw[0, 16:18] = [0xFF, 0xFF]  # a scribbled length
    raw[0, 20:84] = ord("z")
    batch = RecordBatch(
        0, 1, 1, raw, np.zeros(1, np.int64), np.zeros(1, np.uint16), np.zeros(1, np.uint32), np.zeros(1, np.uint64)
    )
    [(data, truncated)] = decode_string(batch, 16)
    assert data == b"z" * L.STRING_CAPACITY and truncated


def test_consumer_delivers_and_counts() -> None:
    got: list[RecordBatch] = []
    errors: list[str] = []
    consumer = Consumer(LAYOUT, got.extend, lambda i: i < 3, errors.append)
    areas = make_areas()
    consumer.add(areas)
    areas.assign(10)
    areas.assign(11)
    for v in range(3):
        write_record(areas, 10, 1, v)
    write_record(areas, 11, 2, 99)
    write_record(areas, 11, 9, 5)  # an unknown probe index: rejected and reported
    assert consumer.drain() == 4
    assert {(b.tid, b.probe_index, len(b.raw)) for b in got} == {(10, 1, 3), (11, 2, 1)}
    assert consumer.corrupt == 1 and len(errors) == 1 and "unknown probe 9" in errors[0]
    area = areas.by_tid[10]
    area.cells[LAYOUT.counter(1, L.HITS) // 8] = 3
    areas.retire(10)
    consumer.drain()  # folds the ended thread's counters; its area is clean and free again
    assert consumer.counters(1) == (3, 0, 0)
    assert areas.assign(12) == area and int(area.cells[LAYOUT.counter(1, L.HITS) // 8]) == 0


def test_an_ended_thread_s_counters_are_folded_for_the_rows_given_out_only() -> None:
    """The rows the session gave out (`in_use`: probes, histograms) are folded, and no row past
    them (the target writes its own area); rows given out later are folded from then on."""
    rows = [2]
    consumer = Consumer(LAYOUT, lambda batches: None, lambda i: True, lambda message: None, in_use=lambda: (rows[0], 0))
    areas = make_areas()
    consumer.add(areas)
    for tid, (inside, past) in ((10, (3, 7)), (11, (4, 9))):
        area = areas.assign(tid)
        area.cells[LAYOUT.counter(1, L.HITS) // 8] = inside
        area.cells[LAYOUT.counter(5, L.HITS) // 8] = past
    areas.retire(10)
    consumer.drain()
    assert consumer.counters(1) == (3 + 4, 0, 0)  # (thread 11's still live)
    assert consumer.folded.row(5) == [0] * len(consumer.folded.row(5))
    rows[0] = 6
    areas.retire(11)
    consumer.drain()
    assert consumer.folded.row(1)[L.HITS] == 7 and consumer.folded.row(5)[L.HITS] == 9


@pytest.mark.skipif(not sc.has_futex_waitv(), reason="futex_waitv (Linux 5.16+) is what the test sleeps in")
def test_a_pass_wakes_a_writer_asleep_for_room() -> None:
    """A writer asleep on its TAIL (WAIT_SLEEPING set) is woken by the pass that took its records."""
    consumer = Consumer(LAYOUT, lambda batches: None, lambda i: True, lambda error: None)
    areas = make_areas()
    consumer.add(areas)
    area = areas.assign(10)
    words = area.cells
    for v in range(LAYOUT.ring_slots):
        write_record(areas, 10, 1, v)
    words[L.WAIT_SLEEPING // 8] = 1
    tail = area.address + L.TAIL
    asleep = threading.Thread(target=sc.futex_waitv, args=([(tail, 0)], 60.0))
    asleep.start()
    while not asleep_in(asleep.native_id or 0, sc.SYS_FUTEX_WAITV):
        os.sched_yield()
    assert consumer.drain() == LAYOUT.ring_slots
    asleep.join(30)  # (woken at once; a wake-up missed leaves it asleep a minute)
    assert not asleep.is_alive() and int(words[L.TAIL // 8]) == LAYOUT.ring_slots


def test_a_process_under_a_seccomp_filter_never_sleeps_waiting_for_room() -> None:
    areas = make_areas()
    area = areas.assign(10)
    areas.set_wait(1 << 30, 1 << 10)
    assert (int(area.cells[L.WAIT_TICKS // 8]), int(area.cells[L.WAIT_SPIN // 8])) == (1 << 30, 1 << 10)
    areas.never_sleep()  # (a thread found under a filter)
    assert (int(area.cells[L.WAIT_TICKS // 8]), int(area.cells[L.WAIT_SPIN // 8])) == (1 << 30, 1 << 30)
    assert int(areas.assign(11).cells[L.WAIT_SPIN // 8]) == 1 << 30
    areas.set_wait(1 << 31, 1 << 10)
    assert int(area.cells[L.WAIT_SPIN // 8]) == 1 << 31


def test_records_stamped_in_one_tick_keep_the_order_they_were_written_in() -> None:
    """A clock that moves in steps (AMD's Zen: 10 ns) stamps a call and the call it makes alike:
    the batches split a thread's records by probe, and `order` puts them back as written."""
    got: list[RecordBatch] = []
    consumer = Consumer(LAYOUT, got.extend, lambda i: i < 3, lambda message: None)
    areas = make_areas()
    consumer.add(areas)
    areas.assign(10)
    now = CLOCK.read()
    for probe, value in [(1, 0), (2, 1), (2, 2), (1, 3)]:  # a, h, h, a, as add_word calls hash
        write_record(areas, 10, probe, value, tsc=now)
    consumer.drain()
    rows = [(t, o, int.from_bytes(bytes(r[16:24]), "little"))
            for b in got for t, o, r in zip(b.time_ns.tolist(), b.order.tolist(), b.raw, strict=True)]  # fmt: skip
    assert len(got) == 2 and [value for *_, value in sorted(rows, key=lambda row: row[:2])] == [0, 1, 2, 3]


def test_records_the_target_cannot_have_written_honestly_are_left_out() -> None:
    """The target writes its ring: a CPU number past the machine's, a time before the session
    began or a second past now are impossible; they are counted and said once, not delivered."""
    got: list[RecordBatch] = []
    errors: list[str] = []
    consumer = Consumer(LAYOUT, got.extend, lambda i: i < 3, errors.append, without_cpu=lambda i: i == 2)
    areas = make_areas()
    consumer.add(areas)
    areas.assign(10)
    second = int(1e9 / consumer.clock.params()["scale"])
    write_record(areas, 10, 2, 0, cpu=5000)  # a function tracer's: no CPU number there
    write_record(areas, 10, 1, 1)
    write_record(areas, 10, 1, 2, cpu=5000)
    write_record(areas, 10, 1, 3, tsc=1)
    write_record(areas, 10, 1, 4, tsc=CLOCK.read() + 10 * second)
    write_record(areas, 10, 1, 5, cpu=os.sysconf("SC_NPROCESSORS_CONF") - 1)
    assert consumer.drain() == 3
    assert [int.from_bytes(bytes(r[16:24]), "little") for b in got for r in b.raw] == [1, 5, 0]
    assert consumer.corrupt == 3 and len(errors) == 1
    assert errors[0].startswith("impossible records of thread 10 of pid 1: 3 with a CPU number past the machine's")


def test_counts_the_time_does_not_allow_are_left_out() -> None:
    """The target writes its counters: a thread's count of more than HITS_PER_NS hits a
    nanosecond since the session began is left out of the sums, live and once folded, and said."""
    errors: list[str] = []
    consumer = Consumer(LAYOUT, lambda batches: None, lambda i: i < 3, errors.append)
    areas = make_areas()
    consumer.add(areas)
    for tid, hits in ((10, 7), (11, 1 << 62), (12, 5)):
        area = areas.assign(tid)
        area.cells[LAYOUT.counter(1, L.HITS) // 8] = hits
    assert consumer.counters(1) == (12, 0, 0)
    assert errors == [
        "impossible counts of thread 11 of pid 1: more than 4 a nanosecond since the session began (written by "
        "the program itself?), left out"
    ]
    areas.retire(11)
    areas.retire(12)
    consumer.drain()  # folded: thread 12's counts kept, thread 11's left out
    assert consumer.counters(1) == (12, 0, 0)


def test_a_sleeping_consumer_starts_draining_as_soon_as_rings_appear(monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing to drain the consumer sleeps long; rings that appear meanwhile wake it at
    once: a busy probe fills a small ring in milliseconds (it slept 50 ms, and the first
    records of a fast probe were lost)."""
    import threading

    from dynprobe.ringbuf import consumer as consumer_module

    monkeypatch.setattr(consumer_module, "IDLE_INTERVAL", 3600.0)
    got: list[RecordBatch] = []
    delivered = threading.Event()

    def deliver(batches: list[RecordBatch]) -> None:
        got.extend(batches)
        if batches:
            delivered.set()

    class Watched(threading.Event):
        """The consumer's wake-up event, telling when the consumer goes to sleep on it."""

        def __init__(self) -> None:
            super().__init__()
            self.slept = threading.Event()

        def wait(self, timeout: float | None = None) -> bool:
            self.slept.set()
            return super().wait(timeout)

    consumer = Consumer(LAYOUT, deliver, lambda i: i < 3, lambda message: None, interval=3600.0)
    consumer._wake = wake = Watched()
    consumer.start()
    try:
        assert wake.slept.wait(20), "the consumer never went to sleep"  # its first pass found nothing
        areas = make_areas()
        areas.assign(10)
        write_record(areas, 10, 1, 42)
        consumer.add(areas)
        assert delivered.wait(20), "the consumer slept on with records to drain"
        assert [(b.tid, len(b.raw)) for b in got] == [(10, 1)]
    finally:
        consumer.stop()


SMALL = st.integers(0, 3 * LAYOUT.ring_slots)  # plausible indexes, where bugs would hide


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32), SMALL | st.integers(0, 2**64 - 1), SMALL | st.integers(0, 2**64 - 1))
def test_random_area_contents_never_crash_the_consumer(seed: int, head: int, tail: int) -> None:
    junk = np.random.default_rng(seed).bytes(LAYOUT.size)
    errors: list[str] = []
    delivered: list[RecordBatch] = []
    consumer = Consumer(LAYOUT, delivered.extend, lambda i: i < 4, errors.append)
    areas = make_areas()
    consumer.add(areas)
    area = areas.assign(5)
    area.pool.view[area.offset : area.offset + LAYOUT.size] = junk
    words = area.cells
    words[L.HEAD // 8], words[L.TAIL // 8] = head, tail
    consumer.drain()
    for batch in delivered:
        assert batch.probe_index < 4 and batch.raw.shape[1] == LAYOUT.record_size
        decode_string(batch, 16)
    if tail <= head <= tail + LAYOUT.ring_slots:  # a ring that makes sense: every record accounted for
        assert sum(len(b.raw) for b in delivered) + consumer.corrupt == head - tail
    else:  # refused whole, said once
        assert not delivered and consumer.corrupt == 1 and len(errors) == 1 and "corrupted ring" in errors[0]
    assert int(words[L.TAIL // 8]) == int(words[L.HEAD // 8])  # skipped or read: never read twice


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 50), max_size=40), max_size=4),
    st.lists(st.integers(0, 50), max_size=10),
    st.integers(1, 30),
)
def test_time_windows_cut_a_pass_in_order_and_lose_nothing(
    batch_times: list[list[int]], more: list[int], most: int
) -> None:
    """The windows follow each other from 0 to no end; each record falls in exactly one; with
    distinct times a window holds at most `most` events (one time is never split)."""
    batches = [
        RecordBatch(0, 1, tid, np.arange(len(t), dtype=np.uint8).reshape(-1, 1), np.array(t, dtype=np.int64),
                    np.zeros(len(t)), np.zeros(len(t)), np.arange(len(t), dtype=np.uint64))
        for tid, t in enumerate(batch_times)
    ]  # fmt: skip
    windows = time_windows(batches, more, most)
    assert windows[0][0] is None and windows[-1][1] is None
    assert all(high == low for (_, high), (low, _) in itertools.pairwise(windows))
    for batch in batches:
        parts = [part for low, high in windows if (part := batch.within(low, high)) is not None]
        assert sorted(np.concatenate([p.order for p in parts] or [np.empty(0, np.uint64)]).tolist()) == list(
            range(len(batch.raw))
        )
    times = [t for ts in batch_times for t in ts] + more
    if len(set(times)) == len(times):
        for low, high in windows:
            assert len([t for t in times if (low is None or low <= t) and (high is None or t < high)]) <= most


def test_a_flight_recorder_s_records_after_a_failure_are_counted_not_delivered() -> None:
    """The output failed (a full disk): from then on a flight recorder's records are read (READ
    moves, never TAIL: the writer's) and counted as discarded, not delivered; the failure is
    told once, and a consumer told to place itself before it runs remembers where."""
    got: list[RecordBatch] = []
    told: list[int] = []
    consumer = Consumer(LAYOUT, got.extend, lambda i: i < 3, lambda message: None)
    consumer.flight = True
    consumer.place({0})
    assert consumer.cpus == {0}
    areas = make_areas()
    consumer.add(areas)
    area = areas.assign(10)
    for v in range(5):
        write_record(areas, 10, 1, v)
    consumer.fail("No space left on device")  # (no one to tell yet)
    consumer.on_failure = lambda: told.append(1)
    consumer.fail("again")
    assert consumer.failure == "No space left on device" and told == []
    consumer.drain()
    words = area.cells
    assert got == [] and consumer.discarded == 5
    assert (int(words[L.READ // 8]), int(words[L.TAIL // 8])) == (5, 0)
    del words, area  # (the memory is let go: no view of it may be left)
    consumer.forget(areas)
    consumer.forget(areas)  # (gone already: nothing more)
    assert consumer.processes == []
