"""The consumer: drains the rings of every thread area, decodes records in bulk, sums counters.

It runs in a thread of the tracer (it only reads shared memory; ptrace stays with the session's
thread), calls `deliver` with the decoded events of each drain, oldest first per thread. The
target is untrusted: every index read from shared memory is checked before use; a ring whose
head and tail make no sense is reported once and skipped, never read out of bounds.

Time: records carry the time-stamp counter; `TscClock` converts it to CLOCK_MONOTONIC
nanoseconds from pairs of (counter, clock) readings the consumer takes itself.

One concept in one module (its length: the flight recorder's snapshots and the checks of
untrusted shared memory belong to the reading side).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import mmap
import os
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, BinaryIO

from dynprobe.arch.x86_64.codegen.clock import read_tsc_code, tsc_readings_code
from dynprobe.frozen import frozen
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.areas import AreaRef, ThreadAreas
from dynprobe.threads import place, start_without_signals

if TYPE_CHECKING:
    import numpy as np
else:
    from dynprobe.deferred import numpy as np

_READINGS_AT = 64  # where tsc_readings_code goes in the clock's page, after read_tsc_code
_READINGS = 4096
FIRST_CALIBRATION = 0.005  # s
_TSC_MASK = 0x7FFF_FFFF_FFFF_FFFF
# What the target cannot have written honestly (it can write its rings and counters): a time
# stamp L.MARGIN_NS or more outside the session, a CPU number past the machine's, a count that
# grew faster than HITS_PER_NS a nanosecond (a hit runs several instructions, and its counter
# is an add that depends on the last).
HITS_PER_NS = 4
CPUS = os.sysconf("SC_NPROCESSORS_CONF")  # CPU numbers are below it


class TscClock:
    """Time-stamp counter -> CLOCK_MONOTONIC ns, calibrated against clock_gettime here: first
    over at least FIRST_CALIBRATION from when it was made (made as a session begins, the
    target's start overlaps it: it is waited out only if it has not passed at the first use),
    then again from that start at every `recalibrate`."""

    def __init__(self) -> None:
        self._page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        self._page.write(read_tsc_code())
        self._page.seek(_READINGS_AT)
        self._page.write(tsc_readings_code())
        address = ctypes.addressof(ctypes.c_char.from_buffer(self._page))
        self.read = ctypes.CFUNCTYPE(ctypes.c_uint64)(address)
        self._readings = ctypes.CFUNCTYPE(None, ctypes.c_uint64, ctypes.c_void_p)(address + _READINGS_AT)
        self._tsc0, self._ns0 = self._pair()
        self._scale = 0.0  # ns a tick: 0 until the first calibration (`scale`)

    @property
    def scale(self) -> float:
        if not self._scale:
            time.sleep(max(0.0, FIRST_CALIBRATION - (time.monotonic_ns() - self._ns0) / 1e9))
            self.recalibrate()
            if not self._scale:  # (a counter that did not move on: no calibration to be had yet)
                self._scale = 1.0
        return self._scale

    @functools.cached_property
    def tick_ns(self) -> float:
        """How far apart, in ns, two readings of the counter back to back typically are (the
        median step): what the clock can tell apart. Some CPUs count in steps (AMD's Zen adds ~25
        to the counter every 10 ns, a 100 MHz clock times the P0 frequency's ratio): two time
        stamps around a call shorter than a step may be equal. Elsewhere a step is a reading's
        own time: no two are equal."""
        readings = array("Q", bytes(8 * _READINGS))
        self._readings(_READINGS, readings.buffer_info()[0])
        steps = [later - earlier for earlier, later in itertools.pairwise(readings) if later > earlier]
        return sorted(steps)[len(steps) // 2] * self.scale if steps else 0.0

    def _pair(self) -> tuple[int, int]:
        """A (tsc, monotonic ns) reading: the tightest of a few tries."""
        best = None
        for _ in range(5):
            a = self.read()
            ns = time.monotonic_ns()
            b = self.read()
            if best is None or b - a < best[0]:
                best = (b - a, (a + b) // 2, ns)
        assert best is not None
        return best[1], best[2]

    def recalibrate(self) -> None:
        tsc, ns = self._pair()
        if tsc > self._tsc0 and ns > self._ns0:
            self._scale = (ns - self._ns0) / (tsc - self._tsc0)

    def params(self) -> dict[str, float]:
        """ns = (tsc - tsc0) * scale + ns0, as `to_ns` computes it; tsc_now: the counter now
        (no record of the session can be later)."""
        return {"tsc0": self._tsc0 & _TSC_MASK, "ns0": self._ns0, "scale": self.scale, "tsc_now": self.read()}

    def plausible(self, tsc: np.ndarray) -> np.ndarray:
        """Which time stamps can be the session's: from its start to now, L.MARGIN_NS either way."""
        margin = int(L.MARGIN_NS / self.scale)
        return (tsc >= np.uint64(max(0, (self._tsc0 & _TSC_MASK) - margin))) & (tsc <= np.uint64(self.read() + margin))

    @property
    def mult(self) -> int:
        """ns = ticks * mult >> 32 (for code in the target, which has no floating point)."""
        return round(self.scale * (1 << 32))

    def ticks_to_ns(self, ticks: int) -> int:
        return round(ticks * self.scale)

    def to_ns(self, tsc: np.ndarray) -> np.ndarray:
        delta = tsc.astype(np.int64) - np.int64(self._tsc0 & _TSC_MASK)
        return (delta * self.scale).astype(np.int64) + self._ns0


@functools.cache
def _header_dtype(record_size: int) -> np.dtype[Any]:
    """A record's header fields (ringbuf/layout.py), the rest of the record left as bytes."""
    fields = [("probe", "<u2"), ("cpu", "<u2"), ("faults", "<u4"), ("tsc", "<u8")]
    if record_size > L.RECORD_HEADER:
        fields.append(("rest", f"V{record_size - L.RECORD_HEADER}"))
    return np.dtype(fields)


def _chunk_header(pid: int, tid: int, count: int) -> bytes:
    return np.array([pid | tid << 32, count], dtype=np.uint64).tobytes()


class RingCorrupted(Exception):
    pass


def _unread(words: memoryview, lay: L.AreaLayout) -> tuple[int, int, int]:
    """(first slot, count, head) of the records not read yet; checked against the ring's size."""
    head = int(words[L.HEAD // 8])
    tail = int(words[L.TAIL // 8])
    slots = lay.ring_slots
    if not tail <= head <= tail + slots:
        raise RingCorrupted(f"head {head} and tail {tail} of a ring of {slots} records")
    return tail % slots, head - tail, head


def _ring(view: memoryview, offset: int, lay: L.AreaLayout) -> np.ndarray:
    ring = np.frombuffer(view, dtype=np.uint8, count=lay.ring_bytes, offset=offset + lay.ring)
    return ring.reshape(lay.ring_slots, lay.record_size)


def take_records(words: memoryview, view: memoryview, offset: int, lay: L.AreaLayout) -> np.ndarray:
    """Copy the unread records of one area out of its ring and mark them read.

    `words`: the area as u64s (AreaRef.cells); `view`: the same bytes. Returns an (n, record_size) u8 array."""
    first, n, head = _unread(words, lay)
    out = _copied(view, offset, lay, first, n)
    words[L.TAIL // 8] = head
    return out


def _copied(view: memoryview, offset: int, lay: L.AreaLayout, first: int, n: int) -> np.ndarray:
    """`n` records of a ring from slot `first` (wrapped at its end), copied out."""
    records = _ring(view, offset, lay)
    if first + n <= lay.ring_slots:
        return records[first : first + n].copy()
    return np.concatenate((records[first:], records[: first + n - lay.ring_slots]))


def snapshot_records(words: memoryview, view: memoryview, offset: int, lay: L.AreaLayout) -> tuple[np.ndarray, int]:
    """A flight recorder's records not read yet (layout.OVERWRITE; the caller pauses the writer):
    copied, then only those the writer did not give up meanwhile kept (from the TAIL after the
    copy: x86 orders the writer's TAIL before its record, and our copy before our reading of
    TAIL); READ marks them read. The writer alone moves TAIL. Returns an (n, record_size) u8
    array, and how many records since the last snapshot were written over unread."""
    head, tail, read = (int(words[w // 8]) for w in (L.HEAD, L.TAIL, L.READ))
    start = max(tail, read)
    if head <= start:  # (nothing since the last snapshot, or all given up: records held back past a ring)
        words[L.READ // 8] = max(head, read)
        return np.empty((0, lay.record_size), dtype=np.uint8), max(head - read, 0)
    if head > start + lay.ring_slots:
        raise RingCorrupted(f"head {head}, tail {tail} and read {read} of a ring of {lay.ring_slots} records")
    out = _copied(view, offset, lay, start % lay.ring_slots, head - start)
    n = len(out)
    given_up = min(max(int(words[L.TAIL // 8]) - start, 0), n)
    words[L.READ // 8] = head
    return out[given_up:], start - read + given_up


def spool_records(
    words: memoryview, view: memoryview, offset: int, lay: L.AreaLayout, sink: BinaryIO, header: Callable[[int], bytes]
) -> int:
    """Write the unread records of one area straight from the ring to `sink` (no copy in
    between), after `header(count)`; then mark them read. Returns how many."""
    first, n, head = _unread(words, lay)
    if n == 0:
        return 0
    sink.write(header(n))
    records = _ring(view, offset, lay)
    end = min(first + n, lay.ring_slots)
    sink.write(records[first:end].data)
    if first + n > lay.ring_slots:
        sink.write(records[: first + n - lay.ring_slots].data)
    words[L.TAIL // 8] = head
    return n


@frozen
class RecordBatch:
    """Records of one probe from one thread: the raw bytes and their decoded header columns.
    `order` numbers the records as the consumer read them (a thread's in the order it wrote
    them): two events of one thread stamped in the same tick of the clock keep their order."""

    probe_index: int
    pid: int
    tid: int
    raw: np.ndarray  # (n, record_size) u8
    time_ns: np.ndarray  # CLOCK_MONOTONIC
    cpu: np.ndarray
    faults: np.ndarray
    order: np.ndarray

    def within(self, low: int | None, high: int | None) -> RecordBatch | None:
        """The batch's records stamped in [low, high) (None: no bound); None if there are none."""
        if low is None and high is None:
            return self
        rows = np.ones(len(self.time_ns), dtype=bool)
        if low is not None:
            rows &= self.time_ns >= low
        if high is not None:
            rows &= self.time_ns < high
        if not rows.any():
            return None
        if rows.all():
            return self
        return RecordBatch(
            self.probe_index, self.pid, self.tid, self.raw[rows], self.time_ns[rows], self.cpu[rows],
            self.faults[rows], self.order[rows],
        )  # fmt: skip


Window = tuple[int | None, int | None]


def time_windows(batches: list[RecordBatch], more: list[int], most: int) -> list[Window]:
    """Windows of time [low, high) (None: no bound) that cut a pass's records (and events
    stamped at `more`) into parts of about `most` each, oldest first (records of one time stay
    together): delivered a part at a time, a full ring of a pass costs memory for `most`
    events, not for the ring. One window, unbounded, when all fit."""
    if sum(len(b.time_ns) for b in batches) + len(more) <= most:
        return [(None, None)]
    times = np.concatenate([b.time_ns for b in batches] + [np.array(more, dtype=np.int64)])
    bounds: list[int | None] = [*np.unique(np.sort(times)[most::most]).tolist()]
    return list(zip([None, *bounds], [*bounds, None], strict=True))


IDLE_INTERVAL = 0.05  # seconds between passes while no thread has an area
BUSY_SHARE = 8  # a ring this share full (or more) in one pass is drained again at once
MAX_WAIT = 0.05  # seconds between passes at most while threads have areas
# Seconds between looks at a flight recorder's SNAPSHOT_DUE words: a thread that asked has its
# ring paused, and waits once it is full, until the snapshot.
ASK_INTERVAL = 0.005
HELD_RINGS = 4  # a flight recorder keeps at most this many rings' worth of its ended threads' records


class _Table:
    """A table of a thread area (its counters, or its histograms: `width` u64s a row, from word
    `start`), summed over ended threads. Rows are read where they are given out only, a row at a
    time as lists: most of a table is never used."""

    def __init__(self, start: int, width: int, rows: int) -> None:
        self.start = start
        self.width = width
        self.rows = rows  # in the layout (past them: another table, or the ring)
        self.sums: list[int] = []

    def row_of(self, cells: memoryview, index: int) -> list[int]:
        at = self.start + index * self.width
        row: list[int] = cells[at : at + self.width].tolist()
        return row

    def row(self, index: int) -> list[int]:
        found = self.sums[index * self.width : (index + 1) * self.width]
        return found or [0] * self.width

    def add(self, cells: memoryview, rows: int, most: int) -> bool:
        """The first `rows` of an area's table added, but for a row holding a count over `most`
        (False: there was one)."""
        width = self.width
        block: list[int] = cells[self.start : self.start + min(rows, self.rows) * width].tolist()
        possible = not block or max(block) <= most
        if not possible:
            for at in range(0, len(block), width):
                if max(block[at : at + width]) > most:
                    block[at : at + width] = [0] * width
        if len(self.sums) < len(block):
            self.sums.extend([0] * (len(block) - len(self.sums)))
        self.sums[: len(block)] = [a + b for a, b in zip(self.sums, block, strict=False)]
        return possible


class Consumer:
    """Drains the areas of every process; `deliver(batches)` gets what each pass found."""

    def __init__(
        self,
        layout: L.AreaLayout,
        deliver: Callable[[list[RecordBatch]], None],
        known_probe: Callable[[int], bool],
        on_error: Callable[[str], None],
        interval: float = 0.005,
        *,
        without_cpu: Callable[[int], bool] = lambda index: False,
        clock: TscClock | None = None,
        in_use: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        self.layout = layout
        self.deliver = deliver
        self.known_probe = known_probe
        # Indexes whose records hold something else where a probe's hold the CPU number (the
        # function tracer's: the entry or exit, and the call's frame)
        self.without_cpu = without_cpu
        self.on_error = on_error
        self.interval = interval
        self.fullest = 0  # the most records one area had in the last pass
        self.last_pass = 0.0  # when the last pass began (time.monotonic)
        self.wait = interval  # before the next pass (`_pace`)
        # Where the consumer may run: all the CPUs the tracer may use, even when it is started
        # by a tracer thread pinned next to the target (it must not share that CPU).
        self.cpus = os.sched_getaffinity(0)
        self.clock = clock or TscClock()
        self.processes: list[ThreadAreas] = []
        # How many counters and histogram indices are given out: the rows of a thread's tables
        # read (past them, only what the program itself wrote)
        self.in_use = in_use or (lambda: (layout.max_probes, layout.max_hists))
        # The counters and histograms of ended threads, summed: a row of each table's after another
        self.folded = _Table(layout.counters // 8, L.PROBE_COUNTERS, layout.max_probes)
        self.folded_hists = _Table(layout.hists // 8, L.HIST_BUCKETS, layout.max_hists)
        self.corrupt = 0  # records or rings rejected
        self.folded_waits = 0  # WAITS of the areas of ended threads
        self.records_read = 0  # numbers the next record read (RecordBatch.order)
        self.started = time.monotonic()
        self.drained = 0
        # Raw output: every drained chunk as (u32 pid, u32 tid, u64 count) + the records, as is.
        self.raw_sink: BinaryIO | None = None
        self.failure: str | None = None  # why records can no longer be written (see `fail`)
        self.on_failure: Callable[[], object] | None = None
        self.discarded = 0  # records drained after a failure, not delivered
        self.decode = True  # False: raw output only, no per-probe batches (fastest drain)
        # A flight recorder's rings (layout.OVERWRITE) are read only when a snapshot is asked for
        # (`snapshot_due`, which a signal handler may set) and at the end.
        self.flight = False
        self.snapshot_due = False
        self.snapshot_asks = False  # threads may ask for a snapshot (layout.SNAPSHOT_DUE)
        self.snapshots_asked = 0  # asks of threads (one snapshot may answer several)
        self.overwritten = 0  # a flight recorder's records written over before they were read
        self.held: deque[tuple[int, int, np.ndarray]] = deque()  # (pid, tid, records) of ended threads
        self._lock = threading.RLock()  # one pass at a time (the thread, or a final drain)
        self._stop = threading.Event()
        self._wake = threading.Event()  # a pass now: stopping, or rings appeared
        self._thread: threading.Thread | None = None
        self._reported: set[str] = set()

    # --- lifecycle ---
    def start(self) -> None:
        if self._thread is None:
            self._thread = start_without_signals(self._loop, "dynprobe-consumer")

    def place(self, cpus: set[int]) -> None:
        """Run on these CPUs (the session keeps the consumer off the target's CPU)."""
        self.cpus = cpus
        place(self._thread, cpus)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.drain()

    def _loop(self) -> None:
        os.sched_setaffinity(0, self.cpus)
        last_calibration = time.monotonic()
        woken = True
        while not self._stop.is_set():
            if self.flight:
                if self.snapshot_due or self._snapshot_asked():
                    self.snapshot_due = False
                    self.drain()
                else:
                    self._hold_ended()
            elif woken or time.monotonic() - self.last_pass >= self.wait:
                self.drain()  # (unless the tracing thread made one: `drain_if_due`)
            now = time.monotonic()
            if now - last_calibration > 1.0:
                self.clock.recalibrate()
                last_calibration = now
            woken = False
            if self.wait or self.flight:  # (a flight recorder's loop never drains at once again)
                # Rings that appear meanwhile wake it (`add`).
                woken = self._wake.wait(self._interval())
                self._wake.clear()

    def _interval(self) -> float:
        if not self.flight:
            return self.wait if self.processes else IDLE_INTERVAL
        return ASK_INTERVAL if self.snapshot_asks else IDLE_INTERVAL

    def _snapshot_asked(self) -> bool:
        """Whether a live thread asked for a snapshot (layout.SNAPSHOT_DUE); the asks are cleared
        and counted (those of threads that ended are `_hold_ended`'s)."""
        if not self.snapshot_asks:
            return False
        asked = 0
        with self._lock:  # (a process's pools close under it)
            for areas in list(self.processes):
                for _, area in areas.live():
                    asked += self._take_ask(area)
        self.snapshots_asked += asked
        return asked > 0

    @staticmethod
    def _take_ask(area: AreaRef) -> int:
        cells = area.cells
        asked = int(cells[L.SNAPSHOT_DUE // 8] != 0)
        cells[L.SNAPSHOT_DUE // 8] = 0
        return asked

    # --- draining ---
    def drain_if_due(self) -> None:
        """A pass, from the tracing thread while it serves trap hits, if none was made for an
        interval: those hits are served in that thread, and a pass made there costs it only the
        pass, where one in the consumer thread also costs it the GIL (waiting for it back after
        each wait for a stop: 20-50% more a hit while the consumer printed trap probes' events)."""
        if not self.flight and time.monotonic() - self.last_pass >= self.wait:
            self.drain()

    def drain(self) -> int:
        """One pass over every area; returns how many records it delivered. Sets the wait
        before the next (see `_pace`)."""
        with self._lock:
            now = time.monotonic()
            since, self.last_pass = now - self.last_pass, now
            before = self.drained
            self.fullest = 0
            batches: list[RecordBatch] = []
            if self.flight:
                self._hold_ended()
                while self.held:
                    batches += self._records(*self.held.popleft())
            for areas in list(self.processes):
                for tid, area in areas.live():
                    batches += self._drain_area(areas, tid, area)
                with areas.lock:
                    retired, areas.retired = areas.retired, []
                for tid, area in retired:
                    batches += self._drain_area(areas, tid, area)
                    self._fold(areas, tid, area)
                    areas.recycle(area)
            self.deliver(batches)  # also when empty: events served at stops wait there
            self.drained += sum(len(b.raw) for b in batches)
            self._pace(since)
            return self.drained - before

    def _pace(self, since: float) -> None:
        """The wait before the next pass: as long as the fullest ring of this pass, filling
        as fast as it did since the last, takes to fill a BUSY_SHARE of itself, from
        `interval` to MAX_WAIT; none when it filled that share already. A pass costs as much
        for a record as for a thousand (and the tracing thread the GIL, which serves trap
        probes' hits): a slow trickle is drained in batches."""
        share = self.layout.ring_slots / BUSY_SHARE
        if self.fullest >= share:
            self.wait = 0.0
        elif not self.fullest:
            self.wait = min(MAX_WAIT, max(self.wait * 2, self.interval))
        else:
            self.wait = min(MAX_WAIT, max(self.interval, share / (self.fullest / max(since, 1e-6))))

    def _drain_area(self, areas: ThreadAreas, tid: int, area: AreaRef) -> list[RecordBatch]:
        try:
            return self._take_area(areas, tid, area)
        finally:
            area.wake_writer()  # (it waited for the room made, or for a snapshot's copy to end)

    def _take_area(self, areas: ThreadAreas, tid: int, area: AreaRef) -> list[RecordBatch]:
        lay = self.layout
        words = area.cells
        try:
            if self.failure is not None:
                return self._discard(words)
            if self.raw_sink is not None and not self.decode and not self.flight:
                self._spool_area(areas, tid, area)
                return []
            if self.flight:
                words[L.OVERWRITE // 8] = 0  # paused while copied (layout.OVERWRITE)
                try:
                    records = self._snapshot(words, area)
                finally:
                    words[L.OVERWRITE // 8] = 1
            elif words[L.HEAD // 8] == words[L.TAIL // 8]:
                return []  # (nothing new: an idle thread's ring, or a session of counters alone)
            else:
                records = take_records(words, memoryview(area.pool.view), area.offset, lay)
        except (RingCorrupted, ValueError) as exc:
            self._corrupted(areas.pid, tid, words, exc)
            return []
        except OSError as exc:  # spooling the raw output: a full disk, a file system gone read-only
            self.fail(exc.strerror or str(exc))
            return self._discard(words)
        return self._records(areas.pid, tid, records)

    def _snapshot(self, words: memoryview, area: AreaRef) -> np.ndarray:
        records, gave_way = snapshot_records(words, memoryview(area.pool.view), area.offset, self.layout)
        self.overwritten += gave_way
        return records

    def _hold_ended(self) -> None:
        """A flight recorder's ended threads: what their rings held is kept for the next
        snapshot (the newest HELD_RINGS rings' worth of them all; older records count as given
        way) and their areas go back to their pools, however many threads the program makes."""
        with self._lock:
            for areas in list(self.processes):
                with areas.lock:
                    retired, areas.retired = areas.retired, []
                for tid, area in retired:
                    words = area.cells
                    if self.snapshot_asks and self._take_ask(area):  # (a thread that asked, then ended)
                        self.snapshots_asked += 1
                        self.snapshot_due = True
                    try:
                        self.held.append((areas.pid, tid, self._snapshot(words, area)))
                    except RingCorrupted as exc:
                        self._corrupted(areas.pid, tid, words, exc)
                    self._fold(areas, tid, area)
                    areas.recycle(area)
            held = sum(len(records) for *_, records in self.held)
            while held > HELD_RINGS * self.layout.ring_slots:
                *_, oldest = self.held.popleft()
                held -= len(oldest)
                self.overwritten += len(oldest)

    def _records(self, pid: int, tid: int, records: np.ndarray) -> list[RecordBatch]:
        """Records read from a thread's ring: written out raw (if asked), then decoded."""
        lay = self.layout
        if self.failure is not None:
            self.discarded += len(records)
            return []
        try:
            if len(records) and self.raw_sink is not None:
                self.raw_sink.write(_chunk_header(pid, tid, len(records)))
                records.tofile(self.raw_sink)
        except OSError as exc:  # writing the raw output: a full disk, a file system gone read-only
            self.fail(exc.strerror or str(exc))
            self.discarded += len(records)
            return []
        if not self.decode:  # (a flight recorder's raw output: copied first, then written)
            self.drained += len(records)
            return []
        if not len(records):
            return []
        self.fullest = max(self.fullest, len(records))
        header = records.view(_header_dtype(lay.record_size))[:, 0]
        # (A function tracer's data records hold values where the time stamp goes: a probe's
        # record with that bit in its CPU number is impossible anyway.)
        plausible = self.clock.plausible(header["tsc"]) | (header["cpu"] & L.TRACE_DATA != 0)
        possible = plausible & self._cpu_possible(header)
        if not possible.all():
            bad = int(np.count_nonzero(~possible))
            self.corrupt += bad
            self._error(
                f"impossible records of thread {tid} of pid {pid}: {bad} with a CPU number past the "
                "machine's or a time outside the session (written by the program itself?), left out"
            )
            records, header = records[possible], header[possible]
            if not len(records):
                return []
        probe, cpu, faults = header["probe"], header["cpu"], header["faults"]
        times = self.clock.to_ns(header["tsc"])
        order = np.arange(self.records_read, self.records_read + len(records), dtype=np.uint64)
        self.records_read += len(records)
        first = int(probe[0])
        if probe.max() == probe.min() and self.known_probe(first):  # (a thread's records: often one probe's)
            return [RecordBatch(first, pid, tid, records, times, cpu, faults, order)]
        out = []
        for index in np.unique(probe):
            if not self.known_probe(int(index)):
                bad = int(np.count_nonzero(probe == index))
                self.corrupt += bad
                self._error(f"thread {tid} of pid {pid}: {bad} record(s) of unknown probe {int(index)}")
                continue
            rows = probe == index
            out.append(
                RecordBatch(int(index), pid, tid, records[rows], times[rows], cpu[rows], faults[rows], order[rows])
            )
        return out

    def _cpu_possible(self, header: np.ndarray) -> np.ndarray | bool:
        """Which records have a CPU number below the machine's count, or no CPU number."""
        probe = header["probe"]
        if probe.max() == probe.min() and self.without_cpu(int(probe[0])):  # (a thread's records: often one's)
            return True
        possible: np.ndarray = header["cpu"] < CPUS
        if not possible.all():
            others = [i for i in np.unique(probe[~possible]).tolist() if self.without_cpu(i)]
            possible |= np.isin(probe, others)
        return possible

    def fail(self, why: str) -> None:
        """What was drained can no longer be written (`why`): from now on records are drained
        and counted (`discarded`), not delivered; `on_failure` is told once."""
        if self.failure is None:
            self.failure = why
            if self.on_failure is not None:
                self.on_failure()

    def _discard(self, words: memoryview) -> list[RecordBatch]:
        if self.flight:  # (a flight recorder's records are those past TAIL and READ)
            start = max(int(words[L.TAIL // 8]), int(words[L.READ // 8]))
            n = min(max(int(words[L.HEAD // 8]) - start, 0), self.layout.ring_slots)
        else:
            try:
                n = _unread(words, self.layout)[1]
            except RingCorrupted:
                n = 0
        self._mark_read(words)
        self.discarded += n
        return []

    def _corrupted(self, pid: int, tid: int, words: memoryview, exc: Exception) -> None:
        self._error(f"thread {tid} of pid {pid}: corrupted ring ({exc}); its records are skipped")
        self._mark_read(words)
        self.corrupt += 1

    def _mark_read(self, words: memoryview) -> None:
        """Whatever the ring holds is read (a flight recorder's: READ; TAIL is its writer's)."""
        words[(L.READ if self.flight else L.TAIL) // 8] = words[L.HEAD // 8]

    def _spool_area(self, areas: ThreadAreas, tid: int, area: AreaRef) -> None:
        """Raw output only: the records go from the ring to the file; nothing is decoded."""
        assert self.raw_sink is not None
        view = memoryview(area.pool.view)
        spooled = spool_records(
            area.cells, view, area.offset, self.layout, self.raw_sink,
            lambda n: _chunk_header(areas.pid, tid, n),
        )  # fmt: skip
        self.drained += spooled
        self.fullest = max(self.fullest, spooled)

    def _fold(self, areas: ThreadAreas, tid: int, area: AreaRef) -> None:
        cells = area.cells
        most = self._most_counted()
        self.folded_waits += min(cells[L.WAITS // 8], most)
        for table, rows in zip((self.folded, self.folded_hists), self.in_use(), strict=True):
            if not table.add(cells, rows, most):
                self._impossible_counts(areas.pid, tid)

    def _most_counted(self) -> int:
        return int((time.monotonic() - self.started) * 1e9 * HITS_PER_NS)

    def _impossible_counts(self, pid: int, tid: int) -> None:
        self._error(f"impossible counts of thread {tid} of pid {pid}: more than {HITS_PER_NS} a nanosecond "
                    "since the session began (written by the program itself?), left out")  # fmt: skip

    def _error(self, message: str) -> None:
        key = message.split(":", 1)[0]
        if key not in self._reported:
            self._reported.add(key)
            self.on_error(message)

    # --- totals ---
    def _total(self, folded: _Table, index: int) -> list[int]:
        """Row `index` of a per-thread table, summed over every live area plus the folded rows
        of ended threads."""
        with self._lock:
            total = folded.row(index)
            most = self._most_counted()
            for areas in self.processes:
                for tid, area in areas.live():
                    row = folded.row_of(area.cells, index)
                    if max(row) > most:
                        self._impossible_counts(areas.pid, tid)
                        continue
                    total = [a + b for a, b in zip(total, row, strict=True)]
        return total

    def counters(self, probe_index: int) -> tuple[int, int, int]:
        """(hits, missed, lost) of a probe summed over every thread area, ended threads included."""
        total = self._total(self.folded, probe_index)
        return total[L.HITS], total[L.MISSED], total[L.LOST]

    def waits(self) -> int:
        """Records whose writer waited for room in a full ring, every thread area summed."""
        live = sum(area.cells[L.WAITS // 8] for areas in list(self.processes) for _, area in areas.live())
        return self.folded_waits + min(live, self._most_counted())

    def histogram(self, hist_index: int) -> list[int]:
        return self._total(self.folded_hists, hist_index)

    def add(self, areas: ThreadAreas) -> None:
        """Drain a process's areas from now on (the first pass starts at once: a busy probe
        can fill a small ring in milliseconds)."""
        self.processes.append(areas)  # passes walk a copy of the list: no lock, no wait for one
        self._wake.set()

    def forget(self, areas: ThreadAreas) -> None:
        """A process is gone: drain and fold what its areas hold, then let go of the memory."""
        with self._lock:
            for tid in list(areas.by_tid):
                areas.retire(tid)
            self.drain()
            if areas in self.processes:
                self.processes.remove(areas)
            areas.close()


def decode_fields(batch: RecordBatch, fields: Iterable[tuple[int, int, str, int]]) -> dict[int, np.ndarray]:
    """Integer columns of a batch: for each (field number, offset, kind, bits), the values
    narrowed to the type (s: sign-extended, as int64; otherwise uint64)."""
    out: dict[int, np.ndarray] = {}
    for number, offset, kind, bits in fields:
        raw = batch.raw[:, offset : offset + 8].copy().view(np.uint64)[:, 0]
        if bits < 64:
            raw = raw & np.uint64((1 << bits) - 1)
        if kind == "s":
            shift = np.uint64(64 - bits)
            out[number] = ((raw << shift).view(np.int64)) >> np.int64(64 - bits)
        else:
            out[number] = raw
    return out


def decode_string(batch: RecordBatch, offset: int) -> list[tuple[bytes, bool]]:
    """(bytes, truncated) of a string field per record; a length past the capacity is clamped."""
    raw = batch.raw
    lengths = raw[:, offset : offset + 2].copy().view(np.uint16)[:, 0]
    flags = raw[:, offset + 2 : offset + 4].copy().view(np.uint16)[:, 0]
    data = raw[:, offset + 4 : offset + 4 + L.STRING_CAPACITY]
    out = []
    for i in range(len(raw)):
        n = min(int(lengths[i]), L.STRING_CAPACITY)
        out.append((bytes(data[i, :n]), bool(flags[i] & L.STRING_TRUNCATED) or int(lengths[i]) > L.STRING_CAPACITY))
    return out
