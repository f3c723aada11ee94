"""bpftrace's language, checked (issue 21): the types of a parsed program's expressions, maps
and variables, and every error bpftrace reports before it runs anything, worded as bpftrace
words it (`count() requires no arguments (1 provided)`), at the span it points at.

Types are bpftrace's: integers (int64 unless cast), strings of a size
(`string[N]`), a stack, and the values only a map holds, from an aggregating call assigned to it
(`count`, `sum`, `min`, `max`, `avg`, `stats`, `hist`, `lhist`). A map's keys and value, and a
scratch variable's value, keep the kind their first use gives them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from dynprobe.errors import ProgramError
from dynprobe.frozen import frozen
from dynprobe.lang import syntax as S


@frozen
class Type:
    kind: str  # int, string, stack, none, or an aggregation: count sum min max avg stats hist lhist
    bits: int = 64
    signed: bool = True
    size: int = 0  # a string's capacity, NUL included

    def __str__(self) -> str:
        if self.kind == "int":
            return f"{'' if self.signed else 'unsigned '}int{self.bits}"
        if self.kind == "string":
            return f"string[{self.size}]"
        return self.kind

    @property
    def kind_name(self) -> str:
        """As bpftrace names a value's kind where the size does not matter: integer, string."""
        return {"int": "integer"}.get(self.kind, self.kind)

    def same_kind(self, other: Type) -> bool:
        return self.kind == other.kind


INT64 = Type("int")
UINT64 = Type("int", signed=False)
NONE = Type("none")
STACK = Type("stack")
STRING_SIZE = 64  # a string a probe reads (str(), comm, func): bytes kept, NUL included
STRING_WORDS = STRING_SIZE // 8  # the 64-bit words of a string kept as a map's key
AGGREGATIONS = {"count": 0, "sum": 1, "min": 1, "max": 1, "avg": 1, "stats": 1, "hist": 1, "lhist": 4}
_STATEMENT_CALLS = {"printf", "print", "delete", "clear", "zero", "exit", "time"}
_FORMAT = re.compile(r"%(?:%|[-+ #0]*\d*(?:\.\d+)?(?:hh|h|ll|l|z|j)?([diouxXcsp]))")
_COUNTED = {0: "no arguments", 1: "one argument"}


@dataclass
class MapInfo:
    keys: tuple[Type, ...] | None = None  # None: not known yet
    value: Type | None = None
    span: S.Span = (0, 0)  # where it was first given a value


@dataclass
class Checked:
    """A program whose every expression has a type (`types`, by node identity)."""

    program: S.Program
    maps: dict[str, MapInfo] = field(default_factory=dict)
    types: dict[int, Type] = field(default_factory=dict)
    lhist: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # an lhist map's min, max, step

    def type_of(self, expr: S.Expr) -> Type:
        return self.types[id(expr)]


def check_program(program: S.Program, source: str, filename: str = "stdin") -> Checked:
    """The types of `program` (parsed from `source`), or the first error bpftrace would report."""
    return _Checker(program, source, filename).run()


class _Checker:
    def __init__(self, program: S.Program, source: str, filename: str) -> None:
        self.checked = Checked(program)
        self.source, self.filename = source, filename
        self.kinds: tuple[str, ...] = ()  # the attach points' kinds of the probe being checked
        self.variables: dict[str, Type] = {}
        self.assigned = set(self._assigned_maps(program))  # (a map read anywhere must be given a value somewhere)

    def error(self, message: str, span: S.Span) -> ProgramError:
        return ProgramError(message, self.source, span, self.filename)

    def run(self) -> Checked:
        for probe in self.checked.program.probes:
            self.kinds = tuple(point.kind for point in probe.attach_points)
            self.variables = {}
            if probe.predicate is not None:
                self.expression(probe.predicate)
            self.statements(probe.body)
        return self.checked

    @staticmethod
    def _assigned_maps(program: S.Program) -> Iterator[str]:
        def walk(statements: tuple[S.Statement, ...]) -> Iterator[str]:
            for statement in statements:
                if isinstance(statement, S.Assign) and isinstance(statement.target, S.MapRef):
                    yield statement.target.name
                elif isinstance(statement, S.ExprStatement) and isinstance(statement.expr, S.Step):
                    if isinstance(statement.expr.target, S.MapRef):
                        yield statement.expr.target.name
                elif isinstance(statement, S.If):
                    yield from walk(statement.then)
                    yield from walk(statement.otherwise)

        for probe in program.probes:
            yield from walk(probe.body)

    # --- statements -----------------------------------------------------------------------------
    def statements(self, statements: tuple[S.Statement, ...]) -> None:
        for statement in statements:
            if isinstance(statement, S.If):
                self.integer(statement.condition, "if")
                self.statements(statement.then)
                self.statements(statement.otherwise)
            elif isinstance(statement, S.Assign):
                self.assign(statement)
            else:
                expr = statement.expr
                if isinstance(expr, S.Call) and expr.name in _STATEMENT_CALLS:
                    self.statement_call(expr)
                else:
                    self.expression(expr)

    def assign(self, statement: S.Assign) -> None:
        target, value = statement.target, statement.value
        if isinstance(value, S.Call) and value.name in AGGREGATIONS:
            if not isinstance(target, S.MapRef) or statement.op != "=":
                raise self.error(f"{value.name}() should be directly assigned to a map", value.span)
            new = self.aggregation(value)
            if value.name == "lhist":
                low, high, step = (arg.value for arg in value.args[1:] if isinstance(arg, S.Int))
                self.checked.lhist.setdefault(target.name, (low, high, step))
        else:
            new = self.expression(value)
            if statement.op != "=":
                self.integer(value, statement.op)
                new = INT64
        if isinstance(target, S.Var):
            old = self.variables.get(target.name)
            if old is None and statement.op != "=":
                raise self.error(f"Undefined or undeclared variable: ${target.name}", target.span)
            if old is not None and not old.same_kind(new):
                raise self.error(f"Type mismatch for ${target.name}: trying to assign value of type '{new}' when "
                                 f"variable already contains a value of type '{old}'", value.span)  # fmt: skip
            self.variables.setdefault(target.name, new)
            self.checked.types[id(target)] = self.variables[target.name]
        else:
            self.map_value(target, new, value.span)

    def map_value(self, target: S.MapRef, new: Type, span: S.Span) -> None:
        info = self.map_keys(target)
        if info.value is not None and not info.value.same_kind(new):
            raise self.error(f"Type mismatch for @{target.name}: trying to assign value of type '{new}' when map "
                             f"already contains a value of type '{info.value}'", span)  # fmt: skip
        if info.value is None:
            info.value, info.span = new, span
        self.checked.types[id(target)] = info.value

    def map_keys(self, ref: S.MapRef) -> MapInfo:
        # (integers, strings, stacks: nothing else has a type; a literal key is an unsigned one)
        keys = tuple(UINT64 if isinstance(k, S.Int) and self.expression(k) else self.expression(k) for k in ref.keys)
        info = self.checked.maps.setdefault(ref.name, MapInfo())
        if info.keys is None:
            info.keys = keys
        elif len(keys) != len(info.keys) or not all(a.same_kind(b) for a, b in zip(keys, info.keys, strict=False)):
            given, expected = ", ".join(map(str, keys)), ", ".join(map(str, info.keys))
            raise self.error(f"Argument mismatch for @{ref.name}: trying to access with arguments: [{given}] when "
                             f"map expects arguments: [{expected}]", ref.span)  # fmt: skip
        return info

    def aggregation(self, call: S.Call) -> Type:
        self.arity(call, AGGREGATIONS[call.name])
        for arg in call.args:
            kind = self.expression(arg)
            if kind.kind != "int":
                raise self.error(f"{call.name}() only supports integer arguments ({kind} provided)", call.span)
        if call.name == "lhist":
            for arg in call.args[1:]:
                if isinstance(arg, S.Unary) and arg.op == "-" and isinstance(arg.operand, S.Int):
                    raise self.error(f"lhist() min must be non-negative (provided min -{arg.operand.value})", call.span)
                if not isinstance(arg, S.Int):
                    raise self.error("lhist() min, max and step must be integer literals", arg.span)
            low, high, step = (arg.value for arg in call.args[1:] if isinstance(arg, S.Int))
            if step <= 0 or high <= low:
                raise self.error("lhist() needs min < max and a step above 0", call.span)
        self.checked.types[id(call)] = Type(call.name)
        return Type(call.name)

    def statement_call(self, call: S.Call) -> None:
        name, args = call.name, call.args
        if name == "printf":
            self.printf(call)
        elif name == "time":
            self.between(call, 0, 1)
            if args and not isinstance(args[0], S.Str):
                raise self.error(f"time() expects a string literal ({self.expression(args[0]).kind_name} provided)",
                                 call.span)  # fmt: skip
        elif name == "exit":
            self.arity(call, 0)
        elif name == "print":
            self.between(call, 1, 2)
            self.known_map(args[0], name, keys_allowed=False)
            if len(args) == 2 and not isinstance(args[1], S.Int):
                raise self.error("print()'s second argument is how many entries: an integer literal", args[1].span)
        elif name == "delete":
            self.arity(call, 1)
            info = self.known_map(args[0], name, keys_allowed=True)
            assert isinstance(args[0], S.MapRef)
            if info.keys is not None and len(args[0].keys) != len(info.keys):
                self.map_keys(args[0])
        else:  # clear, zero
            self.arity(call, 1)
            self.known_map(args[0], name, keys_allowed=False)
        self.checked.types[id(call)] = NONE

    def known_map(self, expr: S.Expr, function: str, *, keys_allowed: bool) -> MapInfo:
        if not isinstance(expr, S.MapRef) or (expr.keys and not keys_allowed):
            what = "a map" if keys_allowed else "a map without keys"
            raise self.error(f"{function}() expects {what}", expr.span)
        if expr.name not in self.assigned:
            raise self.error(f"Undefined map: @{expr.name}", expr.span)
        if expr.keys:
            return self.map_keys(expr)
        return self.checked.maps.setdefault(expr.name, MapInfo())

    def printf(self, call: S.Call) -> None:
        if not call.args:
            raise self.error("printf() requires at least one argument (0 provided)", call.span)
        fmt = call.args[0]
        if not isinstance(fmt, S.Str):
            raise self.error(f"printf() expects a string literal ({self.expression(fmt).kind_name} provided)",
                             call.span)  # fmt: skip
        wanted = [m.group(1) for m in _FORMAT.finditer(fmt.value) if m.group(1)]
        given = call.args[1:]
        if len(given) != len(wanted):
            which = "Not enough" if len(given) < len(wanted) else "Too many"
            raise self.error(f"printf: {which} arguments for format string ({len(given)} supplied, {len(wanted)} "
                             "expected)", call.span)  # fmt: skip
        for conversion, arg in zip(wanted, given, strict=True):
            kind = self.expression(arg)
            expected = "string" if conversion == "s" else "int"
            if kind.kind != expected and not (conversion == "s" and kind.kind == "stack"):
                raise self.error(f"printf: %{conversion} specifier expects a value of type "
                                 f"{'integer' if expected == 'int' else expected} ({kind.kind_name} supplied)",
                                 arg.span)  # fmt: skip

    # --- expressions ----------------------------------------------------------------------------
    def integer(self, expr: S.Expr, where: str) -> Type:
        kind = self.expression(expr)
        if kind.kind != "int":
            raise self.error(f"{where} needs an integer ({kind} provided)", expr.span)
        return kind

    def expression(self, expr: S.Expr) -> Type:
        kind = self._expression(expr)
        self.checked.types[id(expr)] = kind
        return kind

    def _expression(self, expr: S.Expr) -> Type:
        match expr:
            case S.Int():
                return INT64
            case S.Str(value=value):
                return Type("string", size=len(value.encode()) + 1)
            case S.Builtin(name=name):
                return self.builtin(expr, name)
            case S.StackMode(name=name):
                raise self.error(f"'{name}' is a stack mode: ustack()'s first argument, and nothing else", expr.span)
            case S.Var(name=name):
                if name not in self.variables:
                    raise self.error(f"Undefined or undeclared variable: ${name}", expr.span)
                return self.variables[name]
            case S.MapRef(name=name):
                if name not in self.assigned:
                    raise self.error(f"Undefined map: @{name}", expr.span)
                info = self.map_keys(expr)
                if info.value is not None and info.value.kind not in ("int", "string", "stack", "count", "sum",
                                                                      "min", "max", "avg"):  # fmt: skip
                    raise self.error(f"@{name} holds a {info.value}: it can only be printed", expr.span)
                return INT64 if info.value is None else info.value  # (an aggregation's: only printed)
            case S.Call():
                return self.call(expr)
            case S.Unary(op=op, operand=operand):
                self.integer(operand, f"'{op}'")
                return INT64
            case S.Binary(op=op, left=left, right=right):
                return self.binary(expr, op, left, right)
            case S.Ternary(condition=condition, then=then, otherwise=otherwise):
                self.integer(condition, "'?'")
                first, second = self.expression(then), self.expression(otherwise)
                if not first.same_kind(second):
                    raise self.error(f"Ternary operator must return the same type: have '{first.kind_name}' and "
                                     f"'{second.kind_name}'",
                                     expr.span)  # fmt: skip
                return first
            case S.Cast(type_name=type_name, pointer=pointer, operand=operand):
                self.integer(operand, "a cast")
                bits = int(type_name.removeprefix("u").removeprefix("int"))
                return UINT64 if pointer else Type("int", bits, not type_name.startswith("u"))
            case S.Step(target=target):
                if isinstance(target, S.Var):
                    if self.variables.get(target.name, INT64).kind != "int":
                        raise self.error(f"The {expr.op} operator must be applied to an integer", expr.span)
                    self.variables.setdefault(target.name, INT64)
                    self.checked.types[id(target)] = INT64
                else:
                    self.map_value(target, INT64, expr.span)
                return INT64
        raise AssertionError(expr)

    def binary(self, expr: S.Expr, op: str, left: S.Expr, right: S.Expr) -> Type:
        first, second = self.expression(left), self.expression(right)
        if op in ("==", "!=") and first.kind == second.kind == "string":
            return INT64
        if first.kind != "int" or second.kind != "int":
            raise self.error(f"Type mismatch for '{op}': comparing '{first}' with '{second}'", expr.span)
        return INT64

    def builtin(self, expr: S.Expr, name: str) -> Type:
        if name.startswith("arg") and any(kind != "uprobe" for kind in self.kinds):
            raise self.error(f"The {name} builtin can only be used with 'uprobe' probes", expr.span)
        if name == "retval" and any(kind != "uretprobe" for kind in self.kinds):
            raise self.error("The retval builtin can only be used with 'uretprobe' probes", expr.span)
        if name == "func" and any(kind not in ("uprobe", "uretprobe") for kind in self.kinds):
            raise self.error("The func builtin can only be used with 'uprobe' and 'uretprobe' probes", expr.span)
        if name in ("comm", "func", "probe"):
            return Type("string", size=STRING_SIZE)
        return STACK if name == "ustack" else INT64

    def call(self, call: S.Call) -> Type:
        name, args = call.name, call.args
        if name in AGGREGATIONS:
            raise self.error(f"{name}() should be directly assigned to a map", call.span)
        if name in _STATEMENT_CALLS:
            raise self.error(f"{name}() should be a statement of its own", call.span)
        if name == "str":
            self.between(call, 1, 2)
            for arg in args:
                self.integer(arg, "str()")
            size = args[1].value + 1 if len(args) == 2 and isinstance(args[1], S.Int) else STRING_SIZE
            return Type("string", size=min(size, STRING_SIZE))
        if name == "ustack":  # ([mode][, frames]) or (frames), as bpftrace's
            self.between(call, 0, 2)
            mode, frames = (args[0], args[1:]) if args and isinstance(args[0], S.StackMode) else (None, args)
            if len(args) == 2 and mode is None:
                raise self.error(f"ustack() expects a stack mode literal ({self.literal_kind(args[0])} provided)",
                                 call.span)  # fmt: skip
            if frames and not (isinstance(frames[0], S.Int) and 1 <= frames[0].value <= 127):
                raise self.error("ustack()'s frames are a number: an integer literal from 1 to 127", frames[0].span)
            return STACK
        raise self.error(f"Unknown function: {name}", (call.span[0], call.span[0] + len(name)))

    @staticmethod
    def literal_kind(expr: S.Expr) -> str:
        return "integer" if isinstance(expr, S.Int) else "string" if isinstance(expr, S.Str) else "expression"

    def arity(self, call: S.Call, wanted: int) -> None:
        if len(call.args) != wanted:
            count = _COUNTED.get(wanted, f"{wanted} arguments")
            raise self.error(f"{call.name}() requires {count} ({len(call.args)} provided)", call.span)

    def between(self, call: S.Call, least: int, most: int) -> None:
        if len(call.args) > most:
            raise self.error(f"{call.name}() takes up to {most} arguments ({len(call.args)} provided)", call.span)
        if len(call.args) < least:
            count = _COUNTED.get(least, f"{least} arguments").replace("one", "at least one")
            raise self.error(f"{call.name}() requires {count} ({len(call.args)} provided)", call.span)
