"""What a parsed probe specification is: the probe point and its fetch arguments as a small tree."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import field

from dynprobe.frozen import frozen


def split_location(text: str) -> tuple[str, str, str]:
    """'PATH:WHAT' -> (PATH, ':', WHAT), as str.rpartition(':') does, except that the file ends
    at the last ':' that is not half of a C++ '::' ('./app:ns::f' -> './app', ':', 'ns::f';
    'ns::f' -> ('', '', 'ns::f'))."""
    i = len(text) - 1
    while i >= 0:
        if text[i] == ":":
            if i > 0 and text[i - 1] == ":":
                i -= 2
                continue
            return text[:i], ":", text[i + 1 :]
        i -= 1
    return "", "", text


@frozen
class Reg:
    """A register's value (%ax, %rip, %flags)."""

    name: str  # canonical: rax, rdi, rip, eflags, ...


@frozen
class Arg:
    """The N-th integer argument ($argN)."""

    index: int  # $argN, 1-based, System V integer argument registers


@frozen
class Absolute:
    """The word stored at an absolute address (@0xADDR)."""

    addr: int


@frozen
class SymbolAddr:
    """The word stored at a symbol of the probed file, plus an offset (@SYM+OFFS)."""

    symbol: str
    offset: int


@frozen
class Stack:
    """The N-th word on the stack ($stackN)."""

    index: int


@frozen
class StackPointer:
    """The stack pointer ($stack)."""


@frozen
class RetVal:
    """A return probe's return value ($retval)."""


@frozen
class Latency:
    """Nanoseconds from the function's entry to its return ($latency, return probes)."""


@frozen
class Caller:
    """Where a return probe's function returns to (every return event carries it)."""


@frozen
class Comm:
    """The thread's name ($comm)."""


@frozen
class StackSlot:
    """Where a hit's stack is in its process's table of stacks (records of by="stack" probes)."""


@frozen
class Deref:
    """The word at an address another fetch gives, plus an offset (+|-OFFS(INNER))."""

    offset: int
    inner: Fetch


Fetch = Reg | Arg | Absolute | SymbolAddr | Stack | StackPointer | RetVal | Latency | Caller | Comm | StackSlot | Deref


def fetch_chain(fetch: Fetch) -> Iterator[Fetch]:
    """A fetch and, for a dereference, every fetch inside it (its address's, and so on)."""
    yield fetch
    while isinstance(fetch, Deref):
        fetch = fetch.inner
        yield fetch


@frozen
class ArgType:
    """A fetch argument's type: u/s/x with its bits, string, ustring or symbol."""

    kind: str  # 'u', 's', 'x', 'string', 'ustring', 'symbol'
    bits: int = 64

    @property
    def is_string(self) -> bool:
        return self.kind in ("string", "ustring")

    def __str__(self) -> str:
        return self.kind if self.kind in ("string", "ustring", "symbol") else f"{self.kind}{self.bits}"

    def cast(self, value: int) -> int:
        """`value` cut to this type's bits, as a signed number for s8..s64."""
        cut = value & ((1 << self.bits) - 1)
        return cut - (1 << self.bits) if self.kind == "s" and cut >> (self.bits - 1) else cut


@frozen
class FetchArg:
    """One NAME=FETCH:TYPE of a probe specification."""

    name: str
    fetch: Fetch
    type: ArgType
    text: str  # as written, for listings


@frozen
class ProbeSpec:
    """A probe specification, as the kernel's uprobe_events takes it: p|r[:[GRP/]EVENT] LOCATION [FETCHARGS]."""

    kind: str  # 'p' or 'r'
    group: str | None
    event: str | None
    location: str
    args: tuple[FetchArg, ...] = field(default_factory=tuple)
    maxactive: int | None = None
    text: str = ""
