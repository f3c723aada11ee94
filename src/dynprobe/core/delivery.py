"""Delivery: the records the consumer drains and the events served at stops, handed to the
probes' `on_event` handlers (and to the function tracers'), oldest first, a window of time at a
time; a BatchHandler gets a window's events at once, as columns. Runs in the consumer's thread,
or in the caller's (`Session.drain`)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

from dynprobe.core.ftrace import Tracing
from dynprobe.core.probe import BatchHandler, EventColumns, Probe, ProbeEvent
from dynprobe.core.stacks import Stack
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.consumer import HELD_RINGS, RecordBatch, decode_fields, decode_string, time_windows
from dynprobe.spec.fetch import FAULT, StringValue, Value
from dynprobe.spec.model import Comm

DELIVERED_AT_ONCE = 1 << 12  # events made into objects at a time (see `deliver`)


class DeliveryEngine(Protocol):
    """What delivery asks of the engine."""

    tracing: Tracing

    @property
    def flight_recorder(self) -> bool: ...
    @property
    def layout(self) -> L.AreaLayout: ...
    def probe_by_index(self, index: int) -> Probe | None: ...
    def comm_of(self, pid: int, tid: int) -> str: ...
    def symbolizer(self, pid: int) -> Callable[[int], str | None]: ...
    def stack_at(self, pid: int, address: int) -> Stack | None: ...
    def warn(self, message: str) -> None: ...


class Delivery:
    def __init__(self, engine: DeliveryEngine) -> None:
        self.engine = engine
        # Events served at stops, till delivered; a flight recorder's, the newest HELD_RINGS rings'
        # worth (a bounded deque once the layout is fixed), the older counted as given way.
        self._served: deque[ProbeEvent] = deque()
        self.gave_way = 0
        self._lock = threading.Lock()

    def keep(self, event: ProbeEvent) -> None:
        """An event served at a stop (core/traps.py), till the next delivery."""
        with self._lock:
            if self.engine.flight_recorder and self._served.maxlen is None:
                self._served = deque(self._served, maxlen=HELD_RINGS * self.engine.layout.ring_slots)
            if len(self._served) == self._served.maxlen:
                self.gave_way += 1
            self._served.append(event)

    def deliver(self, batches: list[RecordBatch]) -> None:
        """Hand record batches (and events served at stops) to the probes' handlers, oldest
        first, a window of time at a time (`time_windows`: the events of a full ring are made
        into objects a part at a time)."""
        with self._lock:
            events = list(self._served)
            self._served.clear()
        for low, high in time_windows(batches, [e.time_ns for e in events], DELIVERED_AT_ONCE):
            self._deliver_window(
                [part for batch in batches if (part := batch.within(low, high)) is not None],
                [e for e in events if (low is None or e.time_ns >= low) and (high is None or e.time_ns < high)],
            )

    def _deliver_window(self, batches: list[RecordBatch], events: list[ProbeEvent]) -> None:
        """A BatchHandler gets the window's events at once, as columns, other handlers one event
        object at a time; a bpftrace program its probes' records, as they are."""
        columns: dict[BatchHandler, list[EventColumns]] = {}
        programs: dict[Callable[[list[RecordBatch]], None], list[RecordBatch]] = {}
        for event in events:
            if isinstance(event.probe.on_event, BatchHandler):
                columns.setdefault(event.probe.on_event, []).append(EventColumns.of(event))
        events = [e for e in events if not isinstance(e.probe.on_event, BatchHandler)]
        for batch in batches:
            tracer = self.engine.tracing.tracers.get(batch.probe_index)
            if tracer is not None:
                self.engine.tracing.deliver(tracer, batch)
                continue
            probe = self.engine.probe_by_index(batch.probe_index)
            if probe is not None and probe.lang is not None:
                programs.setdefault(probe.lang.on_records, []).append(batch)
                continue
            if probe is None or probe.on_event is None:
                continue
            decoded = self._columns_of(probe, batch)
            if isinstance(probe.on_event, BatchHandler):
                columns.setdefault(probe.on_event, []).append(decoded)
            else:
                events.extend(decoded.events())
        for handler, taken in columns.items():
            self._call_handler(taken[0].probe, lambda: handler.on_batches(taken))  # noqa: B023
        for on_records, records in programs.items():
            on_records(records)
        events.sort(key=lambda e: (e.time_ns, e.order))
        for event in events:
            on_event = event.probe.on_event
            assert on_event is not None
            self._call_handler(event.probe, lambda: on_event(event))  # noqa: B023

    def _call_handler(self, probe: Probe, call: Callable[[], object]) -> None:
        try:
            call()
        except Exception as exc:  # a callback's bug must not stop the consumer
            self.engine.warn(f"{probe.name}: on_event raised {type(exc).__name__}: {exc}")

    def _columns_of(self, probe: Probe, batch: RecordBatch) -> EventColumns:
        ints = [(i, f.offset, f.arg.type.kind, f.arg.type.bits) for i, f in enumerate(probe.fields)
                if f.in_record and not f.arg.type.is_string]  # fmt: skip
        decoded = decode_fields(batch, ints)
        comm = self.engine.comm_of(batch.pid, batch.tid)
        faults = batch.faults.tolist() if batch.faults.any() else None
        values: list[list[Value]] = []
        for i, f in enumerate(probe.fields):
            column: list[Value]
            if isinstance(f.arg.fetch, Comm):
                column = [StringValue(comm)] * len(batch.raw)
            elif f.arg.type.is_string:
                column = [StringValue(data.decode("utf-8", "replace"), truncated)
                          for data, truncated in decode_string(batch, f.offset)]  # fmt: skip
            else:
                column = decoded[i].tolist()
            if faults is not None:
                column = [FAULT if fault >> i & 1 else v for v, fault in zip(column, faults, strict=True)]
            values.append(column)
        callers = stacks = None
        if probe.is_return:  # the caller is the first field of a return probe's records
            callers = [v if isinstance(v, int) else None for v in values.pop(0)]
        if probe.stack_frames:  # and the stack's slot the last of a by="stack" probe's
            slots = values.pop()
            named = {v: self.engine.stack_at(batch.pid, v) for v in set(slots) if isinstance(v, int)}
            stacks = [named.get(v) if isinstance(v, int) else None for v in slots]  # (a slot looked up once a batch)
        return EventColumns(
            probe, batch.pid, batch.tid, comm, probe.sites.get(batch.pid, 0), self.engine.symbolizer(batch.pid),
            batch.time_ns.tolist(), batch.cpu.tolist(), values, callers, batch.order.tolist(), stacks,
        )  # fmt: skip
