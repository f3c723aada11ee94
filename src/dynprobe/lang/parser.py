"""bpftrace's language, read (issue 21): the text of a program into its syntax tree
(lang/syntax.py), or a ProgramError that points at the first thing that is not bpftrace's, as
bpftrace says it (`stdin:1:60-61: ERROR: syntax error, unexpected }`).

A program is probe blocks: attach points (`uprobe:TARGET:FUNC[+OFF]`, `uretprobe:`, the short
forms `u:` and `ur:`, `BEGIN`, `END`, `interval:s:N`), comma-separated, an optional predicate
`/expr/` and a block of statements. Expressions are C's, with bpftrace's scratch variables
`$x`, maps `@m[k1, k2]`, builtins (`arg0`, `pid`, ...), calls (`count()`, `str(arg0)`), casts to
integer types and their pointers (`*(uint32 *)arg0`). An attach point is read as a whole
before the tokens of the block, as bpftrace's lexer does: a path holds characters a block's
tokens do not.
"""

from __future__ import annotations

import re

from dynprobe.errors import ProgramError
from dynprobe.frozen import frozen
from dynprobe.lang import syntax as S

STACK_MODES = ("bpftrace", "perf")  # ustack()'s first argument: how a stack is printed
BUILTINS = frozenset(("pid", "tid", "comm", "cpu", "nsecs", "elapsed", "func", "probe", "retval", "ustack",
                      *(f"arg{i}" for i in range(6))))  # fmt: skip
INTEGER_TYPES = frozenset(f"{sign}int{bits}" for sign in ("", "u") for bits in (8, 16, 32, 64))
ASSIGN_OPS = ("=", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", "<<=", ">>=")
# Binary operators by how tightly they bind (C's order), all left-associative.
BINARY = {
    "||": 1, "&&": 2, "|": 3, "^": 4, "&": 5, "==": 6, "!=": 6, "<": 7, "<=": 7, ">": 7, ">=": 7,
    "<<": 8, ">>": 8, "+": 9, "-": 9, "*": 10, "/": 10, "%": 10,
}  # fmt: skip
_PUNCT = sorted(
    {*ASSIGN_OPS, *BINARY, "++", "--", "{", "}", "(", ")", "[", "]", ",", ";", ":", "?", "!", "~"},
    key=len, reverse=True,
)  # fmt: skip
_SPACE = re.compile(r"(?:\s+|//[^\n]*|/\*.*?\*/)*", re.S)
_TOKEN = re.compile(
    r"(?P<int>0[xX][0-9a-fA-F]+|\d+)(?![A-Za-z_0-9])|(?P<var>\$[A-Za-z_][A-Za-z_0-9]*)"
    r"|(?P<map>@[A-Za-z_0-9]*)|(?P<ident>[A-Za-z_][A-Za-z_0-9]*)|(?P<str>\")|(?P<punct>"
    + "|".join(map(re.escape, _PUNCT)) + ")"
)  # fmt: skip
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "0": "\0", "a": "\a", "b": "\b", "e": "\x1b"}
_ATTACH = re.compile(
    r"(?P<kind>uprobe|uretprobe|ur|u):(?P<target>[^\s:,{/]*(?:/[^\s:,{]*)?):"
    r"(?:\"(?P<quoted>[^\"\n]+)\"|(?P<function>[A-Za-z0-9_*?.$@]+))(?:\+(?P<offset>0[xX][0-9a-fA-F]+|\d+))?"
    r"|(?P<interval>interval):(?P<unit>s|ms):(?P<every>\d+)|(?P<special>BEGIN|END)(?![A-Za-z_0-9:])"
)  # fmt: skip
_PROBE_WORD = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")
_CAST = re.compile(r"\(\s*([A-Za-z_0-9]+)\s*\*?\s*\)")  # `(uint32 *)`: a cast, if the word is a type
PROBE_KINDS = {"u": "uprobe", "ur": "uretprobe", "uprobe": "uprobe", "uretprobe": "uretprobe"}
_OTHER_KINDS = ("kprobe", "kretprobe", "tracepoint", "t", "profile", "hardware", "software", "watchpoint", "kfunc",
                "kretfunc", "fentry", "fexit", "rawtracepoint", "iter")  # fmt: skip
_NOT_YET = ("usdt", "U")  # (user space's, but not attached yet)


@frozen
class Token:
    kind: str  # int, str, var, map, ident, punct, end
    text: str
    start: int
    end: int
    value: int | str = ""

    def describe(self) -> str:
        """As bison names it in "syntax error, unexpected X"."""
        return {"int": "integer", "str": "string", "var": "variable", "map": "map", "ident": "identifier",
                "end": "end of file"}.get(self.kind, self.text)  # fmt: skip


def _integer(digits: str) -> int | None:
    """C's integer literals: hexadecimal (0x), octal (a leading 0), decimal."""
    if digits[:2] in ("0x", "0X"):
        return int(digits, 16)
    if digits.startswith("0"):
        return int(digits, 8) if all(d in "01234567" for d in digits) else None
    return int(digits)


def parse_program(source: str, filename: str = "stdin") -> S.Program:
    """The syntax tree of `source` (ProgramError at the first error)."""
    return _Parser(source, filename).program()


class _Parser:
    def __init__(self, source: str, filename: str) -> None:
        self.source, self.filename = source, filename
        self.at = 0  # where the next token starts (after spaces and comments)
        self.token = Token("end", "", 0, 0)

    # --- errors ---------------------------------------------------------------------------------
    def error(self, message: str, span: S.Span) -> ProgramError:
        return ProgramError(message, self.source, span, self.filename)

    def unexpected(self, token: Token | None = None, expecting: str = "") -> ProgramError:
        token = token or self.token
        message = f"syntax error, unexpected {token.describe()}" + (f", expecting {expecting}" if expecting else "")
        return self.error(message, (token.start, max(token.end, token.start + 1)))

    # --- tokens ---------------------------------------------------------------------------------
    def skip_space(self) -> None:
        match = _SPACE.match(self.source, self.at)
        assert match is not None
        if self.source.startswith("/*", match.end()):
            raise self.error("unterminated comment", (match.end(), len(self.source)))
        self.at = match.end()

    def advance(self) -> Token:
        """The current token; the next one read in its place."""
        current = self.token
        self.skip_space()
        start = self.at
        if start >= len(self.source):
            self.token = Token("end", "", start, start)
            return current
        match = _TOKEN.match(self.source, start)
        if match is None:
            if self.source[start] == "." and (current.kind, current.text, current.end) == ("ident", "args", start):
                raise self.error("args.NAME (arguments by their DWARF names) is not supported yet: use arg0..arg9",
                                 (current.start, start + 1))  # fmt: skip
            raise self.error(f"invalid character '{self.source[start]}'", (start, start + 1))
        kind = match.lastgroup or ""
        if kind == "str":
            text, value, end = self.string(start)
            self.token = Token("str", text, start, end, value)
        elif kind == "int":
            digits = match.group()
            number = _integer(digits)
            if number is None or number >= 1 << 64:
                raise self.error(f"invalid integer: {digits}", match.span())
            self.token = Token("int", digits, start, match.end(), number)
        else:
            self.token = Token(kind, match.group(), start, match.end())
        self.at = self.token.end
        return current

    def string(self, start: int) -> tuple[str, str, int]:
        out: list[str] = []
        i = start + 1
        while i < len(self.source) and self.source[i] not in '"\n':
            char = self.source[i]
            if char == "\\" and i + 1 < len(self.source):
                escape = self.source[i + 1]
                if escape in _ESCAPES:
                    out.append(_ESCAPES[escape])
                    i += 2
                    continue
                hex_digits = re.match(r"x([0-9a-fA-F]{1,2})", self.source[i + 1 : i + 4])
                if hex_digits:
                    out.append(chr(int(hex_digits.group(1), 16)))
                    i += 1 + len(hex_digits.group())
                    continue
                raise self.error(f"invalid escape sequence '\\{escape}'", (i, i + 2))
            out.append(char)
            i += 1
        if i >= len(self.source) or self.source[i] != '"':
            raise self.error("unterminated string", (start, i))
        return self.source[start : i + 1], "".join(out), i + 1

    def peek(self, *texts: str) -> bool:
        return self.token.kind in ("punct", "ident") and self.token.text in texts

    def expect(self, text: str) -> Token:
        if not self.peek(text):
            raise self.unexpected(expecting=text)
        return self.advance()

    # --- probes ---------------------------------------------------------------------------------
    def program(self) -> S.Program:
        probes: list[S.ProbeBlock] = []
        self.skip_space()
        while self.at < len(self.source):
            probes.append(self.probe_block())
            self.skip_space()
        if not probes:
            raise self.error("no probes in the program", (0, len(self.source)))
        return S.Program(tuple(probes), span=(0, len(self.source)))

    def probe_block(self) -> S.ProbeBlock:
        start = self.at
        points = [self.attach_point()]
        self.skip_space()
        while self.source.startswith(",", self.at):
            self.at += 1
            self.skip_space()
            points.append(self.attach_point())
            self.skip_space()
        self.advance()
        predicate = None
        if self.peek("/"):
            self.advance()
            predicate = self.expression()
            self.expect("/")
        body = self.block(probe=True)
        return S.ProbeBlock(tuple(points), predicate, body, span=(start, self.at))

    def attach_point(self) -> S.AttachPoint:
        start = self.at
        match = _ATTACH.match(self.source, start)
        if match is None:
            word = _PROBE_WORD.match(self.source, start)
            if word is not None and word.group() in _NOT_YET:
                raise self.error(f"{word.group()} probes (a program's static tracepoints) are not attached yet: "
                                 "dynprobe attaches uprobe, uretprobe, BEGIN, END and interval probes",
                                 word.span())  # fmt: skip
            if word is not None and word.group() in _OTHER_KINDS:
                raise self.error(f"{word.group()} probes are the kernel's: dynprobe attaches uprobe, uretprobe, "
                                 "BEGIN, END and interval probes", word.span())  # fmt: skip
            end = start
            while end < len(self.source) and not self.source[end].isspace() and self.source[end] not in "{,":
                end += 1
            what = self.source[start:end] or (self.source[start : start + 1] or "end of file")
            raise self.error(f"invalid probe: {what} (uprobe:FILE:FUNCTION, uretprobe:..., BEGIN, END, "
                             "interval:s:N)", (start, max(end, start + 1)))  # fmt: skip
        self.at = match.end()
        span = match.span()
        if match.group("special"):
            return S.AttachPoint(match.group("special"), span=span)
        if match.group("interval"):
            every = int(match.group("every"))
            if not every:
                raise self.error("an interval of 0", span)
            return S.AttachPoint("interval", match.group("unit"), "", every, span=span)
        target = match.group("target")
        if not target:
            raise self.error("a uprobe needs a file or a library: uprobe:FILE:FUNCTION", span)
        function = match.group("quoted") or match.group("function")
        offset = int(match.group("offset"), 0) if match.group("offset") else 0
        kind = PROBE_KINDS[match.group("kind")]
        if offset and kind == "uretprobe":
            raise self.error("a uretprobe is at a function's return: no offset", span)
        return S.AttachPoint(kind, target, function, offset, span=span)

    # --- statements -----------------------------------------------------------------------------
    def block(self, *, probe: bool = False) -> tuple[S.Statement, ...]:
        """`{ statements }`; a probe's (`probe`) is left at its '}', the next probe's attach points
        read as a whole from there."""
        self.expect("{")
        statements: list[S.Statement] = []
        while not self.peek("}"):
            if self.token.kind == "end":
                raise self.unexpected(expecting="}")
            if self.peek(";"):
                self.advance()
                continue
            statement = self.statement()
            statements.append(statement)
            if isinstance(statement, S.If) or self.peek("}"):
                continue
            if not self.peek(";"):
                raise self.unexpected(expecting="; or }")
            self.advance()
        if probe:
            self.at = self.token.end
        else:
            self.advance()
        return tuple(statements)

    def statement(self) -> S.Statement:
        start = self.token.start
        if self.token.kind == "ident" and self.token.text == "if":
            self.advance()
            self.expect("(")
            condition = self.expression()
            self.expect(")")
            then = self.block()
            otherwise: tuple[S.Statement, ...] = ()
            if self.token.kind == "ident" and self.token.text == "else":
                self.advance()
                if not self.peek("if", "{"):
                    raise self.unexpected(expecting="{ or if")
                otherwise = (self.statement(),) if self.peek("if") else self.block()
            return S.If(condition, then, otherwise, span=(start, self.token.start))
        expr = self.expression()
        if self.token.kind == "punct" and self.token.text in ASSIGN_OPS:
            if not isinstance(expr, (S.Var, S.MapRef)):
                raise self.error("only a variable ($x) or a map (@m) can be assigned to", expr.span)
            op = self.advance().text
            value = self.expression()
            return S.Assign(expr, op, value, span=(start, value.span[1]))
        return S.ExprStatement(expr, span=expr.span)

    # --- expressions ----------------------------------------------------------------------------
    def expression(self) -> S.Expr:
        condition = self.binary(1)
        if not self.peek("?"):
            return condition
        self.advance()
        then = self.expression()
        self.expect(":")
        otherwise = self.expression()
        return S.Ternary(condition, then, otherwise, span=(condition.span[0], otherwise.span[1]))

    def binary(self, level: int) -> S.Expr:
        left = self.unary()
        while self.token.kind == "punct" and BINARY.get(self.token.text, 0) >= level and not self.ends_predicate():
            op = self.token.text
            self.advance()
            right = self.binary(BINARY[op] + 1)
            left = S.Binary(op, left, right, span=(left.span[0], right.span[1]))
        return left

    def unary(self) -> S.Expr:
        token = self.token
        if self.peek("!", "-", "~", "*"):
            self.advance()
            operand = self.unary()
            return S.Unary(token.text, operand, span=(token.start, operand.span[1]))
        if self.peek("++", "--"):
            self.advance()
            target = self.unary()
            return S.Step(token.text, self.steppable(target), True, span=(token.start, target.span[1]))
        if self.peek("(") and self.is_cast():
            self.advance()
            type_name = self.advance().text
            pointer = self.peek("*")
            if pointer:
                self.advance()
            self.expect(")")
            operand = self.unary()
            return S.Cast(type_name, pointer, operand, span=(token.start, operand.span[1]))
        return self.postfix()

    def ends_predicate(self) -> bool:
        """At '/': whether it closes a predicate (a block follows), as bpftrace reads `/4/2 == 2/ {`."""
        if not self.peek("/"):
            return False
        match = _SPACE.match(self.source, self.token.end)
        return match is not None and self.source.startswith("{", match.end())

    def is_cast(self) -> bool:
        """At '(': whether a type follows (a cast), not an expression."""
        match = _CAST.match(self.source, self.token.start)
        return match is not None and match.group(1) in INTEGER_TYPES

    def steppable(self, target: S.Expr) -> S.Var | S.MapRef:
        if not isinstance(target, (S.Var, S.MapRef)):
            raise self.error("only a variable ($x) or a map (@m) can be stepped (++, --)", target.span)
        return target

    def postfix(self) -> S.Expr:
        expr = self.primary()
        while self.peek("++", "--"):
            token = self.advance()
            expr = S.Step(token.text, self.steppable(expr), False, span=(expr.span[0], token.end))
        return expr

    def primary(self) -> S.Expr:
        token = self.token
        if token.kind == "int":
            self.advance()
            assert isinstance(token.value, int)
            return S.Int(token.value, span=(token.start, token.end))
        if token.kind == "str":
            self.advance()
            return S.Str(str(token.value), span=(token.start, token.end))
        if token.kind == "var":
            self.advance()
            return S.Var(token.text[1:], span=(token.start, token.end))
        if token.kind == "map":
            self.advance()
            keys: tuple[S.Expr, ...] = ()
            end = token.end
            if self.peek("["):
                self.advance()
                keys = self.arguments("]")
                end = self.advance().end
            return S.MapRef(token.text[1:], keys, span=(token.start, end))
        if token.kind == "ident":
            self.advance()
            if self.peek("("):
                self.advance()
                args = self.arguments(")")
                end = self.advance().end
                return S.Call(token.text, args, span=(token.start, end))
            if token.text in BUILTINS:
                return S.Builtin(token.text, span=(token.start, token.end))
            if token.text in STACK_MODES:
                return S.StackMode(token.text, span=(token.start, token.end))
            raise self.error(f"Unknown identifier: '{token.text}'", (token.start, token.end))
        if self.peek("("):
            self.advance()
            expr = self.expression()
            self.expect(")")
            return expr
        raise self.unexpected()

    def arguments(self, closing: str) -> tuple[S.Expr, ...]:
        """Comma-separated expressions up to `closing` (left as the current token)."""
        args: list[S.Expr] = []
        if self.peek(closing):
            return ()
        while True:
            args.append(self.expression())
            if self.peek(closing):
                return tuple(args)
            if not self.peek(","):
                raise self.unexpected(expecting=f'{closing} or ","')
            self.advance()
