"""Every entry and exit of a trace on a timeline, for the Perfetto UI: Chrome's Trace Event JSON
(`dump --chrome`) and Perfetto's own protobuf trace (`dump --perfetto`).

Both are one small record per event, and a trace holds millions: numpy lays them out a piece
at a time (`_Rows`). Each record is a head whose bytes numpy computes per event (the time stamp)
then a text chosen by the event's key (entry or exit, and function) from a table made once per
key; the rows of a matrix are cut to their lengths. Events numpy cannot lay out (a text longer
than the table takes, a time stamp of another shape than its neighbours') go one at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import BinaryIO, TextIO

import numpy as np

from dynprobe.output.callfilter import CallFilter
from dynprobe.output.callgraph import EXIT, batches
from dynprobe.tracefile import TraceFile

_ROWS = 1 << 14  # events laid out at a time: a matrix of their records
_WIDTHS = (32, 64, 128, 256, 1024)  # bytes of the texts' tables; a longer text (a C++ signature) goes one at a time
_DIGIT_PAIRS = np.frombuffer(b"".join(b"%02d" % i for i in range(100)), dtype=np.uint8).reshape(100, 2)
_POWERS_OF_TEN = 10 ** np.arange(1, 19, dtype=np.int64)


class _Rows:
    """The records of events, laid out by numpy: `head(tid, ns)`, a matrix of each event's
    first bytes (a row per event, all of a width), then `text(key)`, the rest of an event's
    record by its key (function * 2 + exit), from a table. `shape(ns)`: events of one shape
    (-1: not numpy's) share a head's width; `one(tid, key, ns)` writes an event numpy does not.
    `length_at`: the column of a byte that holds the length of the rest of the record (a
    protobuf message's, under 128)."""

    def __init__(
        self,
        functions: int,
        text: Callable[[int], bytes],
        head: Callable[[int, np.ndarray], np.ndarray],
        shape: Callable[[np.ndarray], np.ndarray],
        one: Callable[[int, int, int], bytes],
        *,
        length_at: int | None = None,
    ) -> None:
        self.text, self.head, self.shape, self.one, self.length_at = text, head, shape, one, length_at
        keys = 2 * max(functions, 1)
        self.width = np.zeros(keys, dtype=np.int64)  # key -> its table's width (0: none yet, -1: too long)
        self.row = np.zeros(keys, dtype=np.int64)  # key -> its row there
        self.length = np.zeros(keys, dtype=np.int64)  # key -> its text's length
        # Texts by width (a text in the narrowest that holds it): a long name widens only its own
        # table. Each grows by doubling; what it holds is what the keys seen need, at most twice.
        self.tables = {width: np.zeros((0, width), dtype=np.uint8) for width in _WIDTHS}
        self.used = dict.fromkeys(_WIDTHS, 0)

    def _cover(self, keys: np.ndarray) -> None:
        """Table rows for the keys without one (a text longer than the widest table: none)."""
        seen = np.zeros(len(self.width), dtype=bool)
        seen[keys] = True
        for key in np.flatnonzero(seen & (self.width == 0)).tolist():
            text = self.text(key)
            width = next((w for w in _WIDTHS if len(text) <= w), -1)
            self.width[key], self.length[key] = width, len(text)
            if width < 0:
                continue
            table, used = self.tables[width], self.used[width]
            if used == len(table):
                table = self.tables[width] = np.concatenate((table, np.zeros((max(used, 16), width), np.uint8)))
            table[used, : len(text)] = np.frombuffer(text, dtype=np.uint8)
            self.row[key], self.used[width] = used, used + 1

    def records(self, tid: int, kind: np.ndarray, func: np.ndarray, time_ns: np.ndarray) -> Iterator[memoryview]:
        """The records of these events of thread `tid`, in pieces, in order."""
        for at in range(0, len(kind), _ROWS):
            keys = func[at : at + _ROWS].astype(np.int64) * 2 + (kind[at : at + _ROWS] == EXIT)
            ns = time_ns[at : at + _ROWS].astype(np.int64)
            self._cover(keys)
            shape = np.where(self.width[keys] > 0, self.shape(ns), -1)
            edges = np.flatnonzero(shape[1:] != shape[:-1]) + 1
            for lo, hi in zip([0, *edges.tolist()], [*edges.tolist(), len(keys)], strict=True):
                if shape[lo] >= 0:
                    yield self._matrix(tid, keys[lo:hi], ns[lo:hi])
                else:
                    pairs = zip(keys[lo:hi].tolist(), ns[lo:hi].tolist(), strict=True)
                    yield memoryview(b"".join(self.one(tid, key, t) for key, t in pairs))

    def _matrix(self, tid: int, keys: np.ndarray, ns: np.ndarray) -> memoryview:
        head = self.head(tid, ns)
        fixed, lengths, widths = head.shape[1], self.length[keys], self.width[keys]
        longest = int(widths.max())
        matrix = np.empty((len(ns), fixed + longest), dtype=np.uint8)
        matrix[:, :fixed] = head
        if longest == int(widths.min()):  # (one table: often)
            matrix[:, fixed:] = self.tables[longest][self.row[keys]]
        else:
            for width in _WIDTHS[: _WIDTHS.index(longest) + 1]:
                rows = widths == width
                if rows.any():
                    matrix[rows, fixed : fixed + width] = self.tables[width][self.row[keys[rows]]]
        if self.length_at is not None:
            matrix[:, self.length_at] = fixed + lengths - self.length_at - 1
        return memoryview(matrix[np.arange(fixed + longest) < fixed + lengths[:, None]])


def _decimal(values: np.ndarray, width: int) -> np.ndarray:
    """Non-negative integers below 10**width as `width` decimal digits each (zero-padded): the
    digits all share computed once, the varying ones two at a time."""
    low, high = int(values.min()), int(values.max())
    varying = next(k for k in range(width + 1) if low // 10**k == high // 10**k)
    digits = np.empty((len(values), width), dtype=np.uint8)
    digits[:, : width - varying] = np.frombuffer(f"{high:0{width}}".encode()[: width - varying], dtype=np.uint8)
    rest = values - high // 10**varying * 10**varying
    column = width
    while column > width - varying:
        if column - 2 >= width - varying:
            digits[:, column - 2 : column] = _DIGIT_PAIRS[rest % 100]
            rest //= 100
            column -= 2
        else:
            digits[:, column - 1] = ord("0") + rest % 10
            column -= 1
    return digits


def dump_chrome(trace: TraceFile, out: TextIO, filters: CallFilter | None = None) -> None:
    """Trace Event Format (Perfetto UI, chrome://tracing): a B or E event per entry and exit,
    `{"ts":12.345,"pid":1,"tid":2,"ph":"B","name":"main"},`, time stamps in microseconds with
    the nanoseconds as 3 decimals (as uftrace writes them); then each thread's name and the
    process's."""
    pid = int(trace.info.get("pid") or 0)  # (checked: a count, or null)

    def text(key: int) -> bytes:
        func, kind = divmod(key, 2)
        return f'"ph":"{"E" if kind == EXIT else "B"}","name":{json.dumps(trace.name(func))}}},\n'.encode()

    def head(tid: int, ns: np.ndarray) -> np.ndarray:
        """`{"ts":DIGITS.DDD,"pid":P,"tid":T,` for time stamps of as many digits, not negative."""
        width = max(len(str(int(ns.max()))), 4)  # (`0.001` from 1 ns)
        template = f'{{"ts":{"#" * (width - 3)}.###,"pid":{pid},"tid":{tid},'.encode()
        matrix = np.empty((len(ns), len(template)), dtype=np.uint8)
        matrix[:] = np.frombuffer(template, dtype=np.uint8)
        digits = _decimal(ns, width)
        matrix[:, 6 : 3 + width] = digits[:, : width - 3]
        matrix[:, 4 + width : 7 + width] = digits[:, width - 3 :]
        return matrix

    def shape(ns: np.ndarray) -> np.ndarray:
        return np.where(ns >= 0, np.searchsorted(_POWERS_OF_TEN, np.maximum(ns, 999), side="right"), -1)

    def one(tid: int, key: int, ns: int) -> bytes:
        sign, ns = ("-", -ns) if ns < 0 else ("", ns)
        return f'{{"ts":{sign}{ns // 1000}.{ns % 1000:03},"pid":{pid},"tid":{tid},'.encode() + text(key)

    rows = _Rows(len(trace.functions), text, head, shape, one)
    binary = getattr(out, "buffer", None)  # a file: numpy's bytes written as they are
    out.write('{"displayTimeUnit":"ns","traceEvents":[\n')
    for chunk in batches(trace, filters):
        for record in rows.records(chunk.tid, chunk.kind, chunk.func, chunk.time_ns):
            if binary is not None:
                out.flush()
                binary.write(record)
            else:
                out.write(bytes(record).decode("ascii"))  # (JSON escapes all else)
    metadata = [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
                for tid, name in trace.threads.items()]  # fmt: skip
    metadata.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": trace.program}})
    out.write(",\n".join(json.dumps(m, separators=(",", ":")) for m in metadata) + "]}\n")


# Perfetto's trace format (protos/perfetto/trace/perfetto_trace.proto): field numbers and wire types
_PACKET = 1  # Trace.packet
_TIMESTAMP, _SEQUENCE, _TRACK_EVENT, _INTERNED, _FLAGS = 8, 10, 11, 12, 13  # TracePacket
_DEFAULTS, _TRACK = 59, 60  # TracePacket.trace_packet_defaults, .track_descriptor
_EVENT_TYPE, _NAME_IID, _TRACK_UUID = 9, 10, 11  # TrackEvent (and TrackEventDefaults.track_uuid)
_SLICE_BEGIN, _SLICE_END = 1, 2
_STATE_CLEARED, _NEEDS_STATE = 1, 2  # TracePacket.sequence_flags
_VARINT, _BYTES = 0, 2
_VARINT_STEPS = np.array([1 << (7 * n) for n in range(1, 10)], dtype=np.uint64)  # a varint's bytes: 1 + those <=


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # (a negative int64: ten bytes, as protobuf writes it)
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3 | _VARINT) + _varint(value)
    return _varint(number << 3 | _BYTES) + _varint(len(value)) + value


def _packet(*fields: bytes) -> bytes:
    return _field(_PACKET, b"".join(fields))


def dump_perfetto(trace: TraceFile, out: BinaryIO, filters: CallFilter | None = None) -> None:
    """Perfetto's protobuf trace (ui.perfetto.dev, trace_processor): a track per thread under
    its process's; per event a TrackEvent slice begin or end on its thread's track, names
    interned per thread (each thread is a packet sequence), time stamps in ns."""
    pid = int(trace.info.get("pid") or 0)  # (checked: a count, or null)
    sequences: dict[int, int] = {}  # tid -> its packet sequence (from 1)
    interned: dict[int, set[int]] = {}  # tid -> the functions whose names its sequence holds
    position_of = np.zeros(max(len(trace.functions), 1), dtype=np.int64)  # scratch (see the loop)

    # An event's packet: [packet tag, length] [timestamp tag, varint: `width` bytes] [sequence
    # flags] [sequence id] [track event: its key's]; the track is the sequence's default.
    def text(key: int) -> bytes:
        func, kind = divmod(key, 2)
        event = _field(_EVENT_TYPE, _SLICE_END) if kind == EXIT else _field(_EVENT_TYPE, _SLICE_BEGIN)
        return _field(_TRACK_EVENT, event + (b"" if kind == EXIT else _field(_NAME_IID, func + 1)))

    def tail(tid: int) -> bytes:
        return _field(_FLAGS, _NEEDS_STATE) + _field(_SEQUENCE, sequences[tid])

    def head(tid: int, ns: np.ndarray) -> np.ndarray:
        stamps = ns.view(np.uint64)
        width = 1 + int(np.searchsorted(_VARINT_STEPS, stamps.max(), side="right"))
        after = tail(tid)
        matrix = np.empty((len(ns), 3 + width + len(after)), dtype=np.uint8)
        matrix[:, 0] = _PACKET << 3 | _BYTES
        matrix[:, 2] = _TIMESTAMP << 3 | _VARINT
        for n in range(width):
            matrix[:, 3 + n] = (stamps >> np.uint64(7 * n)) & np.uint64(0x7F) | (0x80 if n < width - 1 else 0)
        matrix[:, 3 + width :] = np.frombuffer(after, dtype=np.uint8)
        return matrix

    def shape(ns: np.ndarray) -> np.ndarray:
        return 1 + np.searchsorted(_VARINT_STEPS, ns.view(np.uint64), side="right")

    def one(tid: int, key: int, ns: int) -> bytes:
        return _packet(_field(_TIMESTAMP, ns), tail(tid), text(key))

    rows = _Rows(len(trace.functions), text, head, shape, one, length_at=1)  # (a packet: under 128 bytes)
    out.write(_packet(_field(_TRACK, _field(1, pid) + _field(3, _field(1, pid) + _field(6, _utf8(trace.program))))))
    for chunk in batches(trace, filters):
        tid = chunk.tid
        if tid not in sequences:
            sequences[tid] = len(sequences) + 1
            interned[tid] = set()
            thread = _field(1, pid) + _field(2, tid) + _field(5, _utf8(trace.threads.get(tid, str(tid))))
            track = _field(1, _thread_track(pid, tid)) + _field(5, pid) + _field(4, thread)
            defaults = _field(_DEFAULTS, _field(_TRACK_EVENT, _field(_TRACK_UUID, _thread_track(pid, tid))))
            out.write(_packet(_field(_TRACK, track)))
            out.write(_packet(_field(_SEQUENCE, sequences[tid]), _field(_FLAGS, _STATE_CLEARED), defaults))
        # The chunk's functions entered, each once, with no sort: each function keeps one of its
        # positions (whichever numpy writes last), which alone reads back as itself.
        entered = chunk.func[chunk.kind != EXIT]
        position_of[entered] = np.arange(len(entered))
        new = sorted(set(entered[position_of[entered] == np.arange(len(entered))].tolist()) - interned[tid])
        if new:
            interned[tid].update(new)
            names = b"".join(_field(2, _field(1, f + 1) + _field(2, _utf8(trace.name(f)))) for f in new)
            out.write(
                _packet(_field(_SEQUENCE, sequences[tid]), _field(_FLAGS, _NEEDS_STATE), _field(_INTERNED, names))
            )
        for record in rows.records(tid, chunk.kind, chunk.func, chunk.time_ns):
            out.write(record)


def _utf8(text: str) -> bytes:
    """Text as protobuf strings are: UTF-8 (a name read from a trace may hold a lone surrogate)."""
    return text.encode("utf-8", "replace")


def _thread_track(pid: int, tid: int) -> int:
    return pid << 32 | tid
