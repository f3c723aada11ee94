"""The in-process programs a probe can run instead of a Python handler (docs/architecture.md §6).

An action is arch-independent data: what to fetch, where each value goes in the record, which
counters and histogram it bumps, and the filter in front of it. `arch/x86_64/codegen/` turns it
into machine code; the consumer decodes what that code wrote using the same field layout.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from dynprobe.frozen import frozen
from dynprobe.ringbuf.layout import INT_FIELD, RECORD_HEADER, STRING_FIELD
from dynprobe.spec.model import Arg, Comm, FetchArg, Latency, fetch_chain

if TYPE_CHECKING:  # (a program in bpftrace's language imports its own modules: commands without one do not)
    from dynprobe.lang.maps import LangBody

MAX_FIELDS = 32  # one fault bit per field in the record header


class ActionKind(enum.Enum):
    COUNT = "count"  # bump the probe's hit counter
    RECORD = "record"  # write a time-stamped record of the fetch arguments to the thread's ring
    HIST = "hist"  # bump a log2 bucket of one fetched value


@frozen
class Compare:
    """A filter's comparison of one fetch argument with a number."""

    arg: FetchArg
    op: str  # == != < <= > >=
    value: int


@frozen
class Logical:
    """Two filters joined by `and` or `or`."""

    op: str  # and, or
    left: Filter
    right: Filter


Filter = Compare | Logical


def filter_args(node: Filter) -> list[FetchArg]:
    if isinstance(node, Compare):
        return [node.arg]
    return filter_args(node.left) + filter_args(node.right)


@frozen
class Field:
    """One fetch argument in a record: where it goes (from the record's start) and how big it is.
    `$comm` takes no bytes: the consumer knows the thread's name."""

    arg: FetchArg
    offset: int
    size: int

    @property
    def in_record(self) -> bool:
        return self.size > 0


def record_fields(args: tuple[FetchArg, ...]) -> tuple[Field, ...]:
    fields = []
    offset = RECORD_HEADER
    for arg in args:
        size = 0 if isinstance(arg.fetch, Comm) else STRING_FIELD if arg.type.is_string else INT_FIELD
        fields.append(Field(arg, offset, size))
        offset += size
    return tuple(fields)


def payload_size(fields: tuple[Field, ...]) -> int:
    return sum(f.size for f in fields)


@frozen
class ReturnEntry:
    """What a return probe does at its function's entry: take a shadow-stack entry (unless
    `maxactive` instances of the probe are pending on the thread), fill it, and point the return
    address at the trampoline. Its program runs at the return, from `handler`."""

    maxactive: int
    handler: int  # the address of the probe's return code
    arg_indices: tuple[int, ...]  # the $argN kept for the return (N, 1-based)
    timestamp: bool  # the entry's time stamp is kept ($latency)


@frozen
class StackCount:
    """Count the hit by its stack too: in the process's table of stacks (at `table`, `slots`
    of them), walked by the process's stack walker (at `walker`: arch/x86_64/codegen/stacks.py),
    at most `max_frames` frames, from a site that is a function's first instruction or not
    (`at_entry`: its return address is at rsp); with the program's value summed by stack too
    (`sums`)."""

    walker: int
    table: int
    slots: int
    max_frames: int
    at_entry: bool
    sums: bool


@frozen
class Program:
    """What one probe does at a hit, in the target."""

    probe_index: int
    kind: ActionKind
    fields: tuple[Field, ...] = ()
    value: FetchArg | None = None  # the histogram's value
    hist_index: int = 0
    filter: Filter | None = None
    entry: ReturnEntry | None = None  # a return probe: at the entry this, the rest at the return
    stacks: StackCount | None = None
    lang: LangBody | None = None  # a bpftrace program's probe body (lang/), run after the count

    def fetch_args(self) -> list[FetchArg]:
        """Everything it reads: its fields, its histogram's value, its filter's arguments."""
        args = [f.arg for f in self.fields] + ([self.value] if self.value is not None else [])
        return args + (filter_args(self.filter) if self.filter is not None else [])

    def return_entry(self, maxactive: int, handler: int) -> ReturnEntry:
        """What its entry does as a return probe's program, whose return code is at `handler`:
        it keeps the $argN the program reads, and the time stamp if it reads $latency."""
        fetches = [f for arg in self.fetch_args() for f in fetch_chain(arg.fetch)]
        indices = sorted({f.index for f in fetches if isinstance(f, Arg)})
        return ReturnEntry(maxactive, handler, tuple(indices), any(isinstance(f, Latency) for f in fetches))
