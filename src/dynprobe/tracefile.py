"""Trace directories (`dynprobe record`): what was traced, and the records, read back in a stream.

    DIR/info.json    format name and version, command, pid, the clock (time-stamp counter ->
                     CLOCK_MONOTONIC ns), the modules (path, build id), the functions (index =
                     id: name, file, address, size, whether a PLT stub), the threads' names,
                     the filters record was given (function ids), the calls forked children
                     began inside, the values functions record ("captures": function id ->
                     [argument specs, return-value specs], as spec/argspec.py writes them),
                     counts (calls, missed, lost, and a flight recorder's records that gave
                     way: overwritten), "complete" once written out; "flight_recorder": each of
                     a thread's chunks after its first follows a gap (Chunk.gap);
                     "snapshot_over_ns": the call length that took a flight recorder's snapshot
    DIR/events.raw   the consumer's raw output: chunks of (u64 pid | tid << 32, u64 count, count
                     records of `record_size` bytes), each record u16 ops, u16 kind (bit 0:
                     exit; bits 1-14: the call's frame, 0 for none; version 1 had no frames),
                     u32 function id, u64 time stamp; from version 3, a call's values in data
                     records after its entry or exit (kind bit 15: see layout.TRACE_DATA)

Readers never load the events whole: `TraceFile.chunks()` yields one chunk at a time (numpy), and a
truncated file yields what it holds and says where it stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TypeGuard

import numpy as np

from dynprobe.errors import DynprobeError
from dynprobe.frozen import frozen
from dynprobe.output import files
from dynprobe.ringbuf.layout import (
    DATA_CUT,
    DATA_END,
    DATA_FAULTED,
    DATA_NULL,
    MARGIN_NS,
    MAX_RECORD_SIZE,
    TRACE_DATA,
)
from dynprobe.spec.argspec import (
    MAX_VALUES,
    STRING_PIECES,
    ArgSpec,
    ArgSpecError,
    parse_value,
    show_string,
    show_value,
)
from dynprobe.symbols.demangle import Demangle, display

FORMAT = "dynprobe-trace"
VERSION = 3
INFO, EVENTS = "info.json", "events.raw"
_CHUNK_HEADER = np.dtype([("who", "<u8"), ("count", "<u8")])
READ_RECORDS = 1 << 16  # records read at a time: a reader's memory stays flat whatever the ring size
MAX_OPEN_CALLS = 1 << 15  # calls a thread can be inside (its frames: 15 bits)


class TraceError(DynprobeError):
    """A trace directory that cannot be read."""


MAX_INFO = 1 << 28  # bytes: an info.json of a million functions is ~100 MiB


def _read_info(directory: str) -> dict[str, Any]:
    """info.json, checked: a trace may come from anywhere (and `complete` is the writer's word)."""
    path = os.path.join(directory, INFO)
    try:
        data = files.read_regular(path, MAX_INFO)
    except FileNotFoundError:
        raise TraceError(f"{directory} is not a trace: {INFO} is missing") from None
    except OSError as exc:
        raise TraceError(f"{path} cannot be read: {exc.strerror}") from None
    try:
        info = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise TraceError(f"{path} is not JSON: {str(exc)[:200]}") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise TraceError(f"{path} is not a dynprobe trace")
    version = info.get("version")
    if not _is_int(version):
        raise TraceError(f"{path} is damaged: no format version")
    if version > VERSION:
        raise TraceError(f"{directory} was written by a newer dynprobe (format {version}; this one reads {VERSION})")
    wrong = _wrong_in(info)
    if wrong is not None:
        raise TraceError(f"{path} is damaged: {wrong}")
    return info


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _wrong_in(info: dict[str, Any]) -> str | None:
    """What in info.json is not as `dynprobe record` writes it, or None."""
    clock = info.get("clock")
    if not isinstance(clock, dict):
        return "no clock"
    if not all(_is_int(clock.get(k)) and 0 <= clock[k] < 1 << 63 for k in ("tsc0", "ns0")):
        return "the clock's tsc0 or ns0 is not a time"
    if "tsc_now" in clock and not (_is_int(clock["tsc_now"]) and 0 <= clock["tsc_now"] < 1 << 63):
        return "the clock's tsc_now is not a time"
    scale = clock.get("scale")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not 1e-6 < scale < 1e6:
        return "the clock's scale is not a clock's"
    size = info.get("record_size")
    if not _is_int(size) or size & (size - 1) or not 16 <= size <= MAX_RECORD_SIZE:
        return f"record_size is not a power of two from 16 to {MAX_RECORD_SIZE}"
    functions = info.get("functions", [])
    if not isinstance(functions, list) or not all(
        isinstance(f, list) and f and isinstance(f[0], str) for f in functions
    ):
        return "the function table is not a list of [name, ...]"
    inherited = info.get("inherited", {})
    if not isinstance(inherited, dict) or not all(
        k.isdigit() and _open_calls(v, len(functions)) for k, v in inherited.items()
    ):  # fmt: skip
        return "the calls forked children inherited are not a table of tid: [time, [[function, frame], ...]]"
    captures = info.get("captures", {})
    if not isinstance(captures, dict) or not all(
        k.isdigit() and int(k) < len(functions) and _capture(v) for k, v in captures.items()
    ):  # fmt: skip
        return "the recorded values are not a table of function id: [[argument, ...], [return value]]"
    threads = info.get("threads", {})
    if not isinstance(threads, dict) or not all(k.isdigit() and isinstance(v, str) for k, v in threads.items()):
        return "the thread names are not a table of tid: name"
    if not isinstance(info.get("flight_recorder", False), bool):
        return "flight_recorder is not true or false"
    for key in ("pid", "threshold_ns", "snapshot_over_ns", "depth", "calls", "missed", "lost", "overwritten"):
        if info.get(key) is not None and not (_is_int(info[key]) and 0 <= info[key] < 1 << 63):
            return f"{key} is not a number"
    return None


def _open_calls(value: object, functions: int) -> bool:
    """[time ns, [[function id, frame], ...]]: the calls a forked child's thread was inside."""
    if not (isinstance(value, list) and len(value) == 2 and _is_int(value[0]) and 0 <= value[0] < 1 << 63):
        return False
    calls = value[1]
    return isinstance(calls, list) and len(calls) <= MAX_OPEN_CALLS and all(
        isinstance(c, list) and len(c) == 2 and all(_is_int(v) for v in c) and 0 <= c[0] < functions
        and 0 < c[1] < 1 << 15
        for c in calls
    )  # fmt: skip


def _capture(value: object) -> bool:
    """[[argument spec, ...], [return-value spec] or []], each as ArgSpec.text writes it."""
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, list) for v in value)):
        return False
    arguments, retval = value
    if len(arguments) > MAX_VALUES or len(retval) > 1:
        return False
    try:
        for specs, is_retval in ((arguments, False), (retval, True)):
            for text in specs:
                if not isinstance(text, str) or len(text) > 64:
                    return False
                parse_value(text, retval=is_retval)
    except ArgSpecError:
        return False
    return True


def _captures(info: dict[str, Any]) -> dict[int, tuple[list[ArgSpec], list[ArgSpec]]]:
    return {
        int(k): ([parse_value(t, retval=False) for t in v[0]], [parse_value(t, retval=True) for t in v[1]])
        for k, v in info.get("captures", {}).items()
    }


def record_dtype(record_size: int) -> np.dtype[Any]:
    fields: list[tuple[str, str]] = [("ops", "<u2"), ("kind", "<u2"), ("func", "<u4"), ("tsc", "<u8")]
    if record_size > 16:
        fields.append(("pad", f"V{record_size - 16}"))
    return np.dtype(fields)


def write_info(directory: str, info: dict[str, Any]) -> None:
    """info.json, replaced whole (a reader never sees half of it), in a directory of ours."""
    path = os.path.join(directory, INFO)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        with os.fdopen(os.open(path + ".tmp", flags, 0o600), "w") as f:
            json.dump({"format": FORMAT, "version": VERSION, **info}, f)
        os.replace(path + ".tmp", path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path + ".tmp")
        raise


_OURS = {INFO, INFO + ".tmp", EVENTS}  # what a trace directory holds


def is_trace_directory(path: str) -> bool:
    """A directory dynprobe wrote: its files are a trace's, and its info says so."""
    try:
        names = set(os.listdir(path))
        info = json.loads(files.read_regular(os.path.join(path, INFO), MAX_INFO))
    except (OSError, ValueError, RecursionError):
        return False
    return names <= _OURS and isinstance(info, dict) and info.get("format") == FORMAT


def create_trace_directory(path: str) -> None:
    """A new trace directory at `path` (mode 0700). An earlier trace there is kept as PATH.old
    (replacing an older PATH.old only if that is a trace too); an empty directory is taken;
    anything else is refused. Nothing that is not a trace dynprobe wrote is ever deleted."""
    kind = files.kind_of(path)
    try:
        if kind == "directory" and not os.listdir(path):
            os.rmdir(path)
        elif kind == "directory" and is_trace_directory(path):
            old = path + ".old"
            if files.kind_of(old) is not None:
                if files.kind_of(old) != "directory" or not is_trace_directory(old):
                    raise files.OutputError(f"{old} is in the way (not a trace): move it, or choose another -o")
                remove_trace_directory(old)
            os.rename(path, old)
        elif kind is not None:
            raise files.OutputError(f"{path} exists and is not a trace directory: choose another name with -o")
    except OSError as exc:
        raise files.OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
    files.make_directory(path)


def remove_trace_directory(path: str) -> None:
    """Delete a trace directory dynprobe wrote (its files only; anything else stays)."""
    for name in _OURS:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, name))
    os.rmdir(path)


@dataclass
class Chunk:
    pid: int
    tid: int
    kind: np.ndarray  # u16: 0 entry, 1 exit
    frame: np.ndarray  # u16: the call's frame (an id reused once the call is over), 0: unknown
    func: np.ndarray  # u32 function ids
    time_ns: np.ndarray  # i64 CLOCK_MONOTONIC
    # Entries of the calls a forked child's thread was inside when it began (its parent's, as
    # the fork left them; stamped with the fork), outermost first: readers open them silently,
    # so the child's calls go on at its parent's depth, as in uftrace.
    inherited: bool = False
    # What is known of an event beyond the call: an index into `notes`, -1 for nothing; None:
    # nothing for any event of the chunk.
    note: np.ndarray | None = None
    notes: list[Note] = field(default_factory=list)
    # A flight recorder's trace holds, for each snapshot, what the rings held then: before these
    # records, the thread's older ones gave way, and the calls still open then are left.
    gap: bool = False


@frozen
class Note:
    """An event's call's recorded values (-A, -R: "(1, "a")" for an entry, " = 3" for an exit),
    and for an entry under a backtrace trigger, the functions of the calls it is under."""

    values: str = ""
    callers: tuple[int, ...] | None = None


_NOTHING = Note()


class TraceFile:
    """A trace directory, checked: its info, and its events in chunks (the Python API's
    `dynprobe.Trace` adds events and a profile: dynprobe/traces.py)."""

    def __init__(
        self, directory: str, demangle: Demangle | str = Demangle.SIMPLE, threads: Collection[int] = ()
    ) -> None:
        """`demangle`: how C++ function names are shown ('simple', 'full', 'no'); `threads`:
        the only threads read (all if none)."""
        self.directory = directory
        self.demangle = Demangle(demangle)
        self.only = frozenset(threads)
        if not os.path.isdir(directory):
            what = "not a directory" if os.path.exists(directory) else "no such directory"
            raise TraceError(f"no trace directory {directory} ({what}): `dynprobe record` writes one")
        self.info = info = _read_info(directory)
        self.functions: list[str] = [display(f[0], self.demangle) for f in info.get("functions", [])]
        self.threads: dict[int, str] = {int(k): v for k, v in info.get("threads", {}).items()}
        clock = info["clock"]
        self._tsc0: int = clock["tsc0"]
        self._ns0: int = clock["ns0"]
        self._scale = float(clock["scale"])
        # No record is older than the session's clock, nor newer than its last reading (known
        # once the trace is complete); MARGIN_NS either way, for the readings themselves.
        margin = int(MARGIN_NS / self._scale)
        self._first_tsc = max(0, self._tsc0 - margin)
        self._last_tsc = clock["tsc_now"] + margin if "tsc_now" in clock and self.complete else (1 << 64) - 1
        self.record = record_dtype(info["record_size"])
        self.captures = _captures(info)  # function id -> (argument specs, return-value specs)
        self.truncated_at: int | None = None  # the byte offset where a truncated file stops
        self.rejected = 0  # records left out: a function id past the table, an impossible time

    @staticmethod
    def call_note(chunk: Chunk, i: int) -> Note:
        """What is known of event `i` of `chunk` beyond the call."""
        index = int(chunk.note[i]) if chunk.note is not None else -1
        return chunk.notes[index] if index >= 0 else _NOTHING

    def first_ns(self) -> int:
        """When the first event of the trace happened (CLOCK_MONOTONIC ns; when the recording
        began if it has none): `-r` times count from there, as uftrace's elapsed times do. Reads
        the chunk headers and each thread's first record only."""
        first: dict[int, int] = {}
        for f, _, who, held in self._headers():
            if who not in first and held:
                record = np.fromfile(f, dtype=self.record, count=1)
                record = record[self._possible(record)]
                if len(record):
                    first[who] = int(self._ns(record["tsc"])[0])
        return min(first.values(), default=self._ns0)

    @property
    def program(self) -> str:
        """The traced program's file name (from the command it ran), or 'program'."""
        command = self.info.get("command")
        first = command[0] if isinstance(command, list) and command else None
        return os.path.basename(first) if isinstance(first, str) and first else "program"

    @property
    def complete(self) -> bool:
        return bool(self.info.get("complete"))

    def name(self, func: int) -> str:
        return self.functions[func] if 0 <= func < len(self.functions) else f"<function {func}>"

    def call_text(self, func: int) -> str:
        """A call as replay shows it: 'name()', or a full C++ signature as it is."""
        name = self.name(func)
        return name if self.demangle is Demangle.FULL and "(" in name else f"{name}()"

    def _headers(self) -> Iterator[tuple[BinaryIO, int, int, int]]:
        """The chunks of the events file: (the file, placed at the chunk's first record; the
        chunk's offset; who wrote it, pid | tid << 32; how many of its records the file holds).
        A chunk the file cuts short is the last; `truncated_at` says where."""
        path = os.path.join(self.directory, EVENTS)
        try:
            f = files.open_regular(path)
        except OSError as exc:
            raise TraceError(f"{path} cannot be read: {exc.strerror}") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            offset = 0
            while offset < size:
                if size - offset < _CHUNK_HEADER.itemsize:
                    self.truncated_at = offset
                    return
                f.seek(offset)
                header = np.fromfile(f, dtype=_CHUNK_HEADER, count=1)[0]
                count = int(header["count"])
                available = (size - offset - _CHUNK_HEADER.itemsize) // self.record.itemsize
                yield f, offset, int(header["who"]), min(count, available)
                if available < count:
                    self.truncated_at = offset
                    return
                offset += _CHUNK_HEADER.itemsize + count * self.record.itemsize

    def chunks(self) -> Iterator[Chunk]:
        latest: dict[int, int] = {}  # tid -> its last time
        inherited: dict[str, list[Any]] = self.info.get("inherited", {})
        flight = self.info.get("flight_recorder") is True  # (each of a thread's chunks after its first: a gap)
        for f, offset, who, held in self._headers():
            if self.only and who >> 32 not in self.only:
                continue
            gap = flight and who in latest
            # A chunk holds up to a ring's worth (up to 1 GiB): read in pieces of READ_RECORDS
            left = held
            carried = None  # a piece's last call, whose data records may be in the next piece
            while left:
                records = np.fromfile(f, dtype=self.record, count=min(left, READ_RECORDS))
                if not len(records):
                    self.truncated_at = offset  # the file shrank while read
                    return
                left -= len(records)
                if carried is not None:
                    records, carried = np.concatenate([carried, records]), None
                data = records["kind"] & TRACE_DATA != 0
                calls = np.flatnonzero(~data)
                if left and self.captures and len(calls):  # (the next piece may hold its last call's values)
                    last_call = int(calls[-1])
                    records, carried, data = records[:last_call], records[last_call:], data[:last_call]
                    if not len(records):
                        continue
                note, notes = self._notes(records, data) if data.any() else (None, list[Note]())
                possible = self._possible(records) & ~data
                if not possible.all():
                    records = records[possible]
                    note = note[possible] if note is not None else None
                if not len(records):
                    continue
                kind, times = records["kind"], self._ns(records["tsc"])
                # A thread's events happened in the order it wrote them, but its time stamps
                # are not ordered (no fence) and a thread may move to a CPU whose counter is a
                # little behind: none goes back in time (no call lasts less than 0).
                times = np.maximum.accumulate(np.maximum(times, latest.get(who, times[0])))
                if who not in latest and str(who >> 32) in inherited:
                    yield self._inherited(who, *inherited[str(who >> 32)])
                latest[who] = int(times[-1])
                yield Chunk(who & 0xFFFF_FFFF, who >> 32, kind & 1, kind >> 1, records["func"], times,
                            note=note, notes=notes, gap=gap)  # fmt: skip
                gap = False

    @staticmethod
    def _inherited(who: int, time_ns: int, calls: list[list[int]]) -> Chunk:
        func, frame = np.array(calls, dtype=np.int64).reshape(-1, 2).T
        n = len(calls)
        return Chunk(who & 0xFFFF_FFFF, who >> 32, np.zeros(n, np.uint16), frame.astype(np.uint16),
                     func.astype(np.uint32), np.full(n, time_ns, np.int64), inherited=True)  # fmt: skip

    def _possible(self, records: np.ndarray) -> np.ndarray:
        """Which calls' records can be true (a mask): the target wrote them into its own
        memory, and could write any function id or time stamp. (Data records are not calls'.)"""
        tsc, data = records["tsc"], records["kind"] & TRACE_DATA != 0
        possible: np.ndarray = (
            (records["func"] < len(self.functions)) & (tsc >= self._first_tsc) & (tsc <= self._last_tsc)
        )
        self.rejected += int(np.count_nonzero(~possible & ~data))
        return possible

    def _notes(self, records: np.ndarray, data: np.ndarray) -> tuple[np.ndarray, list[Note]]:
        """What the calls' data records say (see Chunk.note): each data record belongs to the
        call's record before it; one that does not fit its function's specs is left out."""
        calls = np.flatnonzero(~data)
        at = np.flatnonzero(data)
        owners = np.searchsorted(calls, at) - 1
        note = np.full(len(records), -1, dtype=np.int32)
        notes: list[Note] = []
        kinds, funcs, values = records["kind"].tolist(), records["func"].tolist(), records["tsc"].tolist()
        pieces: dict[int, list[tuple[int, int, int]]] = {}  # the owner's record -> its data records
        for owner, i in zip(owners.tolist(), at.tolist(), strict=True):
            if owner >= 0:
                pieces.setdefault(int(calls[owner]), []).append((kinds[i] & 0xFF, funcs[i], values[i]))
        for call, parts in pieces.items():
            specs = self.captures.get(funcs[call])
            if specs is None:
                continue
            exit = bool(kinds[call] & 1)
            text = _shown(specs[1] if exit else specs[0], parts)
            if text is not None:
                note[call] = len(notes)
                notes.append(Note(f" = {text}" if exit else f"({text})"))
        return note, notes

    def _ns(self, tsc: np.ndarray) -> np.ndarray:
        delta = tsc.astype(np.int64) - np.int64(self._tsc0)
        return (delta * self._scale).astype(np.int64) + self._ns0


def _shown(specs: list[ArgSpec], parts: list[tuple[int, int, int]]) -> str | None:
    """The values of one call, from its data records (value number, bytes held | flags, the
    8 bytes), as replay shows them: "1, \"a\"" (None if no record fits)."""
    strings: dict[int, tuple[bytes, int, int]] = {}  # value number -> its bytes so far, flags, last payload
    numbers: dict[int, int] = {}
    for number, held, raw in parts:
        if number >= len(specs):
            continue
        if not specs[number].is_string:
            numbers[number] = raw
            continue
        so_far, flags, _ = strings.get(number, (b"", 0, 0))
        if flags & (DATA_END | DATA_CUT | DATA_FAULTED | DATA_NULL) or len(so_far) >= 8 * STRING_PIECES:
            continue  # (a string's records after its last: not ours)
        strings[number] = (so_far + raw.to_bytes(8, "little")[: min(held & 0xFF, 8)], held & 0xF00, raw)
    shown = []
    for number, spec in enumerate(specs):
        if number in numbers:
            shown.append(show_value(spec, numbers[number]))
        elif number in strings:
            text, flags, raw = strings[number]
            unreadable = flags & DATA_NULL or (flags & DATA_FAULTED and not text)
            shown.append(show_string(text, cut=bool(flags & DATA_CUT), faulted=bool(flags & DATA_FAULTED),
                                     pointer=raw if unreadable else None))  # fmt: skip
        else:
            shown.append("?")  # (its record lost, or not written)
    return ", ".join(shown) if numbers or strings else None
