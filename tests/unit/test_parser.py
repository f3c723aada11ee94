"""The probe syntax: accepted forms, and one case per error code with its column."""

from __future__ import annotations

import pytest

from dynprobe.errors import ParseError
from dynprobe.spec.fetch import StringValue, format_value
from dynprobe.spec.model import (
    Absolute,
    Arg,
    ArgType,
    Comm,
    Deref,
    Reg,
    Stack,
    StackPointer,
    SymbolAddr,
    split_location,
)
from dynprobe.spec.parser import ERRORS, integer_type, parse_probe, parse_spec

# code -> (spec, column of the fault)
ERROR_TABLE: dict[str, tuple[str, int]] = {
    "EMPTY_SPEC": ("   ", 0),
    "BAD_PROBE_TYPE": ("x main", 0),
    "BAD_MAXACT": ("r0 main", 1),
    "MAXACT_NO_PROBE": ("p5 main", 1),
    "NO_GROUP_NAME": ("p:/ev main", 2),
    "GROUP_TOO_LONG": ("p:" + "g" * 65 + "/ev main", 2),
    "BAD_GROUP_NAME": ("p:9g/ev main", 2),
    "NO_EVENT_NAME": ("p:grp/ main", 6),
    "EVENT_TOO_LONG": ("p:" + "e" * 65 + " main", 2),
    "BAD_EVENT_NAME": ("p:ev-1 main", 2),
    "NO_PROBE_POINT": ("p:ev", 4),
    "BAD_PROBE_ADDR": ("p /bin/ls:main+zz", 15),
    "TOO_MANY_ARGS": ("p main " + " ".join("%di" for _ in range(129)), 7 + 4 * 128),
    "BAD_ARG_NAME": ("p main 1a=%di", 7),
    "USED_ARG_NAME": ("p main a=%di a=%si", 13),
    "NO_ARG_BODY": ("p main a=", 9),
    "BAD_FETCH_ARG": ("p main foo", 7),
    "BAD_REG_NAME": ("p main %xyz", 7),
    "BAD_STACK_NUM": ("p main $stackx", 13),
    "BAD_ARG_NUM": ("p main $arg9", 11),
    "RETVAL_ON_PROBE": ("p main $retval", 7),
    "LATENCY_ON_PROBE": ("p main $latency", 7),
    "BAD_VAR": ("p main $foo", 7),
    "BAD_MEM_ADDR": ("p main @", 7),
    "BAD_DEREF_OFFS": ("p main +(%di)", 7),
    "DEREF_NEED_BRACE": ("p main +8%di", 9),
    "DEREF_OPEN_BRACE": ("p main +8(%di", 13),
    "TOO_MANY_DEREF": ("p main " + "+0(" * 9 + "%di" + ")" * 9, 7 + 3 * 8),
    "COMM_CANT_DEREF": ("p main +0($comm)", 10),
    "BAD_TYPE": ("p main %di:u128", 11),
    "BAD_STRING": ("p main %di:string", 11),
    "BAD_COMM_TYPE": ("p main $comm:u32", 13),
}

RAISED_ELSEWHERE: set[str] = set()


@pytest.mark.parametrize(("code", "case"), ERROR_TABLE.items(), ids=list(ERROR_TABLE))
def test_error_code_and_column(code: str, case: tuple[str, int]) -> None:
    spec, column = case
    with pytest.raises(ParseError) as info:
        parse_spec(spec)
    assert info.value.code == code, info.value
    assert info.value.offset == column, info.value.caret()
    assert info.value.column == column + 1 and str(info.value).endswith(f"(column {column + 1})")  # one convention
    text, caret = info.value.caret().splitlines()
    assert text.replace("...", "") in spec and caret.endswith("^")
    assert text[len(caret) - 1 : len(caret) + 2] == spec[column : column + 3]  # the caret is under the fault


def test_every_error_code_is_tested() -> None:
    assert set(ERRORS) - RAISED_ELSEWHERE == set(ERROR_TABLE)


# Codes raised from more than one place: every other place, with its column and what it says.
OTHER_RAISE_SITES: list[tuple[str, str, int, str]] = [
    ("BAD_PROBE_ADDR", "p :main", 2, "the file name before ':' is empty"),
    ("BAD_PROBE_ADDR", "p /bin/ls:", 10, "nothing after ':'"),
    ("BAD_PROBE_ADDR", "p /bin/ls:0xzz", 10, "'0xzz' is not an offset"),
    ("BAD_PROBE_ADDR", "p /bin/ls:-main", 10, "'-main' is not a symbol name"),
    ("BAD_MEM_ADDR", "p main @0xzz", 8, ""),
    ("BAD_MEM_ADDR", "p main @+8", 8, ""),
    ("BAD_MEM_ADDR", "p main @sym+zz", 12, ""),
    ("NO_ARG_BODY", "p main +0()", 10, ""),
    ("NO_ARG_BODY", "p main :u8", 7, ""),
    ("BAD_PROBE_ADDR", "p -main", 2, "'-main' is not a symbol name"),
    ("BAD_PROBE_ADDR", "p main+-1", 7, "'-1' is not an offset"),
    ("BAD_ARG_NUM", "p main $arg0", 11, ""),
    ("BAD_ARG_NUM", "p main $arg7", 11, ""),
    ("DEREF_NEED_BRACE", "p main +8", 9, ""),
    ("BAD_MEM_ADDR", "p main +0(@ns::v):u8", 11, ""),  # the ':' inside the parentheses are not the type's
    ("BAD_MEM_ADDR", "p main +0(@ns::v)", 11, ""),
    ("BAD_TYPE", "p main %di:", 11, ""),
    ("BAD_ARG_NAME", "p main =%di", 7, ""),
    ("BAD_FETCH_ARG", "p main (a=1)", 7, ""),  # '=' after '(' names nothing
    ("BAD_ARG_NAME", "p main " + "a" * 65 + "=%di", 7, ""),
    ("EVENT_TOO_LONG", "p:" + "e" * 65 + " main", 2, ""),
    ("BAD_MAXACT", "r4097 main", 1, ""),
    ("BAD_MAXACT", "r0 main", 1, ""),
]


@pytest.mark.parametrize(
    "spec",
    ["p:" + "e" * 64 + " main", "p main " + "a" * 64 + "=%di", "r1 main", "r4096 main", "p /bin/ls:0", "p main+0",
     "p main $arg1 $arg6"],
)  # fmt: skip
def test_the_limits_themselves_parse(spec: str) -> None:
    parse_spec(spec)


@pytest.mark.parametrize(("code", "spec", "column", "detail"), OTHER_RAISE_SITES)
def test_every_raise_site(code: str, spec: str, column: int, detail: str) -> None:
    with pytest.raises(ParseError) as info:
        parse_spec(spec)
    assert (info.value.code, info.value.offset) == (code, column), info.value
    assert str(info.value) == f"{code}: {ERRORS[code]}" + (f": {detail}" if detail else "") + f" (column {column + 1})"


def test_integer_type() -> None:
    expected = [ArgType("u", 8), ArgType("s", 16), ArgType("x", 64)]
    assert [integer_type(name) for name in ("u8", "s16", "x64")] == expected
    for name in ("string", "symbol", "u128", ""):
        with pytest.raises(ParseError) as info:
            integer_type(name)
        assert info.value.code == "BAD_TYPE" and f"{name!r} is not an integer type" in str(info.value)
        assert info.value.offset == 0


def test_full_spec() -> None:
    spec = parse_spec("p:grp/ev /bin/true:main+4 a=%di b=+8(%sp):u32 s=+0(%si):string $comm $stack2 @0x1000 @v+8:s32")
    assert (spec.kind, spec.group, spec.event, spec.location) == ("p", "grp", "ev", "/bin/true:main+4")
    fetches = [a.fetch for a in spec.args]
    assert fetches == [
        Reg("rdi"),
        Deref(8, Reg("rsp")),
        Deref(0, Reg("rsi")),
        Comm(),
        Stack(2),
        Absolute(0x1000),
        SymbolAddr("v", 8),
    ]
    assert [a.name for a in spec.args] == ["a", "b", "s", "arg4", "arg5", "arg6", "arg7"]
    assert [str(a.type) for a in spec.args] == ["x64", "u32", "string", "string", "x64", "x64", "s32"]


def test_kernel_register_names_and_args() -> None:
    spec = parse_spec("p f %ax %r8 %rip %flags $arg3 $stack -0x10(+8(%bp)):s8")
    assert [a.fetch for a in spec.args] == [
        Reg("rax"),
        Reg("r8"),
        Reg("rip"),
        Reg("eflags"),
        Arg(3),
        StackPointer(),
        Deref(-16, Deref(8, Reg("rbp"))),
    ]
    assert spec.args[-1].type == ArgType("s", 8)


def test_return_probe_form() -> None:
    spec = parse_spec("r10:g/e lib.so:f ret=$retval:s32")
    assert (spec.kind, spec.maxactive, spec.group, spec.event) == ("r", 10, "g", "e")


@pytest.mark.parametrize(
    ("text", "location"),
    [("main", "main"), ("main+4", "main+4"), ("libc:malloc", "libc:malloc"), ("/a/b.so:0x1139", "/a/b.so:0x1139"),
     ("p main", "main"), ("p:ev main %di", "main"), ("puts", "puts"), ("r5 f", "f")],
)  # fmt: skip
def test_parse_probe_accepts_bare_locations(text: str, location: str) -> None:
    assert parse_probe(text).location == location


@pytest.mark.parametrize(
    ("text", "truncated", "shown"),
    [
        ("hello", False, '"hello"'),
        ('say "hi"\\now', False, '"say \\"hi\\"\\\\now"'),
        ("two\nlines\tand\r\x01\x7f", False, '"two\\nlines\\tand\\r\\x01\\x7f"'),
        ("ünï", True, '"ünï"...'),
    ],
)
def test_strings_print_on_one_line(text: str, truncated: bool, shown: str) -> None:
    """An event is one line: a string's control characters are escaped, as are its quotes."""
    assert format_value(StringValue(text, truncated), parse_spec("p f s=+0(%di):string").args[0].type) == shown


def test_a_probe_type_that_is_not_one() -> None:
    """'q add_word x=%di' is a spec with a wrong type, not the bare location 'q'."""
    with pytest.raises(ParseError) as info:
        parse_probe("q add_word x=%di")
    assert str(info.value) == "BAD_PROBE_TYPE: a probe starts with 'p' (probe) or 'r' (return probe): q (column 1)"
    assert parse_probe("main+4").location == "main+4"  # a bare location is still one


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        ("/bin/ls:main", ("/bin/ls", ":", "main")),
        ("./app:ns::f", ("./app", ":", "ns::f")),
        ("ns::f", ("", "", "ns::f")),
        ("ns::Class::~Class", ("", "", "ns::Class::~Class")),
        (":f", ("", ":", "f")),
        ("a::b:c", ("a::b", ":", "c")),
        ("lib:a::b::c", ("lib", ":", "a::b::c")),
        ("::f", ("", "", "::f")),
        ("x:", ("x", ":", "")),
        ("main", ("", "", "main")),
        ("f::", ("", "", "f::")),
        (":a::", ("", ":", "a::")),
        ("x:::b", ("x", ":", "::b")),
    ],
)
def test_split_location(text: str, parts: tuple[str, str, str]) -> None:
    """The file ends at the last ':' that is not half of a C++ '::'."""
    assert split_location(text) == parts


@pytest.mark.parametrize(
    ("arg_type", "value", "cast"),
    [
        (ArgType("u", 8), 0x1FF, 0xFF),
        (ArgType("s", 8), 0xFF, -1),
        (ArgType("s", 8), 0x7F, 0x7F),
        (ArgType("s", 8), 0x80, -0x80),
        (ArgType("s", 16), 0x1_8000, -0x8000),
        (ArgType("s", 32), 0xFFFF_FFFE, -2),
        (ArgType("s", 64), (1 << 64) - 1, -1),
        (ArgType("u", 64), (1 << 64) + 5, 5),
        (ArgType("x", 16), -1, 0xFFFF),
        (ArgType("x"), -1, (1 << 64) - 1),
    ],
)
def test_arg_type_cast(arg_type: ArgType, value: int, cast: int) -> None:
    assert arg_type.cast(value) == cast


def test_arg_type_names() -> None:
    assert [str(t) for t in (ArgType("u"), ArgType("s", 8), ArgType("x", 32), ArgType("string"))] == [
        "u64", "s8", "x32", "string"
    ]  # fmt: skip
