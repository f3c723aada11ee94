"""Parser of `p[:[GRP/]EVENT] PATH:SYMBOL[+OFFS]|PATH:0xOFF [FETCHARGS]` and the `r` form. SYMBOL
may be a shell-style pattern ('str*', '[ab]?'): the session expands it (`Session.expand`).

Errors carry a code from `ERRORS`, a message and the column where the fault is, as the kernel's
tracefs error_log does, so the CLI prints the spec with a caret under the fault.
"""

from __future__ import annotations

import re

from dynprobe.arch.x86_64 import canonical_name
from dynprobe.errors import ParseError
from dynprobe.spec.model import (
    Absolute,
    Arg,
    ArgType,
    Comm,
    Deref,
    Fetch,
    FetchArg,
    Latency,
    ProbeSpec,
    Reg,
    RetVal,
    Stack,
    StackPointer,
    SymbolAddr,
    split_location,
)

MAX_ARGS = 128
MAX_NAME_LEN = 64
MAX_MAXACTIVE = 4096
MAX_DEREF_DEPTH = 8

ERRORS: dict[str, str] = {
    "EMPTY_SPEC": "the probe specification is empty",
    "BAD_PROBE_TYPE": "a probe starts with 'p' (probe) or 'r' (return probe)",
    "BAD_MAXACT": "maxactive must be a number from 1 to 4096",
    "MAXACT_NO_PROBE": "maxactive is only for return probes ('r')",
    "NO_GROUP_NAME": "the group name is empty",
    "GROUP_TOO_LONG": "the group name is longer than 64 characters",
    "BAD_GROUP_NAME": "a group name is letters, digits and '_', not starting with a digit",
    "NO_EVENT_NAME": "the event name is empty",
    "EVENT_TOO_LONG": "the event name is longer than 64 characters",
    "BAD_EVENT_NAME": "an event name is letters, digits and '_', not starting with a digit",
    "NO_PROBE_POINT": "the probe point (SYMBOL, PATH:SYMBOL[+OFFS] or PATH:0xOFFSET) is missing",
    "BAD_PROBE_ADDR": "the probe point is not SYMBOL[+OFFS], PATH:SYMBOL[+OFFS] or PATH:0xOFFSET",
    "TOO_MANY_ARGS": "too many fetch arguments (at most 128)",
    "BAD_ARG_NAME": "an argument name is letters, digits and '_', not starting with a digit",
    "USED_ARG_NAME": "this argument name is used twice",
    "NO_ARG_BODY": "nothing to fetch after 'NAME='",
    "BAD_FETCH_ARG": "not a fetch argument (%REG, @ADDR, @SYM, $stackN, $stack, $argN, $retval, $latency, $comm, "
    "+|-OFFS(ARG))",
    "BAD_REG_NAME": "unknown register",
    "BAD_STACK_NUM": "the stack index must be a number",
    "BAD_ARG_NUM": "$argN takes N from 1 to 6 (integer register arguments)",
    "RETVAL_ON_PROBE": "$retval is only available in return probes ('r')",
    "LATENCY_ON_PROBE": "$latency is only available in return probes ('r')",
    "BAD_VAR": "unknown variable (known: $stackN, $stack, $argN, $retval, $latency, $comm)",
    "BAD_MEM_ADDR": "@ takes an address (@0x1234) or a symbol (@sym, @sym+8)",
    "BAD_DEREF_OFFS": "a dereference offset must be a number (+8, -0x10)",
    "DEREF_NEED_BRACE": "a dereference offset must be followed by '('",
    "DEREF_OPEN_BRACE": "the dereference has no closing ')'",
    "TOO_MANY_DEREF": "dereferences nest too deep (at most 8)",
    "COMM_CANT_DEREF": "$comm cannot be dereferenced",
    "BAD_TYPE": "unknown type (u8..u64, s8..s64, x8..x64, string, ustring, symbol)",
    "BAD_STRING": "string types need a memory argument (@ADDR, +OFFS(ARG)) or $comm",
    "BAD_COMM_TYPE": "$comm is a string; it takes no other type",
}

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_TYPES = {f"{k}{b}": ArgType(k, b) for k in ("u", "s", "x") for b in (8, 16, 32, 64)}
_TYPES.update({t: ArgType(t) for t in ("string", "ustring", "symbol")})
_DEFAULT_TYPE = ArgType("x", 64)


def integer_type(name: str) -> ArgType:
    """The integer type a name means (u8..u64, s8..s64, x8..x64, as fetch arguments write it)."""
    found = _TYPES.get(name)
    if found is None or found.kind not in ("u", "s", "x"):
        raise _fail("BAD_TYPE", name, 0, f"{name!r} is not an integer type")
    return found


def _fail(code: str, spec: str, column: int, detail: str = "") -> ParseError:
    message = ERRORS[code] + (f": {detail}" if detail else "")
    return ParseError(code, message, spec, column)


def _tokens(spec: str) -> list[tuple[str, int]]:
    return [(m.group(), m.start()) for m in re.finditer(r"\S+", spec)]


def _parse_int(text: str) -> int | None:
    try:
        return int(text, 0)
    except ValueError:
        return None


def _check_name(name: str, spec: str, column: int, kind: str) -> None:
    if not name:
        raise _fail(f"NO_{kind}_NAME", spec, column)
    if len(name) > MAX_NAME_LEN:
        raise _fail(f"{kind}_TOO_LONG", spec, column)
    if not _NAME.match(name):
        raise _fail(f"BAD_{kind}_NAME", spec, column)


def _parse_head(word: str, spec: str, col: int) -> tuple[str, int | None, str | None, str | None]:
    head, sep, naming = word.partition(":")
    kind = head[:1]
    if kind not in ("p", "r"):
        raise _fail("BAD_PROBE_TYPE", spec, col)
    maxactive = None
    if len(head) > 1:
        if kind == "p":
            raise _fail("MAXACT_NO_PROBE", spec, col + 1)
        value = _parse_int(head[1:]) if head[1:].isdigit() else None
        if value is None or not 1 <= value <= MAX_MAXACTIVE:
            raise _fail("BAD_MAXACT", spec, col + 1)
        maxactive = value
    group = event = None
    if sep:
        name_col = col + len(head) + 1
        if "/" in naming:
            group, _, event = naming.partition("/")
            _check_name(group, spec, name_col, "GROUP")
            _check_name(event, spec, name_col + len(group) + 1, "EVENT")
        else:
            event = naming
            _check_name(event, spec, name_col, "EVENT")
    return kind, maxactive, group, event


# A symbol, or a C++ name as demangled ('ns::Class::method', 'Class::~Class', 'ns::f(long)').
_SYMBOL = re.compile(r"[A-Za-z_.$~*?\[][^\s+]*\Z")  # a name, or a shell-style pattern of names


def _check_location(loc: str, spec: str, col: int) -> None:
    path, sep, what = split_location(loc)
    if sep and not path:
        raise _fail("BAD_PROBE_ADDR", spec, col, "the file name before ':' is empty")
    where = col + (len(path) + 1 if sep else 0)
    if not what:
        raise _fail("BAD_PROBE_ADDR", spec, where, "nothing after ':'")
    if what[0].isdigit():
        if _parse_int(what) is None:  # (it starts with a digit: never negative)
            raise _fail("BAD_PROBE_ADDR", spec, where, f"{what!r} is not an offset")
        return
    symbol, plus, offs = what.partition("+")
    if not _SYMBOL.match(symbol):
        raise _fail("BAD_PROBE_ADDR", spec, where, f"{symbol!r} is not a symbol name")
    if plus and (_parse_int(offs) is None or _parse_int(offs) < 0):  # type: ignore[operator]
        raise _fail("BAD_PROBE_ADDR", spec, where + len(symbol) + 1, f"{offs!r} is not an offset")


class _FetchParser:
    def __init__(self, spec: str, kind: str) -> None:
        self.spec = spec
        self.kind = kind

    def parse(self, body: str, col: int, depth: int = 0) -> Fetch:
        if not body:
            raise _fail("NO_ARG_BODY", self.spec, col)
        first = body[0]
        if first == "%":
            reg = canonical_name(body[1:])
            if reg is None:
                raise _fail("BAD_REG_NAME", self.spec, col, body)
            return Reg(reg)
        if first == "@":
            return self._memory(body[1:], col)
        if first == "$":
            return self._variable(body[1:], col)
        if first in "+-" or first.isdigit():
            return self._deref(body, col, depth)
        raise _fail("BAD_FETCH_ARG", self.spec, col)

    def _memory(self, text: str, col: int) -> Fetch:
        if not text:
            raise _fail("BAD_MEM_ADDR", self.spec, col)
        if text[0].isdigit():
            addr = _parse_int(text)
            if addr is None:
                raise _fail("BAD_MEM_ADDR", self.spec, col + 1)
            return Absolute(addr)
        m = re.match(r"([A-Za-z_.][\w.]*)(?:([+-])(.+))?\Z", text)
        if not m:
            raise _fail("BAD_MEM_ADDR", self.spec, col + 1)
        offset = 0
        if m.group(2):
            value = _parse_int(m.group(3))
            if value is None:
                raise _fail("BAD_MEM_ADDR", self.spec, col + 1 + m.start(3))
            offset = -value if m.group(2) == "-" else value
        return SymbolAddr(m.group(1), offset)

    def _variable(self, name: str, col: int) -> Fetch:
        if name == "stack":
            return StackPointer()
        if name.startswith("stack"):
            if not name[5:].isdigit():
                raise _fail("BAD_STACK_NUM", self.spec, col + 6)
            return Stack(int(name[5:]))
        if name.startswith("arg") and name != "arg":
            if not name[3:].isdigit() or not 1 <= int(name[3:]) <= 6:
                raise _fail("BAD_ARG_NUM", self.spec, col + 4)
            return Arg(int(name[3:]))
        if name == "retval":
            if self.kind != "r":
                raise _fail("RETVAL_ON_PROBE", self.spec, col)
            return RetVal()
        if name == "latency":
            if self.kind != "r":
                raise _fail("LATENCY_ON_PROBE", self.spec, col)
            return Latency()
        if name == "comm":
            return Comm()
        raise _fail("BAD_VAR", self.spec, col)

    def _deref(self, body: str, col: int, depth: int) -> Fetch:
        m = re.match(r"[+-]?(?:0[xX][0-9a-fA-F]+|\d+)", body)
        if not m:
            raise _fail("BAD_DEREF_OFFS", self.spec, col)
        offset = int(m.group().lstrip("+"), 0)
        paren = m.end()
        if paren >= len(body) or body[paren] != "(":
            raise _fail("DEREF_NEED_BRACE", self.spec, col + paren)
        if not body.endswith(")"):
            raise _fail("DEREF_OPEN_BRACE", self.spec, col + len(body))
        if depth + 1 > MAX_DEREF_DEPTH:
            raise _fail("TOO_MANY_DEREF", self.spec, col)
        inner = self.parse(body[paren + 1 : -1], col + paren + 1, depth + 1)
        if isinstance(inner, Comm):
            raise _fail("COMM_CANT_DEREF", self.spec, col + paren + 1)
        return Deref(offset, inner)


def _split_type(arg: str) -> tuple[str, str | None, int]:
    """Split 'BODY:TYPE' at the last ':' outside parentheses; returns (body, type, type column)."""
    depth = 0
    for i in range(len(arg) - 1, -1, -1):
        c = arg[i]
        if c == ")":
            depth += 1
        elif c == "(":
            depth -= 1
        elif c == ":" and depth == 0:
            return arg[:i], arg[i + 1 :], i + 1
    return arg, None, len(arg)


def _is_memory(fetch: Fetch) -> bool:
    return isinstance(fetch, Deref | Absolute | SymbolAddr)


def parse_fetch_arg(word: str, col: int, index: int, spec: str, kind: str) -> FetchArg:
    name = f"arg{index}"
    body_col = col
    eq = word.find("=")
    if eq >= 0 and (word.find("(") < 0 or eq < word.find("(")):
        name = word[:eq]
        if not _NAME.match(name) or len(name) > MAX_NAME_LEN:
            raise _fail("BAD_ARG_NAME", spec, col)
        word = word[eq + 1 :]
        body_col = col + eq + 1
    body, type_text, type_off = _split_type(word)
    fetch = _FetchParser(spec, kind).parse(body, body_col)
    if type_text is None:
        arg_type = ArgType("string") if isinstance(fetch, Comm) else _DEFAULT_TYPE
    else:
        found = _TYPES.get(type_text)
        if found is None:
            raise _fail("BAD_TYPE", spec, body_col + type_off, type_text)
        arg_type = found
        if isinstance(fetch, Comm) and not arg_type.is_string:
            raise _fail("BAD_COMM_TYPE", spec, body_col + type_off)
        if arg_type.is_string and not (_is_memory(fetch) or isinstance(fetch, Comm)):
            raise _fail("BAD_STRING", spec, body_col + type_off)
    return FetchArg(name, fetch, arg_type, word)


def parse_spec(spec: str) -> ProbeSpec:
    """Parse one probe specification; raises ParseError with a code and column."""
    tokens = _tokens(spec)
    if not tokens:
        raise _fail("EMPTY_SPEC", spec, 0)
    head, head_col = tokens[0]
    kind, maxactive, group, event = _parse_head(head, spec, head_col)
    if len(tokens) < 2:
        raise _fail("NO_PROBE_POINT", spec, len(spec.rstrip()))
    location, loc_col = tokens[1]
    _check_location(location, spec, loc_col)
    args: list[FetchArg] = []
    names: set[str] = set()
    for i, (word, col) in enumerate(tokens[2:], start=1):
        if i > MAX_ARGS:
            raise _fail("TOO_MANY_ARGS", spec, col)
        arg = parse_fetch_arg(word, col, i, spec, kind)
        if arg.name in names:
            raise _fail("USED_ARG_NAME", spec, col)
        names.add(arg.name)
        args.append(arg)
    return ProbeSpec(kind, group, event, location, tuple(args), maxactive, spec)


def parse_probe(text: str) -> ProbeSpec:
    """A full spec ('p:ev main a=%di'), or a bare location ('main+4', 'libc:malloc') as 'p LOCATION'."""
    stripped = text.strip()
    head = stripped.split(None, 1)[0] if stripped else ""
    kind = head.split(":", 1)[0]
    is_spec = kind[:1] in ("p", "r") and (len(kind) == 1 or kind[1:].isdigit()) and " " in stripped
    if not is_spec and " " in stripped and len(kind) == 1 and kind.isalpha():
        # 'q add_word': a probe type that is not one (a bare location takes no arguments)
        raise _fail("BAD_PROBE_TYPE", text, text.index(kind), kind)
    return parse_spec(text if is_spec or not stripped else f"p {stripped}")
