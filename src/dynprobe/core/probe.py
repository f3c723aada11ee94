"""Probes (what the user asked for) and sites (where the target is patched).

Several probes on one address share one `Site` (the kernel's aggregate kprobe): handlers run in
registration order and the site stays armed while any of its probes is enabled.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dynprobe.arch.x86_64 import SLOT_SIZE, Emulator, Instruction, Regs, ResumeKind, ResumePlan
from dynprobe.spec.fetch import FetchContext, Value, evaluate, format_value
from dynprobe.spec.model import FetchArg
from dynprobe.symbols.resolve import Location

if TYPE_CHECKING:
    from dynprobe.core.session import Session


class ProbeMode(enum.Enum):
    TRAP = "trap"


Handler = Callable[["Hit"], object]


@dataclass
class Hit:
    """What a handler gets: the probe, the thread's registers (writable) and its memory."""

    probe: Probe
    pid: int
    tid: int
    regs: Regs
    address: int
    time: float  # CLOCK_MONOTONIC seconds
    context: FetchContext

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


@dataclass(eq=False)
class Probe:
    """One probe: a location in a file, handlers, fetch arguments, counters."""

    session: Session
    location: Location
    group: str
    event: str
    args: tuple[FetchArg, ...] = ()
    pre: Handler | None = None
    post: Handler | None = None
    enabled: bool = True
    hits: int = 0
    nmissed: int = 0
    removed: bool = False
    resumes: Counter[ResumeKind] = field(default_factory=Counter)

    @property
    def mode(self) -> ProbeMode:
        return ProbeMode.TRAP

    @property
    def name(self) -> str:
        return f"{self.group}/{self.event}"

    @property
    def armed_addresses(self) -> list[int]:
        """Where this probe is armed now, in each traced process (empty while pending)."""
        return self.session.addresses_of(self)

    def enable(self) -> None:
        self.enabled = True
        self.session.sync_probe(self)

    def disable(self) -> None:
        self.enabled = False
        self.session.sync_probe(self)

    def remove(self) -> None:
        self.session.remove_probe(self)

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
    armed: bool = False

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
