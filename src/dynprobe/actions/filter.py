"""The filter language: comparisons of fetched values with constants, joined with and/or.

    a == 5            len > 0x100 and (fd == 1 or fd == 2)            $arg1 != 0 && %si < 10

A name is one of the probe's fetch arguments, or a fetch argument written in place ($arg1, %di,
+8(%di):s32, ...; default type s64). Strings cannot be compared. `and` binds tighter than `or`.
"""

from __future__ import annotations

import operator
import re

from dynprobe.actions.model import Compare, Filter, Logical
from dynprobe.errors import ParseError
from dynprobe.spec.model import ArgType, FetchArg
from dynprobe.spec.parser import parse_fetch_arg

MAX_DEPTH = 16
MAX_COMPARISONS = 64

FILTER_ERRORS: dict[str, str] = {
    "FILTER_EMPTY": "the filter is empty",
    "FILTER_SYNTAX": "expected NAME OP NUMBER, '(' or the end (operators: == != < <= > >=; join with and/or)",
    "FILTER_UNKNOWN_NAME": "not a fetch argument of this probe, nor a fetch argument itself",
    "FILTER_STRING": "strings cannot be compared in a filter",
    "FILTER_BAD_NUMBER": "not a number (decimal, 0x hex or negative)",
    "FILTER_PAREN": "a '(' has no matching ')'",
    "FILTER_TOO_DEEP": f"parentheses nested deeper than {MAX_DEPTH} levels",
    "FILTER_TOO_LONG": f"more than {MAX_COMPARISONS} comparisons in one filter",
    "VALUE_UNKNOWN": "the value is not a fetch argument of this probe, nor a fetch argument itself",
    "VALUE_STRING": "a value is an integer, not a string: give an integer type",
}

_TOKEN = re.compile(
    r"\s*(?:(?P<op>==|!=|<=|>=|<|>|&&|\|\||\(|\))"
    r"|(?P<word>[+-](?:0x)?[0-9a-fA-F]+\([^)\s]*\)+(?::\w+)?|[^\s()=!<>&|]+))"
)
_COMPARE = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
            ">=": operator.ge}  # fmt: skip
_OPS = set(_COMPARE)
_SIGNED64 = ArgType("s", 64)
_MASK64 = (1 << 64) - 1


def _fail(code: str, text: str, column: int) -> ParseError:
    return ParseError(code, FILTER_ERRORS[code], text, column)


class _Parser:
    def __init__(self, text: str, args: tuple[FetchArg, ...]) -> None:
        self.text = text
        self.args = {a.name: a for a in args}
        self.tokens: list[tuple[str, int]] = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None or m.end() == pos:
                if text[pos:].strip():
                    raise _fail("FILTER_SYNTAX", text, pos + len(text[pos:]) - len(text[pos:].lstrip()))
                break
            kind = "op" if m.group("op") else "word"
            self.tokens.append((m.group(kind), m.start(kind)))
            pos = m.end()
        self.pos = 0
        self.depth = 0
        self.comparisons = 0

    def peek(self) -> tuple[str, int] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> tuple[str, int]:
        token = self.peek()
        if token is None:
            raise _fail("FILTER_SYNTAX", self.text, len(self.text))
        self.pos += 1
        return token

    def expression(self) -> Filter:
        node = self.conjunction()
        while (t := self.peek()) is not None and t[0] in ("or", "||"):
            self.pos += 1
            node = Logical("or", node, self.conjunction())
        return node

    def conjunction(self) -> Filter:
        node = self.comparison()
        while (t := self.peek()) is not None and t[0] in ("and", "&&"):
            self.pos += 1
            node = Logical("and", node, self.comparison())
        return node

    def comparison(self) -> Filter:
        word, col = self.take()
        if word == "(":
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise _fail("FILTER_TOO_DEEP", self.text, col)
            node = self.expression()
            closing = self.peek()
            if closing is None or closing[0] != ")":
                raise _fail("FILTER_PAREN", self.text, col)
            self.pos += 1
            self.depth -= 1
            return node
        self.comparisons += 1
        if self.comparisons > MAX_COMPARISONS:
            raise _fail("FILTER_TOO_LONG", self.text, col)
        arg = self.operand(word, col)
        op, op_col = self.take()
        if op not in _OPS:
            raise _fail("FILTER_SYNTAX", self.text, op_col)
        number, num_col = self.take()
        try:
            value = int(number, 0)
        except ValueError:
            raise _fail("FILTER_BAD_NUMBER", self.text, num_col) from None
        return Compare(arg, op, value)

    def operand(self, word: str, col: int) -> FetchArg:
        if word in ("(", ")") or word in _OPS:
            raise _fail("FILTER_SYNTAX", self.text, col)
        arg = self.args.get(word)
        if arg is None:
            arg = _written_in_place(word)
            if arg is None:
                raise _fail("FILTER_UNKNOWN_NAME", self.text, col)
            if ":" not in word:
                arg = FetchArg(word, arg.fetch, _SIGNED64, word)
        if arg.type.is_string:
            raise _fail("FILTER_STRING", self.text, col)
        return arg


def _written_in_place(text: str) -> FetchArg | None:
    """A fetch argument written in place (`$arg1`, `+8(%di):u32`), named by its text (two of
    them in one filter are two values), or None if `text` is none."""
    try:
        arg = parse_fetch_arg(text, 0, 1, text, "p")
    except ParseError:
        return None
    return FetchArg(text, arg.fetch, arg.type, text)


def parse_filter(text: str, args: tuple[FetchArg, ...] = ()) -> Filter:
    """Parse a filter over the fetch arguments `args`; raises ParseError with a code and column."""
    if not text.strip():
        raise _fail("FILTER_EMPTY", text, 0)
    parser = _Parser(text, args)
    node = parser.expression()
    extra = parser.peek()
    if extra is not None:
        raise _fail("FILTER_SYNTAX", text, extra[1])
    return node


def matches(node: Filter, value_of: dict[str, int | None]) -> bool:
    """Evaluate on values already fetched (trap mode); a faulted value (None) fails its comparison."""
    if isinstance(node, Logical):
        left = matches(node.left, value_of)
        if node.op == "and":
            return left and matches(node.right, value_of)
        return left or matches(node.right, value_of)
    value = value_of.get(node.arg.name)
    if value is None:
        return False
    # As the generated code compares: 64-bit, signed for s types, unsigned otherwise.
    const = node.value & _MASK64
    if node.arg.type.kind == "s" and const >> 63:
        const -= 1 << 64
    return bool(_COMPARE[node.op](value, const))


def parse_value(text: str, args: tuple[FetchArg, ...] = ()) -> FetchArg:
    """A histogram's value: one of the probe's fetch arguments by name, or a fetch argument."""
    arg = {a.name: a for a in args}.get(text) or _written_in_place(text)
    if arg is None:
        raise _fail("VALUE_UNKNOWN", text, 0)
    if arg.type.is_string:
        raise _fail("VALUE_STRING", text, 0)
    return arg
