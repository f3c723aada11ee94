"""Evaluation of fetch arguments on a stopped thread (trap probes): registers, stack, memory.

A dereference that hits unmapped memory yields `FAULT`, never an exception: the event still
prints, with `(fault)` where the value would be, as tracefs does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dynprobe.arch.x86_64 import Regs
from dynprobe.arch.x86_64.regs import ARG_REGS
from dynprobe.frozen import frozen
from dynprobe.spec.model import (
    Absolute,
    Arg,
    ArgType,
    Caller,
    Comm,
    Deref,
    Fetch,
    FetchArg,
    Latency,
    Reg,
    RetVal,
    Stack,
    StackPointer,
    StackSlot,
    SymbolAddr,
)

MAX_STRING = 4096


class _Fault:
    def __repr__(self) -> str:
        return "FAULT"


FAULT = _Fault()


@frozen
class StringValue:
    """A string fetched from the target (`truncated`: longer than MAX_STRING)."""

    text: str
    truncated: bool = False


Value = int | StringValue | _Fault


class Memory(Protocol):
    def read(self, addr: int, size: int) -> bytes: ...
    def read_upto(self, addr: int, size: int) -> bytes: ...


@frozen
class ReturnValues:
    """What a return probe's fetches see besides the registers at the return."""

    args: tuple[int, ...]  # $arg1..$arg6 as they were at the entry
    caller: int  # the original return address
    latency_ns: int


@dataclass
class FetchContext:
    """What fetch arguments are evaluated against at one hit: its registers, memory and names."""

    regs: Regs
    memory: Memory
    comm: Callable[[], str]
    symbol_address: Callable[[str], int | None]  # @SYM: absolute address of a symbol of the probed file
    symbolize: Callable[[int], str | None]
    returning: ReturnValues | None = None


class _Faulted(Exception):
    pass


def _address(fetch: Fetch, ctx: FetchContext) -> int:
    """The address a memory fetch reads from."""
    if isinstance(fetch, Absolute):
        return fetch.addr
    if isinstance(fetch, SymbolAddr):
        base = ctx.symbol_address(fetch.symbol)
        if base is None:
            raise _Faulted
        return base + fetch.offset
    assert isinstance(fetch, Deref), fetch
    return (_word(fetch.inner, ctx) + fetch.offset) & ((1 << 64) - 1)


def _read(ctx: FetchContext, addr: int, size: int) -> int:
    try:
        return int.from_bytes(ctx.memory.read(addr, size), "little")
    except OSError as exc:
        raise _Faulted from exc


def _word(fetch: Fetch, ctx: FetchContext, size: int = 8) -> int:
    regs = ctx.regs
    if isinstance(fetch, Reg):
        return regs[fetch.name]
    if isinstance(fetch, Arg):
        if ctx.returning is not None:
            return ctx.returning.args[fetch.index - 1]
        return int(getattr(regs, ARG_REGS[fetch.index - 1]))
    if isinstance(fetch, Latency | Caller):
        if ctx.returning is None:
            raise _Faulted
        return ctx.returning.latency_ns if isinstance(fetch, Latency) else ctx.returning.caller
    if isinstance(fetch, StackPointer):
        return int(regs.rsp)
    if isinstance(fetch, StackSlot):
        return 0  # (a stack walked at a stop is the event's own: core/traps.py)
    if isinstance(fetch, Stack):
        return _read(ctx, int(regs.rsp) + 8 * fetch.index, 8)
    if isinstance(fetch, RetVal):
        return int(regs.rax)
    return _read(ctx, _address(fetch, ctx), size)


def _string(fetch: Fetch, ctx: FetchContext) -> StringValue:
    if isinstance(fetch, Comm):
        return StringValue(ctx.comm())
    addr = _address(fetch, ctx)
    data = ctx.memory.read_upto(addr, MAX_STRING + 1)
    nul = data.find(b"\0")
    if nul >= 0:
        return StringValue(data[:nul].decode("utf-8", "replace"))
    if not data:
        raise _Faulted
    # longer than MAX_STRING, or cut by unmapped memory before its NUL
    return StringValue(data[:MAX_STRING].decode("utf-8", "replace"), truncated=True)


def evaluate(arg: FetchArg, ctx: FetchContext) -> Value:
    try:
        if arg.type.is_string:
            return _string(arg.fetch, ctx)
        size = arg.type.bits // 8
        value = _word(arg.fetch, ctx, size) & ((1 << arg.type.bits) - 1)
        if arg.type.kind == "s" and value >> (arg.type.bits - 1):
            value -= 1 << arg.type.bits
        return value
    except _Faulted:
        return FAULT


# In a string's quotes: a backslash and a quote escaped, and control characters (a newline would
# split an event's line in two)
_ESCAPES = {
    **{c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)},
    **{ord("\n"): "\\n", ord("\t"): "\\t", ord("\r"): "\\r", ord("\\"): "\\\\", ord('"'): '\\"'},
}


def format_value(value: Value, arg_type: ArgType, symbolize: Callable[[int], str | None] | None = None) -> str:
    """A value as tracefs prints it: 0x.. for x types, decimal for u/s, "..." for strings."""
    if value is FAULT:
        return "(fault)"
    if isinstance(value, StringValue):
        return f'"{value.text.translate(_ESCAPES)}"' + ("..." if value.truncated else "")
    assert isinstance(value, int)
    if arg_type.kind == "x":
        return f"{value:#x}"
    if arg_type.kind == "symbol":
        name = symbolize(value) if symbolize else None
        return name if name else f"{value:#x}"
    return str(value)


def json_value(value: Value) -> object:
    if value is FAULT:
        return None
    if isinstance(value, StringValue):
        return value.text
    return value
