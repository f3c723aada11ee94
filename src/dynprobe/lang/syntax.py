"""The syntax tree of a bpftrace program (issue 21's subset of bpftrace's language), as
lang/parser.py builds it. Every node keeps its span in the source (start, end offsets), for
errors shown as bpftrace shows them: the line, and the span underlined."""

from __future__ import annotations

import re
from dataclasses import field

from dynprobe.frozen import frozen

Span = tuple[int, int]


@frozen
class Node:
    span: Span = field(compare=False, repr=False, kw_only=True)


# --- expressions --------------------------------------------------------------------------------
@frozen
class Int(Node):
    value: int


@frozen
class Str(Node):
    value: str


@frozen
class Builtin(Node):
    """arg0..arg9, retval, pid, tid, comm, cpu, nsecs, elapsed, func, probe, ustack."""

    name: str


@frozen
class StackMode(Node):
    """`bpftrace` or `perf`: how ustack() prints a stack."""

    name: str


@frozen
class Var(Node):
    """A scratch variable, `$name`: the probe's, for one hit."""

    name: str


@frozen
class MapRef(Node):
    """`@name[k1, k2]` (`@` alone: the map named ""; no keys: the map's one value)."""

    name: str
    keys: tuple[Expr, ...] = ()


@frozen
class Call(Node):
    name: str
    args: tuple[Expr, ...] = ()


@frozen
class Unary(Node):
    op: str  # ! - ~ *
    operand: Expr


@frozen
class Binary(Node):
    op: str
    left: Expr
    right: Expr


@frozen
class Ternary(Node):
    condition: Expr
    then: Expr
    otherwise: Expr


@frozen
class Cast(Node):
    """`(uint32)x`, `(uint32 *)x`: an integer type (int8 .. uint64), maybe a pointer to one."""

    type_name: str
    pointer: bool
    operand: Expr


@frozen
class Step(Node):
    """`x++`, `--x`: a variable or map value stepped by one (`prefix`: the new value)."""

    op: str  # ++ --
    target: Var | MapRef
    prefix: bool


Expr = Int | Str | Builtin | StackMode | Var | MapRef | Call | Unary | Binary | Ternary | Cast | Step


# --- statements ---------------------------------------------------------------------------------
@frozen
class ExprStatement(Node):
    expr: Expr


@frozen
class Assign(Node):
    """`target = value`, or `target op= value` (op one of + - * / % & | ^ << >>)."""

    target: Var | MapRef
    op: str
    value: Expr


@frozen
class If(Node):
    condition: Expr
    then: tuple[Statement, ...]
    otherwise: tuple[Statement, ...] = ()


Statement = ExprStatement | Assign | If


# --- probes -------------------------------------------------------------------------------------
@frozen
class AttachPoint(Node):
    """`uprobe:TARGET:FUNC[+OFFSET]` (`uretprobe`, short forms `u`, `ur`), `BEGIN`, `END`, or
    `interval:UNIT:N` (target: the unit, s or ms; offset: N)."""

    kind: str  # uprobe, uretprobe, BEGIN, END, interval
    target: str = ""
    function: str = ""
    offset: int = 0

    def __str__(self) -> str:
        if self.kind in ("BEGIN", "END"):
            return self.kind
        if self.kind == "interval":
            return f"interval:{self.target}:{self.offset}"
        function = self.function if re.fullmatch(r"[A-Za-z0-9_*?.$@]+", self.function) else f'"{self.function}"'
        return f"{self.kind}:{self.target}:{function}" + (f"+{self.offset}" if self.offset else "")


@frozen
class ProbeBlock(Node):
    attach_points: tuple[AttachPoint, ...]
    predicate: Expr | None
    body: tuple[Statement, ...]


@frozen
class Program(Node):
    probes: tuple[ProbeBlock, ...]


# --- back to text ------------------------------------------------------------------------------
_ESCAPED = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\", '"': '\\"'}


def to_source(node: Program | ProbeBlock | Statement | Expr) -> str:
    """A node as program text that reads back as the same tree (expressions fully parenthesized)."""
    match node:
        case Program(probes=probes):
            return "\n".join(map(to_source, probes)) + "\n"
        case ProbeBlock(attach_points=points, predicate=predicate, body=body):
            condition = f" /{to_source(predicate)}/" if predicate is not None else ""
            return f"{', '.join(map(str, points))}{condition} {_block(body)}"
        case ExprStatement(expr=expr):
            return to_source(expr) + ";"
        case Assign(target=target, op=op, value=value):
            return f"{to_source(target)} {op} {to_source(value)};"
        case If(condition=condition, then=then, otherwise=otherwise):
            tail = f" else {_block(otherwise)}" if otherwise else ""
            return f"if ({to_source(condition)}) {_block(then)}{tail}"
        case Int(value=value):
            return f"({value})" if value < 0 else str(value)
        case Str(value=value):
            return '"' + "".join(_ESCAPED.get(c, c if " " <= c <= "~" else f"\\x{ord(c):02x}") for c in value) + '"'
        case Builtin(name=name):
            return name
        case Var(name=name):
            return f"${name}"
        case MapRef(name=name, keys=keys):
            return f"@{name}" + (f"[{', '.join(map(to_source, keys))}]" if keys else "")
        case Call(name=name, args=args):
            return f"{name}({', '.join(map(to_source, args))})"
        case Unary(op=op, operand=operand):
            return f"({op}{to_source(operand)})"
        case Binary(op=op, left=left, right=right):
            return f"({to_source(left)} {op} {to_source(right)})"
        case Ternary(condition=condition, then=then, otherwise=otherwise):
            return f"({to_source(condition)} ? {to_source(then)} : {to_source(otherwise)})"
        case Cast(type_name=type_name, pointer=pointer, operand=operand):
            return f"(({type_name}{' *' if pointer else ''}){to_source(operand)})"
        case Step(op=op, target=target, prefix=prefix):
            return f"({op}{to_source(target)})" if prefix else f"({to_source(target)}{op})"
    raise AssertionError(node)


def _block(statements: tuple[Statement, ...]) -> str:
    return "{ " + " ".join(map(to_source, statements)) + " }" if statements else "{ }"
