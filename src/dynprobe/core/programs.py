"""A bpftrace program placed in a session (`session.program()`, `dynprobe run`, issue 21).

Parsed, checked and split between the target and the tracer (lang/), its maps laid out
(lang/maps.py): each uprobe and uretprobe attach point becomes a probe that counts its hits and
whose detour (or return code) then runs the block's body (arch/x86_64/codegen/lang.py) over the
maps' region of the process it runs in. A region is memory shared with the process (a memfd, as
the thread areas), mapped there when the first probe is placed in it; a fork child shares its
parent's (the same memory: their updates add up). The maps are read whenever the tracer prints
them, merged across the regions of every process the program ran in, after they ended too (our
mappings stay): by BEGIN, END and interval bodies, which run in the tracer (`TracerBlock`), and
at the end, every map, as bpftrace prints them. A body's printf() writes a record into the
thread's ring; the consumer hands each window of time's records here (`on_records`), which
prints them in the order they were written.
"""

from __future__ import annotations

import mmap
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from dynprobe.core.probe import Probe
from dynprobe.core.slots import map_shared_memory
from dynprobe.core.stacks import Stack, StackFrame
from dynprobe.core.traced import TracedProcess
from dynprobe.errors import OptimizeRefusal
from dynprobe.lang import maps, output
from dynprobe.lang import syntax as S
from dynprobe.lang.check import check_program
from dynprobe.lang.maps import Clock, LangBody, MapTable
from dynprobe.lang.output import c_format
from dynprobe.lang.parser import parse_program
from dynprobe.lang.target import (
    STACK_KINDS,
    TRACER_NAMES,
    PrintfRecord,
    check_runnable,
    printf_records,
    tracer_maps,
    ustack_frames,
)
from dynprobe.lang.tracer import TracerBlock, TracerMaps
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.consumer import RecordBatch
from dynprobe.spec.model import ProbeSpec

if TYPE_CHECKING:
    import numpy as np
else:
    from dynprobe.deferred import numpy as np

_RUN_IN_TARGET = ("uprobe", "uretprobe")


@dataclass
class _Region:
    pid: int  # the process it was mapped into (a fork child's code uses its parent's)
    address: int  # in the target
    view: mmap.mmap

    @property
    def words(self) -> np.ndarray:
        return np.frombuffer(self.view, dtype=np.uint64)


class PlacedProgram:
    """A program's probes in a session, and its maps (see the module's docstring)."""

    def __init__(self, source: str, filename: str, *, clock: Clock, process: Callable[[int], TracedProcess | None],
                 comm: Callable[[int, int], str], stack_at: Callable[[int, int], Stack | None]) -> None:  # fmt: skip
        program = parse_program(source, filename)
        self.checked = check_program(program, source, filename)
        check_runnable(self.checked, source, filename)
        self.region = maps.lay_out(self.checked)
        self.tracer_maps = TracerMaps(tracer_maps(self.checked), self.region.tables)
        self.printfs = printf_records(self.checked)
        self._printf_by_number = {record.number: record for record in self.printfs.values()}
        self.record_bytes = max((record.size for record in self.printfs.values()), default=0)
        self.clock = clock
        self.process = process  # the traced process of a pid
        self.comm = comm  # a thread's name (pid, tid)
        self.stack_at = stack_at  # the stack in a slot of a process's stack table (pid, address)
        self.probes: list[Probe] = []
        self._by_index: dict[int, Probe] = {}
        self._regions: dict[int, _Region | OptimizeRefusal] = {}  # by pid
        self._all: list[_Region] = []
        self.exited = False  # a body called exit()
        self.printed: list[str] = []  # what BEGIN, END and interval bodies printed, not written yet
        self.write: Callable[[str], None] = self.printed.append

    # --- placing ---------------------------------------------------------------------------------
    def place(self, expand: Callable[[str], list[ProbeSpec]], probe: Callable[..., Probe]) -> None:
        """A probe for each uprobe and uretprobe attach point (each function a pattern names):
        `expand` and `probe` are the session's."""
        for block in self.checked.program.probes:
            for point in block.attach_points:
                if point.kind not in _RUN_IN_TARGET:
                    continue
                kind = "r" if point.kind == "uretprobe" else "p"
                where = f"{point.target}:{point.function}" + (f"+{point.offset}" if point.offset else "")
                frames = ustack_frames(block)  # (a ustack key: each hit counted by its stack, the key its slot)
                stacks = {"by": "stack", "max_frames": frames} if frames is not None else {}
                for spec in expand(f"{kind} {where}"):
                    self.probes.append(probe(spec, lang=_Body(self, block), **stacks))

    def placed(self, block: S.ProbeBlock, pid: int) -> LangBody | OptimizeRefusal:
        """The block's body in process `pid`, over its region of the maps (mapped on first use)."""
        proc = self.process(pid)
        if proc is None:
            return OptimizeRefusal.SHARED_MEMORY
        region = self._region_of(proc)
        if isinstance(region, OptimizeRefusal):
            return region
        return LangBody(block, self.checked, region.address, self.region.tables, self.clock, self.printfs)

    def _region_of(self, proc: TracedProcess) -> _Region | OptimizeRefusal:
        found = self._regions.get(proc.pid)
        if found is not None:
            return found
        mapped = map_shared_memory(proc, max(self.region.size, mmap.PAGESIZE), "the program's maps")
        if isinstance(mapped, OptimizeRefusal):
            self._regions[proc.pid] = mapped  # (not tried again, as the stack table is not)
            return mapped
        region = _Region(proc.pid, *mapped[2:])
        words = region.words
        self.region.initialize(words)
        self._regions[proc.pid] = region
        self._all.append(region)
        return region

    # --- printf() records --------------------------------------------------------------------------
    def on_records(self, batches: list[RecordBatch]) -> None:
        """What the records of a window of time print, in the order they were written (a
        print()'s, the map as it is now; a record no printf() or print() of the program wrote,
        which only the target could have made, is skipped)."""
        lines: list[tuple[int, int, str]] = []
        wall = time.time_ns() - time.monotonic_ns()  # (the wall clock less the monotonic one)
        for batch in batches:
            payload = batch.raw[:, L.RECORD_HEADER :]
            numbers = payload[:, :8].copy().view(np.uint64)[:, 0].tolist()
            for row, number, stamp, order in zip(payload, numbers, batch.time_ns.tolist(), batch.order.tolist(),
                                                 strict=True):  # fmt: skip
                record = self._printf_by_number.get(number)
                if record is None or record.size > len(row):
                    continue
                if record.prints is not None:
                    lines.append((stamp, order, self.format_map(*record.prints)))
                elif record.time:  # (the hit's time: CLOCK_MONOTONIC ns, as wall-clock time)
                    lines.append((stamp, order, time.strftime(record.fmt, time.localtime((stamp + wall) / 1e9))))
                else:
                    values = list(self._values(record, row.tobytes(), batch))
                    lines.append((stamp, order, c_format(record.fmt, values)))
        lines.sort(key=lambda line: line[:2])
        for *_, text in lines:
            self.write(text)

    def _values(self, record: PrintfRecord, row: bytes, batch: RecordBatch) -> Iterator[int | str]:
        for arg in record.args:
            at = arg.offset
            if arg.kind == "comm":
                yield self.comm(batch.pid, batch.tid)
            elif arg.kind in ("func", "probe"):
                yield self._names(batch.probe_index)[arg.kind == "probe"]
            elif arg.kind.endswith(" word"):  # (a map's comm, func or probe, as the record holds it)
                word = int.from_bytes(row[at : at + 8], "little")
                named = self._named(batch.pid, arg.kind.removesuffix(" word"), word)
                yield named if isinstance(named, str) else ""
            elif arg.kind == "str":
                length = min(int.from_bytes(row[at : at + 2], "little"), arg.chars)
                yield row[at + 4 : at + 4 + length].decode("utf-8", "replace")
            else:
                yield int.from_bytes(row[at : at + 8], "little", signed=True)

    def probe_name(self, probe: Probe) -> str:
        """The probe as bpftrace names it: 'uprobe:PATH:FUNCTION'."""
        return self._names(probe.index)[1]

    def _names(self, index: int) -> tuple[str, str]:
        """`func` and `probe` of the program's probe of index `index` (as bpftrace names them:
        the function, and 'uprobe:PATH:FUNCTION')."""
        if len(self._by_index) != len(self.probes):  # (probes placed since)
            self._by_index = {p.index: p for p in self.probes}
        probe = self._by_index.get(index)
        if probe is None:
            return "?", "?"
        where = probe.location
        func = where.function.name if where.function is not None else where.label
        return func, f"{'uretprobe' if probe.is_return else 'uprobe'}:{where.path}:{where.label}"

    # --- the maps --------------------------------------------------------------------------------
    def entries(self, name: str) -> list[output.Entry]:
        """The map's entries, merged across the processes the program ran in and across the
        words that name the same key (a stack key named by its frames, as bpftrace prints it; a
        comm key by the thread's name, as the tracer last read it; func and probe by the probe's)."""
        if name in self.tracer_maps:
            return self.tracer_maps.entries(name)
        table = self.region.tables[name]
        merged: dict[tuple[output.Key, ...], output.Value] = {}
        for region in self._all:
            for raw, value in maps.entries(region.view, table):
                keys = tuple(self._named(region.pid, kind, k) for k, kind in zip(raw, table.key_kinds, strict=True))
                if table.kind in TRACER_NAMES and isinstance(value, int):  # (a map of comm, func or probe)
                    value = self._named(region.pid, table.kind, value)
                merged[keys] = _merge(table, merged[keys], value) if keys in merged else value
        return list(merged.items())

    def _named(self, pid: int, kind: str, key: output.Key) -> output.Key:
        """A key as printed: the words the tracer names (a stack's slot, a thread's pid << 32 |
        tid, a probe's index plus 1) named."""
        if kind in STACK_KINDS.values():
            return self._stack_key(pid, key, perf=kind == STACK_KINDS["perf"])
        if kind in TRACER_NAMES and key == 0:
            return ""  # (a value zero() set, or one never given)
        if kind == "comm" and isinstance(key, int):
            return self.comm(key >> 32, key & 0xFFFFFFFF)
        if kind in ("func", "probe") and isinstance(key, int):
            return self._names(key - 1)[kind == "probe"]  # (the probe's index, plus 1)
        return key

    def _stack_key(self, pid: int, slot: output.Key, *, perf: bool) -> str:
        """A stack key as printed: a frame a line, as dynprobe names frames (bpftrace's mode), or
        as perf's mode prints them, `\tADDRESS SYMBOL+OFFSET (MODULE)` (what flame graph scripts
        read), a frame a return address."""
        stack = self.stack_at(pid, slot) if isinstance(slot, int) and slot else None
        if stack is None:
            frames = ["(no stack: the table of stacks was full)"]
        elif perf:
            frames = [_perf_frame(frame) for frame in stack if not frame.inlined]
        else:
            frames = str(stack).splitlines()
        indent = "\t" if perf else " " * 8
        return "".join(f"\n{indent}{frame}" for frame in frames) + "\n"

    def dropped(self) -> dict[str, int]:
        """Updates each map could not take (its table full), if any."""
        counts = {name: sum(maps.dropped(r.view, t) for r in self._all) for name, t in self.region.tables.items()}
        return {name: count for name, count in counts.items() if count}

    def called_exit(self) -> bool:
        return self.exited or any(int(r.words[0]) for r in self._all)

    def format_map(self, name: str, top: int = 0) -> str:
        table = self.region.tables[name]
        kind = "string" if table.kind in TRACER_NAMES else table.kind  # (named: strings)
        return output.format_map(name, kind, self.entries(name), top=top, lhist=table.lhist)

    @property
    def maps(self) -> dict[str, object]:
        """Every map, by name, in bpftrace's shapes: a map without keys its value, one with keys
        a dict of its entries, each key alone or several as a tuple; values as
        `output.plain` gives them (an int, a str, an avg's average, stats as a dict, a hist's
        counts by bucket)."""
        out: dict[str, object] = {}
        for name, table in sorted(self.region.tables.items()):
            entries = {keys: output.plain(table.kind, value, table.lhist) for keys, value in self.entries(name)}
            if not table.key_kinds:
                out[name] = entries.get(())
            else:
                out[name] = {keys[0] if len(keys) == 1 else keys: value for keys, value in entries.items()}
        return out

    def print(self, file: TextIO | None = None) -> None:
        """Every map as bpftrace prints them at its end (to the standard output)."""
        (file or sys.stdout).write(self.format_maps())

    def format_maps(self) -> str:
        """Every map, by name, as bpftrace prints them at its end."""
        return "".join(self.format_map(name) for name in sorted(self.region.tables))

    def clear(self, name: str, keep_keys: bool) -> None:
        """`clear(@m)` (entries gone) or `zero(@m)` (values back to their start)."""
        if name in self.tracer_maps:
            self.tracer_maps.clear(name, keep_keys=keep_keys)
            return
        for region in self._all:
            self.region.tables[name].clear(region.words, keep_keys=keep_keys)

    def value(self, name: str, keys: tuple[output.Key, ...]) -> int | str:
        """A target's map's value for `keys`, an integer or a string (0: none), for the tracer's
        bodies."""
        found = dict(self.entries(name)).get(keys, 0)
        return found if isinstance(found, int | str) else 0

    # --- the tracer's blocks ---------------------------------------------------------------------
    def _tracer_block(self, block: S.ProbeBlock) -> TracerBlock:
        return TracerBlock(
            block, self.checked, self.tracer_maps, read_map=self.value, print_map=self.format_map, clear=self.clear,
            write=lambda text: self.write(text), start_ns=self.clock.start,
        )  # fmt: skip

    def intervals(self) -> list[tuple[float, TracerBlock]]:
        """Each interval block with its period in seconds."""
        return [
            (point.offset / 1000 if point.target == "ms" else float(point.offset), self._tracer_block(block))
            for block in self.checked.program.probes
            for point in block.attach_points
            if point.kind == "interval"
        ]

    def run_blocks(self, kind: str) -> None:
        """The BEGIN or END blocks, in order."""
        for block in self.checked.program.probes:
            if any(p.kind == kind for p in block.attach_points) and self._tracer_block(block).run():
                self.exited = True


def _merge(table: MapTable, first: output.Value, second: output.Value) -> output.Value:
    if isinstance(first, dict) and isinstance(second, dict):
        return {b: first.get(b, 0) + second.get(b, 0) for b in first.keys() | second.keys()}
    if isinstance(first, tuple) and isinstance(second, tuple):
        return first[0] + second[0], first[1] + second[1]
    if isinstance(first, str) or isinstance(second, str):
        return second  # (a map of strings: the last region's, as an integer's)
    assert isinstance(first, int) and isinstance(second, int)
    if table.kind in ("count", "sum"):
        return first + second
    if table.kind == "min":
        return min(first, second)
    return max(first, second) if table.kind == "max" else second


class _Body:
    """One block's body, as its probes carry it (core/probe.py's `ProgramBody`)."""

    def __init__(self, program: PlacedProgram, block: S.ProbeBlock) -> None:
        self.program, self.block = program, block
        self.on_records = program.on_records  # (one for every block: a window's records are sorted together)

    @property
    def record_bytes(self) -> int:
        return self.program.record_bytes

    def placed(self, pid: int) -> LangBody | OptimizeRefusal:
        return self.program.placed(self.block, pid)


def _perf_frame(frame: StackFrame) -> str:
    """A frame as bpftrace's perf mode prints it (its offset in decimal; an address no symbol
    names, as such, in `[unknown]`)."""
    if frame.function is None:
        return f"{frame.address:x} {frame.address:#x} ([unknown])"
    return f"{frame.address:x} {frame.function}+{frame.offset} ({frame.module or '[unknown]'})"
