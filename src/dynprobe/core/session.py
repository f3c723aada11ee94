"""A tracing session: the public API over the runtime (core/runtime.py) of one set of traced
processes. `spawn()` and `attach()` make one; it places probes and function tracers, runs the
target, and lets it go on `close()` (or at the end of a `with` block), restoring every byte
dynprobe wrote. Threads that do not hit a probe never stop: a breakpoint stops only the thread
that hit it, and the world is stopped only to patch memory other threads may be executing or to
leave. docs/architecture.md describes the layers beneath. (One concept in one module: the API,
its length its docstrings, the reference of its users.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO, ParamSpec, Protocol, TypeVar

from dynprobe.actions.filter import parse_filter, parse_value
from dynprobe.actions.model import ActionKind, filter_args
from dynprobe.core.datapath import FLIGHT_AND_THRESHOLD, SNAPSHOT_WITHOUT_FLIGHT
from dynprobe.core.ftrace import FunctionTracer, Selection, TracedFunction, TracerEvent
from dynprobe.core.probe import EventHandler, Handler, Probe, ProgramBody
from dynprobe.core.processes import signals_held
from dynprobe.core.returns import RETURNS_TWICE, default_maxactive
from dynprobe.core.runtime import Runtime
from dynprobe.core.sites import check_location, default_event_name, identifier
from dynprobe.core.stacks import MAX_FRAMES
from dynprobe.core.traced import TracedProcess
from dynprobe.errors import ProbeRefused, ProcessError, Refusal, SessionError, SymbolError
from dynprobe.gcpause import gc_paused
from dynprobe.ptrace.process import Tracee
from dynprobe.ptrace.process import attach as ptrace_attach
from dynprobe.ptrace.process import spawn as ptrace_spawn
from dynprobe.ringbuf import layout as L
from dynprobe.spec.model import FetchArg, ProbeSpec, SymbolAddr, fetch_chain, split_location
from dynprobe.spec.parser import parse_probe
from dynprobe.symbols import files
from dynprobe.symbols.elf import load_elf
from dynprobe.symbols.maps import read_maps
from dynprobe.symbols.patterns import NamePattern, as_patterns
from dynprobe.symbols.resolve import (
    Location,
    expand_pattern,
    find_file,
    is_pattern,
    loaded_in,
    resolve,
    resolve_address,
)

if TYPE_CHECKING:
    from dynprobe.core.programs import PlacedProgram

_P = ParamSpec("_P")
_T = TypeVar("_T")


def _on_tracing_thread(what: str) -> Callable[[Callable[_P, _T]], Callable[_P, _T]]:
    """A method that uses ptrace: called from a handler served by an upcall, the stop loop
    makes the call for it (core/upcalls.py)."""

    def decorate(method: Callable[_P, _T]) -> Callable[_P, _T]:
        @functools.wraps(method)
        def call(*args: _P.args, **kw: _P.kwargs) -> _T:
            session = args[0]
            assert isinstance(session, Session)
            return session._runtime.upcalls.on_tracing_thread(what, lambda: method(*args, **kw))

        return call

    return decorate


class Session:
    """Traced processes and their probes. Use `spawn()` or `attach()` to make one."""

    def __init__(self, tracee: Tracee, spawned: bool, follow_fork: bool = False) -> None:
        """(Made by `spawn()` and `attach()`, over the tracee they start or attach to.)"""
        self.spawned = spawned
        self.warnings: list[str] = []
        self.on_warning: Callable[[str], None] | None = None
        self._runtime = Runtime(tracee, follow_fork=follow_fork, warn=self._warn)

    def __enter__(self) -> Session:
        """The session; `close()` at the end of the block, whatever ends it."""
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        """`close()`."""
        self.close()

    def close(self) -> None:
        """Detach from every process, restoring every byte dynprobe wrote. Idempotent.

        A command this session spawned that never ran (`run()` was not called) is killed
        instead: it has not executed a single instruction of its own."""
        processes = self._runtime.processes
        if processes.closed:
            return
        self._runtime.upcalls.check_not_in_server("closing the session")
        processes.closed = True
        with signals_held():
            self._runtime.shut_down(kill=self.spawned and not processes.started)

    def detach(self) -> None:
        """Restore every byte written, move threads out of slots and traps, and let all go."""
        self._runtime.upcalls.check_not_in_server("detaching")
        self._runtime.detacher.detach_all()

    def _check_open(self) -> None:
        if self._runtime.processes.closed:
            raise SessionError("the session is closed")

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        if self.on_warning is not None:
            self.on_warning(message)

    # --- settings -------------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        """The process the session began with (the command, or the one attached to)."""
        return self._runtime.processes.main_pid

    @property
    def exit_status(self) -> int | None:
        """The main process's exit status once it ended (128+N if signal N killed it)."""
        return self._runtime.processes.exit_status

    @property
    def follow_fork(self) -> bool:
        """Whether children the processes fork are traced (with the probes) or let go."""
        return self._runtime.follow_fork

    @property
    def probes(self) -> list[Probe]:
        """The probes placed and not removed."""
        return self._runtime.probes

    @property
    def stats(self) -> dict[str, int]:
        """ "stops": trap hits served at a stop; "fixups": faulting fetches of detours fixed up."""
        return self._runtime.stats

    @property
    def optimize(self) -> bool:
        """Whether probes may become jumps (optprobes); False: every probe stays a trap."""
        return self._runtime.optimize

    @optimize.setter
    def optimize(self, on: bool) -> None:
        self._runtime.optimize = on

    @property
    def upcalls(self) -> bool:
        """Whether Python handlers are served without a ptrace stop: a site whose probes all
        have Python handlers (pre, post, a return probe's entry and return) takes a jump to code
        that hands the thread's registers to them through shared memory, and waits
        (docs/architecture.md §4). Handlers then run in a thread of dynprobe's, one at a time;
        what they ask of the session is done by `run()` while they wait. On by default where
        the kernel has futex_waitv (5.16+). Off: every hit a stop."""
        return self._runtime.upcalls.enabled

    @upcalls.setter
    def upcalls(self, on: bool) -> None:
        if on == self._runtime.upcalls.enabled:
            return
        self._runtime.upcalls.enabled = on
        for probe in self.probes:  # (sites placed already: a jump now, or a trap again)
            self._runtime.sync_probe(probe)

    @property
    def pin_tracer(self) -> bool:
        """Whether `run()` keeps dynprobe on one CPU and wakes the target's threads there (trap
        hits cost less when both are on one CPU of a VM)."""
        return self._runtime.loop.pin_tracer

    @pin_tracer.setter
    def pin_tracer(self, on: bool) -> None:
        self._runtime.loop.pin_tracer = on

    @property
    def ring_bytes(self) -> int:
        """Bytes of each thread's ring; set before the first probe is optimized (`layout`)."""
        return self._runtime.data.ring_bytes

    @ring_bytes.setter
    def ring_bytes(self, size: int) -> None:
        self._runtime.data.ring_bytes = size

    @property
    def record_size(self) -> int | None:
        """Bytes of a record (a power of two); None: the smallest that holds every probe's."""
        return self._runtime.data.record_size

    @record_size.setter
    def record_size(self, size: int | None) -> None:
        self._runtime.data.record_size = size

    @property
    def layout(self) -> L.AreaLayout:
        """The thread-area layout, fixed by the first call: ring size, and a record size that holds
        the record of every probe placed so far (later, bigger ones stay traps)."""
        return self._runtime.data.layout

    @property
    def wait_for_room(self) -> float:
        """Seconds a thread whose ring is full waits for the reader to make room before its record
        is counted lost (0: lost at once, the lossy mode). The wait costs the target nothing
        while its rings have room."""
        return self._runtime.data.wait_for_room

    @wait_for_room.setter
    def wait_for_room(self, seconds: float) -> None:
        self._runtime.data.wait_for_room = seconds

    @property
    def flight_recorder(self) -> bool:
        """Whether the rings are a flight recorder's: a full ring gives up its oldest records for
        the newest (counted: `records_overwritten`; nothing waits, nothing is lost), and records
        are read only by `drain()` (from any thread; `request_snapshot()` from a signal handler)
        and when the session ends: the newest each ring holds, as ftrace's snapshot and perf's
        --overwrite keep them."""
        return self._runtime.data.flight_recorder

    @flight_recorder.setter
    def flight_recorder(self, on: bool) -> None:
        self._runtime.data.flight_recorder = on

    # --- probes ---------------------------------------------------------------------------------
    def _main_process(self, refused: str) -> TracedProcess:
        self._check_open()
        main = self._runtime.processes.main()
        if main is None:
            raise SessionError(f"the target has exited; {refused}")
        return main

    @_on_tracing_thread("placing a probe")
    def probe(
        self,
        spec_or_address: str | int | ProbeSpec,
        pre: Handler | None = None,
        post: Handler | None = None,
        enabled: bool = True,
        action: str | ActionKind | None = None,
        filter: str | None = None,
        value: str | None = None,
        on_event: EventHandler | None = None,
        *,
        on_entry: Handler | None = None,
        on_return: Handler | None = None,
        maxactive: int | None = None,
        data_size: int = 0,
        by: str | None = None,
        max_frames: int = MAX_FRAMES,
        lang: ProgramBody | None = None,
    ) -> Probe:
        """Place a probe (a return probe for an 'r' spec; see `retprobe`). `spec_or_address` is a
        probe spec ('p:grp/ev libc:malloc size=%di'), a bare location ('main', 'main+4',
        '/path/lib.so:0x1139') or an absolute address.

        With `pre`/`post` Python handlers it is a trap probe (handlers run at a stop). Otherwise it
        runs an action in the target once optimized: 'count' (the default), 'record' (the fetch
        arguments, delivered to `on_event` by the consumer; implied by `on_event`) or 'hist'
        (a log2 histogram of the fetch argument `value`), behind an optional `filter`
        ('a == 5 and b > 0' over its fetch arguments). With `by="stack"` a count also counts
        each hit by its stack (`probe.stacks`), walked in the target, at most `max_frames`
        frames (with a `value`, it is summed by stack too: `probe.stack_sums`); the records of a
        probe placed so (`on_event`, action="record") carry their stack (`ProbeEvent.stack`). `lang`
        is `program()`'s: the body of a bpftrace program's probe."""
        main = self._main_process("no probe can be placed")
        stack_frames = self._stack_frames(by, max_frames)
        maps = self._runtime.maps_of(main.pid)
        if isinstance(spec_or_address, int):
            location = resolve_address(spec_or_address, maps)
            spec = ProbeSpec("p", None, None, f"{spec_or_address:#x}")
        else:
            spec = spec_or_address if isinstance(spec_or_address, ProbeSpec) else parse_probe(spec_or_address)
            if is_pattern(split_location(spec.location)[2]):
                raise SessionError(
                    f"{spec.location!r} is a pattern: session.expand(spec) gives a spec for each function it names"
                )
            location = resolve(spec.location, main.exe, maps, main.libraries, main.tracee.peek_u64)
        is_return = spec.kind == "r"
        refusal = check_location(location)
        if refusal is None and is_return:
            refusal = self._return_refusal(main, location)
        if refusal is not None:
            raise ProbeRefused(refusal, f"{location.basename}:{location.label}")
        if not is_return and (on_entry or on_return or maxactive or data_size):
            raise SessionError("on_entry, on_return, maxactive and data_size are for return probes")
        if is_return and (pre or post):
            raise SessionError("a return probe takes on_entry/on_return handlers, not pre/post")
        active = self._check_maxactive(maxactive if maxactive is not None else spec.maxactive) if is_return else 0
        self._check_fetch_symbols(spec.args, location)
        python = any(h is not None for h in (pre, post, on_entry, on_return))
        kind = self._action_kind(action, python, on_event)
        if stack_frames and kind not in (ActionKind.COUNT, ActionKind.RECORD):
            other = kind.value if kind else "Python handlers"
            raise SessionError(f"by='stack' counts or records a probe's hits with their stacks: a count or a "
                               f"record, not {other}")  # fmt: skip
        parsed_filter = parse_filter(filter, spec.args) if filter is not None else None
        hist_value = None
        if kind == ActionKind.HIST:
            if value is None:
                raise SessionError("a histogram needs a value: a fetch argument's name, or a fetch argument")
            hist_value = parse_value(value, spec.args)
        elif value is not None:
            if not (stack_frames and kind == ActionKind.COUNT):
                raise SessionError("a value is for a histogram, or summed by stack (a count with by='stack')")
            hist_value = parse_value(value, spec.args)
        if parsed_filter is not None:
            self._check_fetch_symbols(tuple(filter_args(parsed_filter)), location)
        data = self._runtime.data
        probe = Probe(
            self._runtime, location, spec.group or "uprobes", spec.event or default_event_name(location, is_return),
            spec.args, pre, post, enabled, kind, parsed_filter, hist_value, on_event,
            index=data.next_index(), hist_index=data.hists, is_return=is_return, maxactive=active,
            on_entry=on_entry, on_return=on_return, data_size=data_size, stack_frames=stack_frames, lang=lang,
        )  # fmt: skip
        if is_return and kind is not None:
            self._check_data_size(probe)
        data.register(probe)
        self.probes.append(probe)
        try:
            for proc in self._runtime.processes:
                if proc.follow:
                    known = self._runtime.modules.now.get(proc.pid)
                    self._runtime.modules.sync_process(proc, only=probe, strict=proc.pid == main.pid, maps=known)
        except ProbeRefused:
            probe.remove()
            raise
        return probe

    @staticmethod
    def _stack_frames(by: str | None, max_frames: int) -> int:
        if by is None:
            return 0
        if by != "stack":
            raise SessionError(f"by={by!r}: hits are counted by 'stack' only")
        if isinstance(max_frames, bool) or not isinstance(max_frames, int) or not 1 <= max_frames <= MAX_FRAMES:
            raise SessionError(f"max_frames {max_frames!r} is not a number of frames (1..{MAX_FRAMES})")
        return max_frames

    def program(self, source: str, filename: str = "stdin") -> PlacedProgram:
        """A program in bpftrace's language (`dynprobe run`'s): its uprobe and uretprobe bodies
        compiled into the target, its maps in memory shared with it (`PlacedProgram.entries`,
        `format_maps`); BEGIN, END and interval bodies are the caller's to run
        (`run_blocks`, `intervals`). Raises `ProgramError` as bpftrace reports errors."""
        from dynprobe.core.programs import PlacedProgram  # (its language's modules: only for programs)
        from dynprobe.lang.maps import Clock

        self._main_process("no program can be placed")
        runtime = self._runtime
        mult, ticks = runtime.tsc_mult(), runtime.read_tsc()
        clock = Clock(mult, runtime.tsc_to_ns(ticks) - (ticks * mult >> 32), time.monotonic_ns())

        def process(pid: int) -> TracedProcess | None:
            return next((p for p in runtime.processes if p.pid == pid), None)

        placed = PlacedProgram(source, filename, clock=clock, process=process, comm=runtime.comm_of,
                               stack_at=runtime.stack_at)  # fmt: skip
        placed.place(self.expand, functools.partial(self.probe, action="count"))
        return placed

    def expand(self, spec: str | ProbeSpec) -> list[ProbeSpec]:
        """A spec whose location is a shell-style pattern ('p libc:str*', 'r app:parse_*
        n=%di') as the specs of each function it names (one per address; `expand_pattern`),
        each with its own event name; any other spec as itself."""
        parsed = spec if isinstance(spec, ProbeSpec) else parse_probe(spec)
        if not is_pattern(split_location(parsed.location)[2]):
            return [parsed]
        main = self._main_process("no probe can be placed")
        maps = self._runtime.maps_of(main.pid)
        locations = expand_pattern(parsed.location, main.exe, maps, main.libraries, main.tracee.peek_u64)
        if len(locations) == 1:
            return [dataclasses.replace(parsed, location=locations[0][0])]
        named = []  # each event named after its function: p_strlen (by default), EVENT_strcmp_4
        for where, name in locations:
            what = split_location(where)[2]
            by_offset = what.startswith("0x")  # a name several functions have: named with its offset
            if parsed.event is None and not by_offset:
                named.append(dataclasses.replace(parsed, location=where))
                continue
            function = f"{name}_{what[2:]}" if by_offset else what.replace("+0x", "_")
            prefix = parsed.event or parsed.kind
            named.append(dataclasses.replace(parsed, location=where, event=identifier(f"{prefix}_{function}")))
        return named

    def retprobe(
        self,
        function: str,
        handler: Handler | None = None,
        entry: Handler | None = None,
        data_size: int = 0,
        maxactive: int | None = None,
        **kw: Any,
    ) -> Probe:
        """Place a return probe on `function` ('SYMBOL' or 'PATH:SYMBOL', with or without fetch
        arguments, or an 'r' spec). With Python handlers: `entry(hit)` runs at the entry (a true result
        vetoes the instance: no return handler runs, nothing is counted missed; `hit.data = obj`
        keeps any object for the return), `handler(hit)` at the return (`hit.retval`,
        `hit.data`, `hit.caller`; changing `hit.regs.rax` changes the return value). Without
        them, an action as for `probe` (keyword arguments), run in the target, where `$argN`
        are the entry's arguments and `$latency` the nanoseconds since the entry; `data_size`
        (if given) is checked to hold what the entry keeps. `maxactive`: pending instances per
        thread (default max(10, 2 x CPUs)); entries beyond it are counted in `nmissed`."""
        kind = function.split(None, 1)[0].split(":", 1)[0] if function.strip() else ""
        parsed = parse_probe(function if kind in ("p", "r") else f"r {function}")
        if parsed.kind != "r":
            raise SessionError(f"{function!r} is not a return probe spec")
        return self.probe(parsed, on_entry=entry, on_return=handler, maxactive=maxactive, data_size=data_size, **kw)

    @staticmethod
    def _check_maxactive(maxactive: int | None) -> int:
        if maxactive is None:
            return default_maxactive()
        if not 1 <= maxactive <= L.SHADOW_CAPACITY:
            raise SessionError(f"maxactive {maxactive} is out of range (1..{L.SHADOW_CAPACITY})")
        return maxactive

    def _check_data_size(self, probe: Probe) -> None:
        kept = 8 * len(self._runtime.returns.entry_of(probe).arg_indices)
        room = L.SHADOW_ENTRY - L.ENTRY_DATA
        if not 0 <= probe.data_size <= room:
            raise SessionError(f"data_size {probe.data_size} is out of range (0..{room} bytes)")
        if probe.data_size and probe.data_size < kept:
            raise SessionError(f"data_size {probe.data_size} is too small: the entry keeps {kept} bytes of $argN")

    def _return_refusal(self, proc: TracedProcess, location: Location) -> Refusal | None:
        if location.function is None or location.function.addr != location.vaddr:
            return Refusal.NOT_FUNCTION_ENTRY
        if location.function.name in RETURNS_TWICE:
            return Refusal.RETURNS_TWICE
        return self._runtime.returns.refusal(proc, location.path)

    @_on_tracing_thread("making a function tracer")
    def function_tracer(
        self,
        filter: Iterable[str | NamePattern] = (),  # ftrace's word (set_ftrace_filter)
        exclude: Iterable[str | NamePattern] = (),
        libraries: Iterable[str] = (),
        graph: bool = True,
        on_event: Callable[[TracerEvent], object] | None = None,
        depth: int | None = None,
        threshold_ns: int = 0,
        library_calls: bool = False,
        nested_calls: bool = False,
        snapshot_over_ns: int = 0,
    ) -> FunctionTracer:
        """A function tracer (an ftrace ops: filter, action, graph or not) over the functions of
        the main executable (and of `libraries`, by name or path, as mapped) whose names match a
        pattern of `filter` (all if none) and none of `exclude` (set_ftrace_notrace; a string is
        a glob, a NamePattern a regular expression or glob with an optional @MODULE). Graph mode
        records entries and exits (the return-probe mechanism), else entries only; `depth` (graph
        mode) leaves out calls nested deeper than that many traced calls, `threshold_ns` calls
        that end sooner (dropped in the target: they cost no disk); `library_calls`: the calls the
        program makes to library functions too (its PLT stubs, named after them), and with
        `nested_calls` those its libraries make. With a `flight_recorder`, `snapshot_over_ns`
        (graph mode) makes each call that lasts that long take a snapshot: what led up to it is
        kept (the thread's ring paused till then) and delivered at once, as ftrace's latency
        tracers keep the trace of a new worst case. Call `start()` on it; events go to
        `on_event` or, spooled raw, to `write_raw` (`dynprobe record`)."""
        self._check_open()
        runtime = self._runtime
        main = runtime.processes.process(self.pid)
        if main is None:
            raise SessionError("the target has exited; nothing can be traced")
        if threshold_ns and runtime.data.flight_recorder:
            raise SessionError(FLIGHT_AND_THRESHOLD)
        if snapshot_over_ns and not runtime.data.flight_recorder:
            raise SessionError(SNAPSHOT_WITHOUT_FLIGHT)
        maps = read_maps(main.pid)
        paths = [main.exe] + [find_file(name, maps, main.libraries) for name in libraries]
        selection = Selection(as_patterns(filter), as_patterns(exclude), tuple(libraries), library_calls, nested_calls)
        selected = runtime.tracing.select(
            paths, filter, exclude, lambda image: loaded_in(image, maps, main.tracee.peek_u64),
            calls_of=selection.calls_of(main.exe, main.libraries()),
        )  # fmt: skip
        if not selected and not any(f.size for path in paths for f in load_elf(path).functions):
            names = ", ".join(os.path.basename(p) for p in paths)
            raise SessionError(
                f"{names}: no function symbols (stripped, no debug file found); trace the libraries it uses "
                "(--lib libc, libraries=[...] in the API), or a build with symbols"
            )
        tracer = runtime.tracing.new_tracer(selected, graph, on_event, depth, threshold_ns, snapshot_over_ns)
        if snapshot_over_ns:
            runtime.data.ensure_consumer().snapshot_asks = True
        tracer.selection = selection
        return tracer

    @staticmethod
    def _action_kind(action: str | ActionKind | None, python: bool, on_event: EventHandler | None) -> ActionKind | None:
        if isinstance(action, str):
            try:
                action = ActionKind(action)
            except ValueError:
                raise SessionError(f"unknown action {action!r} (count, record, hist)") from None
        if python:
            if action is not None or on_event is not None:
                raise SessionError("a probe runs Python handlers or an action, not both")
            return None
        if on_event is not None:
            if action not in (None, ActionKind.RECORD):
                raise SessionError("on_event receives records: use action='record'")
            return ActionKind.RECORD
        return action or ActionKind.COUNT

    @staticmethod
    def _check_fetch_symbols(args: tuple[FetchArg, ...], location: Location) -> None:
        image = load_elf(location.path)
        for fetch in (f for arg in args for f in fetch_chain(arg.fetch)):
            if isinstance(fetch, SymbolAddr) and image.address_of(fetch.symbol) is None:
                raise SymbolError(f"no symbol {fetch.symbol!r} in {location.path} (for @{fetch.symbol})")

    @_on_tracing_thread("placing probes")
    def probes_from(self, specs: list[str], **kw: Any) -> list[Probe]:
        """Place many probes (keyword arguments as for `probe`)."""
        with self.batch():
            return [self.probe(s, **kw) for s in specs]

    @contextlib.contextmanager
    def batch(self, progress: Callable[[int, int], object] | None = None) -> Iterator[None]:
        """Place many probes at once: the memory maps are read once for all of them (call it
        while the target is stopped, between runs: nothing is mapped meanwhile). Probes that
        may be optimized are, at the end of the block, without a trap first: their int3 is
        written only where the optimizer refuses the site. `progress(done, total)` is told how
        far that optimization is. (From a handler at a trap stop, they start as traps: the loop
        optimizes them when the handler has returned. From one served by an upcall, a batch is
        refused: `probes_from` places many.)"""
        runtime = self._runtime
        runtime.upcalls.check_not_in_server("a batch of probes")
        if runtime.modules.now:  # nested: the outer block does it
            yield
            return
        runtime.modules.now = {proc.pid: read_maps(proc.pid) for proc in runtime.processes}
        try:
            with gc_paused(), files.unchanged(), contextlib.ExitStack() as stack:
                for proc in runtime.processes:
                    stack.enter_context(proc.tracee.batched())
                with runtime.patcher.int3s_deferred(
                    not runtime.loop.in_run, flush=lambda: runtime.optimizer.flush(progress)
                ):
                    yield
        finally:
            runtime.modules.now = {}

    def optimize_now(self) -> None:
        """Optimize queued sites at once instead of after the batching delay (from a handler:
        as soon as it has returned)."""
        if self._runtime.loop.in_run:
            self._runtime.optimizer.expedite()
        else:
            self._runtime.optimizer.flush()

    @property
    def traced_functions(self) -> list[TracedFunction]:
        """Every function a tracer of the session traces, by id (the id its records carry)."""
        return self._runtime.tracing.functions

    # --- running --------------------------------------------------------------------------------
    def run(self, timeout: float | None = None) -> int | None:
        """Run the target until every traced process has exited; return the exit status of the
        first one (128+N if a signal killed it), or None if `timeout` seconds passed first or
        `stop()` was called."""
        self._check_open()
        ended = self._runtime.loop.run(timeout)
        return self.exit_status if ended else None

    def stop(self) -> None:
        """Make `run()` return after the event at hand (call it from a handler)."""
        self._runtime.request_stop()

    def request_stop(self) -> None:
        """Make `run()` return soon, from any thread: within a fraction of a second in the main
        thread; elsewhere, at the next event."""
        self._runtime.request_stop()

    def interrupt_wait(self, signum: int, frame: FrameType | None) -> None:
        """A signal handler (SIGINT/SIGTERM in the CLI) that makes `run()` return promptly."""
        self._runtime.loop.interrupt_wait()

    # --- records --------------------------------------------------------------------------------
    def write_raw(self, sink: BinaryIO, decode: bool = True) -> None:
        """Also write every drained record, as is, to `sink`: per chunk a u64 (pid | tid << 32)
        and a u64 count, then count records of `layout.record_size` bytes. `decode=False` skips
        the per-event callbacks (the fastest drain, for recording to disk). Call it once the
        probes are placed: it fixes the record size."""
        self._runtime.data.write_raw(sink, decode)

    def drain(self) -> None:
        """Deliver every record written so far to the `on_event` callbacks (in this thread): a
        flight recorder's, what its rings hold (a snapshot)."""
        self._runtime.data.drain()

    def request_snapshot(self) -> None:
        """A flight recorder's records read (and delivered) soon, by the consumer's thread: safe
        from a signal handler, where `drain()` is not."""
        self._runtime.data.request_snapshot()

    @property
    def snapshots_asked(self) -> int:
        """Calls that lasted a tracer's `snapshot_over_ns` and asked a flight recorder for a
        snapshot (one snapshot may answer several; a thread's asks before the reader looks, one)."""
        return self._runtime.data.snapshots_asked

    @property
    def records_drained(self) -> int:
        """Records read from the threads' rings so far."""
        return self._runtime.data.drained

    @property
    def records_waited(self) -> int:
        """Records whose thread found its ring full and waited for room (none of them lost)."""
        return self._runtime.data.waited

    @property
    def records_overwritten(self) -> int:
        """A flight recorder's records that gave way to newer ones before they were read (as of
        the last snapshot: `flight_recorder`)."""
        return self._runtime.data.overwritten

    @property
    def output_failure(self) -> str | None:
        """Why drained records could not be written (a full disk), if they could not: the
        session stopped then; `records_discarded` were drained after it."""
        return self._runtime.data.failure

    @property
    def records_discarded(self) -> int:
        """Records drained after the output failed (`output_failure`), which could not be written."""
        return self._runtime.data.discarded

    def thread_names(self) -> dict[int, str]:
        """The name of every thread seen in a thread area (tid -> comm), still known after it ended."""
        return self._runtime.data.thread_names()

    def clock(self) -> dict[str, float]:
        """The time-stamp counter's calibration: ns = (tsc - tsc0) * scale + ns0 (CLOCK_MONOTONIC)."""
        return self._runtime.clock()

    # --- introspection --------------------------------------------------------------------------
    def processes(self) -> list[int]:
        """The pids traced now."""
        return sorted(self._runtime.processes.by_pid)

    def process(self, pid: int) -> TracedProcess | None:
        """A traced process as dynprobe keeps it (its sites, slots, thread areas)."""
        return self._runtime.processes.process(pid)

    def slot_bytes_in_use(self) -> int:
        """Executable bytes handed out (trap slots and detours) in every traced process."""
        return sum(p.slots.in_use for p in self._runtime.processes)

    def slot_bytes(self) -> int:
        """Executable bytes mapped for dynprobe's code in every traced process."""
        return sum(p.slots.bytes_mapped() for p in self._runtime.processes)


class HasFileno(Protocol):
    """An open file (what `subprocess` takes for a command's standard streams too)."""

    def fileno(self) -> int: ...


def spawn(
    argv: list[str],
    follow_fork: bool = False,
    env: dict[str, str] | None = None,
    stdin: int | HasFileno | None = None,
    stdout: int | HasFileno | None = None,
    stderr: int | HasFileno | None = None,
) -> Session:
    """Start `argv` under dynprobe, stopped before its first instruction; returns the session.
    `stdin`/`stdout`/`stderr`: the command's, as file descriptors, open files or
    subprocess.DEVNULL (default: ours)."""
    if not argv:
        raise ProcessError("no command given")
    exe = argv[0] if "/" in argv[0] else shutil.which(argv[0])
    if exe is None:
        raise ProcessError(f"command not found: {argv[0]}")
    if not os.path.exists(exe):
        raise ProcessError(f"no such file: {exe}")
    try:
        with open(exe, "rb") as f:
            shebang = f.readline(256)
    except OSError:
        shebang = b""  # load_elf says why
    if shebang.startswith(b"#!"):
        interpreter = shebang[2:].decode(errors="replace").strip()
        raise ProcessError(
            f"{argv[0]} is a script ({interpreter}), not a program: give dynprobe the program it runs "
            "(a pyenv shim's: `pyenv which python3`)"
        )
    load_elf(exe)  # a non-ELF or 32-bit command is refused before it runs
    with contextlib.ExitStack() as opened:
        stdio: list[int | None] = []
        for stream in (stdin, stdout, stderr):
            if stream == subprocess.DEVNULL:
                stream = opened.enter_context(open(os.devnull, "r+b"))
            stdio.append(stream if stream is None or isinstance(stream, int) else stream.fileno())
        tracee = ptrace_spawn(argv, env, *stdio)
    try:
        return Session(tracee, spawned=True, follow_fork=follow_fork)
    except BaseException:
        with contextlib.suppress(OSError):
            os.kill(tracee.pid, signal.SIGKILL)
            os.waitpid(tracee.pid, 0)
        raise


def attach(pid: int, follow_fork: bool = False) -> Session:
    """Attach to every thread of a running process; returns the session (threads stopped)."""
    tracee = ptrace_attach(pid)
    return Session(tracee, spawned=False, follow_fork=follow_fork)


def print_warning(message: str) -> None:
    print(f"dynprobe: warning: {message}", file=sys.stderr)
