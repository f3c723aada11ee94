"""The data path: the thread areas' layout, the consumer that drains their rings (in its own
thread), the time-stamp clock records are converted with, the counters and histograms the target
keeps, and the settings that decide what a full ring does (wait for room, or overwrite as a
flight recorder). The areas themselves are made by the optimizer's code (they need a stopped
thread and a slot); this module adopts them (`adopt`) and lets them go (`release`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import BinaryIO, Protocol

from dynprobe.actions.model import ActionKind, payload_size
from dynprobe.core.delivery import Delivery
from dynprobe.core.ftrace import Tracing
from dynprobe.core.probe import Probe
from dynprobe.core.processes import ProcessTable
from dynprobe.core.traced import TracedProcess
from dynprobe.errors import OptimizeRefusal, SessionError
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.areas import ThreadAreas
from dynprobe.ringbuf.consumer import Consumer, TscClock

COMM_REFRESH = 0.5  # seconds a thread's name is taken as known
DEFAULT_WAIT_FOR_ROOM = 10.0  # seconds (Session.wait_for_room): a reader that gets no CPU for that long
WAIT_SPIN_NS = 50_000  # of a wait for room, spent spinning before the writer sleeps (futex: ~5-50 us to wake)
MAX_WAIT_FOR_ROOM = 60.0
_DEFAULT_LAYOUT = L.AreaLayout()  # the limits before a session fixes its layout
FLIGHT_AND_THRESHOLD = (
    "a flight recorder keeps every call, the newest: not with a time threshold, which holds calls back until they end"
)
SNAPSHOT_WITHOUT_FLIGHT = "a snapshot threshold is a flight recorder's: set flight_recorder first"


class DataPathEngine(Protocol):
    """What the data path asks of the runtime (core/runtime.py)."""

    processes: ProcessTable
    tracing: Tracing
    delivery: Delivery
    probes: list[Probe]

    def warn(self, message: str) -> None: ...
    def request_stop(self) -> None: ...


class DataPath:
    """Thread areas, their consumer and clock, and what a full ring does."""

    def __init__(self, engine: DataPathEngine) -> None:
        self.engine = engine
        self.ring_bytes = L.DEFAULT_RING_BYTES
        self.record_size: int | None = None  # None: the smallest that holds every probe's record
        self.consumer: Consumer | None = None
        self._layout: L.AreaLayout | None = None
        self._wait_for_room = DEFAULT_WAIT_FOR_ROOM
        self._flight_recorder = False
        self._by_index: list[Probe | None] = []  # counters-and-records index -> its probe (None: a tracer's)
        self.hists = 0  # histogram indices given out
        self._comms: dict[tuple[int, int], tuple[str, float]] = {}  # (pid, tid) -> name, when read
        self.clock = TscClock()  # (calibrated at its first use, as the target starts meanwhile)

    # --- indices --------------------------------------------------------------------------------
    def next_index(self) -> int:
        return len(self._by_index)

    def register(self, probe: Probe | None) -> int:
        """A counters-and-records index for `probe` (None: something that is not a probe, a
        function tracer); a histogram's takes a histogram index too."""
        self._by_index.append(probe)
        if probe is not None and probe.action == ActionKind.HIST:
            self.hists += 1
        return len(self._by_index) - 1

    def probe_by_index(self, index: int) -> Probe | None:
        return self._by_index[index] if 0 <= index < len(self._by_index) else None

    def _known_index(self, index: int) -> bool:
        return 0 <= index < len(self._by_index) and (
            self._by_index[index] is not None or index in self.engine.tracing.tracers
        )

    # --- layout ---------------------------------------------------------------------------------
    @property
    def layout(self) -> L.AreaLayout:
        """The thread-area layout, fixed by the first call: ring size, and a record size that holds
        the record of every probe placed so far (later, bigger ones stay traps)."""
        if self._layout is None:
            problem = L.check_ring_bytes(self.ring_bytes)
            if problem is not None:
                raise SessionError(problem)
            need = max((_record_bytes(p) for p in self.engine.probes), default=0)
            size = self.record_size or L.record_size_for(need)
            if size & (size - 1) or not L.RECORD_HEADER <= size <= min(L.MAX_RECORD_SIZE, self.ring_bytes):
                raise SessionError(f"record size {size} is not a power of two from 16 to {L.MAX_RECORD_SIZE}")
            self._layout = L.AreaLayout(ring_bytes=self.ring_bytes, record_size=size)
        return self._layout

    def action_refusal(self, probe: Probe) -> OptimizeRefusal | None:
        """Why a probe's action cannot run in the target (it then runs at a stop). Asking does not
        fix the layout: until the first thread area exists, every record will fit."""
        limits = self._layout or _DEFAULT_LAYOUT
        if probe.index >= limits.max_probes or probe.hist_index >= limits.max_hists:
            return OptimizeRefusal.TOO_MANY_PROBES
        if self._layout is not None and L.RECORD_HEADER + _record_bytes(probe) > self._layout.record_size:
            return OptimizeRefusal.RECORD_TOO_LARGE
        return None

    def records(self) -> bool:
        """Whether anything of the session writes records (into the threads' rings)."""
        return bool(self.engine.tracing.tracers) or any(_record_bytes(p) for p in self.engine.probes)

    # --- areas ----------------------------------------------------------------------------------
    def adopt(self, areas: ThreadAreas) -> None:
        """New thread areas, read by the consumer and set as the session's rings are."""
        self.ensure_consumer().add(areas)
        areas.set_wait(*self._wait_ticks())
        areas.set_overwrite(self._flight_recorder)

    def release(self, proc: TracedProcess) -> None:
        """The process exited or exec'd: what its areas hold is drained and folded into totals."""
        areas = proc.areas
        if areas is None:
            return
        proc.areas = None
        if any(p.areas is areas for p in self.engine.processes):
            areas.retire(proc.pid)  # a vfork child that borrowed an area of its parent's pools
        elif self.consumer is not None:
            areas.publish_held()
            self.consumer.forget(areas)

    def end_waits(self, areas: ThreadAreas) -> None:
        """No thread waits for room in its ring any more: a pass of the reader makes room for
        those that wait now (stopped, they see it as they leave their detours), and no later
        record waits (nobody will read it)."""
        if self.consumer is not None:
            self.consumer.drain()
        areas.set_wait(0, 0)

    # --- the consumer ---------------------------------------------------------------------------
    def ensure_consumer(self) -> Consumer:
        if self.consumer is None:
            self.consumer = Consumer(
                self.layout, self.engine.delivery.deliver, self._known_index, self.engine.warn,
                without_cpu=lambda i: i in self.engine.tracing.tracers, clock=self.clock,
                in_use=lambda: (len(self._by_index), self.hists),
            )  # fmt: skip
            self.consumer.on_failure = self.engine.request_stop
            self.consumer.flight = self._flight_recorder
            processes = self.engine.processes
            if processes.started and not processes.closed:
                self.consumer.start()
        return self.consumer

    def stop_consumer(self) -> None:
        if self.consumer is not None:
            self.consumer.stop()
            for areas in list(self.consumer.processes):
                self.consumer.forget(areas)

    def write_raw(self, sink: BinaryIO, decode: bool = True) -> None:
        consumer = self.ensure_consumer()
        consumer.raw_sink = sink
        consumer.decode = decode

    def drain(self) -> None:
        if self.consumer is not None:
            self.consumer.drain()
        else:
            self.engine.delivery.deliver([])

    def counters(self, index: int) -> tuple[int, int, int]:
        """(hits, missed, lost) of a counters index, as the target's thread areas count them."""
        if self.consumer is None or index >= self.layout.max_probes:
            return 0, 0, 0
        return self.consumer.counters(index)

    def histogram_of(self, probe: Probe) -> list[int]:
        buckets = list(probe.trap_hist)
        if self.consumer is not None and probe.action == ActionKind.HIST and probe.hist_index < self.layout.max_hists:
            for i, n in enumerate(self.consumer.histogram(probe.hist_index)):
                buckets[i] += n
        return buckets

    def _consumer_count(self, read: Callable[[Consumer], int]) -> int:
        return read(self.consumer) if self.consumer is not None else 0

    @property
    def drained(self) -> int:
        return self._consumer_count(lambda c: c.drained)

    @property
    def discarded(self) -> int:
        return self._consumer_count(lambda c: c.discarded)

    @property
    def waited(self) -> int:
        return self._consumer_count(lambda c: c.waits())

    @property
    def snapshots_asked(self) -> int:
        return self._consumer_count(lambda c: c.snapshots_asked)

    @property
    def overwritten(self) -> int:
        return self.engine.delivery.gave_way + self._consumer_count(lambda c: c.overwritten)

    @property
    def failure(self) -> str | None:
        return self.consumer.failure if self.consumer is not None else None

    def request_snapshot(self) -> None:
        if self.consumer is not None:
            self.consumer.snapshot_due = True

    # --- what a full ring does ------------------------------------------------------------------
    @property
    def wait_for_room(self) -> float:
        return self._wait_for_room

    @wait_for_room.setter
    def wait_for_room(self, seconds: float) -> None:
        if not 0 <= seconds <= MAX_WAIT_FOR_ROOM:
            raise SessionError(f"wait_for_room {seconds} is out of range (0..{MAX_WAIT_FOR_ROOM} s)")
        self._wait_for_room = seconds
        ticks = self._wait_ticks()
        for proc in self.engine.processes:
            if proc.areas is not None:
                proc.areas.set_wait(*ticks)  # (a vfork child's are its parent's: set twice, the same)

    def _wait_ticks(self) -> tuple[int, int]:
        """How long a writer waits for room, and spins before it sleeps, in time-stamp ticks."""
        if not self._wait_for_room:
            return 0, 0
        wait = max(1, int(self._wait_for_room * 1e9 * (1 << 32) / self.clock.mult))
        if self._wait_for_room * 1e9 < 2 * L.SLEEP_NS:
            return wait, wait  # (a wait shorter than two sleeps: spun whole, never overslept)
        return wait, int(WAIT_SPIN_NS * (1 << 32) / self.clock.mult)

    @property
    def flight_recorder(self) -> bool:
        return self._flight_recorder

    @flight_recorder.setter
    def flight_recorder(self, on: bool) -> None:
        if on == self._flight_recorder:
            return
        if self.engine.processes.started:
            raise SessionError("flight_recorder is chosen before the session runs (its rings are read another way)")
        tracers = self.engine.tracing.tracers.values()
        if on and any(tracer.threshold_ns for tracer in tracers):
            raise SessionError(FLIGHT_AND_THRESHOLD)
        if not on and any(tracer.snapshot_over_ns for tracer in tracers):
            raise SessionError(SNAPSHOT_WITHOUT_FLIGHT)
        self._flight_recorder = on
        if self.consumer is not None:
            self.consumer.flight = on
        for proc in self.engine.processes:
            if proc.areas is not None:
                proc.areas.set_overwrite(on)

    # --- names ---------------------------------------------------------------------------------
    def comm_of(self, pid: int, tid: int, *, fresh: bool = False) -> str:
        """A thread's name; remembered, so events read after it ended still have it. Read
        again at most every COMM_REFRESH seconds (a thread may rename itself; reading
        /proc at every drain cost more than the records of a trap probe's hits), or now if
        `fresh` (a thread given an area: after an exec, the name is the new program's)."""
        now = time.monotonic()
        known = self._comms.get((pid, tid))
        if known is not None and now - known[1] < COMM_REFRESH and not fresh:
            return known[0]
        proc = self.engine.processes.process(pid)
        if proc is not None and tid in proc.tracee.threads:
            name = proc.tracee.comm(tid)
            if name != "<...>":
                self._comms[pid, tid] = (name, now)
                return name
        return known[0] if known is not None else "<...>"

    def thread_names(self) -> dict[int, str]:
        return {tid: name for (_, tid), (name, _) in self._comms.items()}


def _record_bytes(probe: Probe) -> int:
    """The payload of the largest record the probe writes (0: it writes none)."""
    if probe.lang is not None:
        return probe.lang.record_bytes
    return payload_size(probe.fields) if probe.action == ActionKind.RECORD else 0
