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
    name: str  # canonical: rax, rdi, rip, eflags, ...


@frozen
class Arg:
    index: int  # $argN, 1-based, System V integer argument registers


@frozen
class Absolute:
    addr: int  # @0xADDR: the value stored at this address


@frozen
class SymbolAddr:
    symbol: str  # @SYM+off: the value stored at a symbol of the probed file
    offset: int


@frozen
class Stack:
    index: int  # $stackN: the N-th word on the stack


@frozen
class StackPointer:
    pass


@frozen
class RetVal:
    pass


@frozen
class Latency:
    pass  # $latency: nanoseconds from the function's entry to its return (return probes)


@frozen
class Caller:
    pass  # where a return probe's function returns to (every return event carries it)


@frozen
class Comm:
    pass


@frozen
class StackSlot:
    pass  # where a hit's stack is in its process's table of stacks (records of by="stack" probes)


@frozen
class Deref:
    offset: int  # +|-OFFS(INNER): the value stored at INNER + OFFS
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
    name: str
    fetch: Fetch
    type: ArgType
    text: str  # as written, for listings


@frozen
class ProbeSpec:
    kind: str  # 'p' or 'r'
    group: str | None
    event: str | None
    location: str
    args: tuple[FetchArg, ...] = field(default_factory=tuple)
    maxactive: int | None = None
    text: str = ""
