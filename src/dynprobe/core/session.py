"""A tracing session: the traced processes, their probes, and the event loop that serves them.

The session owns the one wait loop (every ptrace call happens on the thread that runs it) and the
one teardown path (`detach`, reached from `close()` and the context manager). Threads that do not
hit a probe never stop: a breakpoint stops only the thread that hit it, and the world is stopped
only to patch memory other threads may be executing or to leave.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from types import FrameType, TracebackType
from typing import Any, BinaryIO, Protocol

from dynprobe.actions.filter import parse_filter, parse_value
from dynprobe.actions.model import ActionKind, Program, filter_args, payload_size
from dynprobe.arch.x86_64 import (
    INT3,
    MAX_INSN_LEN,
    SLOT_SIZE,
    Regs,
    ResumeKind,
    boost_is_cheaper,
    decode_one,
    out_of_line,
)
from dynprobe.core import rescue
from dynprobe.core.delivery import Delivery
from dynprobe.core.ftrace import FunctionTracer, Selection, TracerEvent, Tracing
from dynprobe.core.optimizer import Optimizer, new_thread_areas
from dynprobe.core.probe import EventHandler, Handler, Probe, ProbeEvent, Site
from dynprobe.core.returns import RETURNS_TWICE, ReturnProbes, default_maxactive
from dynprobe.core.sites import check_location, default_event_name, first_instruction, identifier
from dynprobe.core.traced import MemoryReader, TracedProcess
from dynprobe.core.traps import Traps
from dynprobe.debug import ENABLED as DEBUG
from dynprobe.debug import debug as _debug
from dynprobe.errors import (
    OptimizeRefusal,
    ProbeRefused,
    ProcessError,
    Refusal,
    SeccompFiltered,
    SessionError,
    SymbolError,
)
from dynprobe.gcpause import gc_paused
from dynprobe.ptrace import syscalls as sc
from dynprobe.ptrace.events import (
    WAIT_SLICE,
    Event,
    EventKind,
    decode_status,
    in_tracing_stop,
    peek_stop,
    poll_event,
    sigchld_blocked,
    take_stop,
    wait_event,
)
from dynprobe.ptrace.guardian import Guardian
from dynprobe.ptrace.process import EVENT_STOPS, TRACE_OPTIONS, ThreadState, Tracee, tracer_of
from dynprobe.ptrace.process import attach as ptrace_attach
from dynprobe.ptrace.process import spawn as ptrace_spawn
from dynprobe.ptrace.procfs import list_threads, runs_no_code_to_take, sigtrap_pending, thread_cpu
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.areas import ThreadAreas
from dynprobe.ringbuf.consumer import (
    Consumer,
    TscClock,
)
from dynprobe.spec.fetch import FetchContext
from dynprobe.spec.model import FetchArg, ProbeSpec, SymbolAddr, fetch_chain, split_location
from dynprobe.spec.parser import parse_probe
from dynprobe.symbols import files
from dynprobe.symbols.elf import load_elf
from dynprobe.symbols.maps import (
    Mapping,
    address_of_offset,
    file_key,
    load_bias,
    mapping_at,
    maps_file,
    read_maps,
    root_of,
)
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
from dynprobe.threads import start_without_signals

LOADER_HOOK = "_dl_debug_state"
RSEQ_OFFSET = "__rseq_offset"  # glibc 2.35+: where its threads' rseq areas are, from the thread pointer
COMM_REFRESH = 0.5  # seconds a thread's name is taken as known
# Reasons a site stays a trap for as long as its probes are there (not the optimizer's delay).
_LASTING_TRAP = (OptimizeRefusal.DISABLED, OptimizeRefusal.POST_HANDLER, OptimizeRefusal.PYTHON_HANDLER)


_SIGTRAP_STOP = (signal.SIGTRAP << 8) | 0x7F  # waitpid status of a plain SIGTRAP signal-delivery-stop
_FAULT_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGTRAP}
_TRACE_CHILDREN = sc.PTRACE_O_TRACECLONE | sc.PTRACE_O_TRACEFORK | sc.PTRACE_O_TRACEVFORK | sc.PTRACE_O_TRACEVFORKDONE
_DEFAULT_LAYOUT = L.AreaLayout()  # the limits before a session fixes its layout
_FLIGHT_AND_THRESHOLD = (
    "a flight recorder keeps every call, the newest: not with a time threshold, which holds calls back until they end"
)
_SNAPSHOT_WITHOUT_FLIGHT = "a snapshot threshold is a flight recorder's: set flight_recorder first"
DEFAULT_WAIT_FOR_ROOM = 1.0  # seconds (Session.wait_for_room): many times a full ring's drain
MAX_WAIT_FOR_ROOM = 60.0
_WAKE_SIGNAL = signal.SIGURG  # what wakes the main thread from its wait for a stop (see _wakeable; ignored by default)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block is done, then take effect: a Ctrl-C (often the
    second one) must not cut a detach short, or the target keeps int3s and jumps of a tracer that
    is gone. (Python runs handlers in the main thread whichever thread the signal reached: the
    handlers are replaced, not the signals blocked.) Only from the main thread, where handlers
    can be set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in held}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)


def _in_sigtrap_stop(tid: int) -> bool:
    """Whether stopped thread `tid` is in the signal-delivery stop of a SIGTRAP (an int3, a
    single step), which a dying tracer lets go on to take that signal when not yet taken."""
    try:
        info = sc.get_siginfo(tid)
    except OSError:
        return False
    return (
        int(info.si_signo) == signal.SIGTRAP
        and int(info.si_code) >> 8 == 0
        and int(info.si_code) != signal.SIGTRAP | 0x80
    )


def _in_syscall_stop(tid: int) -> bool:
    """Whether stopped thread `tid` is at a system-call stop (where our remote syscalls end)."""
    try:
        return int(sc.get_siginfo(tid).si_code) == signal.SIGTRAP | 0x80
    except OSError:
        return False


def _exe_of(pid: int) -> str:
    try:
        return root_of(pid) + os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
    except OSError as exc:
        raise ProcessError(f"cannot read the executable of pid {pid}: {exc.strerror}") from exc


def _sites_to_recheck(sites: dict[int, Site], before: list[Mapping] | None, maps: list[Mapping]) -> list[int]:
    """The sites that may have lost their module: all but those inside an executable mapping
    that is the same in `before` (the map of the last sync) and in `maps`. A library load
    re-syncs a process of 10^4 sites without looking at each. (A site outside every mapping of
    `before`, placed with a map read after it, is looked at.)"""
    if before is None:
        return list(sites)
    kept = sorted((m for m in set(before).intersection(maps) if m.executable), key=lambda m: m.start)
    addrs = sorted(sites)
    recheck, at = [], 0
    for m in kept:
        inside = bisect.bisect_left(addrs, m.start, at)
        recheck += addrs[at:inside]
        at = bisect.bisect_left(addrs, m.end, inside)
    return recheck + addrs[at:]


def symbolize_in(maps: list[Mapping], addr: int) -> str | None:
    """`function+0xoff` for an address of a process with these maps (`symbol`-typed fetches)."""
    m = mapping_at(maps, addr)
    if m is None or not m.path.startswith("/"):
        return None
    try:
        image = load_elf(m.path)
    except SymbolError:
        return None
    vaddr = image.offset_to_vaddr(addr - m.start + m.offset)
    return image.symbolize(vaddr) if vaddr is not None else None


class Session:
    """Traced processes and their probes. Use `spawn()` or `attach()` to make one."""

    def __init__(self, tracee: Tracee, spawned: bool, follow_fork: bool = False) -> None:
        self.spawned = spawned
        self.follow_fork = follow_fork
        self.pin_tracer = True  # see _tracer_pinned
        self._home_cpu: int | None = None
        self.probes: list[Probe] = []
        self.warnings: list[str] = []
        self.on_warning: Callable[[str], None] | None = None
        self.main_pid = tracee.pid
        self.exit_status: int | None = None
        self._processes: dict[int, TracedProcess] = {}
        self._owner: dict[int, TracedProcess] = {}
        self._orphans: dict[int, Event] = {}
        self._exited_unknown: set[int] = set()
        self._pending: deque[Event] = deque()
        self._stop_requested = False
        self._interrupted = False  # interrupt_wait was called, maybe before run() began
        self._waiting = False  # in a blocking wait for a stop (see _wakeable)
        self._wait_until: float | None = None  # when that wait's time limit passes (time.monotonic)
        self._waker_on = False  # the main thread's run: its waits are woken by a thread (_wakeable)
        self._closed = False
        self._started = False
        self._in_run = False  # see _running
        self.stats = {"stops": 0, "fixups": 0}
        # Optimized probes (docs/architecture.md §5, §6). The ring size and record size are fixed
        # when the first thread area is made; set them before placing probes.
        self.optimize = True
        self.ring_bytes = L.DEFAULT_RING_BYTES
        self.record_size: int | None = None  # None: the smallest that holds every probe's record
        self._wait_for_room = DEFAULT_WAIT_FOR_ROOM
        self._flight_recorder = False
        self._layout: L.AreaLayout | None = None
        self._optimizer = Optimizer(self)
        self.returns = ReturnProbes(self)
        self.tracing = Tracing(self)
        self._traps = Traps(self)
        self._consumer: Consumer | None = None
        self._by_index: list[Probe | None] = []
        self._hists = 0
        self._delivery = Delivery(self)
        self._comms: dict[tuple[int, int], tuple[str, float]] = {}  # (pid, tid) -> name, when read
        self._last_maps: dict[int, list[Mapping]] = {}  # for symbolizing after a process ended
        self._maps_now: dict[int, list[Mapping]] = {}  # within batch(): the maps, read once
        # within batch(): sites armed for the optimizer, whose int3 waits for its verdict
        self._int3_deferred: list[tuple[TracedProcess, Site]] | None = None
        self._guardian = Guardian()
        self._guardian.journal.on_full = lambda: self._warn(
            f"more than {self._guardian.journal.capacity:,} code changes: if dynprobe dies, its guardian "
            "will not put back the rest"
        )
        try:
            proc = TracedProcess(tracee, _exe_of(tracee.pid))
            self._add_process(proc)
            self._install_rescue(proc)
            self._sync_process(proc)
        except BaseException:
            self._guardian.dismiss()
            raise

    # --- context management -------------------------------------------------------------------
    def __enter__(self) -> Session:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Detach from every process, restoring every byte dynprobe wrote. Idempotent.

        A command this session spawned that never ran (`run()` was not called) is killed
        instead: it has not executed a single instruction of its own."""
        if self._closed:
            return
        self._closed = True
        with _signals_held():
            try:
                if self.spawned and not self._started:
                    self._kill_unstarted()
                else:
                    self.detach()
            finally:
                self._stop_consumer()
                if self._guardian.journal.empty:
                    self._guardian.dismiss()
                else:
                    self._guardian.hand_over()  # a detach that could not finish: it does what it can

    def _kill_unstarted(self) -> None:
        for proc in list(self._processes.values()):
            self._guardian.journal.forget(proc.pid)
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(proc.pid, sc.WALL)
            proc.tracee.close_memory()
        self._processes.clear()
        self._owner.clear()

    # --- probes ---------------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self.main_pid

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
    ) -> Probe:
        """Place a probe (a return probe for an 'r' spec; see `retprobe`). `spec_or_address` is a
        probe spec ('p:grp/ev libc:malloc size=%di'), a bare location ('main', 'main+4',
        '/path/lib.so:0x1139') or an absolute address.

        With `pre`/`post` Python handlers it is a trap probe (handlers run at a stop). Otherwise it
        runs an action in the target once optimized: 'count' (the default), 'record' (the fetch
        arguments, delivered to `on_event` by the consumer; implied by `on_event`) or 'hist'
        (a log2 histogram of the fetch argument `value`), behind an optional `filter`
        ('a == 5 and b > 0' over its fetch arguments)."""
        self._check_open()
        main = self._processes.get(self.main_pid) or next(iter(self._processes.values()), None)
        if main is None:
            raise SessionError("the target has exited; no probe can be placed")
        maps = self._maps_now.get(main.pid) or read_maps(main.pid)
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
        parsed_filter = parse_filter(filter, spec.args) if filter is not None else None
        hist_value = None
        if kind == ActionKind.HIST:
            if value is None:
                raise SessionError("a histogram needs a value: a fetch argument's name, or a fetch argument")
            hist_value = parse_value(value, spec.args)
        if parsed_filter is not None:
            self._check_fetch_symbols(tuple(filter_args(parsed_filter)), location)
        probe = Probe(
            self, location, spec.group or "uprobes", spec.event or default_event_name(location, is_return),
            spec.args, pre, post, enabled, kind, parsed_filter, hist_value, on_event,
            index=len(self._by_index), hist_index=self._hists, is_return=is_return, maxactive=active,
            on_entry=on_entry, on_return=on_return, data_size=data_size,
        )  # fmt: skip
        if is_return and kind is not None:
            self._check_data_size(probe)
        self._by_index.append(probe)
        if kind == ActionKind.HIST:
            self._hists += 1
        self.probes.append(probe)
        try:
            for proc in list(self._processes.values()):
                if proc.follow:
                    self._sync_process(proc, only=probe, strict=proc.pid == main.pid, maps=self._maps_now.get(proc.pid))
        except ProbeRefused:
            self.remove_probe(probe)
            raise
        return probe

    def expand(self, spec: str | ProbeSpec) -> list[ProbeSpec]:
        """A spec whose location is a shell-style pattern ('p libc:str*', 'r app:parse_*
        n=%di') as the specs of each function it names (one per address; `expand_pattern`),
        each with its own event name; any other spec as itself."""
        parsed = spec if isinstance(spec, ProbeSpec) else parse_probe(spec)
        if not is_pattern(split_location(parsed.location)[2]):
            return [parsed]
        main = self._processes.get(self.main_pid) or next(iter(self._processes.values()), None)
        if main is None:
            raise SessionError("the target has exited; no probe can be placed")
        maps = self._maps_now.get(main.pid) or read_maps(main.pid)
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
        kept = 8 * len(self.returns.entry_of(probe).arg_indices)
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
        return self.returns.refusal(proc, location.path)

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
        main = self._processes.get(self.main_pid)
        if main is None:
            raise SessionError("the target has exited; nothing can be traced")
        if threshold_ns and self._flight_recorder:
            raise SessionError(_FLIGHT_AND_THRESHOLD)
        if snapshot_over_ns and not self._flight_recorder:
            raise SessionError(_SNAPSHOT_WITHOUT_FLIGHT)
        maps = read_maps(main.pid)
        paths = [main.exe] + [find_file(name, maps, main.libraries) for name in libraries]
        selection = Selection(as_patterns(filter), as_patterns(exclude), tuple(libraries), library_calls, nested_calls)
        selected = self.tracing.select(
            paths, filter, exclude, lambda image: loaded_in(image, maps, main.tracee.peek_u64),
            calls_of=selection.calls_of(main.exe, main.libraries()),
        )  # fmt: skip
        if not selected and not any(f.size for path in paths for f in load_elf(path).functions):
            names = ", ".join(os.path.basename(p) for p in paths)
            raise SessionError(
                f"{names}: no function symbols (stripped, no debug file found); trace the libraries it uses "
                "(--lib libc, libraries=[...] in the API), or a build with symbols"
            )
        tracer = self.tracing.new_tracer(selected, graph, on_event, depth, threshold_ns, snapshot_over_ns)
        if snapshot_over_ns:
            self._ensure_consumer().snapshot_asks = True
        tracer.selection = selection
        return tracer

    def reserve_index(self) -> int:
        """A counters-and-records index for something that is not a probe (a function tracer)."""
        self._by_index.append(None)
        return len(self._by_index) - 1

    def counters_of_index(self, index: int) -> tuple[int, int, int]:
        if self._consumer is None or index >= self.layout.max_probes:
            return 0, 0, 0
        return self._consumer.counters(index)

    def traced_processes(self) -> list[TracedProcess]:
        return [p for p in self._processes.values() if p.follow and p.status is None]

    def ensure_thread_areas(self, proc: TracedProcess) -> bool:
        """Every stopped thread of `proc` has its thread area (False: the target uses GS)."""
        self._ensure_consumer()
        return self._optimizer.ensure_areas(proc)

    def thread_rips(self, proc: TracedProcess) -> list[int]:
        return list(self._optimizer.thread_rips(proc).values())

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
        far that optimization is. (From a handler, they start as traps: the loop optimizes them
        when the handler has returned.)"""
        if self._maps_now:  # nested: the outer block does it
            yield
            return
        self._maps_now = {pid: read_maps(pid) for pid in self._processes}
        self._int3_deferred = None if self._in_run else []
        try:
            with gc_paused(), files.unchanged(), contextlib.ExitStack() as stack:
                for proc in list(self._processes.values()):
                    stack.enter_context(proc.tracee.batched())
                try:
                    yield
                finally:
                    self._end_batch(progress)
        finally:
            self._maps_now = {}
            self._int3_deferred = None

    def _end_batch(self, progress: Callable[[int, int], object] | None) -> None:
        deferred, self._int3_deferred = self._int3_deferred or [], None
        try:
            if deferred:
                self._optimizer.flush(progress)
        finally:
            for proc, site in deferred:
                if site.armed and not site.optimized and proc.status is None and proc.sites.get(site.addr) is site:
                    self._write_int3(proc, site)
            for proc in self._processes.values():
                if proc.rescue is not None and proc.rescue.stale:
                    proc.rescue.publish(list(proc.sites.values()))

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

    def addresses_of(self, probe: Probe) -> list[int]:
        return [
            a
            for p in self._processes.values()
            for a, s in p.sites.items()
            if probe in s.probes and (s.armed or s.optimized)
        ]

    def sync_probe(self, probe: Probe) -> None:
        for proc in self._processes.values():
            for site in proc.sites.values():
                if probe in site.probes:
                    self._set_armed(proc, site, site.wanted)

    def remove_probe(self, probe: Probe) -> None:
        probe.removed = True
        probe.enabled = False
        if probe in self.probes:
            self.probes.remove(probe)
        for proc in self._processes.values():
            for addr, site in list(proc.sites.items()):
                if probe in site.probes:
                    site.probes.remove(probe)
                    if not site.probes and site.internal is None:
                        self._drop_site(proc, addr)
                    else:
                        self._set_armed(proc, site, site.wanted)

    # --- running ----------------------------------------------------------------------------------
    def run(self, timeout: float | None = None) -> int | None:
        """Run the target until every traced process has exited; return the exit status of the
        first one (128+N if a signal killed it), or None if `timeout` seconds passed first or
        `stop()` was called."""
        self._check_open()
        self._stop_requested = False
        if self._interrupted:  # (a signal that came before this run: it ends this one)
            self._stop_requested, self._interrupted = True, False
        deadline = None if timeout is None else time.monotonic() + timeout
        if any(p.action is not None for p in self.probes) or self.tracing.tracers:
            self._ensure_consumer().start()  # before the tracer pins itself: it runs elsewhere
        with self._tracer_pinned(), self._running(), self._wakeable():
            self._optimizer.flush()  # everything placed so far, before the target runs on
            self._start()
            while self._processes and not self._stop_requested:
                try:
                    due = self._optimizer.due_in()
                    if due == 0:
                        self._optimizer.flush()
                        continue
                    if not self._pending:
                        wait = due
                        if deadline is not None:
                            left = deadline - time.monotonic()
                            if left <= 0:
                                break  # the deadline passed
                            wait = left if due is None else min(due, left)
                        stop = self._next_stop(wait)
                        if stop is None:
                            continue  # a time limit came first
                        if self._serve_breakpoint(*stop):
                            if self._consumer is not None:
                                self._consumer.drain_if_due()
                            continue
                    if not self._pending:
                        break  # no tracee left at all (ECHILD)
                    self._handle(self._pending.popleft())
                except ProcessLookupError as exc:
                    # ESRCH: the thread died under us (SIGKILL wakes a stopped tracee, a process
                    # exits during a remote syscall); its exit event follows, or was kept aside
                    # by the remote syscall that met it, and settles the bookkeeping.
                    _debug(f"thread gone while handled: {exc}")
                    self._requeue_exits()
            self._interrupted = False  # (a signal this run took: it ended this one only)
        return self.exit_status if not self._processes else None

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        """While `run()` serves stops: a handler then runs with its thread in the middle of
        being served (its registers read, to be written back), so nothing it calls may stop the
        world and change threads' registers under it (an optimization gives threads their GS
        base): that waits for the loop."""
        self._in_run = True
        try:
            yield
        finally:
            self._in_run = False

    def _requeue_exits(self) -> None:
        """Exit events a remote syscall met, handled as they come."""
        for proc in self._processes.values():
            for state in proc.tracee.threads.values():
                exits = [e for e in state.deferred if e.kind in (EventKind.EXITED, EventKind.KILLED)]
                if exits:
                    state.deferred = [e for e in state.deferred if e not in exits]
                    self._pending.extend(exits)

    @contextlib.contextmanager
    def _tracer_pinned(self) -> Iterator[None]:
        """While `run()` runs, the tracer stays on one CPU and resumed target threads wake up on it.

        A trap stop wakes the tracer and PTRACE_CONT wakes the target; when they are on different
        CPUs, each wake-up of an idle vCPU costs tens of microseconds on this kind of VM (measured
        ~200 us per hit, against ~20 us on one CPU), and the scheduler does not bring them
        together by itself. Pinning the target would change what it observes (nproc, thread-pool
        sizes), so only the wake-up is placed (Tracee.resume); the target's own mask is back
        before it runs an instruction."""
        allowed = os.sched_getaffinity(0)
        if not self.pin_tracer or len(allowed) < 2:
            yield
            return
        cpu = thread_cpu(self.main_pid, self.main_pid)
        if cpu not in allowed:
            cpu = min(allowed)
        os.sched_setaffinity(0, {cpu})
        self._home_cpu = cpu
        if self._consumer is not None:
            self._consumer.place(allowed - {cpu})  # draining rings never competes with the target
        for proc in self._processes.values():
            proc.tracee.home_cpu = cpu
        try:
            yield
        finally:
            self._home_cpu = None
            for proc in self._processes.values():
                proc.tracee.home_cpu = None
            os.sched_setaffinity(0, allowed)
            if self._consumer is not None:
                self._consumer.place(allowed)

    def _next_stop(self, timeout: float | None) -> tuple[int, int] | None:
        """The next (pid, status) of any tracee, (-1, 0) when none is left, or None when `timeout`
        seconds passed first, or a slice of it (`run()` waits again). The stop is only seen
        here, not taken (`peek_stop`): `_serve_breakpoint` serves an int3 hit, whose resume
        takes it, and takes any other stop.

        The main thread waits in waitid, woken by the waker at its time limit (see _wakeable),
        never by SIGCHLD: another thread of the Python program may take a SIGCHLD (the kernel
        gives a process's signal to any thread that does not block it) and leave this one
        asleep. Another thread's run has no waker, nor a wait with no tracee running (nothing
        for the waker to interrupt): a timed wait sleeps in sigtimedwait for SIGCHLD, in slices
        that bound what a SIGCHLD taken elsewhere costs."""
        if timeout is None or (self._waker_on and next(self._running_tracees(), None) is not None):
            self._wait_until = None if timeout is None else time.monotonic() + timeout
            self._waiting = True  # (see _wakeable)
            try:
                return peek_stop(block=True)
            finally:
                self._waiting = False
                self._wait_until = None
        with sigchld_blocked():
            stop = peek_stop(block=False)
            if stop is None:
                signal.sigtimedwait([signal.SIGCHLD], min(timeout, WAIT_SLICE))
                stop = peek_stop(block=False)
        return stop

    def stop(self) -> None:
        """Make `run()` return after the event at hand (call it from a handler)."""
        self._stop_requested = True

    def request_stop(self) -> None:
        """Make `run()` return soon, from any thread (the consumer's, when its output failed):
        within WAIT_SLICE in the main thread (see _wakeable); elsewhere, at the next event."""
        self._stop_requested = True

    @property
    def output_failure(self) -> str | None:
        """Why drained records could not be written (a full disk), if they could not: the
        session stopped then; `records_discarded` were drained after it."""
        return self._consumer.failure if self._consumer is not None else None

    @property
    def records_discarded(self) -> int:
        return self._consumer.discarded if self._consumer is not None else 0

    @contextlib.contextmanager
    def _wakeable(self) -> Iterator[None]:
        """While `run()` runs in the main thread, a thread sends _WAKE_SIGNAL to it while it
        waits for a stop: every WAIT_SLICE, and at the wait's time limit. The wait returns with
        EINTR and Python runs the signal handlers due: a handler runs between bytecodes, so
        that of a signal caught just before the wait (a Ctrl-C) would otherwise run only once
        the wait ended, never on a target that never stops. `_woken` then interrupts a running
        tracee when a stop was asked for (a signal's handler, `request_stop`) or the time limit
        has passed, which ends the wait (Python itself would wait again). Nothing is added to
        serving a stop."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(_WAKE_SIGNAL, self._woken)
        main, done = threading.get_ident(), threading.Event()

        def until_the_next_poke() -> float:
            until = self._wait_until
            return WAIT_SLICE if until is None else min(WAIT_SLICE, max(until - time.monotonic(), 0.001))

        def wake_while_waiting() -> None:
            while not done.wait(until_the_next_poke()):
                if self._waiting:
                    with contextlib.suppress(OSError):
                        signal.pthread_kill(main, _WAKE_SIGNAL)

        waker = start_without_signals(wake_while_waiting, "dynprobe-waker")
        self._waker_on = True
        try:
            yield
        finally:
            self._waker_on = False
            done.set()
            waker.join()
            signal.signal(_WAKE_SIGNAL, previous)

    def _woken(self, signum: int, frame: FrameType | None) -> None:
        until = self._wait_until
        if self._waiting and (self._stop_requested or (until is not None and time.monotonic() >= until)):
            self._interrupt_running()

    def interrupt_wait(self, signum: int, frame: FrameType | None) -> None:
        """A signal handler (SIGINT/SIGTERM in the CLI) that makes `run()` return promptly: it
        never raises (an exception in the middle of waitpid could lose an event); it sets a flag
        and PTRACE_INTERRUPTs a running tracee so the wait for a stop ends (see _wakeable)."""
        self._interrupted = self._stop_requested = True
        self._interrupt_running()

    def _running_tracees(self) -> Iterator[int]:
        return (t for p in self._processes.values() for t, s in p.tracee.threads.items() if not s.stopped)

    def _interrupt_running(self) -> None:
        """PTRACE_INTERRUPT a running tracee (one is enough to end a wait for any stop)."""
        for tid in self._running_tracees():
            try:
                sc.interrupt(tid)
            except OSError:
                continue
            return

    def _start(self) -> None:
        if self._started:
            return
        self._started = True
        for proc in list(self._processes.values()):
            for state in list(proc.tracee.threads.values()):
                self._release(proc, state)

    def _release(self, proc: TracedProcess, state: ThreadState) -> None:
        """Resume a stopped thread, or queue the events it collected while the world was stopped."""
        if state.deferred:
            self._pending.extend(state.deferred)
            state.deferred = []
        elif state.stopped:
            proc.tracee.resume(state.tid)

    def _serve_breakpoint(self, pid: int, status: int) -> bool:
        """The hot path: if the stop is a thread of ours hitting one of our int3s, serve it
        without building an Event. False (the stop queued) for anything else."""
        if pid == -1:
            self._processes.clear()  # ECHILD: nothing left to wait for
            return False
        if status == _SIGTRAP_STOP:
            proc = self._owner.get(pid)
            if proc is not None and pid not in proc.stepping:
                regs = sc.get_regs(pid)
                site = proc.sites.get(regs.rip - 1)
                state = proc.tracee.threads.get(pid)
                if site is not None and site.armed and state is not None:
                    state.stopped = True
                    state.in_event_stop = False
                    state.at_trap = site.addr
                    self._traps.hit(proc, pid, site, regs)  # (its resume takes the stop)
                    return True
                if state is not None and (site is not None or (regs.rip - 1) in proc.retired):
                    state.stopped = True
                    if self._traps.past_trap(proc, pid, regs, site):
                        return True
        taken = take_stop(pid)
        if taken is not None:
            self._pending.append(decode_status(pid, taken))
        return False

    def _handle(self, event: Event) -> None:
        proc = self._owner.get(event.tid)
        if proc is None:
            if event.kind in (EventKind.EXITED, EventKind.KILLED):
                self._exited_unknown.add(event.tid)  # a thread whose clone event we have not seen
            else:
                self._orphans[event.tid] = event
            return
        tracee = proc.tracee
        state = tracee.threads.get(event.tid)
        if state is None:
            state = tracee.threads[event.tid] = ThreadState(event.tid)
        state.stopped = event.kind not in (EventKind.EXITED, EventKind.KILLED)
        state.in_event_stop = event.kind in EVENT_STOPS
        kind = event.kind
        if state.stopped and kind is not EventKind.EXEC:  # (an exec: the areas went with the old image)
            self._optimizer.thread_stopped(proc, event.tid)
        if kind in (EventKind.EXITED, EventKind.KILLED):
            self._on_exit(proc, event)
        elif kind == EventKind.SIGNAL:
            self._on_signal(proc, event)
        elif kind == EventKind.STOP:
            tracee.resume(event.tid)
        elif kind == EventKind.GROUP_STOP:
            try:
                sc.listen(event.tid)
            except ProcessLookupError:
                pass
            except OSError:
                # EIO: no longer in its group-stop (a process stopped by job control when we
                # attached, whose thread then ran a remote syscall for us, which ends in our
                # int3's signal stop): that signal becomes the stop signal again.
                tracee.resume(event.tid, event.sig)
            state.stopped = False
        elif kind == EventKind.CLONE:
            self._adopt_thread(proc, event.msg)
            tracee.resume(event.tid)
        elif kind in (EventKind.FORK, EventKind.VFORK):
            self._on_fork(proc, event)
        elif kind == EventKind.EXEC:
            self._on_exec(proc)
        else:  # VFORK_DONE
            tracee.resume(event.tid)

    def _on_exit(self, proc: TracedProcess, event: Event) -> None:
        """A thread ended. The process is gone once its last thread's exit is collected: not at
        the leader's (the leader may pthread_exit while others run, and in a group exit the
        tracer still has to reap every thread, or it stays a zombie the parent waits on forever)."""
        proc.tracee.threads.pop(event.tid, None)
        proc.stepping.pop(event.tid, None)
        self._owner.pop(event.tid, None)
        if proc.areas is not None:
            proc.areas.retire(event.tid)
        status = event.code if event.kind == EventKind.EXITED else 128 + event.sig
        if event.tid == proc.pid or proc.leader_status is not None:
            proc.leader_status = status  # in a group exit every thread ends with the group's status
        if proc.leader_status is None:
            return
        for tid in [t for t in proc.tracee.threads if not os.path.exists(f"/proc/{proc.pid}/task/{t}")]:
            proc.tracee.threads.pop(tid)  # reaped already: nothing more will come from it
            self._owner.pop(tid, None)
        if proc.tracee.threads:
            return
        proc.status = proc.leader_status
        if proc.pid == self.main_pid:
            self.exit_status = proc.status
        self._guardian.journal.forget(proc.pid)
        proc.tracee.close_memory()
        self._processes.pop(proc.pid, None)
        self._release_areas(proc)

    def _adopt_thread(self, proc: TracedProcess, tid: int) -> None:
        if tid in self._exited_unknown:
            self._exited_unknown.discard(tid)  # born and gone before its clone event reached us
            return
        self._owner[tid] = proc
        orphan = self._orphans.pop(tid, None)
        if orphan is not None:
            self._pending.append(orphan)
        # Already known when attach saw the thread before its creator's clone event. Otherwise
        # the thread counts as running until its first stop is collected: it may sit in that
        # stop already, but a stop nobody has waited for is not ours to use. Remote syscalls
        # run in it would swallow the stop's event, and nothing would ever resume the thread.
        proc.tracee.threads.setdefault(tid, ThreadState(tid, stopped=orphan is not None))

    def _add_process(self, proc: TracedProcess) -> None:
        proc.tracee.home_cpu = self._home_cpu
        proc.tracee.journal = self._guardian.journal
        self._processes[proc.pid] = proc
        for tid in proc.tracee.threads:
            self._owner[tid] = proc

    def _on_fork(self, parent: TracedProcess, event: Event) -> None:
        child_pid = event.msg
        vfork = event.kind == EventKind.VFORK
        child = TracedProcess(Tracee(child_pid, [child_pid]), parent.exe, follow=self.follow_fork)
        child.sites = {a: dataclasses.replace(s, probes=list(s.probes)) for a, s in parent.sites.items()}
        if parent.pid in self._last_maps:  # the child's sites were placed with its parent's map
            self._last_maps[child_pid] = self._last_maps[parent.pid]
        else:
            self._last_maps.pop(child_pid, None)  # (an earlier process's, if its pid was reused)
        child.slots.inherit(parent.slots)
        child.rescue = parent.rescue  # its handler and its page (shared memory) came with the fork
        child.fixups = dict(parent.fixups)
        child.dirty = list(parent.dirty)
        self.tracing.forked(parent, child)
        if not vfork:
            self._guardian.journal.inherit(parent.pid, child_pid)
        if vfork:
            child.areas = parent.areas  # one address space: its thread takes an area of the parent's pools
            child.returns = parent.returns
        else:
            child.gs_inherited = parent.areas is not None or parent.gs_inherited
            self.returns.snapshot(parent, event.tid, child)
        self._add_process(child)
        orphan = self._orphans.pop(child_pid, None)
        if not self.follow_fork and not vfork:
            # A copy of our int3s is in the child: take them out before it runs a single instruction.
            if orphan is None:
                while True:
                    ev = wait_event(child_pid)
                    if ev is None or ev.kind in (
                        EventKind.STOP,
                        EventKind.SIGNAL,
                        EventKind.EXITED,
                        EventKind.KILLED,
                    ):
                        orphan = ev
                        break
            if orphan is not None and orphan.kind not in (EventKind.EXITED, EventKind.KILLED):
                self._optimizer.restore_all(child)
                self.tracing.restore(child)
                self.returns.restore_child(child)
                for site in child.sites.values():
                    if site.armed:
                        with contextlib.suppress(OSError):
                            child.tracee.unpatch(site.addr, site.original[:1])
                self._uninstall_rescue(child, child_pid)
                with contextlib.suppress(OSError):
                    sc.detach(child_pid, orphan.sig if orphan.kind == EventKind.SIGNAL else 0)
            self._guardian.journal.forget(child_pid)
            child.tracee.close_memory()
            self._owner.pop(child_pid, None)
            self._processes.pop(child_pid, None)
        else:
            # Followed, or a vfork child: it shares our memory (vfork) or has its own copy of the
            # armed probes (fork); either way it is served like any traced process.
            if orphan is not None:
                self._pending.append(orphan)
        parent.tracee.resume(event.tid)

    def _on_exec(self, proc: TracedProcess) -> None:
        pid = proc.pid
        # (A non-leader thread that exec'd took the leader's tid: its exec stop is reported as
        # the pid's, and every other thread is gone.)
        for tid in list(proc.tracee.threads):
            if tid != pid:
                proc.tracee.threads.pop(tid)
                self._owner.pop(tid, None)
        # A fresh state: nothing of the thread whose tid the exec'ing one took (stopped at a trap
        # of the old image, say) carries over.
        proc.tracee.threads[pid] = ThreadState(pid, in_event_stop=True)
        proc.sites.clear()
        proc.stepping.clear()
        proc.retired.clear()
        proc.comms.clear()
        proc.slots.forget()
        self._guardian.journal.forget(pid)
        self._release_areas(proc)
        proc.areas = None
        proc.gs_inherited = False
        proc.areas_refused = None
        proc.fixups.clear()
        proc.dirty.clear()
        proc.returns = None
        self.tracing.forget_image(proc)
        proc.loader_hook = None
        proc.needed = None
        if not proc.follow:
            # An unfollowed vfork child leaves our shared memory: let it go.
            with contextlib.suppress(OSError):
                sc.detach(pid)
            self._owner.pop(pid, None)
            self._processes.pop(pid, None)
            return
        proc.tracee.open_memory()
        proc.exe = _exe_of(pid)
        proc.rescue = None  # the exec took the handler and its page with the old image
        self._install_rescue(proc)
        self._sync_process(proc)
        if self.tracing.tracers:
            with files.unchanged(), proc.tracee.batched():
                self.tracing.execed(proc, read_maps(pid))
        proc.tracee.resume(pid)

    def _on_signal(self, proc: TracedProcess, event: Event) -> None:
        tid, sig = event.tid, event.sig
        step = proc.stepping.get(tid)
        if proc.fixups and sig in (signal.SIGSEGV, signal.SIGBUS) and step is None:
            regs = sc.get_regs(tid)
            fixup = proc.fixups.get(int(regs.rip))
            if fixup is not None:
                # A fetch in a detour read a bad address: the value is marked faulted, the
                # target never sees the signal (the kernel's exception table, in user space).
                regs.rip = fixup
                sc.set_regs(tid, regs)
                self.stats["fixups"] += 1
                proc.tracee.resume(tid)
                return
        if sig == signal.SIGTRAP:
            if step is None:
                # Our int3s are told apart by address (as the kernel's uprobes do): a thread at
                # site+1 of an armed site executed it. No GETSIGINFO on this hot path.
                regs = sc.get_regs(tid)
                site = proc.sites.get(regs.rip - 1)
                if site is not None and site.armed:
                    self._traps.hit(proc, tid, site, regs)
                    return
                if self._traps.past_trap(proc, tid, regs, site):
                    return
            elif sc.get_siginfo(tid).si_code != sc.SI_KERNEL:
                self._traps.finish_step(proc, tid, step)
                return
        if step is not None:
            if sig in _FAULT_SIGNALS:  # the instruction itself faulted in its slot
                proc.stepping.pop(tid)
                self._traps.deliver_fault(proc, tid, sig)
                return
            step.held_signals.append(sig)  # asynchronous: deliver once the step is done
            proc.tracee.resume(tid, 0, step=True)
            return
        if sig in _FAULT_SIGNALS:
            if sig == signal.SIGTRAP and DEBUG:
                info = sc.get_siginfo(tid)
                _debug(f"SIGTRAP of the target's own: tid {tid} rip {sc.get_regs(tid).rip:#x} code {info.si_code:#x}")
            self._traps.deliver_fault(proc, tid, sig)
            return
        proc.tracee.resume(tid, sig)

    # --- sites ---------------------------------------------------------------------------------------
    def _sync_process(
        self, proc: TracedProcess, only: Probe | None = None, strict: bool = False, maps: list[Mapping] | None = None
    ) -> None:
        """Make the process's sites match the probes and what is mapped now: arm probes whose file
        is mapped, forget sites whose module went away (dlclose)."""
        with files.unchanged():
            self._sync_sites(proc, only, strict, maps or read_maps(proc.pid))

    def _sync_sites(self, proc: TracedProcess, only: Probe | None, strict: bool, maps: list[Mapping]) -> None:
        before, self._last_maps[proc.pid] = self._last_maps.get(proc.pid), maps
        if only is None:
            for addr in _sites_to_recheck(proc.sites, before, maps):
                site = proc.sites[addr]
                m = mapping_at(maps, addr)
                if (
                    m is None
                    or not m.executable
                    or (
                        not any(maps_file(m, file_key(p.location.path), p.location.path) for p in site.probes)
                        and site.internal is None
                    )
                ):
                    self._forget_site(proc, addr)
            self._install_loader_hook(proc, maps)
        keys: dict[str, tuple[int, int] | None] = {}
        for probe in [only] if only else list(self.probes):
            if probe.removed:
                continue
            placed = proc.sites.get(probe.sites.get(proc.pid, -1))
            if only is None and placed is not None and probe in placed.probes:
                continue  # armed already (its module's mapping was checked above)
            loc = probe.location
            if loc.path not in keys:
                keys[loc.path] = file_key(loc.path)
            where = address_of_offset(maps, keys[loc.path], loc.path, loc.offset)
            if where is None:
                if any(m.path == f"{loc.path} (deleted)" for m in maps):
                    refused = ProbeRefused(Refusal.FILE_REPLACED, f"{loc.basename}:{loc.label}")
                    if strict:
                        raise refused
                    self._warn(f"{probe.name}: {refused} (pid {proc.pid})")
                continue
            existing = proc.sites.get(where)
            if existing is not None and probe in existing.probes:
                continue
            try:
                self._install(proc, probe, where)
            except ProbeRefused as refused:
                if strict:
                    raise
                self._warn(f"{probe.name}: {refused} (pid {proc.pid})")

    def _on_modules_changed(self, proc: TracedProcess) -> None:
        """The loader mapped or unmapped libraries: arm pending probes, and optimize them at
        once (they arrive as one batch; the program may not run long enough for the delay)."""
        self._sync_process(proc)
        self.returns.hook_unwinders(proc, self._last_maps[proc.pid])
        self.tracing.modules_changed(proc, self._last_maps[proc.pid])
        self._optimizer.expedite()

    def _interpreter(self, proc: TracedProcess) -> str | None:
        """The path of the process's dynamic linker, as we reach it (None: a static binary)."""
        try:
            interp = load_elf(proc.exe).interp
        except SymbolError:
            return None
        return files.real_path(root_of(proc.pid) + interp) if interp else None

    def rseq_offset_at(self, proc: TracedProcess) -> int | None:
        """Where the process's glibc (2.35 and later) keeps `__rseq_offset`: the distance from a
        thread's pointer to the rseq area glibc registers for it, where the kernel keeps the
        thread's CPU number (a load: cheaper than `rdpid`). None without it."""
        maps = self._maps_now.get(proc.pid) or read_maps(proc.pid)
        for path in (proc.exe, self._interpreter(proc)):
            if path is None:
                continue
            try:
                image = load_elf(path)
            except SymbolError:
                continue
            vaddr = image.own_object(RSEQ_OFFSET)  # the program's first: a copy relocation's
            bias = load_bias(maps, file_key(path), path, image.first_page) if vaddr is not None else None
            if vaddr is not None and bias is not None:
                return bias + vaddr
        return None

    def _install_loader_hook(self, proc: TracedProcess, maps: list[Mapping]) -> None:
        if proc.loader_hook in proc.sites:
            return
        path = self._interpreter(proc)
        if path is None:
            return  # static binary: nothing is loaded later
        try:
            loader = load_elf(path)
        except SymbolError:
            return
        func = loader.own_function(LOADER_HOOK) or loader.by_name.get(LOADER_HOOK)
        if func is None:
            self._warn(f"{path} has no {LOADER_HOOK}: libraries loaded later will not be probed")
            return
        offset = loader.vaddr_to_offset(func.addr)
        addr = address_of_offset(maps, file_key(path), path, offset) if offset is not None else None
        if addr is None:
            return
        location = Location(path, offset or 0, func.addr, func, LOADER_HOOK)
        self.add_internal_site(proc, location, addr, lambda tid, regs: self._on_modules_changed(proc))
        proc.loader_hook = addr

    def add_internal_site(
        self, proc: TracedProcess, location: Location, addr: int, callback: Callable[[int, Regs], None],
        *, rescue_wait: bool = False,
    ) -> None:  # fmt: skip
        """A trap of dynprobe's own at `addr` (a function of a mapped file): `callback(tid,
        regs)` runs at each hit, before any probe of the same site (`rescue_wait`: see
        Site.rescue_wait)."""
        site = proc.sites.get(addr)
        if site is None:
            site = proc.sites[addr] = self._make_site(proc, location, addr)
        site.internal = callback
        site.rescue_wait = rescue_wait
        self._set_armed(proc, site, True)

    def arm_site(self, proc: TracedProcess, site: Site) -> None:
        self._set_armed(proc, site, True)

    def _make_site(self, proc: TracedProcess, location: Location, addr: int) -> Site:
        def refused(reason: Refusal) -> ProbeRefused:
            return ProbeRefused(reason, f"{location.basename}:{location.label}")

        decoded = first_instruction(location)
        if isinstance(decoded, Refusal):
            raise refused(decoded)
        plan = decoded[1]  # the plan holds wherever the file is mapped; RIP-relative operands do not
        code = load_elf(location.path).code(location.vaddr, decoded[0].len)
        insn = decode_one(code, addr)
        if insn is None:
            raise refused(Refusal.UNDECODABLE)
        if self.tracing.patched_over(proc, addr):
            raise refused(Refusal.FUNCTION_TRACED)
        try:
            current = proc.tracee.read(addr, insn.len)
        except OSError as exc:
            raise refused(Refusal.NOT_EXECUTABLE) from exc
        if current != code:
            raise refused(Refusal.FOREIGN_INT3 if current[0] == INT3 else Refusal.BYTES_MISMATCH)
        site = Site(addr, insn, code, plan)  # its emulator is prepared at its first hit
        try:
            if plan.kind != ResumeKind.EMULATE and not self.give_slot(proc, site):
                raise refused(Refusal.RIP_REL_OUT_OF_REACH)
        except SeccompFiltered as exc:
            raise refused(Refusal.SECCOMP) from exc
        return site

    def slot_at_hit(self, proc: TracedProcess, site: Site) -> bool:
        """`give_slot` at a hit, in a process that may turn out to run no code of ours (a
        seccomp filter we may not suspend): then it has no thread area either."""
        try:
            return self.give_slot(proc, site)
        except SeccompFiltered:
            proc.areas_refused = OptimizeRefusal.SECCOMP
            return False

    def give_slot(self, proc: TracedProcess, site: Site) -> bool:
        """The site's out-of-line slot: made at placement, or for an emulated instruction at the
        first hit that needs it (emulation refused, a post-handler): most function entries are
        emulated, and a probe optimized at once never needs one."""
        if site.slot is not None:
            return True
        slot = self.allocate_slot(proc, site.addr)
        if slot is None:
            return False
        built = out_of_line(site.insn, slot)
        if built is None:
            proc.slots.free(slot)
            return False
        proc.tracee.write(slot, built[0])
        site.slot, site.slot_insn_len = slot, built[1]
        return True

    def _install(self, proc: TracedProcess, probe: Probe, addr: int) -> None:
        if probe.is_return:
            self._ensure_returns(proc, probe, addr)
        site = proc.sites.get(addr)
        if site is None:
            sites = proc.sites
            for other in [sites[a] for a in range(addr - MAX_INSN_LEN * 2, addr) if a in sites]:
                if other.optimized and addr < other.addr + len(other.region):
                    # The new int3 would land inside the other site's jmp: that one goes back to a trap.
                    other.static_refusal = OptimizeRefusal.REGION_OVERLAP
                    self._optimizer.unoptimize(proc, other, arm=True)
                    other.refusal = OptimizeRefusal.REGION_OVERLAP
            site = self._make_site(proc, probe.location, addr)
            proc.sites[addr] = site
        site.probes.append(probe)
        probe.sites[proc.pid] = addr
        self._set_armed(proc, site, site.wanted)
        if (
            site.armed  # then the optimizer has said why it is a trap (site.refusal)
            and site.refusal in _LASTING_TRAP
            and site.plan.kind == ResumeKind.EMULATE
            and not site.prefer_slot
            and boost_is_cheaper(site.insn)
        ):
            self._slot_for_boost(proc, site)

    def _ensure_returns(self, proc: TracedProcess, probe: Probe, addr: int) -> None:
        """The process's return trampoline, made as its first return probe is placed: a process
        with no memory left for it, or whose threads use GS (no thread area for the shadow
        stack), refuses the probe here rather than miss every call."""
        if proc.returns is not None:
            return
        where = f"{probe.location.basename}:{probe.location.label}"
        if proc.areas is None and self._optimizer.gs_in_use(proc):
            raise ProbeRefused(Refusal.GS_IN_USE, where)
        try:
            self.returns.setup(proc, addr)
        except ProcessError as exc:
            _debug(f"pid {proc.pid}: {exc}")
            raise ProbeRefused(Refusal.NO_MEMORY, where) from exc

    def _slot_for_boost(self, proc: TracedProcess, site: Site) -> None:
        """A slot for an emulated push whose site stays a trap: cheaper from there (an emulated
        hit if none can be made)."""
        with contextlib.suppress(SeccompFiltered):
            site.prefer_slot = self.give_slot(proc, site)

    def process_of(self, tid: int) -> TracedProcess | None:
        """The traced process a thread belongs to."""
        return self._owner.get(tid)

    def allocate_slot(self, proc: TracedProcess, near: int, size: int = SLOT_SIZE) -> int | None:
        stopped = next((t for t, s in proc.tracee.threads.items() if s.stopped), None)
        if proc.slots.stub() is not None and stopped is not None:
            proc.map_tid = stopped  # our own page holds the syscall stub: nothing else is touched
            return proc.slots.allocate(near, size)
        # The first region borrows target code for the stub, with every thread stopped: the
        # program's entry point, which runs once, at its start (not the site, which may hold
        # an int3 of ours and is where threads go).
        with self.world_stopped(proc) as tid:
            if tid is None:
                return None
            proc.map_tid, proc.scratch = tid, self._entry_point(proc) or near
            return proc.slots.allocate(near, size)

    def _install_rescue(self, proc: TracedProcess) -> None:
        """The process's rescue handler (core/rescue.py), with every thread stopped: a killed
        tracer then leaves no thread to die of a SIGTRAP of its. Not in a process where we may
        run no code (seccomp, without the right to suspend it), nor one that handles SIGTRAP."""
        if not proc.follow:
            return
        try:
            with self.world_stopped(proc) as tid:
                if tid is None or not proc.tracee.may_run_code(tid):
                    _debug(f"pid {proc.pid}: no rescue handler (it may not run our code)")
                    return
                if proc.slots.stub() is None:  # the first region of ours, for the remote syscalls' stub
                    near = self._entry_point(proc) or int(sc.get_regs(tid).rip)
                    slot = self.allocate_slot(proc, near)
                    if slot is None:
                        return
                    proc.slots.free(slot)
                stub = proc.slots.stub()
                assert stub is not None
                proc.rescue = rescue.install(
                    proc.tracee, tid, stub, lambda near, size: self.allocate_slot(proc, near, size)
                )
                if proc.rescue is not None and proc.tracee.journal is not None:
                    proc.tracee.journal.record_rescue(proc.pid, proc.rescue.page)
        except (ProcessError, OSError) as exc:
            _debug(f"pid {proc.pid}: no rescue handler: {exc}")

    @staticmethod
    def _uninstall_rescue(proc: TracedProcess, tid: int) -> None:
        """The program's own disposition of SIGTRAP back, through stopped thread `tid`."""
        stub = proc.slots.stub()
        if proc.rescue is not None and stub is not None:
            try:
                rescue.uninstall(proc.tracee, proc.rescue, tid, stub)
            except (ProcessError, OSError) as exc:
                _debug(f"pid {proc.pid}: the rescue handler stays: {exc}")

    def _entry_point(self, proc: TracedProcess) -> int | None:
        """Where the main executable's entry point is mapped in `proc`."""
        try:
            image = load_elf(proc.exe)
        except SymbolError:
            return None
        offset = image.vaddr_to_offset(image.entry)
        if offset is None:
            return None
        return address_of_offset(
            self._maps_now.get(proc.pid) or read_maps(proc.pid), file_key(proc.exe), proc.exe, offset
        )

    def _set_armed(self, proc: TracedProcess, site: Site, armed: bool) -> None:
        """Make the site a probe (`armed`) or not. An armed site is a trap, queued for the
        optimizer when it may take a jump; an optimized site that may not stay one goes back."""
        if proc.status is not None:
            return
        if site.optimized:
            if armed and self._optimizer.trap_reason(proc, site) is None and self._optimizer.detour_current(site):
                return
            # A Python handler, a disabled or removed probe, or one more action on the site: the
            # detour no longer does what the probes ask. Back to a trap; re-optimized if it may.
            self._optimizer.unoptimize(proc, site, arm=armed)
        newly_armed = armed and not site.armed
        if site.armed and not armed:
            try:
                proc.tracee.unpatch(site.addr, site.original[:1])
            except OSError as exc:
                raise ProcessError(f"cannot write at {site.addr:#x} in pid {proc.pid}: {exc.strerror}") from exc
            site.armed = False
            proc.retired.add(site.addr)
        if not armed:
            return
        site.armed = True
        queued = self._optimizer.consider(proc, site)
        if newly_armed:
            proc.retired.discard(site.addr)
            if queued and self._int3_deferred is not None:
                self._int3_deferred.append((proc, site))  # optimized at the batch's end: no trap first
            else:
                self._write_int3(proc, site)

    @staticmethod
    def rescue_knows(proc: TracedProcess, site: Site) -> None:
        """The process's rescue table has `site`, before an int3 of ours goes there."""
        table = proc.rescue
        if table is not None and site.addr not in table.known:
            if proc.tracee.batching:
                table.stale = True  # published at the batch's end, before its writes go out
            else:
                table.publish(list(proc.sites.values()))

    def _write_int3(self, proc: TracedProcess, site: Site) -> None:
        self.rescue_knows(proc, site)
        try:
            proc.tracee.patch(site.addr, bytes([INT3]), site.original[:1])
        except OSError as exc:
            raise ProcessError(f"cannot write at {site.addr:#x} in pid {proc.pid}: {exc.strerror}") from exc

    def _drop_site(self, proc: TracedProcess, addr: int) -> None:
        site = proc.sites.get(addr)
        if site is None:
            return
        self._set_armed(proc, site, False)
        del proc.sites[addr]
        # The slot is not reused: a thread may still be inside it until the next quiescent point.
        if site.actions is not None:
            proc.dirty.append(site.actions)

    def _forget_site(self, proc: TracedProcess, addr: int) -> None:
        """The module holding `addr` is gone: nothing to restore, just forget it."""
        proc.sites.pop(addr, None)
        self._guardian.journal.drop(proc.pid, addr)

    def _warn(self, message: str) -> None:
        self.warnings.append(message)
        if self.on_warning is not None:
            self.on_warning(message)

    # --- stop the world, detach -----------------------------------------------------------------------
    @contextlib.contextmanager
    def world_stopped(self, proc: TracedProcess) -> Iterator[int | None]:
        """Every thread of `proc` stopped; yields one tid usable for remote syscalls, or None
        when there is nothing to work on: the process is going away, or it has exec'd (what we
        know of its memory is of the old image; its exec event, handled next, starts over).
        A Ctrl-C meanwhile takes effect after the block: its changes to the target (a jump
        written, its site not yet known) must not be cut short."""
        with _signals_held():
            interrupted = self._stop_all(proc)
            try:
                gone = proc.tracee.image_gone()
                yield None if gone else next((t for t, s in proc.tracee.threads.items() if s.stopped), None)
            finally:
                if self._started and not self._closed:
                    for t in interrupted:
                        state = proc.tracee.threads.get(t)
                        if state is not None:
                            self._release(proc, state)

    def _stop_all(self, proc: TracedProcess) -> list[int]:
        """Interrupt every running thread of `proc` and wait until each has stopped. Events of
        other threads seen meanwhile are queued; those of interrupted threads are kept on them."""
        running = [t for t, s in proc.tracee.threads.items() if not s.stopped]
        for tid in running:
            try:
                sc.interrupt(tid)
            except ProcessLookupError as exc:
                _debug(f"stop_all: interrupt {tid}: {exc}")
        waiting = set(running)
        quiet_slices = 0
        with sigchld_blocked():
            while waiting:
                # Each thread's own stop, never another's: a thread being served at a trap
                # keeps its stop until its resume (see peek_stop).
                event = next((e for e in map(poll_event, list(waiting)) if e is not None), None)
                if event is None:
                    signal.sigtimedwait([signal.SIGCHLD], WAIT_SLICE)
                    quiet_slices += 1
                    if quiet_slices >= 4:
                        # /proc says a thread is in a tracing stop: its event is taken now (the
                        # stop may be the one that just ended the slice), or it was taken
                        # earlier (a stop is reported once) and /proc is all there is.
                        for tid in [t for t in waiting if in_tracing_stop(proc.pid, t)]:
                            waiting.discard(tid)
                            late = poll_event(tid)
                            if late is not None:
                                self._took_stop(proc, late)
                            else:
                                proc.tracee.threads[tid].stopped = True
                        # Rarely, a running thread does not stop for its interrupt (seen once in
                        # thousands of stop-the-worlds): ask again, it is idempotent.
                        for tid in waiting:
                            _debug(f"stop_all: thread {tid} did not stop; interrupting it again")
                            with contextlib.suppress(ProcessLookupError):
                                sc.interrupt(tid)
                        quiet_slices = 0
                    continue
                quiet_slices = 0
                waiting.discard(event.tid)
                self._took_stop(proc, event)
        return running

    def _took_stop(self, proc: TracedProcess, event: Event) -> None:
        """The stop (or end) of a thread `_stop_all` interrupted: kept on the thread, the stop
        at one of our int3s rewound to the site."""
        if event.kind in (EventKind.EXITED, EventKind.KILLED):
            self._pending.append(event)
            return
        state = proc.tracee.threads[event.tid]
        state.stopped = True
        state.in_event_stop = event.kind in EVENT_STOPS
        if event.kind != EventKind.STOP and not self._rewound(proc, event):
            state.deferred.append(event)

    @staticmethod
    def _rewound(proc: TracedProcess, event: Event) -> bool:
        """A taken stop at one of our int3s becomes a plain stop at the site: the thread hits
        it again when it runs on (and should dynprobe die first, it runs the site, not the
        middle of its instruction: a taken stop is resumed with no signal)."""
        if event.kind != EventKind.SIGNAL or event.sig != signal.SIGTRAP:
            return False
        try:
            regs = sc.get_regs(event.tid)
            site = proc.sites.get(int(regs.rip) - 1)
            if site is None or not (site.armed or site.optimized):
                return False
            regs.rip = site.addr
            sc.set_regs(event.tid, regs)
        except OSError:
            return False
        return True

    def detach(self) -> None:
        """Restore every byte written, move threads out of slots and traps, and let all go."""
        for proc in list(self._processes.values()):
            try:
                self._detach_process(proc)
            except (ProcessError, OSError) as exc:
                _debug(f"detach of {proc.pid}: {exc}")
        self._processes.clear()
        self._owner.clear()

    def _detach_process(self, proc: TracedProcess) -> None:
        """Let one process go. Each step stands alone: a thread that fails (it died under us) must
        not keep the others attached, and the /proc sweep at the end always runs."""
        try:
            self._stop_all(proc)
            # Events that arrived for this process but were not handled yet belong to its threads.
            for event in [e for e in self._pending if self._owner.get(e.tid) is proc]:
                self._pending.remove(event)
                self._note_exit(event)
                state = proc.tracee.threads.get(event.tid)
                if state is not None:
                    state.deferred.append(event)
            for tid, state in proc.tracee.threads.items():
                if state.stopped:
                    self._deliver_held_signal(proc, tid, state)
            self._adopt_unseen_threads(proc)
            self._optimizer.restore_all(proc)
            self.tracing.restore(proc)
            if proc.areas is not None:
                proc.areas.publish_held()
                self._end_waits(proc.areas)
            self.returns.before_detach(proc)
            self._leave_detours(proc)
            self._reset_thread_areas(proc, keep=self.returns.keep_areas_at_detach(proc))
            for site in proc.sites.values():
                if site.armed:
                    with contextlib.suppress(OSError):
                        proc.tracee.unpatch(site.addr, site.original[:1])
                    site.armed = False
            # Every thread made ready to go while the rescue handler still stands: after it is
            # gone, a killed dynprobe must leave no thread a SIGTRAP of ours.
            due: dict[int, int] = {}
            for tid, state in list(proc.tracee.threads.items()):
                _debug(
                    f"detach: thread {tid} stopped={state.stopped} stepped={state.stepped} deferred={state.deferred}"
                )
                try:
                    sig = self._settle_thread(proc, tid, state) if state.stopped else None
                except OSError as exc:
                    _debug(f"detach: thread {tid}: {exc}")
                    continue
                if sig is not None:
                    due[tid] = sig
            if due:
                self._uninstall_rescue(proc, next(iter(due)))
            for tid, sig in due.items():
                try:
                    self._detach_thread(proc, tid, sig)
                except OSError as exc:
                    _debug(f"detach: thread {tid}: {exc}")
        finally:
            self._detach_stragglers(proc)
            proc.tracee.close_memory()

    @staticmethod
    def _traced_by_us(proc: TracedProcess) -> list[int]:
        """Threads of `proc` that /proc says we trace, whatever our bookkeeping believes."""
        me = os.getpid()
        try:
            return [t for t in list_threads(proc.pid) if tracer_of(proc.pid, t) == me]
        except ProcessError:
            return []

    @staticmethod
    def _state_from_stop(tid: int, event: Event | None) -> ThreadState:
        """A stopped thread's state, keeping the stop's event unless it needs no handling."""
        state = ThreadState(tid)
        if event is not None and event.kind not in (EventKind.STOP, EventKind.EXITED, EventKind.KILLED):
            state.deferred.append(event)
        return state

    def _detach_stragglers(self, proc: TracedProcess) -> None:
        """Whatever our bookkeeping believes, no thread may stay traced by us after detach: it
        would sit in a ptrace stop for as long as this process lives. /proc has the last word."""
        for _ in range(3):
            left = self._traced_by_us(proc)
            if not left:
                return
            for tid in left:
                with contextlib.suppress(OSError):
                    sc.interrupt(tid)
                event = self._wait_stop(tid, timeout=1.0)
                _debug(f"detach: thread {tid} of {proc.pid} was still traced; its stop: {event}")
                try:
                    state = proc.tracee.threads[tid] = self._state_from_stop(tid, event)
                    sig = self._settle_thread(proc, tid, state)
                    if sig is not None:
                        self._detach_thread(proc, tid, sig)
                except OSError as exc:
                    _debug(f"detach: thread {tid}: {exc}")

    def _deliver_held_signal(self, proc: TracedProcess, tid: int, state: ThreadState) -> None:
        """A thread stopped with a signal for the program (a terminal's SIGINT) takes it now,
        before dynprobe's last system calls run in it: resumed from that stop without it, the
        signal would be lost, and a system call it interrupted (pause) restarted instead of
        failing with EINTR. A single step with the signal sets up its handler as the kernel
        would and stops before the handler's first instruction (or the signal ends the
        process); a signal whose taking would run the program's code is left to the detach."""
        held = [e for e in state.deferred if e.kind == EventKind.SIGNAL and e.sig not in _FAULT_SIGNALS]
        if not held or not runs_no_code_to_take(proc.pid, tid, held[-1].sig):
            return
        try:
            if sc.get_siginfo(tid).si_signo != held[-1].sig:
                return  # no longer in that signal's stop: the detach delivers what it can
            rip = int(sc.get_regs(tid).rip)
            if (rip - 1) in proc.sites or self._traps.slot_site(proc, rip) or self.in_own_code(proc, rip):
                return  # (its handler would return where the detach is about to move it from)
            sc.singlestep(tid, held[-1].sig)
            state.stepped = True
        except OSError as exc:
            _debug(f"detach: thread {tid}: signal {held[-1].sig} not delivered ahead: {exc}")
            return
        state.deferred.remove(held[-1])
        event = self._wait_stop(tid, timeout=1.0)
        if event is not None and event.kind == EventKind.SIGNAL and event.sig != signal.SIGTRAP:
            state.deferred.append(event)  # another signal came meanwhile: the detach delivers it
        elif event is not None and event.kind in (EventKind.EXITED, EventKind.KILLED):
            self._pending.append(event)  # the signal ended it (its default action)

    def _wait_stop(self, tid: int, timeout: float) -> Event | None:
        """The next stop of `tid`, polling up to `timeout` seconds (None if it does not come:
        then it is stopped already, its event taken earlier)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            event = poll_event(tid)
            if event is not None:
                return self._note_exit(event)
            if in_tracing_stop(tid, tid):
                time.sleep(0.001)
                return self._note_exit(poll_event(tid))
            time.sleep(0.0005)
        return None

    def _note_exit(self, event: Event | None) -> Event | None:
        """The command's end, reaped while we let it go (a detach waits for stops and may get
        it): its status is here alone, for `exit_status`."""
        if event is not None and event.tid == self.main_pid and event.kind in (EventKind.EXITED, EventKind.KILLED):
            self.exit_status = event.code if event.kind == EventKind.EXITED else 128 + event.sig
        return event

    def _adopt_unseen_threads(self, proc: TracedProcess) -> None:
        """Threads born while we worked, whose clone event we have not matched yet: PTRACE_O_TRACECLONE
        attached them, so they sit in their first stop and must be let go too."""
        for tid in self._traced_by_us(proc):
            if tid in proc.tracee.threads:
                continue
            event = self._orphans.pop(tid, None)
            for queued in [e for e in self._pending if e.tid == tid]:
                self._pending.remove(queued)
                event = event or queued
            if event is None:
                event = self._note_exit(wait_event(tid))  # its first stop is imminent: it is born stopped
            proc.tracee.threads[tid] = self._state_from_stop(tid, event)

    def _settle_thread(self, proc: TracedProcess, tid: int, state: ThreadState) -> int | None:
        """Make stopped thread `tid` ready to be let go: off our sites and slots, and in a stop
        that a killed dynprobe leaves harmless. Returns the signal its detach delivers (None:
        it is gone)."""
        if not any(e.kind == EventKind.SIGNAL and e.sig == signal.SIGTRAP for e in state.deferred) and (
            sigtrap_pending(proc.pid, tid)
        ):
            # It executed our int3 just as our PTRACE_INTERRUPT came: the interrupt stop is reported
            # before pending signals, so the SIGTRAP still waits in its queue. Detached now, it
            # would take that SIGTRAP with no tracer and die of it. Let it report the trap first.
            with contextlib.suppress(OSError):
                sc.cont(tid)
            event = self._wait_stop(tid, timeout=1.0)
            _debug(f"detach: thread {tid} had a SIGTRAP pending; reported as {event}")
            if event is not None and event.kind == EventKind.SIGNAL:
                state.deferred.append(event)
        try:
            regs = sc.get_regs(tid)
        except OSError as exc:
            _debug(f"detach: thread {tid}: no registers ({exc}); deferred {state.deferred}")
            return None
        # Only a SIGTRAP stop we saw counts: GETSIGINFO of a PTRACE_INTERRUPT stop also reads as
        # SIGTRAP/SI_KERNEL, and a thread interrupted at site+1 (after an emulated push) must not
        # be rewound.
        signals = [e.sig for e in state.deferred if e.kind == EventKind.SIGNAL]
        trapped = signal.SIGTRAP in signals
        sig = next((s for s in reversed(signals) if s != signal.SIGTRAP), 0)
        rip = int(regs.rip)
        step = proc.stepping.pop(tid, None)
        site = self._traps.slot_site(proc, rip) or (step.site if step else None)
        if site is not None and site.in_slot(rip):
            regs.rip = site.original_rip(rip)
            proc.set_trap_regs(tid, regs)
        elif trapped and (rip - 1) in proc.sites:
            regs.rip = rip - 1  # stopped on our int3, now gone: run the original instruction
            proc.set_trap_regs(tid, regs)
        elif trapped and step is None and not sig:
            sig = signal.SIGTRAP  # the target's own trap: it is due to it
        if step is not None and step.held_signals:
            sig = step.held_signals[0]
        state.deferred = [e for e in state.deferred if e.kind != EventKind.SIGNAL]  # (in `sig` now)
        if sig != signal.SIGTRAP and (state.stepped or _in_sigtrap_stop(tid)):
            return self._park(proc, tid, state, sig)
        return sig

    def _park(self, proc: TracedProcess, tid: int, state: ThreadState, sig: int) -> int | None:
        """Move a thread out of a stop that a dying dynprobe would leave with a SIGTRAP (an int3
        stop not taken yet, the trap flag of a single step): resumed with the signal it is due,
        and interrupted at once, it waits in an interrupt stop, which a tracer's death or the
        detach ends as is. Threads and processes it creates meanwhile are not traced. Returns
        the signal its detach delivers: that of a signal stop reached instead (None: gone)."""
        with contextlib.suppress(OSError):
            sc.set_options(tid, TRACE_OPTIONS & ~_TRACE_CHILDREN)
        proc.resume_trapped(tid, sig)
        with contextlib.suppress(OSError):
            sc.interrupt(tid)
        event = self._wait_stop(tid, timeout=1.0)
        if event is None or event.kind in (EventKind.EXITED, EventKind.KILLED):
            if event is not None:
                self._pending.append(event)
            proc.tracee.threads.pop(tid, None)
            return None
        state.stopped = True
        state.in_event_stop = event.kind in EVENT_STOPS
        return event.sig if event.kind == EventKind.SIGNAL else 0

    def _detach_thread(self, proc: TracedProcess, tid: int, sig: int) -> None:
        """Let settled thread `tid` go with signal `sig`, and the signals it reported since (a
        pending one the remote system call that took the rescue handler out made it take)."""
        state = proc.tracee.threads.get(tid)
        later = [e.sig for e in state.deferred if e.kind == EventKind.SIGNAL and e.sig != signal.SIGTRAP] if (
            state is not None
        ) else []  # fmt: skip
        if later and not sig:
            sig = later.pop()
        for other in later:  # (queued again: the detach delivers one)
            with contextlib.suppress(OSError):
                sc.tgkill(proc.pid, tid, other)
        if (
            sig
            and sig not in _FAULT_SIGNALS
            and state is not None
            and state.interrupted is not None
            and _in_syscall_stop(tid)
        ):
            # A signal that came while our system call ran in it: sent on from this stop (as
            # the kernel does from a system-call stop), with the registers of the call it
            # interrupted, so that its handler's return restarts it or fails it with EINTR.
            sc.set_regs(tid, state.interrupted)
        _debug(f"detach: thread {tid} let go with signal {sig}")
        with contextlib.suppress(OSError):
            sc.detach(tid, sig)

    def _check_open(self) -> None:
        if self._closed:
            raise SessionError("the session is closed")

    # --- optimized probes: thread areas, the consumer, counters --------------------------------------
    @property
    def layout(self) -> L.AreaLayout:
        """The thread-area layout, fixed by the first call: ring size, and a record size that holds
        the record of every probe placed so far (later, bigger ones stay traps)."""
        if self._layout is None:
            problem = L.check_ring_bytes(self.ring_bytes)
            if problem is not None:
                raise SessionError(problem)
            need = max((payload_size(p.fields) for p in self.probes if p.action == ActionKind.RECORD), default=0)
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
        if (
            probe.action == ActionKind.RECORD
            and self._layout is not None
            and L.RECORD_HEADER + payload_size(probe.fields) > self._layout.record_size
        ):
            return OptimizeRefusal.RECORD_TOO_LARGE
        return None

    def process(self, pid: int) -> TracedProcess | None:
        return self._processes.get(pid)

    def warn(self, message: str) -> None:
        self._warn(message)

    def symbol_resolver(self, site: Site) -> Callable[[str], int | None]:
        """@SYM of fetch arguments, as addresses in the process of `site`."""
        location = site.probes[0].location

        def address(name: str) -> int | None:
            vaddr = load_elf(location.path).address_of(name)
            return None if vaddr is None else site.addr - location.vaddr + vaddr

        return address

    def symbol_resolver_for(self, probe: Probe, proc: TracedProcess) -> Callable[[str], int | None]:
        site = proc.sites.get(probe.sites.get(proc.pid, -1))
        return self.symbol_resolver(site) if site is not None and site.probes else (lambda name: None)

    def fetch_context(self, proc: TracedProcess, tid: int, regs: Regs, probe: Probe) -> FetchContext:
        """What the probe's fetches read on thread `tid` of `proc`."""
        return FetchContext(
            regs, MemoryReader(proc.tracee), lambda: proc.comm(tid), self.symbol_resolver_for(probe, proc),
            self.symbolizer(proc.pid),
        )  # fmt: skip

    def probe_by_index(self, index: int) -> Probe | None:
        return self._by_index[index] if 0 <= index < len(self._by_index) else None

    def give_area(self, proc: TracedProcess, tid: int) -> None:
        self._optimizer.give_area(proc, tid)

    @functools.cached_property
    def _clock(self) -> TscClock:
        """The time-stamp counter's calibration, made on first use (the consumer converts
        with it; asking it fixes nothing of the thread-area layout)."""
        return TscClock()

    def read_tsc(self) -> int:
        return int(self._clock.read())

    def tsc_to_ns(self, ticks: int) -> int:
        return self._clock.ticks_to_ns(ticks)

    def clock_tick_ns(self) -> float:
        """The typical (median) step between two readings of the time-stamp counter back to
        back, in ns: time stamps closer than that may read the same."""
        return float(self._clock.tick_ns)

    def tsc_mult(self) -> int:
        """ns = ticks * tsc_mult >> 32, for $latency computed in the target."""
        return self._clock.mult

    def program_for(self, proc: TracedProcess, probe: Probe, site: Site) -> Program:
        """What the probe runs in `proc`'s detour at `site`."""
        if probe.is_return:
            return self.returns.entry_program(proc, probe, site.addr)
        return probe.program()

    def in_own_code(self, proc: TracedProcess, rip: int) -> bool:
        """In a detour, return-probe or tracer code: a thread there needs its thread area."""
        return (
            self._optimizer.in_detour(proc, rip)
            or (proc.returns is not None and proc.returns.owns(rip))
            or self.tracing.owns(proc, rip)
            or any(s.actions is not None and rip in s.actions for s in proc.sites.values())
        )

    def records(self) -> bool:
        """Whether anything of the session writes records (into the threads' rings)."""
        return bool(self.tracing.tracers) or any(p.action is ActionKind.RECORD for p in self.probes)

    def new_areas(self, proc: TracedProcess) -> ThreadAreas:
        areas = new_thread_areas(proc, self)
        proc.rseq_offset_at = self.rseq_offset_at(proc)
        self._ensure_consumer().add(areas)
        areas.set_wait(self._wait_ticks())
        areas.set_overwrite(self._flight_recorder)
        return areas

    @property
    def wait_for_room(self) -> float:
        """Seconds a thread whose ring is full waits for the reader to make room before its record
        is counted lost (0: lost at once, the lossy mode). The wait costs the target nothing
        while its rings have room."""
        return self._wait_for_room

    @wait_for_room.setter
    def wait_for_room(self, seconds: float) -> None:
        if not 0 <= seconds <= MAX_WAIT_FOR_ROOM:
            raise SessionError(f"wait_for_room {seconds} is out of range (0..{MAX_WAIT_FOR_ROOM} s)")
        self._wait_for_room = seconds
        ticks = self._wait_ticks()
        for proc in self._processes.values():
            if proc.areas is not None:
                proc.areas.set_wait(ticks)  # (a vfork child's are its parent's: set twice, the same)

    @property
    def flight_recorder(self) -> bool:
        """Whether the rings are a flight recorder's: a full ring gives up its oldest records for
        the newest (counted: `records_overwritten`; nothing waits, nothing is lost), and records
        are read only by `drain()` (from any thread; `request_snapshot()` from a signal handler)
        and when the session ends: the newest each ring holds, as ftrace's snapshot and perf's
        --overwrite keep them."""
        return self._flight_recorder

    @flight_recorder.setter
    def flight_recorder(self, on: bool) -> None:
        if on == self._flight_recorder:
            return
        if self._started:
            raise SessionError("flight_recorder is chosen before the session runs (its rings are read another way)")
        if on and any(tracer.threshold_ns for tracer in self.tracing.tracers.values()):
            raise SessionError(_FLIGHT_AND_THRESHOLD)
        if not on and any(tracer.snapshot_over_ns for tracer in self.tracing.tracers.values()):
            raise SessionError(_SNAPSHOT_WITHOUT_FLIGHT)
        self._flight_recorder = on
        if self._consumer is not None:
            self._consumer.flight = on
        for proc in self._processes.values():
            if proc.areas is not None:
                proc.areas.set_overwrite(on)

    def request_snapshot(self) -> None:
        """A flight recorder's records read (and delivered) soon, by the consumer's thread: safe
        from a signal handler, where `drain()` is not."""
        if self._consumer is not None:
            self._consumer.snapshot_due = True

    @property
    def snapshots_asked(self) -> int:
        """Calls that lasted a tracer's `snapshot_over_ns` and asked a flight recorder for a
        snapshot (one snapshot may answer several; a thread's asks before the reader looks, one)."""
        return self._consumer.snapshots_asked if self._consumer is not None else 0

    def keep_event(self, event: ProbeEvent) -> None:
        """An event served at a stop, for the next delivery (core/traps.py)."""
        self._delivery.keep(event)

    def act_in_tracer(
        self, probe: Probe, proc: TracedProcess, tid: int, address: int, context: FetchContext,
        caller: int | None = None,
    ) -> None:  # fmt: skip
        """What the probe's detour or return code does, done at a stop (core/traps.py)."""
        self._traps.act_in_tracer(probe, proc, tid, address, context, caller)

    @property
    def records_overwritten(self) -> int:
        """A flight recorder's records that gave way to newer ones before they were read (as of
        the last snapshot: `flight_recorder`)."""
        return self._delivery.gave_way + (self._consumer.overwritten if self._consumer is not None else 0)

    def _wait_ticks(self) -> int:
        if not self._wait_for_room:
            return 0
        return max(1, int(self._wait_for_room * 1e9 * (1 << 32) / self.tsc_mult()))

    @property
    def records_waited(self) -> int:
        """Records whose thread found its ring full and waited for room (none of them lost)."""
        return self._consumer.waits() if self._consumer is not None else 0

    def _release_areas(self, proc: TracedProcess) -> None:
        """The process exited or exec'd: what its areas hold is drained and folded into totals."""
        areas = proc.areas
        if areas is None:
            return
        proc.areas = None
        if any(p.areas is areas for p in self._processes.values()):
            areas.retire(proc.pid)  # a vfork child that borrowed an area of its parent's pools
        elif self._consumer is not None:
            areas.publish_held()
            self._consumer.forget(areas)

    def _end_waits(self, areas: ThreadAreas) -> None:
        """No thread waits for room in its ring any more: a pass of the reader makes room for
        those that wait now (stopped, they see it as they leave their detours), and no later
        record waits (nobody will read it)."""
        if self._consumer is not None:
            self._consumer.drain()
        areas.set_wait(0)

    def _leave_detours(self, proc: TracedProcess) -> None:
        """At detach: a thread inside a detour runs to its end one instruction at a time, so no
        thread needs a detour or its thread area once we are gone (a fetch that faults meanwhile
        goes to its fix-up; other signals are kept for the detach to deliver)."""
        for tid, state in list(proc.tracee.threads.items()):
            if not state.stopped:
                continue
            try:
                rip = int(sc.get_regs(tid).rip)
                # (a detour is straight code, one bounded string loop, and a wait for room in a
                # full ring, which _end_waits made or ended)
                for _ in range(100_000):
                    if not self.in_own_code(proc, rip):
                        break
                    sc.singlestep(tid, 0)
                    state.stepped = True
                    event = self._note_exit(wait_event(tid))
                    if event is None or event.kind in (EventKind.EXITED, EventKind.KILLED):
                        proc.tracee.threads.pop(tid, None)
                        break
                    regs = sc.get_regs(tid)
                    if event.kind == EventKind.SIGNAL and event.sig in (signal.SIGSEGV, signal.SIGBUS):
                        fixup = proc.fixups.get(int(regs.rip))
                        if fixup is not None:
                            regs.rip = fixup
                            sc.set_regs(tid, regs)
                            rip = fixup
                            continue
                    if not (event.kind == EventKind.SIGNAL and event.sig == signal.SIGTRAP):
                        state.deferred.append(event)
                    rip = int(regs.rip)
            except OSError as exc:
                _debug(f"detach: thread {tid} could not leave its detour: {exc}")

    def _reset_thread_areas(self, proc: TracedProcess, keep: set[int]) -> None:
        """At detach: GS bases back to 0 (as we found them), except for a thread still running
        a detour, which needs its area until it is out, and the threads in `keep` (frames that
        still return through the trampoline). The memory stays mapped in the target."""
        if proc.areas is None:
            return
        for tid, state in proc.tracee.threads.items():
            if not state.stopped or not proc.areas.owns(tid) or tid in keep:
                continue
            try:
                regs = sc.get_regs(tid)
                if not self.in_own_code(proc, int(regs.rip)):
                    regs.gs_base = 0
                    sc.set_regs(tid, regs)
            except OSError:
                continue

    def _ensure_consumer(self) -> Consumer:
        if self._consumer is None:
            self._consumer = Consumer(
                self.layout, self._delivery.deliver,
                lambda i: 0 <= i < len(self._by_index) and (self._by_index[i] is not None or i in self.tracing.tracers),
                self._warn, without_cpu=lambda i: i in self.tracing.tracers, clock=self._clock,
            )  # fmt: skip
            self._consumer.on_failure = self.request_stop
            self._consumer.flight = self._flight_recorder
            if self._started and not self._closed:
                self._consumer.start()
        return self._consumer

    def _stop_consumer(self) -> None:
        if self._consumer is not None:
            self._consumer.stop()
            for areas in list(self._consumer.processes):
                self._consumer.forget(areas)

    def write_raw(self, sink: BinaryIO, decode: bool = True) -> None:
        """Also write every drained record, as is, to `sink`: per chunk a u64 (pid | tid << 32)
        and a u64 count, then count records of `layout.record_size` bytes. `decode=False` skips
        the per-event callbacks (the fastest drain, for recording to disk). Call it once the
        probes are placed: it fixes the record size."""
        consumer = self._ensure_consumer()
        consumer.raw_sink = sink
        consumer.decode = decode

    def drain(self) -> None:
        """Deliver every record written so far to the `on_event` callbacks (in this thread): a
        flight recorder's, what its rings hold (a snapshot)."""
        if self._consumer is not None:
            self._consumer.drain()
        else:
            self._delivery.deliver([])

    def thread_names(self) -> dict[int, str]:
        """The name of every thread seen in a thread area (tid -> comm), still known after it ended."""
        return {tid: name for (_, tid), (name, _) in self._comms.items()}

    def clock(self) -> dict[str, float]:
        """The time-stamp counter's calibration: ns = (tsc - tsc0) * scale + ns0 (CLOCK_MONOTONIC)."""
        return self._clock.params()

    def comm_of(self, pid: int, tid: int) -> str:
        """A thread's name; remembered, so events read after it ended still have it. Read
        again at most every COMM_REFRESH seconds (a thread may rename itself; reading
        /proc at every drain cost more than the records of a trap probe's hits)."""
        now = time.monotonic()
        known = self._comms.get((pid, tid))
        if known is not None and now - known[1] < COMM_REFRESH:
            return known[0]
        proc = self._processes.get(pid)
        if proc is not None and tid in proc.tracee.threads:
            name = proc.tracee.comm(tid)
            if name != "<...>":
                self._comms[pid, tid] = (name, now)
                return name
        return known[0] if known is not None else "<...>"

    def symbolizer(self, pid: int) -> Callable[[int], str | None]:
        """Symbolizes addresses of `pid` when asked, which may be after it exited (events are
        formatted by the consumer): then with the maps dynprobe saw last."""

        def symbolize(addr: int) -> str | None:
            maps = read_maps(pid) or self._last_maps.get(pid, [])
            return symbolize_in(maps, addr)

        return symbolize

    def counters_of(self, probe: Probe) -> tuple[int, int, int]:
        """(hits, missed, lost) counted in the target's thread areas."""
        if self._consumer is None or probe.index >= self.layout.max_probes:
            return 0, 0, 0
        return self._consumer.counters(probe.index)

    def histogram_of(self, probe: Probe) -> list[int]:
        buckets = list(probe.trap_hist)
        if self._consumer is not None and probe.action == ActionKind.HIST and probe.hist_index < self.layout.max_hists:
            for i, n in enumerate(self._consumer.histogram(probe.hist_index).tolist()):
                buckets[i] += n
        return buckets

    def is_optimized(self, probe: Probe) -> bool:
        """Whether a site of the probe is a jump now, or was when its process ended."""
        return bool(probe.jumps)

    def trap_reason_of(self, probe: Probe) -> OptimizeRefusal | None:
        if probe.jumps:
            return None
        for proc in self._processes.values():
            for site in proc.sites.values():
                if probe in site.probes and site.refusal is not None:
                    return site.refusal
        return probe.refusal

    def optimize_now(self) -> None:
        """Optimize queued sites at once instead of after the batching delay (from a handler:
        as soon as it has returned, see `_running`)."""
        if self._in_run:
            self._optimizer.expedite()
        else:
            self._optimizer.flush()

    # --- introspection ----------------------------------------------------------------------------------
    def processes(self) -> list[int]:
        return sorted(self._processes)

    def slot_bytes_in_use(self) -> int:
        """Executable bytes handed out (trap slots and detours) in every traced process."""
        return sum(p.slots.in_use for p in self._processes.values())

    @property
    def records_drained(self) -> int:
        return self._consumer.drained if self._consumer is not None else 0

    def slot_bytes(self) -> int:
        return sum(p.slots.bytes_mapped() for p in self._processes.values())


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
