"""The function tracer: ftrace for user space (docs/architecture.md §8).

A tracer instance ("ops": which functions, graph mode or not) gets its own generated code in each
process (`codegen/ftrace.py`'s `build_ops_code`): an entry record, and in graph mode a shadow-stack entry whose
return code writes the exit record (the return-probe mechanism, core/returns.py). Each traced
function's entry takes a 5-byte jump (the optimizer's checks and relocation) to a small site
detour, `push ID; call TARGET`, TARGET being the one ops that traces the function, or a list
trampoline that calls every ops tracing it in turn. Starting or stopping an ops patches or
re-points only its own sites, under one stop-the-world per process; the others keep tracing.

Records are 16 bytes in the thread's ring: u16 ops, u16 kind (entry/exit), u32 function id, u64
time stamp; `session.write_raw` spools them to disk (`dynprobe record`), or `on_event` gets them.

One mechanism, kept whole in one module: choosing functions, patching them and following the
processes' life (fork, exec, dlopen) for them.
"""

from __future__ import annotations

import dataclasses
import os
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import iced_x86 as iced

from dynprobe.arch.x86_64 import jump_to
from dynprobe.arch.x86_64.codegen.ftrace import (
    SITE_CALL_AT,
    Captures,
    OpsCode,
    build_list_trampoline,
    build_ops_code,
    build_tracer_site,
    call_to,
)
from dynprobe.core.engine import Engine
from dynprobe.core.returns import RETURNS_TWICE
from dynprobe.core.slots import PlacedCode
from dynprobe.core.traced import TracedProcess
from dynprobe.debug import debug as _debug
from dynprobe.errors import OptimizeRefusal, ProcessError, Refusal, SessionError, SymbolError
from dynprobe.frozen import frozen
from dynprobe.gcpause import gc_paused
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.consumer import RecordBatch
from dynprobe.ringbuf.layout import FRAME_SHIFT, TRACE_DATA, TRACE_EXIT
from dynprobe.spec.argspec import MAX_VALUES, ArgSpec
from dynprobe.symbols import files
from dynprobe.symbols.demangle import names_of
from dynprobe.symbols.elf import ElfImage, load_elf
from dynprobe.symbols.ifunc import LoadedIn, callable_functions
from dynprobe.symbols.maps import Mapping, address_of_offset, file_key, maps_file, read_maps
from dynprobe.symbols.patterns import NamePattern, as_patterns
from dynprobe.symbols.resolve import find_file

if TYPE_CHECKING:
    import numpy as np

    from dynprobe.core.returns import ReturnProbes
else:
    from dynprobe.deferred import numpy as np


class TracingEngine(Engine, Protocol):
    """What the function tracer asks of the runtime (core/runtime.py), besides the engine's services."""

    returns: ReturnProbes

    def clock(self) -> dict[str, float]: ...
    def counters_of_index(self, index: int) -> tuple[int, int, int]: ...
    def ensure_thread_areas(self, proc: TracedProcess) -> bool: ...
    def reserve_index(self) -> int: ...
    def thread_rips(self, proc: TracedProcess) -> list[int]: ...
    def traced_processes(self) -> list[TracedProcess]: ...


ENDBR64 = bytes.fromhex("f30f1efa")
# Entered by a jump or a signal return, not a call (and the program's entry point, found in the ELF)
NOT_CALLED = frozenset({"_start", "__restore_rt", "_dl_start", "_dl_start_user", "__start_context"})
OPS_CODE_SLACK = 64
SITE_ROOM = 96
REACH = (1 << 31) - (1 << 24)  # a rel32 call from a site detour reaches code this close


@frozen
class TracedFunction:
    """A function the function tracer may patch, numbered (its id in records)."""

    id: int
    path: str
    vaddr: int
    size: int
    name: str
    plt: bool = False  # a PLT stub of the file at `path`: its calls to the library function `name`


@frozen
class TracerEvent:
    """One entry or exit, as `on_event` gets it (CLOCK_MONOTONIC ns)."""

    pid: int
    tid: int
    time_ns: int
    exit: bool
    function: TracedFunction


@dataclass(eq=False)
class TracerSite:
    """A function's entry patched by the tracer in one process, and the tracers its detour serves."""

    function: TracedFunction
    addr: int  # the function's entry in the process
    detour: int
    size: int
    region: bytes  # the original bytes under the jump
    ops: list[FunctionTracer] = field(default_factory=list)


@dataclass(eq=False)
class ProcessTracing:
    """The function tracer's state in one process: its patched entries and the code they share."""

    sites: dict[int, TracerSite] = field(default_factory=dict)  # function id -> site
    # ((ops index, the values it records), its code, size)
    code: list[tuple[tuple[int, Captures | None], OpsCode, int]] = field(default_factory=list)
    # ((ops index, values) of each, address, size)
    lists: list[tuple[tuple[tuple[int, Captures | None], ...], int, int]] = field(default_factory=list)
    # Detours of sites taken out at detach (address, size): a thread stopped in one still runs
    # into the tracer's code, and leaves it before its thread area goes
    retired: list[tuple[int, int]] = field(default_factory=list)

    def copy(self) -> ProcessTracing:
        """A fork child's: the same sites and code at the same addresses, its own bookkeeping."""
        sites = {k: dataclasses.replace(s, ops=list(s.ops)) for k, s in self.sites.items()}
        return ProcessTracing(sites, list(self.code), list(self.lists))

    def owns(self, rip: int) -> bool:
        """A thread at `rip` runs tracer code (it must leave it before the thread area goes)."""
        if any(s.detour <= rip < s.detour + s.size for s in self.sites.values()):
            return True
        if any(start <= rip < start + size for start, size in self.retired):
            return True
        return any(c.entry <= rip < c.entry + n for _, c, n in self.code) or any(
            a <= rip < a + n for _, a, n in self.lists
        )


@frozen
class Selection:
    """What a tracer traces, as asked: globs of names to include (all if none) and exclude, and
    libraries by name or path besides the program. Chosen again in a program a process execs."""

    include: tuple[NamePattern, ...] = ()
    exclude: tuple[NamePattern, ...] = ()
    libraries: tuple[str, ...] = ()
    library_calls: bool = False  # the program's calls to libraries, through its PLT
    nested_calls: bool = False  # and the calls its libraries make to others (uftrace's --nest-libcall)

    def calls_of(self, exe: str, libraries: dict[str, str]) -> list[str]:
        """The files whose PLT stubs are traced: the program's, and with nested calls those of
        the libraries it loads at start (not the dynamic loader's)."""
        if not self.library_calls:
            return []
        nested = [p for p in libraries.values() if not os.path.basename(p).startswith("ld-linux")]
        return [exe, *(nested if self.nested_calls else [])]


@frozen
class ValueRequest:
    """One -A or -R: the functions `pattern` names record `values` (arguments, or the return
    value). `auto`: from the table of known library functions (-a), which a user's request for
    the same function replaces."""

    pattern: NamePattern
    values: tuple[ArgSpec, ...]
    auto: bool = False


class FunctionTracer:
    """One tracer instance: a set of functions, graph mode (entries and exits) or entries only.
    `start()` patches its functions in every traced process, `stop()` takes them back."""

    def __init__(
        self, tracing: Tracing, index: int, functions: list[TracedFunction], graph: bool,
        on_event: Callable[[TracerEvent], object] | None, depth: int | None = None, threshold_ns: int = 0,
        snapshot_over_ns: int = 0,
    ) -> None:  # fmt: skip
        self.tracing = tracing
        self.index = index
        self.functions = functions
        self.graph = graph
        self.depth = depth  # graph mode: calls nested deeper than this are not recorded
        self.threshold_ns = threshold_ns  # graph mode: calls that end sooner are not recorded
        self.snapshot_over_ns = snapshot_over_ns  # a flight recorder's: calls this long take a snapshot
        self.on_event = on_event
        self.started = False
        self.patched = 0
        self.nop_entries = 0  # of them, patched over the NOPs compilers leave for tracers
        self.not_patched: Counter[str] = Counter()  # reason -> functions
        self.refused: dict[str, list[TracedFunction]] = {}  # reason -> the functions themselves
        self.unmapped: dict[int, set[int]] = {}  # pid -> functions whose library is not mapped there
        self.selection = Selection()
        # A forked child's thread -> (when it began, the calls of this tracer it began inside:
        # (function id, frame), outermost first), for readers to go on at its parent's depth
        self.inherited: dict[int, tuple[int, list[tuple[int, int]]]] = {}
        # function id -> the arguments and return value its records carry (`record_values`)
        self.captures: dict[int, Captures] = {}
        self.requests: tuple[ValueRequest, ...] = ()

    def record_values(self, requests: Iterable[ValueRequest]) -> None:
        """Have the functions `requests` name record those values, in graph mode for return
        values (before start(): each function's code is chosen as it is patched)."""
        self.requests = tuple(requests)
        if not self.graph and any(v.retval for r in self.requests for v in r.values):
            raise SessionError("return values are recorded in graph mode (where returns are traced)")
        self.captures.clear()
        self.choose_captures(self.functions)

    def choose_captures(self, functions: Iterable[TracedFunction]) -> None:
        """The values each of `functions` records, from the requests that name it: arguments
        add up (up to MAX_VALUES), the last return value given counts."""
        for func in functions:
            names = names_of(func.name)
            matching = [r for r in self.requests if r.pattern.matches(names, func.path, plt=func.plt)]
            if any(not r.auto for r in matching):
                matching = [r for r in matching if not r.auto]
            arguments: list[ArgSpec] = []
            retval: tuple[ArgSpec, ...] = ()
            for request in matching:
                if request.values[0].retval:
                    retval = request.values
                else:
                    arguments += [v for v in request.values if v not in arguments]
            if arguments or retval:
                self.captures[func.id] = Captures(tuple(arguments[:MAX_VALUES]), retval)

    def refuse(self, func: TracedFunction, reason: str) -> None:
        """`func` could not be patched, for `reason` (a Refusal or OptimizeRefusal name)."""
        self.not_patched[reason] += 1
        if reason != "NOT_MAPPED":  # (patched when its library is)
            self.refused.setdefault(reason, []).append(func)

    def start(self, progress: Callable[[int], object] | None = None) -> None:
        """Patch its functions in every traced process; `progress(n)` is told as n more are done."""
        if not self.started:
            self.tracing.start(self, progress)

    def stop(self) -> None:
        if self.started:
            self.tracing.stop(self)

    @property
    def calls(self) -> int:
        """Entries traced (in the target's counters)."""
        return self.tracing.engine.counters_of_index(self.index)[0]

    @property
    def missed(self) -> int:
        return self.tracing.engine.counters_of_index(self.index)[1]

    @property
    def lost(self) -> int:
        return self.tracing.engine.counters_of_index(self.index)[2]


class Tracing:
    """The function tracers of a session."""

    def __init__(self, engine: TracingEngine) -> None:
        self.engine = engine
        self.functions: list[TracedFunction] = []
        self._ids: dict[tuple[str, int], TracedFunction] = {}
        self.tracers: dict[int, FunctionTracer] = {}
        # What the tracers installed in each process (gone with it: a weak reference)
        self._installed: weakref.WeakKeyDictionary[TracedProcess, ProcessTracing] = weakref.WeakKeyDictionary()

    def of(self, proc: TracedProcess) -> ProcessTracing:
        """The tracers' sites and code in `proc`."""
        state = self._installed.get(proc)
        if state is None:
            state = self._installed[proc] = ProcessTracing()
        return state

    def owns(self, proc: TracedProcess, rip: int) -> bool:
        """A thread of `proc` at `rip` runs tracer code (it must leave it before its thread area goes)."""
        state = self._installed.get(proc)
        return state is not None and state.owns(rip)

    def patched_over(self, proc: TracedProcess, addr: int) -> bool:
        """Whether a traced function's jump covers `addr` in `proc`."""
        state = self._installed.get(proc)
        return state is not None and any(s.addr <= addr < s.addr + len(s.region) for s in state.sites.values())

    def began_inside(self, tid: int, entries: list[tuple[int, int, int]]) -> None:
        """A forked child's thread `tid` begins inside the calls its parent had open: its copy of
        the shadow stack, as (probe index, return-address slot, data) of each entry."""
        began = time.monotonic_ns()
        outermost_first = sorted(entries, key=lambda entry: -entry[1])  # (the stack grows down)
        for tracer in self.tracers.values():
            calls = [(data & 0xFFFF_FFFF, (data >> 32 & 0xFFFF) >> FRAME_SHIFT)
                     for index, _, data in outermost_first if index == tracer.index]  # fmt: skip
            if calls and tracer.graph:
                tracer.inherited[tid] = (began, calls)

    # --- choosing functions ---------------------------------------------------------------------------
    def select(
        self,
        paths: Iterable[str],
        include: Iterable[str | NamePattern] = (),
        exclude: Iterable[str | NamePattern] = (),
        loaded: Callable[[ElfImage], LoadedIn | None] = lambda image: None,
        *,
        calls_of: Iterable[str] = (),
    ) -> list[TracedFunction]:
        """The functions (symbols with a size) of the files at `paths` whose names (demangled
        too) match a pattern of `include` (all if none) and none of `exclude` (a string is a
        glob; `loaded`: where a file is mapped, for its indirect functions: symbols/ifunc.py).
        With them, the PLT stubs of the files at `calls_of`: each traces the calls the file
        makes to a library function, named after it (uftrace's library calls)."""
        include, exclude = as_patterns(include), as_patterns(exclude)
        chosen = []
        images = [load_elf(path) for path in paths]
        candidates = [(image, callable_functions(image, loaded(image)), False) for image in images]
        candidates += [(image, image.plt_stubs, True) for image in map(load_elf, calls_of)]
        for image, functions, plt in candidates:
            for func in functions:
                if not image.is_executable(func.addr):
                    continue
                if func.addr <= image.entry < func.end or func.name in NOT_CALLED:
                    continue  # entered without a call: [rsp] is not a return address
                names = names_of(func.name)  # C++: 'ns::Class::*' matches too
                if include and not any(p.matches(names, image.path, plt=plt) for p in include):
                    continue
                if any(p.matches(names, image.path, plt=plt) for p in exclude):
                    continue
                chosen.append(self._function(image.path, func.addr, func.size, func.name, plt=plt))
        # Aliases (C++ C1/C2 constructors, glibc's __libc_malloc and malloc) are one function.
        return list({f.id: f for f in chosen}.values())

    def _function(self, path: str, vaddr: int, size: int, name: str, *, plt: bool = False) -> TracedFunction:
        key = (path, vaddr)
        func = self._ids.get(key)
        if func is None:
            func = self._ids[key] = TracedFunction(len(self.functions), path, vaddr, size, name, plt)
            self.functions.append(func)
        return func

    def new_tracer(
        self, functions: list[TracedFunction], graph: bool, on_event: Callable[[TracerEvent], object] | None,
        depth: int | None = None, threshold_ns: int = 0, snapshot_over_ns: int = 0,
    ) -> FunctionTracer:  # fmt: skip
        if not functions:
            raise SessionError("no function to trace: the filters match nothing")
        if depth is not None and (not graph or not 1 <= depth <= L.SHADOW_CAPACITY):
            raise SessionError(f"a depth limit is from 1 to {L.SHADOW_CAPACITY}, in graph mode")
        if threshold_ns and (not graph or threshold_ns < 0):
            raise SessionError("a time threshold is a positive time, in graph mode")
        if snapshot_over_ns and (not graph or snapshot_over_ns < 0):
            raise SessionError("a snapshot threshold is a positive time, in graph mode")
        tracer = FunctionTracer(
            self, self.engine.reserve_index(), functions, graph, on_event, depth, threshold_ns, snapshot_over_ns
        )
        self.tracers[tracer.index] = tracer
        return tracer

    # --- starting and stopping -----------------------------------------------------------------------
    def start(self, tracer: FunctionTracer, progress: Callable[[int], object] | None = None) -> None:
        tracer.started = True
        tracer.patched = tracer.nop_entries = 0
        tracer.not_patched.clear()
        tracer.refused.clear()
        tracer.unmapped.clear()
        for proc in self.engine.traced_processes():
            with self.engine.world_stopped(proc) as tid, files.unchanged(), gc_paused(), proc.tracee.batched():
                if tid is not None:
                    self._start_in(proc, tracer, progress=progress)

    def _start_in(
        self, proc: TracedProcess, tracer: FunctionTracer, functions: list[TracedFunction] | None = None,
        progress: Callable[[int], object] | None = None,
    ) -> None:  # fmt: skip
        engine = self.engine
        functions = tracer.functions if functions is None else functions
        if not engine.ensure_thread_areas(proc):
            tracer.not_patched[(proc.areas_refused or OptimizeRefusal.GS_IN_USE).name] += len(functions)
            return
        maps = read_maps(proc.pid)
        if tracer.graph:
            near = next((m.start for m in maps if m.executable and m.path == proc.exe), maps[0].start)
            try:
                engine.returns.setup(proc, near)
            except ProcessError as exc:  # (no memory for the trampoline: nothing is patched)
                raise SessionError(f"cannot trace function returns: {exc}") from exc
        state = self.of(proc)
        rips = engine.thread_rips(proc)
        # Graph mode replaces return addresses: where return probes cannot be safe (Go's moving
        # stacks, a CET shadow stack), neither is it.
        refusals: dict[str, Refusal | None] = {}
        for done, func in enumerate(functions, 1):
            if progress is not None and done % 100 == 0:
                progress(100)
            if tracer.graph:
                if func.name in RETURNS_TWICE:
                    tracer.refuse(func, Refusal.RETURNS_TWICE.name)
                    continue
                if func.path not in refusals:
                    refusals[func.path] = engine.returns.refusal(proc, func.path)
                refusal = refusals[func.path]
                if refusal is not None:
                    tracer.refuse(func, refusal.name)
                    continue
            site = state.sites.get(func.id)
            if site is not None:
                site.ops.append(tracer)
                self._point(proc, site)
                tracer.patched += 1
                continue
            reason = self._patch(proc, func, tracer, maps, rips)
            if reason is None:
                tracer.patched += 1
            else:
                tracer.refuse(func, reason)
                if reason == "NOT_MAPPED":
                    tracer.unmapped.setdefault(proc.pid, set()).add(func.id)

    def _patch(
        self, proc: TracedProcess, func: TracedFunction, tracer: FunctionTracer, maps: list[Mapping], rips: list[int]
    ) -> str | None:
        """Patch `func` in `proc` for `tracer` alone; the reason if it cannot be."""
        image = load_elf(func.path)
        offset = image.vaddr_to_offset(func.vaddr)
        addr = address_of_offset(maps, file_key(func.path), func.path, offset) if offset is not None else None
        if addr is None:
            return "NOT_MAPPED"
        code = image.code(func.vaddr, func.size) + image.padding_after(func.vaddr + func.size)
        # After an endbr64 when there is one: a call through a pointer must still land on it (IBT).
        skip = len(ENDBR64) if code.startswith(ENDBR64) else 0
        bias = addr - func.vaddr
        # (Its patch is the entry's alone: a branch into the replaced bytes is not taken along.)
        plan = image.jump_plan(func.vaddr, func.size, addr + skip, bias=bias, take_along=False)
        if isinstance(plan, OptimizeRefusal) and skip:
            skip = 0
            plan = image.jump_plan(func.vaddr, func.size, addr, bias=bias, take_along=False)
        if isinstance(plan, OptimizeRefusal):
            return plan.name
        addr += skip
        if any(addr <= a < addr + plan.overwritten for a in proc.sites):
            return "PROBED"  # a probe's int3 or jump is there
        original = code[skip : skip + plan.overwritten]
        if proc.tracee.read(addr, plan.overwritten) != original:
            return "BYTES_MISMATCH"
        if any(addr < rip < addr + plan.length for rip in rips):
            return "BUSY"  # a thread is inside the patched bytes now
        at = self.engine.allocate_slot(proc, addr, SITE_ROOM)
        if at is None:
            return OptimizeRefusal.NO_MEMORY.name
        detour = build_tracer_site(plan, func.id, self._ops_entry(proc, tracer, func, at), at)
        if isinstance(detour, OptimizeRefusal) or len(detour) > SITE_ROOM:
            proc.slots.free(at, SITE_ROOM)
            return detour.name if isinstance(detour, OptimizeRefusal) else "TOO_LARGE"
        proc.slots.shrink(at, SITE_ROOM, len(detour))
        proc.tracee.write(at, detour)
        proc.tracee.patch(addr, jump_to(addr, at), original)
        self.of(proc).sites[func.id] = TracerSite(func, addr, at, len(detour), original, [tracer])
        if all(insn.mnemonic == iced.Mnemonic.NOP for insn in plan.region):
            tracer.nop_entries += 1  # -mnop-mcount, -fpatchable-function-entry: nothing to relocate
        return None

    def modules_changed(self, proc: TracedProcess, maps: list[Mapping]) -> None:
        """Libraries were mapped or unmapped (`maps`: as they are now): functions of libraries
        gone are forgotten, and wait for their library as those never mapped do; functions of
        mapped ones that started tracers wait for get patched."""
        self._forget_unmapped(proc, maps)
        waiting = [t for t in self.tracers.values() if t.started and t.unmapped.get(proc.pid)]
        if not waiting or not proc.follow:
            return
        with self.engine.world_stopped(proc) as tid, files.unchanged(), gc_paused(), proc.tracee.batched():
            if tid is None:
                return
            for tracer in waiting:
                ids = tracer.unmapped.pop(proc.pid)
                tracer.not_patched["NOT_MAPPED"] -= len(ids)
                self._start_in(proc, tracer, [f for f in tracer.functions if f.id in ids])
                tracer.not_patched += Counter()  # drop zero counts

    def let_go(self, child: TracedProcess) -> None:
        self.restore(child)

    def execed(self, proc: TracedProcess, maps: list[Mapping]) -> None:
        """`proc` runs a new program (exec, followed): each started tracer chooses its functions
        again in it, as it chose them in the first (new ones join its table), and patches them
        (those of libraries once the loader maps them)."""
        for tracer in self.tracers.values():
            tracer.inherited.pop(proc.pid, None)  # (the calls it began inside are gone with their program)
        for tracer in [t for t in self.tracers.values() if t.started]:
            tracer.unmapped.pop(proc.pid, None)
            selection = tracer.selection
            try:
                paths = [proc.exe] + [find_file(name, maps, proc.libraries) for name in selection.libraries]
                calls_of = selection.calls_of(proc.exe, proc.libraries())
                chosen = self.select(paths, selection.include, selection.exclude, calls_of=calls_of)
            except (SymbolError, SessionError) as exc:
                _debug(f"pid {proc.pid} exec'd {proc.exe}: not traced: {exc}")
                continue
            known = {f.id for f in tracer.functions}
            tracer.functions.extend(f for f in chosen if f.id not in known)
            tracer.choose_captures(chosen)
            self._start_in(proc, tracer, chosen)

    def forget_image(self, proc: TracedProcess) -> None:
        """`proc` exec'd: the old image took the sites and code with it."""
        self._installed.pop(proc, None)

    def forked(self, parent: TracedProcess, child: TracedProcess, tid: int, *, vfork: bool) -> None:
        """A fork child has its parent's sites and code, and waits for the same libraries."""
        if parent in self._installed:
            self._installed[child] = self._installed[parent].copy()
        for tracer in self.tracers.values():
            if parent.pid in tracer.unmapped:
                tracer.unmapped[child.pid] = set(tracer.unmapped[parent.pid])

    def _forget_unmapped(self, proc: TracedProcess, maps: list[Mapping]) -> None:
        """Sites whose library was unloaded (dlclose): nothing of ours is left there, and the
        address may hold another library by now, which must never get the old bytes back."""
        code: dict[str, list[tuple[int, int]]] = {}  # path -> where it is mapped executable
        sites = self.of(proc).sites
        for fid, site in list(sites.items()):
            path = site.function.path
            if path not in code:
                key = file_key(path)
                code[path] = [(m.start, m.end) for m in maps if m.executable and maps_file(m, key, path)]
            if any(start <= site.addr < end for start, end in code[path]):
                continue
            del sites[fid]
            proc.dirty.append(PlacedCode(site.detour, site.size, ()))
            if proc.tracee.journal is not None:
                proc.tracee.journal.drop(proc.pid, site.addr)
            for tracer in site.ops:
                tracer.patched -= 1
                tracer.not_patched["NOT_MAPPED"] += 1
                tracer.unmapped.setdefault(proc.pid, set()).add(fid)

    def stop(self, tracer: FunctionTracer) -> None:
        tracer.started = False
        for proc in self.engine.traced_processes():
            with self.engine.world_stopped(proc), proc.tracee.batched():
                if proc.tracee.image_gone():
                    continue
                for site in list(self.of(proc).sites.values()):
                    if tracer in site.ops:
                        site.ops.remove(tracer)
                        self._point(proc, site)

    def _point(self, proc: TracedProcess, site: TracerSite) -> None:
        """The site calls its one ops directly, a list trampoline for several, or goes (none)."""
        if not site.ops:
            proc.tracee.unpatch(site.addr, site.region)
            proc.dirty.append(PlacedCode(site.detour, site.size, ()))
            del self.of(proc).sites[site.function.id]
            return
        if len(site.ops) == 1:
            target = self._ops_entry(proc, site.ops[0], site.function, site.detour)
        else:
            target = self._list(proc, site.ops, site.function, site.detour)
        proc.tracee.write(site.detour + SITE_CALL_AT, call_to(site.detour, target))

    # --- generated code ------------------------------------------------------------------------------
    def _ops_code(self, proc: TracedProcess, tracer: FunctionTracer, func: TracedFunction, near: int) -> OpsCode:
        """The code of `tracer` for `func` within reach of `near`: its instance's, or the
        instance's for the values `func` records."""
        captures = tracer.captures.get(func.id)
        for key, placed, _ in self.of(proc).code:
            if key == (tracer.index, captures) and abs(placed.entry - near) < REACH:
                return placed
        engine = self.engine
        trampoline = proc.returns.trampoline if tracer.graph and proc.returns is not None else None
        scale = engine.clock()["scale"]
        ticks, snapshot_ticks = (
            max(1, round(ns / scale)) if ns else 0 for ns in (tracer.threshold_ns, tracer.snapshot_over_ns)
        )

        def build(at: int) -> tuple[bytes, OpsCode]:
            return build_ops_code(
                engine.layout, tracer.index, trampoline, at, depth=tracer.depth, threshold=ticks, captures=captures,
                snapshot_over=snapshot_ticks,
            )  # fmt: skip

        room = len(build(near)[0]) + OPS_CODE_SLACK  # (branches out may take other sizes elsewhere)
        at = engine.allocate_slot(proc, near, room)
        if at is None:
            raise SessionError(f"no executable memory for the function tracer in pid {proc.pid}")
        code, where = build(at)
        assert len(code) <= room
        proc.slots.shrink(at, room, len(code))
        proc.tracee.write(at, code)
        proc.fixups.update(where.fixups)
        self.of(proc).code.append(((tracer.index, captures), where, len(code)))
        return where

    def _ops_entry(self, proc: TracedProcess, tracer: FunctionTracer, func: TracedFunction, near: int) -> int:
        return self._ops_code(proc, tracer, func, near).entry

    def _list(self, proc: TracedProcess, tracers: list[FunctionTracer], func: TracedFunction, near: int) -> int:
        key = tuple((t.index, t.captures.get(func.id)) for t in tracers)
        for ops, addr, _ in self.of(proc).lists:
            if ops == key and abs(addr - near) < REACH:
                return addr
        bodies = [self._ops_code(proc, t, func, near).body for t in tracers]
        points = proc.returns.trampoline.points if proc.returns is not None else None
        size = len(build_list_trampoline(bodies, near, points))  # (rel32 calls, an imm64: any address)
        at = self.engine.allocate_slot(proc, near, size)
        if at is None:
            raise SessionError(f"no executable memory for the function tracer in pid {proc.pid}")
        code = build_list_trampoline(bodies, at, points)
        assert len(code) == size
        proc.tracee.write(at, code)
        self.of(proc).lists.append((key, at, len(code)))
        return at

    # --- the process's life ----------------------------------------------------------------------------
    def restore(self, proc: TracedProcess) -> None:
        """Original bytes at every traced function (detach, a fork child let go)."""
        state = self.of(proc)
        for site in state.sites.values():
            try:
                proc.tracee.unpatch(site.addr, site.region)
            except OSError:
                continue
            state.retired.append((site.detour, site.size))
        state.sites.clear()

    # --- events ---------------------------------------------------------------------------------------
    def deliver(self, tracer: FunctionTracer, batch: RecordBatch) -> None:
        if tracer.on_event is None:
            return
        raw, times = batch.raw, batch.time_ns
        if tracer.captures:  # (the values' records: `dynprobe record` keeps them)
            calls = raw[:, 3] & (TRACE_DATA >> 8) == 0
            raw, times = raw[calls], times[calls]
        kinds = raw[:, 2:4].copy().view(np.uint16).ravel().tolist()
        ids = raw[:, 4:8].copy().view(np.uint32).ravel().tolist()
        for t, kind, fid in zip(times.tolist(), kinds, ids, strict=True):
            if fid < len(self.functions):
                tracer.on_event(TracerEvent(batch.pid, batch.tid, t, bool(kind & TRACE_EXIT), self.functions[fid]))
