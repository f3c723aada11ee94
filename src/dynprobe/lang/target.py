"""What of a checked bpftrace program runs where (issue 21): uprobe and uretprobe bodies run in
the target, compiled (arch/x86_64/codegen/lang.py), so they may hold only what that code does;
BEGIN, END and interval bodies run in the tracer (lang/tracer.py), whose maps (`tracer_maps`)
live there. Anything else is refused here, before anything is placed, at its span, in
bpftrace's form: never a probe that silently stays a slow trap.

A probe body's printf() writes a record into the thread's ring (`PrintfRecord`: its values,
strings copied, comm left to the tracer) that the tracer formats.
"""

from __future__ import annotations

from collections.abc import Iterator

from dynprobe.errors import ProgramError
from dynprobe.frozen import frozen
from dynprobe.lang import syntax as S
from dynprobe.lang.check import AGGREGATIONS, STRING_WORDS, Checked
from dynprobe.ringbuf import layout as L

MAX_KEYS = 16  # words of a map's keys
MAX_DEPTH = L.LANG_TEMPS_WORDS - MAX_KEYS  # operands an expression keeps waiting (a map's keys beside them)
MAX_VARIABLES = L.LANG_VARS_WORDS
_IN_TARGET_CALLS = ("delete", "exit", "printf", "print", "clear", "zero", "time")
TIME_FORMAT = "%H:%M:%S\n"  # time()'s, as bpftrace's
PRINTF_NUMBER = 8  # the record's first payload word: which printf() wrote it
TRACER_CALLS = ("printf", "print", "clear", "zero", "delete", "exit", "time")  # (lang/tracer.py runs them)
_TRACER_BUILTINS = ("nsecs", "elapsed")
_WHERE = "in BEGIN, END and interval probes (dynprobe runs them in the tracer)"
_NOT_YET = (
    "{what} is not run in the target yet (dynprobe compiles probe bodies: integers, maps of them and of str(), comm,"
    " func and probe)"
)


def check_runnable(checked: Checked, source: str, filename: str = "stdin") -> None:
    """Raise `ProgramError` for the first thing of `checked` that cannot run where it would."""
    key_kinds, value_kinds = map_key_kinds(checked), map_value_kinds(checked)
    target_maps = {ref.name for probe in checked.program.probes if _in_target(probe) for ref in _map_refs(probe)}
    for probe in checked.program.probes:
        if not _in_target(probe):
            _check_tracer_block(probe, target_maps, source, filename)
        elif any(p.kind not in ("uprobe", "uretprobe") for p in probe.attach_points):
            raise ProgramError("a probe block is either uprobes and uretprobes, or BEGIN, END or an interval",
                               source, probe.span, filename)  # fmt: skip
        else:
            _TargetCheck(checked, source, filename, key_kinds, value_kinds).block(probe)


def tracer_maps(checked: Checked) -> set[str]:
    """The maps a BEGIN, END or interval body writes: they live in the tracer."""
    written: set[str] = set()
    for block in checked.program.probes:
        if not _in_target(block):
            written.update(_written(block.body))
    return written


def _check_tracer_block(block: S.ProbeBlock, in_target: set[str], source: str, filename: str) -> None:
    """Raise `ProgramError` for the first thing of a BEGIN, END or interval `block` the tracer
    cannot run, or for a map it writes that a probe body also uses (`in_target`: the maps probe
    bodies use)."""

    def refuse(message: str, node: S.Node) -> ProgramError:
        return ProgramError(message, source, node.span, filename)

    if block.predicate is not None:
        raise refuse("a predicate is for uprobes (dynprobe runs BEGIN, END and intervals in the tracer)",
                     block.predicate)  # fmt: skip
    for name in sorted(_written(block.body) & in_target):
        ref = next(r for r in _map_refs(block) if r.name == name)
        raise refuse(f"@{name} is written {_WHERE} and used by probe bodies: dynprobe keeps a map on one side "
                     "(clear() and zero() reach either)", ref)  # fmt: skip
    for node in _nodes(block.body):
        match node:
            case S.Builtin(name=name) if name not in _TRACER_BUILTINS:
                raise refuse(f"{name} {_WHERE}: it belongs to a thread of the target", node)
            case S.Unary(op="*") | S.Cast(pointer=True):
                raise refuse(f"reading memory {_WHERE}", node)
            case S.Call(name="delete", args=(S.MapRef(name=name) as ref,)) if name in in_target:
                raise refuse(f"delete() of a map probe bodies write, {_WHERE}: clear() it", ref)
            case S.Call(name=name) if name not in TRACER_CALLS and name not in AGGREGATIONS:
                raise refuse(f"{name}() {_WHERE}", node)


def _in_target(block: S.ProbeBlock) -> bool:
    return any(p.kind in ("uprobe", "uretprobe") for p in block.attach_points)


def _written(statements: tuple[S.Statement, ...]) -> set[str]:
    return {
        node.target.name
        for node in _nodes(statements)
        if isinstance(node, S.Assign | S.Step) and isinstance(node.target, S.MapRef)
    }


def _nodes(statements: tuple[S.Statement, ...] | S.Node) -> Iterator[S.Node]:
    """Every node of `statements`, however deep, each before the nodes it holds."""
    for part in statements if isinstance(statements, tuple) else (statements,):
        yield part
        for value in vars(part).values():
            for child in value if isinstance(value, tuple) else (value,):
                if isinstance(child, S.Node):
                    yield from _nodes(child)


@frozen
class PrintfArg:
    # "int", "str" (copied: at most `chars` bytes), "comm", "func", "probe" (none: the tracer's),
    # or "comm word", "func word", "probe word" (a map's value: a word the tracer names)
    kind: str
    offset: int  # in the record's payload
    chars: int = 0


@frozen
class PrintfRecord:
    """How a probe body's printf() goes through the ring: the record's payload is its number
    (a u64), then each argument's value (8 bytes), string (a record's string field) or nothing
    (comm, func, probe: the tracer knows them). A print(@m[, N]) is a record of its number
    alone (`prints`: the map and N): the tracer prints the map when it reads the record, as
    bpftrace's does; so is a time(fmt) (`time`: `fmt` is strftime's, the hit's time given)."""

    number: int
    fmt: str
    args: tuple[PrintfArg, ...]
    prints: tuple[str, int] | None = None
    time: bool = False

    @property
    def size(self) -> int:
        last = self.args[-1] if self.args else None
        return PRINTF_NUMBER if last is None else last.offset + _ARG_BYTES[last.kind]


_ARG_BYTES = {"int": L.INT_FIELD, "str": L.STRING_FIELD, "comm": 0, "func": 0, "probe": 0, "comm word": L.INT_FIELD,
              "func word": L.INT_FIELD, "probe word": L.INT_FIELD}  # fmt: skip
TRACER_NAMES = ("comm", "func", "probe")
STACK_KINDS = {"bpftrace": "stack", "perf": "perf stack"}  # a ustack key's kind, by its mode
_HELD = {"string": "str()", "comm": "comm", "func": "func", "probe": "probe"}


def printf_records(checked: Checked) -> dict[S.Call, PrintfRecord]:
    """The printf(), print() and time() calls of the program's uprobe and uretprobe bodies (one record
    layout for calls that are the same), numbered in the order they appear."""
    found: dict[S.Call, PrintfRecord] = {}
    value_kinds = map_value_kinds(checked)

    def walk(statements: tuple[S.Statement, ...]) -> None:
        for statement in statements:
            if isinstance(statement, S.If):
                walk(statement.then)
                walk(statement.otherwise)
            elif isinstance(statement, S.ExprStatement) and isinstance(statement.expr, S.Call):
                call = statement.expr
                if call.name == "printf" and call not in found:
                    found[call] = _record(len(found), call, checked, value_kinds)
                elif call.name == "time" and call not in found:
                    fmt = call.args[0].value if call.args and isinstance(call.args[0], S.Str) else TIME_FORMAT
                    found[call] = PrintfRecord(len(found), fmt, (), time=True)
                elif call.name == "print" and call not in found and isinstance(call.args[0], S.MapRef):
                    top = call.args[1].value if len(call.args) == 2 and isinstance(call.args[1], S.Int) else 0
                    found[call] = PrintfRecord(len(found), "", (), prints=(call.args[0].name, top))

    for probe in checked.program.probes:
        if any(p.kind in ("uprobe", "uretprobe") for p in probe.attach_points):
            walk(probe.body)
    return found


def _record(number: int, call: S.Call, checked: Checked, value_kinds: dict[str, str]) -> PrintfRecord:
    fmt = call.args[0]
    assert isinstance(fmt, S.Str)
    args, offset = [], PRINTF_NUMBER
    for arg in call.args[1:]:
        if isinstance(arg, S.Builtin) and arg.name in TRACER_NAMES:
            args.append(PrintfArg(arg.name, offset))
        elif isinstance(arg, S.Call) and arg.name == "str":
            args.append(PrintfArg("str", offset, checked.type_of(arg).size - 1))
        elif isinstance(arg, S.MapRef) and checked.type_of(arg).kind == "string":
            held = value_kinds.get(arg.name, "string")
            args.append(PrintfArg("str", offset, STRING_WORDS * 8 - 1) if held == "string" else
                        PrintfArg(f"{held} word", offset))  # fmt: skip
        else:
            args.append(PrintfArg("int", offset))
        offset += _ARG_BYTES[args[-1].kind]
    return PrintfRecord(number, fmt.value, tuple(args))


def _is_ustack(expr: S.Expr) -> bool:
    return (isinstance(expr, S.Builtin) and expr.name == "ustack") or (
        isinstance(expr, S.Call) and expr.name == "ustack"
    )


def _ustack_mode(expr: S.Expr) -> tuple[str, int]:
    """A `ustack` (checked): how it is printed, "bpftrace" or "perf", and the frames it walks
    (127 unless it says)."""
    args = expr.args if isinstance(expr, S.Call) else ()
    mode = args[0].name if args and isinstance(args[0], S.StackMode) else "bpftrace"
    frames = [arg.value for arg in args if isinstance(arg, S.Int)]
    return mode, frames[0] if frames else 127


def ustack_frames(block: S.ProbeBlock) -> int | None:
    """The frames a block's `ustack` keys walk (`ustack(N)`'s N, else 127), None if it has none;
    ProgramError-free: check_runnable refuses two different counts in one block first."""
    found = {_ustack_mode(key)[1] for key in _all_keys(block) if _is_ustack(key)}
    return max(found) if found else None


def map_key_kinds(checked: Checked) -> dict[str, tuple[str, ...]]:
    """How the target holds each keyed map's keys, a key each: "int", "string" (a str()'s
    bytes), "stack" or "perf stack" (its slot in the stack table; printed as bpftrace's or as
    perf's modes print it), "comm" (the thread's pid << 32 | tid), "func" or "probe" (the
    probe's index plus 1), all but the first two named by the tracer; as the map's first use with keys
    has them (`check_runnable` refuses a use that differs)."""
    kinds: dict[str, tuple[str, ...]] = {}
    for ref in _map_refs(checked.program):
        if ref.keys:
            kinds.setdefault(ref.name, tuple(_key_kind(checked, key) for key in ref.keys))
    return kinds


def thread_keyed_maps(checked: Checked) -> frozenset[str]:
    """The maps every probe body's update keys by `tid` (at one place among the keys): an entry
    is then written by one thread only, its value updated without a locked instruction (what
    `delete()` or the tracer's clear() race with, they race with either way)."""
    places: dict[str, set[int]] = {}
    for block in checked.program.probes:
        if not _in_target(block):
            continue
        for node in _nodes(block.body):
            if isinstance(node, S.Assign | S.Step) and isinstance(node.target, S.MapRef):
                keys = node.target.keys
                tids = {i for i, key in enumerate(keys) if isinstance(key, S.Builtin) and key.name == "tid"}
                places[node.target.name] = places.get(node.target.name, tids) & tids
    return frozenset(name for name, where in places.items() if where)


def map_value_kinds(checked: Checked) -> dict[str, str]:
    """What each map of strings the probe bodies write holds: "string" (the bytes a str()
    read), or "comm", "func" or "probe" (a word the tracer names, as those keys are); as the
    map's first assignment there has it (`check_runnable` refuses one that differs)."""
    kinds: dict[str, str] = {}
    for block in checked.program.probes:
        if not _in_target(block):
            continue
        for node in _nodes(block.body):
            if isinstance(node, S.Assign) and isinstance(node.target, S.MapRef) \
                    and checked.type_of(node.value).kind == "string":  # fmt: skip
                kinds.setdefault(node.target.name, _string_source(node.value))
    return kinds


def _string_source(value: S.Expr) -> str:
    return value.name if isinstance(value, S.Builtin) and value.name in TRACER_NAMES else "string"


def _key_kind(checked: Checked, key: S.Expr) -> str:
    if isinstance(key, S.Builtin) and key.name in TRACER_NAMES:
        return key.name
    if _is_ustack(key):
        return STACK_KINDS[_ustack_mode(key)[0]]
    kind = checked.type_of(key).kind
    return kind if kind in ("string", "stack") else "int"


def _map_refs(node: S.Node) -> Iterator[S.MapRef]:
    """The maps `node` names, however deep, in the order they are written."""
    return (part for part in _nodes(node) if isinstance(part, S.MapRef))


def _all_keys(block: S.ProbeBlock) -> Iterator[S.Expr]:
    """Every key of every map a block names (its expressions walked)."""
    for ref in _map_refs(block):
        yield from ref.keys


class _TargetCheck:
    def __init__(self, checked: Checked, source: str, filename: str, key_kinds: dict[str, tuple[str, ...]],
                 value_kinds: dict[str, str]) -> None:  # fmt: skip
        self.checked, self.source, self.filename = checked, source, filename
        self.variables: set[str] = set()
        self.key_kinds = key_kinds  # (the program's: map_key_kinds)
        self.value_kinds = value_kinds  # (the program's: map_value_kinds)

    def refuse(self, what: str, span: S.Span) -> ProgramError:
        return ProgramError(_NOT_YET.format(what=what), self.source, span, self.filename)

    def block(self, probe: S.ProbeBlock) -> None:
        counts = {_ustack_mode(key)[1] for key in _all_keys(probe) if _is_ustack(key)}
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
                case S.Assign(target=S.MapRef() as target, value=value) if self.holds_strings(target):
                    source, held = _string_source(value), self.value_kinds[target.name]
                    if source == "string" and not (isinstance(value, S.Call) and value.name == "str"):
                        raise self.refuse(f"a value of @{target.name} that is not a str(), comm, func or probe (a "
                                          "map of strings takes the bytes str() reads, or the tracer's names)",
                                          value.span)  # fmt: skip
                    if source != held:
                        raise self.refuse(f"@{target.name} holding {_HELD[source]} here and {_HELD[held]} elsewhere",
                                          value.span)  # fmt: skip
                    if isinstance(value, S.Call):  # (a str(): the rest are refused above)
                        self.string(value, 0)
                    self.map_keys(target, STRING_WORDS if source == "string" else 0)
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
                case S.ExprStatement(expr=S.Call(name=name) as call) if name in TRACER_CALLS + _IN_TARGET_CALLS:
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
            if isinstance(arg, S.Builtin) and arg.name in TRACER_NAMES:
                continue
            if isinstance(arg, S.Call) and arg.name == "str":
                self.string(arg, 0)
            elif isinstance(arg, S.MapRef) and self.holds_strings(arg):
                self.map_keys(arg, 0)
            else:
                self.expression(arg, 0)
        size = _record(0, call, self.checked, self.value_kinds).size
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

    def holds_strings(self, ref: S.MapRef) -> bool:
        info = self.checked.maps.get(ref.name)
        return info is not None and info.value is not None and info.value.kind == "string"

    def map_keys(self, ref: S.MapRef, depth: int) -> None:
        info = self.checked.maps.get(ref.name)
        if info is not None and info.value is not None and info.value.kind == "stack":
            raise self.refuse(f"a map of stacks (@{ref.name})", ref.span)
        if any(_is_ustack(key) for key in ref.keys) and len(ref.keys) > 1:
            raise self.refuse("ustack among a map's keys (it is run as the only one)", ref.span)
        kinds = tuple(_key_kind(self.checked, key) for key in ref.keys)
        if ref.keys and kinds != self.key_kinds[ref.name]:
            raise self.refuse(f"@{ref.name} keyed by {', '.join(kinds)} here and by "
                              f"{', '.join(self.key_kinds[ref.name])} elsewhere", ref.span)  # fmt: skip
        words = depth
        for key, kind in zip(ref.keys, kinds, strict=True):
            if kind in TRACER_NAMES:
                words += 1  # (a word the tracer names: the thread, the probe's index plus 1)
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
