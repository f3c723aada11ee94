"""The timelines of `dump --chrome` and `dump --perfetto`: every event of every thread, exactly,
whether numpy laid it out or it went one at a time (a name longer than the table takes, a time
stamp unlike its neighbours': below 1 us, across a power of ten or of 128, negative)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as perfetto

from dynprobe.output import timeline
from dynprobe.tracefile import record_dtype, write_info
from dynprobe.traces import Trace

PID, TSC0 = 1, 2000
NAMES = ['say "hi"\\', "caf\u00e9\n", "x" * (timeline._WIDTHS[-1] + 1), "a" * 100, "main", "\ud800 lone"]
TIMES = [-1500, -1, 0, 7, 999, 1000, 9999, 10_000, 99_999_999, 100_000_000, 123_456_789_012, (1 << 49) - 1, 1 << 49]
# (thread, [(exit, function, ns)]) in the order of the file's chunks: a thread's go on in a later one
CHUNKS = [
    (7, [(i % 2, i % len(NAMES), t) for i, t in enumerate(TIMES[:9])]),
    (9, [(i % 2, (len(NAMES) - 1 - i) % len(NAMES), t) for i, t in enumerate(TIMES)]),
    (7, [(i % 2, i % len(NAMES), t) for i, t in enumerate(TIMES[9:])]),
]
THREADS = {7: "app", 9: "worker"}


@pytest.fixture
def trace(tmp_path: Path) -> Trace:
    with open(tmp_path / "events.raw", "wb") as f:
        for tid, events in CHUNKS:
            data = np.zeros(len(events), dtype=record_dtype(16))
            data["kind"] = [exit for exit, _, _ in events]
            data["func"] = [func for _, func, _ in events]
            data["tsc"] = [TSC0 + ns for _, _, ns in events]
            f.write(np.array([(PID | tid << 32, len(events))], dtype="<u8,<u8").tobytes() + data.tobytes())
    write_info(str(tmp_path), {"functions": [[n, "x", 0, 1] for n in NAMES], "record_size": 16, "pid": PID,
                               "clock": {"tsc0": TSC0, "ns0": 0, "scale": 1.0}, "command": ["/bin/app"],
                               "threads": {str(tid): name for tid, name in THREADS.items()}})  # fmt: skip
    return Trace(str(tmp_path))


@pytest.fixture(params=[timeline._ROWS, 5, 1], ids=["pieces", "small-pieces", "one-event-pieces"])
def rows(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timeline, "_ROWS", request.param)


@pytest.mark.usefixtures("rows")
def test_chrome_json_holds_every_event_as_written(trace: Trace, tmp_path: Path) -> None:
    """Time stamps exactly the ns as microseconds with 3 decimals; names JSON-escaped; the same
    written on a file (bytes) or a text stream; then the threads' and the process's names."""
    with open(tmp_path / "out.json", "w") as f:
        timeline.dump_chrome(trace, f)
    text = io.StringIO()
    timeline.dump_chrome(trace, text)
    written = (tmp_path / "out.json").read_text()
    assert written == text.getvalue()
    events = json.loads(written, parse_float=str)["traceEvents"]
    assert [(e["ph"], e["name"], e["ts"], e["pid"], e["tid"]) for e in events[:-3]] == [
        ("E" if exit else "B", NAMES[func], f"{'-' if ns < 0 else ''}{abs(ns) // 1000}.{abs(ns) % 1000:03}", PID, tid)
        for tid, chunk in CHUNKS
        for exit, func, ns in chunk
    ]
    assert events[-3:] == [
        {"name": "thread_name", "ph": "M", "pid": PID, "tid": 7, "args": {"name": "app"}},
        {"name": "thread_name", "ph": "M", "pid": PID, "tid": 9, "args": {"name": "worker"}},
        {"name": "process_name", "ph": "M", "pid": PID, "args": {"name": "app"}},
    ]


@pytest.mark.usefixtures("rows")
def test_perfetto_trace_holds_every_event_on_its_thread_s_track(trace: Trace) -> None:
    """Decoded with Perfetto's own schema: the process's track, a track per thread under it;
    each thread a packet sequence whose events go on its track by default, with the names it
    interned (UTF-8: a lone surrogate replaced); every entry a slice begin with its function's
    name, every exit a slice end, at its time in ns (a negative one as protobuf writes an int64
    in a uint64)."""
    out = io.BytesIO()
    timeline.dump_perfetto(trace, out)
    packets = perfetto.Trace.FromString(out.getvalue()).packet
    tracks = {p.track_descriptor.uuid: p.track_descriptor for p in packets if p.HasField("track_descriptor")}
    process = next(t for t in tracks.values() if t.HasField("process"))
    assert (process.process.pid, process.process.process_name) == (PID, "app")
    threads = {t.uuid: t.thread for t in tracks.values() if t.HasField("thread")}
    assert {(t.pid, t.tid, t.thread_name) for t in threads.values()} == {(PID, 7, "app"), (PID, 9, "worker")}
    assert all(tracks[uuid].parent_uuid == process.uuid for uuid in threads)
    track_of: dict[int, int] = {}  # sequence -> its events' track
    names: dict[int, dict[int, str]] = {}  # sequence -> iid -> name
    events = []
    for p in packets:
        if p.HasField("trace_packet_defaults"):
            assert p.sequence_flags == perfetto.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
            track_of[p.trusted_packet_sequence_id] = p.trace_packet_defaults.track_event_defaults.track_uuid
        if p.HasField("interned_data"):
            names.setdefault(p.trusted_packet_sequence_id, {}).update(
                (n.iid, n.name) for n in p.interned_data.event_names
            )
        if p.HasField("track_event"):
            sequence, event = p.trusted_packet_sequence_id, p.track_event
            assert p.sequence_flags == perfetto.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
            begin = event.type == perfetto.TrackEvent.TYPE_SLICE_BEGIN
            assert begin or event.type == perfetto.TrackEvent.TYPE_SLICE_END
            name = names[sequence][event.name_iid] if begin else None
            events.append((threads[track_of[sequence]].tid, begin, name, p.timestamp))
    assert len(track_of) == 2
    assert events == [
        (tid, not exit, None if exit else NAMES[func].encode("utf-8", "replace").decode(), ns % (1 << 64))
        for tid, chunk in CHUNKS
        for exit, func, ns in chunk
    ]


def test_a_trace_without_a_pid_is_written_with_pid_0(trace: Trace) -> None:
    """info.json's pid may be null (a trace file is untrusted, and checked): pid 0 is written."""
    trace.info["pid"] = None
    chrome = io.StringIO()
    timeline.dump_chrome(trace, chrome)
    assert {e["pid"] for e in json.loads(chrome.getvalue())["traceEvents"]} == {0}
    out = io.BytesIO()
    timeline.dump_perfetto(trace, out)
    packets = perfetto.Trace.FromString(out.getvalue()).packet
    assert {p.track_descriptor.thread.pid for p in packets if p.track_descriptor.HasField("thread")} == {0}
