"""Probes (what the user asked for) and sites (where the target is patched).

Several probes on one address share one `Site` (the kernel's aggregate kprobe): handlers run in
registration order and the site stays armed while any of its probes is enabled.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from dynprobe.actions.model import ActionKind, Field, Filter, Program, record_fields
from dynprobe.arch.x86_64 import SLOT_SIZE, Emulator, Instruction, Regs, ResumeKind, ResumePlan
from dynprobe.arch.x86_64.codegen.asm import Unsupported
from dynprobe.arch.x86_64.regs import canonical_name
from dynprobe.core.slots import PlacedCode
from dynprobe.core.stacks import MAX_FRAMES, Stack
from dynprobe.errors import OptimizeRefusal, ProbeRefused, SessionError
from dynprobe.output.hist import Histogram, zero_label
from dynprobe.ringbuf.layout import HIST_BUCKETS
from dynprobe.spec.fetch import FetchContext, Value, evaluate, format_value, json_value
from dynprobe.spec.model import ArgType, Caller, FetchArg, StackSlot
from dynprobe.spec.parser import integer_type
from dynprobe.symbols.resolve import Location

if TYPE_CHECKING:
    from dynprobe.lang.maps import LangBody
    from dynprobe.ringbuf.consumer import RecordBatch


class ProgramBody(Protocol):
    """A bpftrace program's probe body (core/programs.py): what its detour runs in the process
    `pid` (`placed`), the payload bytes of its largest record (its printf()s'; 0: it writes
    none), and what takes its records (a window of time's, all of the program's probes' at once)."""

    @property
    def record_bytes(self) -> int: ...
    def placed(self, pid: int) -> LangBody | OptimizeRefusal: ...
    def on_records(self, batches: list[RecordBatch]) -> None: ...


class ProbeOwner(Protocol):
    """What a probe asks of the runtime of the session that made it (core/runtime.py)."""

    def counters_of(self, probe: Probe) -> tuple[int, int, int]: ...
    def histogram_of(self, probe: Probe) -> list[int]: ...
    def is_optimized(self, probe: Probe) -> bool: ...
    def trap_reason_of(self, probe: Probe) -> OptimizeRefusal | None: ...
    def addresses_of(self, probe: Probe) -> list[int]: ...
    def sync_probe(self, probe: Probe) -> None: ...
    def remove_probe(self, probe: Probe) -> None: ...
    def clock_tick_ns(self) -> float: ...  # how finely its time values ($latency) are measured
    def stack_of(self, hit: Hit, max_frames: int) -> Stack: ...
    def stacks_of(self, probe: Probe, *, sums: bool = False) -> Counter[Stack]: ...


class ProbeMode(enum.Enum):
    TRAP = "trap"
    OPTIMIZED = "optimized"


Handler = Callable[["Hit"], object]
HandlerFailed = Callable[["Probe", BaseException], None]
CALLER_ARG = FetchArg("__caller", Caller(), ArgType("x", 64), "")  # first in a return probe's records
STACK_ARG = FetchArg("__stack", StackSlot(), ArgType("x", 64), "")  # last in the records of a by="stack" probe
EventHandler = Callable[["ProbeEvent"], object]


@dataclass
class ProbeEvent:
    """One hit of a recording probe, as the consumer delivers it (after the fact, in the tracer):
    the fetch arguments' values, the thread, when (CLOCK_MONOTONIC ns) and on which CPU."""

    probe: Probe
    pid: int
    tid: int
    cpu: int
    time_ns: int
    address: int
    values: dict[str, Value]
    comm: str
    symbolize: Callable[[int], str | None] | None = None
    caller: int | None = None  # a return event: where the function returned to
    order: int = 0  # RecordBatch.order: after time, what puts a thread's events in order
    stack: Stack | None = None  # the thread's stack at the hit, for a probe placed with by="stack"

    @property
    def time(self) -> float:
        return self.time_ns / 1e9

    def formatted(self) -> list[tuple[str, str]]:
        return [(a.name, format_value(self.values[a.name], a.type, self.symbolize)) for a in self.probe.args]

    def json_values(self) -> dict[str, object]:
        return {k: json_value(v) for k, v in self.values.items()}


@dataclass
class EventColumns:
    """Events of one probe on one thread, by column: what the consumer decodes from a batch of
    records, before any event object is made (`events()` makes them)."""

    probe: Probe
    pid: int
    tid: int
    comm: str
    address: int
    symbolize: Callable[[int], str | None] | None
    time_ns: list[int]
    cpu: list[int]
    values: list[list[Value]]  # one column per fetch argument, in the spec's order
    callers: list[int | None] | None = None  # a return probe's: where each call returned to
    order: list[int] | None = None  # RecordBatch.order (None: an event served at a stop)
    stacks: list[Stack | None] | None = None  # a by="stack" probe's: each hit's stack

    @classmethod
    def of(cls, event: ProbeEvent) -> EventColumns:
        """One event as a column of one."""
        return cls(
            event.probe, event.pid, event.tid, event.comm, event.address, event.symbolize, [event.time_ns],
            [event.cpu], [[event.values[a.name]] for a in event.probe.args],
            [event.caller] if event.probe.is_return else None, [event.order],
            [event.stack] if event.probe.stack_frames else None,
        )  # fmt: skip

    def events(self) -> list[ProbeEvent]:
        names = [a.name for a in self.probe.args]
        callers = self.callers or [None] * len(self.time_ns)
        stacks = self.stacks or [None] * len(self.time_ns)
        return [
            ProbeEvent(self.probe, self.pid, self.tid, cpu, t, self.address, dict(zip(names, row, strict=True)),
                       self.comm, self.symbolize, caller, order, stack)
            for t, order, cpu, caller, stack, *row in zip(self.time_ns, self.orders(), self.cpu, callers, stacks,
                                                          *self.values, strict=True)
        ]  # fmt: skip

    def orders(self) -> list[int]:
        return self.order or [0] * len(self.time_ns)


class BatchHandler:
    """An `on_event` handler that takes a drain's events of its probes at once, as columns
    (`on_batches`), rather than an event object per hit: a printer formats a column of
    values in one go (`dynprobe trace`). `__call__` takes single events (API use)."""

    def __call__(self, event: ProbeEvent) -> None:
        self.on_batches([EventColumns.of(event)])

    def on_batches(self, batches: list[EventColumns]) -> None:
        raise NotImplementedError


@dataclass(slots=True)
class Hit:
    """What a handler gets: the probe, the thread's registers (writable) and its memory."""

    probe: Probe
    pid: int
    tid: int
    regs: Regs
    address: int
    time: float  # CLOCK_MONOTONIC seconds
    # What fetches read, or what makes it from the hit when first asked: most handlers never
    # ask (the upcall server makes its makers once per thread: an upcall costs a few us).
    context_source: FetchContext | Callable[[Hit], FetchContext]
    data: object = None  # a return probe's instance data: set by the entry handler, read at return
    caller: int | None = None  # at a return: where the function returns to

    @property
    def context(self) -> FetchContext:
        if not isinstance(self.context_source, FetchContext):
            self.context_source = self.context_source(self)
        return self.context_source

    @property
    def retval(self) -> int:
        """At a return: the return value (rax, unsigned; writable through `regs`); `ret(type)`
        gives it typed."""
        return int(self.regs.rax)

    def ret(self, type_name: str = "u64") -> int:
        """At a return: the return value as `type_name` says (u8..u64, s8..s64, x8..x64, as
        fetch arguments write them): `hit.ret("s32")` of an int function is negative when it is."""
        return integer_type(type_name).cast(int(self.regs.rax))

    def arg(self, index: int, type_name: str = "u64") -> int:
        """The `index`-th integer argument (1-based, as $argN) read from its register now (at
        a function's entry: the argument), as `type_name` says: `hit.arg(1, "s32")`."""
        return integer_type(type_name).cast(self.regs.arg(index))

    def reg(self, name: str, type_name: str = "u64") -> int:
        """A register by the name fetch arguments or `regs` give it ("di", "%di", "rdi"), as
        `type_name` says: `hit.reg("si", "s64")`."""
        canonical = canonical_name(name)
        if canonical is None:
            raise ValueError(f"unknown register: {name}")
        return integer_type(type_name).cast(int(getattr(self.regs, canonical)))

    @property
    def memory(self) -> object:
        return self.context.memory

    def read(self, addr: int, size: int) -> bytes:
        return self.context.memory.read(addr, size)

    def fetch(self) -> dict[str, Value]:
        """The probe's fetch arguments evaluated now."""
        return {arg.name: evaluate(arg, self.context) for arg in self.probe.args}

    def formatted(self) -> list[tuple[str, str]]:
        return [
            (arg.name, format_value(evaluate(arg, self.context), arg.type, self.context.symbolize))
            for arg in self.probe.args
        ]

    def comm(self) -> str:
        return self.context.comm()

    def stack(self, max_frames: int = MAX_FRAMES) -> Stack:
        """The thread's call stack now, innermost first (`str()` prints it a frame a line, as
        `function+0xoff (module)`): walked with each module's unwind tables, frame pointers
        where there are none; return addresses dynprobe replaced appear as the real callers."""
        if isinstance(max_frames, bool) or not isinstance(max_frames, int) or not 1 <= max_frames <= MAX_FRAMES:
            raise SessionError(f"max_frames {max_frames!r} is not a number of frames (1..{MAX_FRAMES})")
        return self.probe.owner.stack_of(self, max_frames)


def call_handler(handler: Handler, hit: Hit, failed: HandlerFailed, *, anything: bool = False) -> object:
    """What `handler(hit)` returns. An Exception it raises goes to `failed` and counts as None:
    the program goes on as if the handler had not run. So does anything else it raises if
    `anything` (the upcall server, which nothing may end); else that (a Ctrl-C, sys.exit in the
    tracing thread) ends the run."""
    try:
        return handler(hit)
    except Exception as exc:
        failed(hit.probe, exc)
    except BaseException as exc:
        if not anything:
            raise
        failed(hit.probe, exc)
    return None


@dataclass(eq=False)
class Probe:
    """One probe: a location in a file, handlers, fetch arguments, counters."""

    owner: ProbeOwner  # the session's runtime (core/runtime.py)
    location: Location
    group: str
    event: str
    args: tuple[FetchArg, ...] = ()
    pre: Handler | None = None
    post: Handler | None = None
    enabled: bool = True
    action: ActionKind | None = None  # None: Python handlers, in the tracer, at a stop
    filter: Filter | None = None
    value: FetchArg | None = None  # what a histogram counts
    on_event: EventHandler | None = None
    index: int = 0  # its counters in every thread area; the probe number in records
    hist_index: int = 0
    trap_hits: int = 0  # hits served at a stop; those of the detour are in the thread areas
    removed: bool = False
    resumes: Counter[ResumeKind] = field(default_factory=Counter)
    trap_hist: list[int] = field(default_factory=lambda: [0] * HIST_BUCKETS)
    fields: tuple[Field, ...] = ()
    jumps: set[tuple[int, int]] = field(default_factory=set)  # (pid, site) where it is optimized
    sites: dict[int, int] = field(default_factory=dict)  # pid -> where it was placed (kept after exit)
    refusal: OptimizeRefusal | None = None  # why its site was last left a trap
    not_placed: ProbeRefused | None = None  # why it was last refused where its module is mapped
    # Return probes (docs/architecture.md §7): `pre` is unused; `on_entry` runs at the entry (a
    # true result vetoes the instance), `on_return` at the return.
    is_return: bool = False
    maxactive: int = 0
    on_entry: Handler | None = None
    on_return: Handler | None = None
    data_size: int = 0
    trap_missed: int = 0  # at a stop: return entries refused (maxactive reached, shadow stack full), stacks not kept
    stack_frames: int = 0  # counting by stack, walking at most this many frames (0: not by stack)
    trap_stacks: Counter[Stack] = field(default_factory=Counter)  # hits by stack counted at a stop
    trap_stack_sums: Counter[Stack] = field(default_factory=Counter)  # and their values summed
    # A bpftrace program's probe (core/programs.py): the body its detour runs after the count
    lang: ProgramBody | None = None

    def __post_init__(self) -> None:
        stacks = (STACK_ARG,) if self.stack_frames and self.action == ActionKind.RECORD else ()
        self.fields = record_fields(((CALLER_ARG,) if self.is_return else ()) + self.args + stacks)

    @property
    def python_handlers(self) -> bool:
        return self.pre is not None or self.post is not None or self.on_entry is not None or self.on_return is not None

    def program(self, pid: int | None = None) -> Program:
        """What it runs in the target; with its bpftrace body in process `pid` if given (at a
        return probe's return, not at its entry)."""
        body: LangBody | None = None
        if self.lang is not None and pid is not None:
            placed = self.lang.placed(pid)
            if isinstance(placed, OptimizeRefusal):
                raise Unsupported(placed)
            body = placed
        return Program(
            self.index, self.action or ActionKind.COUNT, self.fields, self.value, self.hist_index, self.filter,
            lang=body,
        )  # fmt: skip

    @property
    def hits(self) -> int:
        """Every hit: at a stop (trap) and in the target (optimized)."""
        return self.hits_and_missed()[0]

    @property
    def nmissed(self) -> int:
        """Hits whose action could not run (a record re-entered from a signal handler); for a
        return probe, entries with `maxactive` instances pending on the thread."""
        return self.hits_and_missed()[1]

    def hits_and_missed(self) -> tuple[int, int]:
        """`hits` and `nmissed` from one read of the target's counters (a read sums every
        thread's: 10^4 probes printed every interval read them once each)."""
        hits, missed, _ = self.owner.counters_of(self)
        return self.trap_hits + hits, self.trap_missed + missed

    @property
    def stacks(self) -> Counter[Stack]:
        """Hits by stack, for a probe placed with `by="stack"` (walked in the target once
        optimized, in the tracer at a stop): the most hit first with `most_common()`."""
        return self.owner.stacks_of(self)

    @property
    def stack_sums(self) -> Counter[Stack]:
        """For a count by stack with a `value`: the value summed by stack (bytes allocated by
        each stack, say)."""
        return self.owner.stacks_of(self, sums=True)

    @property
    def lost(self) -> int:
        """Records dropped because the thread's ring was full."""
        return self.owner.counters_of(self)[2]

    @property
    def histogram(self) -> Histogram:
        """The log2 histogram of `value` (`Histogram`: counts by bucket, `buckets()` with their
        ranges, str() as `dynprobe hist` prints it)."""
        return Histogram(self.owner.histogram_of(self), zero_label(self.value))

    @property
    def mode(self) -> ProbeMode:
        """OPTIMIZED while any of its sites is a jump."""
        return ProbeMode.OPTIMIZED if self.owner.is_optimized(self) else ProbeMode.TRAP

    @property
    def trap_reason(self) -> OptimizeRefusal | None:
        """Why a site of this probe is a trap (None when optimized, or not placed yet)."""
        return self.owner.trap_reason_of(self)

    @property
    def name(self) -> str:
        return f"{self.group}/{self.event}"

    @property
    def clock_tick_ns(self) -> float:
        """How finely its time values ($latency) are measured: the typical step of the clock, in ns."""
        return self.owner.clock_tick_ns()

    @property
    def armed_addresses(self) -> list[int]:
        """Where this probe is armed now, in each traced process (empty while pending)."""
        return self.owner.addresses_of(self)

    def enable(self) -> None:
        self.enabled = True
        self.owner.sync_probe(self)

    def disable(self) -> None:
        self.enabled = False
        self.owner.sync_probe(self)

    def remove(self) -> None:
        self.owner.remove_probe(self)

    def __repr__(self) -> str:
        return f"<Probe {self.name} at {self.location.basename}:{self.location.label} hits={self.hits}>"


@dataclass(eq=False)
class Site:
    """A probed instruction in one process: its original bytes, how to resume, its slot."""

    addr: int
    insn: Instruction
    original: bytes  # the instruction's bytes as found
    plan: ResumePlan
    emulator: Emulator | None = None  # prepared once when the plan is to emulate
    probes: list[Probe] = field(default_factory=list)
    internal: Callable[[int, Regs], None] | None = None  # dynprobe's own hooks (dlopen tracking)
    slot: int | None = None
    slot_insn_len: int = 0
    # An emulated push on a site that stays a trap: its hits run it from the slot, made at
    # placement (analysis.boost_is_cheaper).
    prefer_slot: bool = False
    armed: bool = False  # our int3 is there (in a batch: will be, unless it is optimized at its end)
    optimized: bool = False  # our jmp is there
    detour: tuple[int, int] | None = None  # (address, size) of the optimized site's code
    region: bytes = b""  # the original bytes the jmp replaced
    # Branches from elsewhere into the region, aimed at the detour: (address, the file's bytes)
    moved: tuple[tuple[int, bytes], ...] = ()
    fixups: tuple[int, ...] = ()  # addresses in the detour of loads that may fault
    detour_probes: tuple[int, ...] = ()  # the probes whose programs the detour runs
    # In-target code of its probes' actions, for hits served at a stop, and the probes it was
    # made for
    actions: PlacedCode | None = None
    actions_probes: tuple[Probe, ...] = ()
    # A thread at its int3 when the tracer dies waits for the guardian before going on (the
    # unwinder's entries: the guardian puts the pending return addresses back first)
    rescue_wait: bool = False
    refusal: OptimizeRefusal | None = None  # why it is a trap now
    # An upcall site's (core/upcalls.py): each address of its region -> its detour's copy of it
    upcall_resume: dict[int, int] | None = None
    static_refusal: OptimizeRefusal | None = None  # why it can never be optimized (found once)

    @property
    def next_ip(self) -> int:
        return self.addr + len(self.original)

    def in_slot(self, addr: int) -> bool:
        return self.slot is not None and self.slot <= addr < self.slot + SLOT_SIZE

    def original_rip(self, slot_rip: int) -> int:
        """Where a thread at `slot_rip` in this site's slot is in the original code: at the site
        before the relocated instruction ran, right after it once it has."""
        assert self.slot is not None
        return self.addr if slot_rip < self.slot + self.slot_insn_len else self.next_ip

    @property
    def wanted(self) -> bool:
        return self.internal is not None or any(p.enabled for p in self.probes)
