"""BEGIN, END and interval bodies, run in the tracer (issue 21): interpreted (`TracerBlock`; what
they may hold is lang/target.py's to say) with the arithmetic of the code probe bodies compile to
(arch/x86_64/codegen/lang.py, bpftrace 0.17's): 64-bit words; division, remainder and `>>`
unsigned; a comparison signed when both sides are; a division by zero 0, a remainder by zero
the dividend; casts that narrow and extend.

A map such a body writes (`@ticks++`, `@start = nsecs`, `@h = hist(x)`) lives here, in the
tracer (`TracerMaps`: per entry the words a target's slot would hold, so it prints as one); a
map a probe body uses lives in the target's region, and from here is read, printed, cleared and
zeroed. A map is on one side only: one written here and used by a probe body is refused, as
is anything that needs a target's thread (`pid`, `arg0`, memory).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dynprobe.lang import maps, output
from dynprobe.lang import syntax as S
from dynprobe.lang.check import AGGREGATIONS, Checked
from dynprobe.lang.maps import MASK64, MapTable, as_signed
from dynprobe.lang.output import c_format
from dynprobe.lang.target import TIME_FORMAT, TRACER_CALLS


class TracerMaps:
    """The maps BEGIN, END and interval bodies write: per map, per entry's keys, the value words
    a target's slot would hold (`tables`: each map's layout)."""

    def __init__(self, names: set[str], tables: dict[str, MapTable]) -> None:
        self.tables = {name: tables[name] for name in names}
        self.values: dict[str, dict[tuple[output.Key, ...], list[int]]] = {name: {} for name in names}

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def words(self, name: str, keys: tuple[output.Key, ...]) -> list[int]:
        """The entry's value words (made, at their start, if it has none)."""
        entries = self.values[name]
        found = entries.get(keys)
        if found is None:
            found = entries[keys] = self._fresh(name)
        return found

    def _fresh(self, name: str) -> list[int]:
        """A new entry's value words: what min and max start at, else zeros."""
        table = self.tables[name]
        return [table.initial & MASK64] * table.value_words

    def entries(self, name: str) -> list[output.Entry]:
        table = self.tables[name]
        return [(keys, maps.value_of(table, words)) for keys, words in self.values[name].items()]

    def clear(self, name: str, *, keep_keys: bool) -> None:
        if keep_keys:
            for words in self.values[name].values():
                words[:] = self._fresh(name)
        else:
            self.values[name].clear()


def operate(op: str, left: int, right: int, *, signed: bool) -> int:
    """`left op right` on 64-bit words, as the target's code does it."""
    if op == "+":
        return (left + right) & MASK64
    if op == "-":
        return (left - right) & MASK64
    if op == "*":
        return (left * right) & MASK64
    if op == "&":
        return left & right
    if op == "|":
        return left | right
    if op == "^":
        return left ^ right
    if op == "/":
        return left // right if right else 0
    if op == "%":
        return left % right if right else left
    if op == "<<":
        return (left << (right & 63)) & MASK64
    if op == ">>":
        return left >> (right & 63)
    a, b = (as_signed(left), as_signed(right)) if signed else (left, right)
    return int({"==": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op])


def narrow(word: int, bits: int, signed: bool) -> int:
    """A cast to a `bits`-bit integer: cut, then extended as the type says."""
    cut = word & ((1 << bits) - 1)
    if signed and cut >> (bits - 1):
        cut -= 1 << bits
    return cut & MASK64


def bucket(table: MapTable, value: int) -> int:
    """The value word a hist or lhist counts `value` (a word) in (as the target's code picks it)."""
    number = as_signed(value)
    if table.kind == "hist":
        return output.hist_bucket(number) + 1
    low, _, step = table.lhist
    return 0 if number < low else min((number - low) // step + 1, table.value_words - 1)


class TracerBlock:
    """A BEGIN, END or interval body, run in the tracer: `run()` writes what it prints through
    `write`; the maps it writes are `tracer`'s; a target's map is read by `read_map(name,
    keys)` (an integer or a string, 0 if none), printed by `print_map(name, top)`, cleared by
    `clear(name, keep_keys)`. It returns True if it called exit()."""

    def __init__(self, block: S.ProbeBlock, checked: Checked, tracer: TracerMaps, *,
                 read_map: Callable[[str, tuple[output.Key, ...]], int | str], print_map: Callable[[str, int], str],
                 clear: Callable[[str, bool], None], write: Callable[[str], None], start_ns: int) -> None:  # fmt: skip
        self.block, self.checked, self.tracer = block, checked, tracer
        self.read_map, self.print_map, self.clear, self.write = read_map, print_map, clear, write
        self.start_ns = start_ns

    variables: dict[str, int | str]  # (a run's: set by run())
    exited: bool

    def run(self) -> bool:
        self.variables, self.exited = {}, False
        self.statements(self.block.body)
        return self.exited

    def statements(self, statements: tuple[S.Statement, ...]) -> None:
        for statement in statements:
            match statement:
                case S.If(condition=condition, then=then, otherwise=otherwise):
                    self.statements(then if self.integer(condition) else otherwise)
                case S.Assign(target=S.MapRef() as target, value=S.Call(name=name) as call) if name in AGGREGATIONS:
                    self.aggregate(target, call)
                case S.Assign(target=target, op=op, value=value):
                    self.assign(target, op, value)
                case S.ExprStatement(expr=S.Call(name=name) as call) if name in TRACER_CALLS:
                    self.call(call)
                case S.ExprStatement(expr=expr):
                    self.value(expr)

    def call(self, call: S.Call) -> None:
        match call:
            case S.Call(name="printf", args=(S.Str(value=fmt), *args)):
                self.write(c_format(fmt, [self.value(arg) for arg in args]))
            case S.Call(name="print", args=(S.MapRef(name=name), S.Int(value=top))):
                self.write(self.print_map(name, top))
            case S.Call(name="print", args=(S.MapRef(name=name),)):
                self.write(self.print_map(name, 0))
            case S.Call(name="clear" | "zero" as what, args=(S.MapRef(name=name),)):
                self.clear(name, what == "zero")
            case S.Call(name="delete", args=(S.MapRef() as ref,)):
                self.tracer.values[ref.name].pop(self.keys(ref), None)
            case S.Call(name="time", args=(S.Str(value=fmt),)):
                self.write(time.strftime(fmt))
            case S.Call(name="time"):
                self.write(time.strftime(TIME_FORMAT))
            case _:  # exit
                self.exited = True

    def keys(self, ref: S.MapRef) -> tuple[output.Key, ...]:
        """An entry's keys as maps print them: integers signed, strings as they are."""
        return tuple(as_signed(k) if isinstance(k := self.value(key), int) else k for key in ref.keys)

    def assign(self, target: S.Var | S.MapRef, op: str, value: S.Expr) -> None:
        new = self.value(value)
        if isinstance(target, S.Var):
            if op != "=":
                assert isinstance(new, int)
                new = operate(op[:-1], self.integer(target), new, signed=False)
            self.variables[target.name] = new
            return
        words = self.tracer.words(target.name, self.keys(target))
        if isinstance(new, str):  # (a map of strings)
            words[:] = maps.words_of(new)
            return
        words[0] = new if op == "=" else operate(op[:-1], words[0], new, signed=False)

    def aggregate(self, target: S.MapRef, call: S.Call) -> None:
        words = self.tracer.words(target.name, self.keys(target))
        table = self.tracer.tables[target.name]
        value = self.integer(call.args[0]) if call.args else 1
        match call.name:
            case "count" | "sum":
                words[0] = (words[0] + value) & MASK64
            case "avg" | "stats":
                words[0], words[1] = (words[0] + 1) & MASK64, (words[1] + value) & MASK64
            case "min":
                words[0] = min(value, words[0], key=as_signed)
            case "max":
                words[0] = max(value, words[0], key=as_signed)
            case _:  # hist, lhist
                words[bucket(table, value)] += 1

    def signed(self, expr: S.Expr) -> bool:
        return isinstance(expr, S.Int) or self.checked.type_of(expr).signed

    def integer(self, expr: S.Expr) -> int:
        value = self.value(expr)
        assert isinstance(value, int)
        return value

    def value(self, expr: S.Expr) -> int | str:
        """An integer expression's 64-bit word, or a string's text."""
        match expr:
            case S.Int(value=value):
                return value & MASK64
            case S.Str(value=text):
                return text
            case S.Builtin(name="nsecs"):
                return time.monotonic_ns()
            case S.Builtin(name="elapsed"):
                return (time.monotonic_ns() - self.start_ns) & MASK64
            case S.Var(name=name):
                return self.variables.get(name, 0)  # (one set in a branch not taken: 0, as bpftrace's)
            case S.MapRef(name=name):
                keys = self.keys(expr)
                if name not in self.tracer:
                    found = self.read_map(name, keys)
                    return found & MASK64 if isinstance(found, int) else found
                words = self.tracer.values[name].get(keys)
                if self.tracer.tables[name].kind == "string":
                    return maps.text_of(words or [])
                return words[0] if words is not None else 0
            case S.Unary(op="-", operand=operand):
                return -self.integer(operand) & MASK64
            case S.Unary(op="~", operand=operand):
                return ~self.integer(operand) & MASK64
            case S.Unary(operand=operand):  # !
                return int(self.integer(operand) == 0)
            case S.Cast(type_name=type_name, operand=operand):
                bits = int(type_name.removeprefix("u").removeprefix("int"))
                return narrow(self.integer(operand), bits, not type_name.startswith("u"))
            case S.Binary(op="&&", left=left, right=right):
                return int(bool(self.integer(left)) and bool(self.integer(right)))
            case S.Binary(op="||", left=left, right=right):
                return int(bool(self.integer(left)) or bool(self.integer(right)))
            case S.Binary(op=op, left=left, right=right):
                signed = self.signed(left) and self.signed(right)
                return operate(op, self.integer(left), self.integer(right), signed=signed)
            case S.Ternary(condition=condition, then=then, otherwise=otherwise):
                return self.value(then if self.integer(condition) else otherwise)
            case S.Step(op=op, target=target, prefix=prefix):
                return self.step(op, target, prefix=prefix)
        raise AssertionError(expr)  # (check_tracer_block refuses the rest)

    def step(self, op: str, target: S.Var | S.MapRef, *, prefix: bool) -> int:
        delta = 1 if op == "++" else -1
        if isinstance(target, S.Var):
            old = self.integer(target)
            self.variables[target.name] = new = (old + delta) & MASK64
        else:
            words = self.tracer.words(target.name, self.keys(target))
            old = words[0]
            words[0] = new = (old + delta) & MASK64
        return new if prefix else old
