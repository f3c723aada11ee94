"""What of a checked bpftrace program runs where (issue 21): uprobe and uretprobe bodies run in
the target, compiled (arch/x86_64/codegen/lang.py), so they may hold only what that code does;
BEGIN, END and interval bodies run in the tracer, so they may only print, clear, zero and
exit. Anything else is refused here, before anything is placed, at its span, in bpftrace's
form: never a probe that silently stays a slow trap.

A probe body's printf() writes a record into the thread's ring (`PrintfRecord`: its values,
strings copied, comm left to the tracer) that the tracer formats. The tracer's side is here
too: BEGIN, END and interval bodies run over the maps as they are when they run
(`TracerBlock`), and `printf` formats as bpftrace's does (C's conversions).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dynprobe.errors import ProgramError
from dynprobe.lang import syntax as S
from dynprobe.lang.check import STRING_WORDS, Checked
from dynprobe.ringbuf import layout as L

MAX_KEYS = 16  # words of a map's keys
MAX_DEPTH = L.LANG_TEMPS_WORDS - MAX_KEYS  # operands an expression keeps waiting (a map's keys beside them)
MAX_VARIABLES = L.LANG_VARS_WORDS
_IN_TARGET_CALLS = ("delete", "exit", "printf", "print")
PRINTF_NUMBER = 8  # the record's first payload word: which printf() wrote it
_TRACER_CALLS = ("printf", "print", "clear", "zero", "exit", "time")
_NOT_YET = "{what} is not run in the target yet (dynprobe compiles probe bodies: integers and maps of integers)"


def check_runnable(checked: Checked, source: str, filename: str = "stdin") -> None:
    """Raise `ProgramError` for the first thing of `checked` that cannot run where it would."""
    key_kinds = map_key_kinds(checked)
    for probe in checked.program.probes:
        in_target = any(p.kind in ("uprobe", "uretprobe") for p in probe.attach_points)
        if in_target and any(p.kind not in ("uprobe", "uretprobe") for p in probe.attach_points):
            raise ProgramError("a probe block is either uprobes and uretprobes, or BEGIN, END or an interval",
                               source, probe.span, filename)  # fmt: skip
        if in_target:
            _TargetCheck(checked, source, filename, key_kinds).block(probe)
        else:
            if probe.predicate is not None:
                raise ProgramError("a predicate is for uprobes (dynprobe runs BEGIN, END and intervals in the tracer)",
                                   source, probe.predicate.span, filename)  # fmt: skip
            _tracer_statements(probe.body, source, filename)


@dataclass(frozen=True)
class PrintfArg:
    kind: str  # "int", "str" (copied: at most `chars` bytes), or "comm", "func", "probe" (none: the tracer's)
    offset: int  # in the record's payload
    chars: int = 0


@dataclass(frozen=True)
class PrintfRecord:
    """How a probe body's printf() goes through the ring: the record's payload is its number
    (a u64), then each argument's value (8 bytes), string (a record's string field) or nothing
    (comm, func, probe: the tracer knows them). A print(@m[, N]) is a record of its number
    alone (`prints`: the map and N): the tracer prints the map when it reads the record, as
    bpftrace's does."""

    number: int
    fmt: str
    args: tuple[PrintfArg, ...]
    prints: tuple[str, int] | None = None

    @property
    def size(self) -> int:
        last = self.args[-1] if self.args else None
        return PRINTF_NUMBER if last is None else last.offset + _ARG_BYTES[last.kind]


_ARG_BYTES = {"int": L.INT_FIELD, "str": L.STRING_FIELD, "comm": 0, "func": 0, "probe": 0}
_TRACER_KNOWS = ("comm", "func", "probe")


def printf_records(checked: Checked) -> dict[S.Call, PrintfRecord]:
    """The printf() and print() calls of the program's uprobe and uretprobe bodies (one record
    layout for calls that are the same), numbered in the order they appear."""
    found: dict[S.Call, PrintfRecord] = {}

    def walk(statements: tuple[S.Statement, ...]) -> None:
        for statement in statements:
            if isinstance(statement, S.If):
                walk(statement.then)
                walk(statement.otherwise)
            elif isinstance(statement, S.ExprStatement) and isinstance(statement.expr, S.Call):
                call = statement.expr
                if call.name == "printf" and call not in found:
                    found[call] = _record(len(found), call, checked)
                elif call.name == "print" and call not in found and isinstance(call.args[0], S.MapRef):
                    top = call.args[1].value if len(call.args) == 2 and isinstance(call.args[1], S.Int) else 0
                    found[call] = PrintfRecord(len(found), "", (), prints=(call.args[0].name, top))

    for probe in checked.program.probes:
        if any(p.kind in ("uprobe", "uretprobe") for p in probe.attach_points):
            walk(probe.body)
    return found


def _record(number: int, call: S.Call, checked: Checked) -> PrintfRecord:
    fmt = call.args[0]
    assert isinstance(fmt, S.Str)
    args, offset = [], PRINTF_NUMBER
    for arg in call.args[1:]:
        if isinstance(arg, S.Builtin) and arg.name in _TRACER_KNOWS:
            args.append(PrintfArg(arg.name, offset))
        elif isinstance(arg, S.Call) and arg.name == "str":
            args.append(PrintfArg("str", offset, checked.type_of(arg).size - 1))
        else:
            args.append(PrintfArg("int", offset))
        offset += _ARG_BYTES[args[-1].kind]
    return PrintfRecord(number, fmt.value, tuple(args))


def _tracer_statements(statements: tuple[S.Statement, ...], source: str, filename: str) -> None:
    for statement in statements:
        call = statement.expr if isinstance(statement, S.ExprStatement) else None
        if not isinstance(call, S.Call) or call.name not in _TRACER_CALLS:
            raise ProgramError("BEGIN, END and interval probes only print, clear, zero and exit here (dynprobe runs "
                               "them in the tracer)", source, statement.span, filename)  # fmt: skip
        for arg in call.args[1:] if call.name == "printf" else ():
            if not _constant(arg):
                raise ProgramError("printf() in BEGIN, END and interval probes prints integers, strings and maps' "
                                   "values", source, arg.span, filename)  # fmt: skip


def _is_ustack(expr: S.Expr) -> bool:
    return (isinstance(expr, S.Builtin) and expr.name == "ustack") or (
        isinstance(expr, S.Call) and expr.name == "ustack"
    )


def ustack_frames(block: S.ProbeBlock) -> int | None:
    """The frames a block's `ustack` keys walk (`ustack(N)`'s N, else 127), None if it has none;
    ProgramError-free: check_runnable refuses two different counts in one block first."""
    found = {key.args[0].value if isinstance(key, S.Call) and key.args and isinstance(key.args[0], S.Int) else 127
             for key in _all_keys(block) if _is_ustack(key)}  # fmt: skip
    return max(found) if found else None


def map_key_kinds(checked: Checked) -> dict[str, tuple[str, ...]]:
    """How the target holds each keyed map's keys, a key each: "int", "string" (a str()'s
    bytes), "stack" (its slot in the stack table), "comm" (the thread's pid << 32 | tid),
    "func" or "probe" (the probe's index), the last four named by the tracer; as the map's
    first use with keys has them (`check_runnable` refuses a use that differs)."""
    kinds: dict[str, tuple[str, ...]] = {}
    for ref in _map_refs(checked.program):
        if ref.keys:
            kinds.setdefault(ref.name, tuple(_key_kind(checked, key) for key in ref.keys))
    return kinds


def _key_kind(checked: Checked, key: S.Expr) -> str:
    if isinstance(key, S.Builtin) and key.name in _TRACER_KNOWS:
        return key.name
    kind = checked.type_of(key).kind
    return kind if kind in ("string", "stack") else "int"


def _map_refs(node: S.Node) -> Iterator[S.MapRef]:
    """The maps `node` names, however deep, in the order they are written."""
    if isinstance(node, S.MapRef):
        yield node
    for value in vars(node).values():
        for part in value if isinstance(value, tuple) else (value,):
            if isinstance(part, S.Node):
                yield from _map_refs(part)


def _all_keys(block: S.ProbeBlock) -> Iterator[S.Expr]:
    """Every key of every map a block names (its expressions walked)."""
    for ref in _map_refs(block):
        yield from ref.keys


def _constant(expr: S.Expr) -> bool:
    if isinstance(expr, S.MapRef):
        return all(isinstance(k, S.Int) for k in expr.keys)
    return isinstance(expr, S.Int | S.Str) or (isinstance(expr, S.Unary) and expr.op == "-" and _constant(expr.operand))


class _TargetCheck:
    def __init__(self, checked: Checked, source: str, filename: str, key_kinds: dict[str, tuple[str, ...]]) -> None:
        self.checked, self.source, self.filename = checked, source, filename
        self.variables: set[str] = set()
        self.key_kinds = key_kinds  # (the program's: map_key_kinds)

    def refuse(self, what: str, span: S.Span) -> ProgramError:
        return ProgramError(_NOT_YET.format(what=what), self.source, span, self.filename)

    def block(self, probe: S.ProbeBlock) -> None:
        counts = {key.args[0].value if isinstance(key, S.Call) and key.args and isinstance(key.args[0], S.Int) else 127
                  for key in _all_keys(probe) if _is_ustack(key)}  # fmt: skip
        if len(counts) > 1:
            raise self.refuse("ustack of different depths in one probe", probe.span)
        if probe.predicate is not None:
            self.expression(probe.predicate, 0)
        self.statements(probe.body)

    def statements(self, statements: tuple[S.Statement, ...]) -> None:
        for statement in statements:
            match statement:
                case S.If(condition=condition, then=then, otherwise=otherwise):
                    self.expression(condition, 0)
                    self.statements(then)
                    self.statements(otherwise)
                case S.Assign(target=target, value=value):
                    self.target(target)
                    if isinstance(value, S.Call) and value.name in ("count", "sum", "min", "max", "avg", "stats",
                                                                    "hist", "lhist"):  # fmt: skip
                        for arg in value.args[:1]:
                            self.expression(arg, 1)
                    else:
                        self.expression(value, 1)
                case S.ExprStatement(expr=S.Call(name="printf") as call):
                    self.printf(call)
                case S.ExprStatement(expr=S.Call(name=name) as call) if name in _TRACER_CALLS + _IN_TARGET_CALLS:
                    if name not in _IN_TARGET_CALLS:
                        raise self.refuse(f"{name}()", call.span)
                    for arg in call.args:
                        if isinstance(arg, S.MapRef):
                            self.map_keys(arg, 0)
                case S.ExprStatement(expr=expr):
                    self.expression(expr, 0)

    def printf(self, call: S.Call) -> None:
        """Integers and str() (its bytes, at most its length) go into its record; comm, func
        and probe are the tracer's."""
        for arg in call.args[1:]:
            if isinstance(arg, S.Builtin) and arg.name in _TRACER_KNOWS:
                continue
            if isinstance(arg, S.Call) and arg.name == "str":
                self.string(arg, 0)
            else:
                self.expression(arg, 0)
        size = _record(0, call, self.checked).size
        if L.RECORD_HEADER + size > L.MAX_RECORD_SIZE:
            raise self.refuse(f"a printf() of {size} bytes of values (a record holds "
                              f"{L.MAX_RECORD_SIZE - L.RECORD_HEADER})", call.span)  # fmt: skip

    def target(self, target: S.Var | S.MapRef) -> None:
        if isinstance(target, S.Var):
            self.variable(target)
        else:
            self.map_keys(target, 1)

    def variable(self, var: S.Var) -> None:
        self.variables.add(var.name)
        if len(self.variables) > MAX_VARIABLES:
            raise self.refuse(f"a probe with more than {MAX_VARIABLES} scratch variables", var.span)

    def map_keys(self, ref: S.MapRef, depth: int) -> None:
        info = self.checked.maps.get(ref.name)
        if info is not None and info.value is not None and info.value.kind in ("string", "stack"):
            raise self.refuse(f"a map of {info.value.kind}s (@{ref.name})", ref.span)
        if any(_is_ustack(key) for key in ref.keys) and len(ref.keys) > 1:
            raise self.refuse("ustack among a map's keys (it is run as the only one)", ref.span)
        kinds = tuple(_key_kind(self.checked, key) for key in ref.keys)
        if ref.keys and kinds != self.key_kinds[ref.name]:
            raise self.refuse(f"@{ref.name} keyed by {', '.join(kinds)} here and by "
                              f"{', '.join(self.key_kinds[ref.name])} elsewhere", ref.span)  # fmt: skip
        words = depth
        for key, kind in zip(ref.keys, kinds, strict=True):
            if kind in _TRACER_KNOWS:
                words += 1  # (a word the tracer names: the tid, the probe's index)
            elif _is_ustack(key):
                words += 1  # (the hit's stack, counted by the probe: its slot in the stack table)
            elif isinstance(key, S.Call) and key.name == "str":
                self.string(key, words)
                words += STRING_WORDS
            elif self.checked.type_of(key).kind != "int":
                raise self.refuse("a map key that is not an integer, str(), comm, func, probe or ustack", key.span)
            else:
                self.expression(key, words)
                words += 1
            if words - depth > MAX_KEYS:
                raise self.refuse(f"a map with keys of more than {MAX_KEYS} words (a str(): {STRING_WORDS})", ref.span)

    def string(self, call: S.Call, depth: int) -> None:
        """A str() the target reads: its length (when not a literal), then its address."""
        if len(call.args) == 2 and not isinstance(call.args[1], S.Int):
            self.expression(call.args[1], depth)
            depth += 1
        self.expression(call.args[0], depth)

    def expression(self, expr: S.Expr, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise self.refuse("an expression nested this deep", expr.span)
        kind = self.checked.type_of(expr).kind
        if kind not in ("int", "count", "sum", "min", "max", "avg"):
            raise self.refuse(f"a {kind} value", expr.span)
        match expr:  # (comm, func, probe, ustack and calls are refused above: no integer kind)
            case S.Var():
                self.variable(expr)
            case S.MapRef():
                self.map_keys(expr, depth)
            case S.Unary(operand=operand) | S.Cast(operand=operand):
                self.expression(operand, depth)
            case S.Binary(left=left, right=right):
                self.expression(left, depth)
                self.expression(right, depth + 1)
            case S.Ternary(condition=condition, then=then, otherwise=otherwise):
                for part in (condition, then, otherwise):
                    self.expression(part, depth)
            case S.Step(target=target):
                self.target(target)


# --- the tracer's side ----------------------------------------------------------------------------
_CONVERSION = re.compile(r"%(%|[-+ #0]*\d*(?:\.\d+)?)(hh|h|ll|l|z|j)?([diouxXcsp])?")


def c_format(fmt: str, values: list[int | str]) -> str:
    """`fmt` with `values` put in as C's printf (and bpftrace's) puts them: %d %u %x %s %c..."""
    given = iter(values)

    def one(match: re.Match[str]) -> str:
        flags, conversion = match.group(1), match.group(3)
        if flags == "%":
            return "%"
        if conversion is None:
            return match.group(0)
        value = next(given)
        if conversion in "di":
            value = int(value)
            value = value - (1 << 64) if value >= 1 << 63 else value
            return f"%{flags}d" % value
        if conversion in "ouxX":
            return f"%{flags}{conversion}" % (int(value) & ((1 << 64) - 1))
        if conversion == "p":
            return f"0x{int(value) & ((1 << 64) - 1):x}"
        if conversion == "c":
            return f"%{flags}c" % chr(int(value) & 0xFF)
        return f"%{flags}s" % value

    return _CONVERSION.sub(one, fmt)


class TracerBlock:
    """A BEGIN, END or interval body, run in the tracer: `run()` writes what it prints through
    `write`, a map's value for literal keys read by `value(ref)`, a whole map formatted by
    `print_map(name, top)`, maps changed by `clear(name, keep_keys)`; it returns True if it
    called exit()."""

    def __init__(self, block: S.ProbeBlock, *, value: Callable[[S.MapRef], int], print_map: Callable[[str, int], str],
                 clear: Callable[[str, bool], None], write: Callable[[str], None]) -> None:  # fmt: skip
        self.block = block
        self.value, self.print_map, self.clear, self.write = value, print_map, clear, write

    def run(self) -> bool:
        exited = False
        for statement in self.block.body:
            assert isinstance(statement, S.ExprStatement) and isinstance(statement.expr, S.Call)
            call = statement.expr
            match call.name:
                case "printf":
                    assert isinstance(call.args[0], S.Str)
                    self.write(c_format(call.args[0].value, list(self._values(call.args[1:]))))
                case "print":
                    assert isinstance(call.args[0], S.MapRef)
                    top = call.args[1].value if len(call.args) > 1 and isinstance(call.args[1], S.Int) else 0
                    self.write(self.print_map(call.args[0].name, top))
                case "clear" | "zero":
                    assert isinstance(call.args[0], S.MapRef)
                    self.clear(call.args[0].name, call.name == "zero")
                case "time":
                    fmt = call.args[0].value if call.args and isinstance(call.args[0], S.Str) else "%H:%M:%S\n"
                    self.write(time.strftime(fmt))
                case _:  # exit
                    exited = True
        return exited

    def _values(self, args: tuple[S.Expr, ...]) -> Iterator[int | str]:
        for arg in args:
            yield self._value(arg)

    def _value(self, expr: S.Expr) -> int | str:
        match expr:
            case S.Int(value=value):
                return value
            case S.Str(value=value):
                return value
            case S.Unary(op="-", operand=operand):
                return -int(self._value(operand))
            case S.MapRef():
                return self.value(expr)
        raise AssertionError(expr)
