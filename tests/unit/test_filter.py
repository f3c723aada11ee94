"""The filter language and histogram values: accepted forms, precedence, and one case per error code."""

from __future__ import annotations

import pytest

from dynprobe.actions.filter import FILTER_ERRORS, matches, parse_filter, parse_value
from dynprobe.actions.model import Compare, Logical, filter_args
from dynprobe.errors import ParseError
from dynprobe.spec.model import Arg, ArgType, Deref, Reg
from dynprobe.spec.parser import parse_spec

ARGS = parse_spec("p main a=%di b=%si:s32 s=+0(%dx):string").args

# code -> (text, column of the fault, parse a value instead of a filter)
ERROR_TABLE: dict[str, tuple[str, int, bool]] = {
    "FILTER_EMPTY": ("  ", 0, False),
    "FILTER_SYNTAX": ("a == 5 b", 7, False),
    "FILTER_UNKNOWN_NAME": ("a == 1 and zz > 2", 11, False),
    "FILTER_STRING": ("s == 1", 0, False),
    "FILTER_BAD_NUMBER": ("a == five", 5, False),
    "FILTER_PAREN": ("(a == 1 or b == 2", 0, False),
    "FILTER_TOO_DEEP": ("(" * 17 + "a == 1" + ")" * 17, 16, False),  # (16 levels parse)
    "FILTER_TOO_LONG": (" or ".join(["a == 1"] * 65), 64 * len("a == 1 or "), False),
    "VALUE_UNKNOWN": ("nope", 0, True),
    "VALUE_STRING": ("s", 0, True),
}


@pytest.mark.parametrize("code", list(ERROR_TABLE))
def test_error_codes(code: str) -> None:
    text, column, value = ERROR_TABLE[code]
    with pytest.raises(ParseError) as info:
        parse_value(text, ARGS) if value else parse_filter(text, ARGS)
    assert (info.value.code, info.value.offset) == (code, column)
    assert info.value.message == FILTER_ERRORS[code]


def test_every_error_code_has_a_case() -> None:
    assert set(ERROR_TABLE) == set(FILTER_ERRORS)


def test_the_limits_themselves_parse() -> None:
    parse_filter("(" * 16 + "a == 1" + ")" * 16, ARGS)
    parse_filter(" or ".join(["a == 1"] * 64), ARGS)


def test_a_long_text_s_caret_shows_the_80_characters_around_the_fault() -> None:
    with pytest.raises(ParseError) as info:
        parse_filter("(" * 5000 + "a == 1" + ")" * 5000, ARGS)
    assert info.value.caret().splitlines() == ["(" * 80 + "...", " " * 16 + "^"]
    text = " or ".join(["a == 1"] * 100)
    with pytest.raises(ParseError) as info:
        parse_filter(text, ARGS)
    assert info.value.caret().splitlines() == ["..." + text[600:680] + "...", " " * 43 + "^"]


def test_and_binds_tighter_than_or() -> None:
    tree = parse_filter("a == 1 or b < 2 and a != 3", ARGS)
    assert isinstance(tree, Logical) and tree.op == "or"
    assert isinstance(tree.right, Logical) and tree.right.op == "and"
    assert parse_filter("(a == 1 || b < 2) && a != 3", ARGS) == Logical(
        "and", Logical("or", tree.left, tree.right.left), tree.right.right
    )


def test_fetch_arguments_written_in_place() -> None:
    tree = parse_filter("$arg1 >= 0x10 and +8(%si):u32 != -1", ARGS)
    assert isinstance(tree, Logical)
    left, right = tree.left, tree.right
    assert isinstance(left, Compare) and left.arg.fetch == Arg(1) and left.arg.type == ArgType("s", 64)
    assert left.value == 16
    assert isinstance(right, Compare) and right.arg.fetch == Deref(8, Reg("rsi"))
    assert right.arg.type == ArgType("u", 32) and right.value == -1


def test_matches_on_fetched_values() -> None:
    tree = parse_filter("a == 5 or (b < -2 and a != 7)", ARGS)
    assert matches(tree, {"a": 5, "b": 0})
    assert matches(tree, {"a": 1, "b": -3})
    assert not matches(tree, {"a": 7, "b": -3})
    assert not matches(tree, {"a": None, "b": 0})  # a faulted fetch fails its comparison


def test_value_by_name_or_fetch_argument() -> None:
    assert parse_value("b", ARGS) == ARGS[1]
    assert parse_value("%dx:u16", ARGS).type == ArgType("u", 16)


def test_unsigned_comparisons_see_the_constant_as_the_code_does() -> None:
    args = parse_spec("p main u=%di:u64 s=%si:s64").args
    assert matches(parse_filter("u == -1", args), {"u": 2**64 - 1})  # the same 64-bit pattern
    assert matches(parse_filter("s < 0", args), {"s": -5})
    assert not matches(parse_filter("u < 0", args), {"u": 5})  # unsigned: 0 is the least


# FILTER_SYNTAX from each place that raises it: (text, column)
SYNTAX_SITES = [
    ("a == 1 & b == 2", 7),  # no token
    ("a == 1   &", 9),  # the column is the token's, past the blanks
    ("a ==", 4),  # ends early
    ("a b 1", 2),  # no operator
    ("== 1", 0),  # an operator where a name goes
    (") == 1", 0),
]


@pytest.mark.parametrize(("text", "column"), SYNTAX_SITES)
def test_every_syntax_error_site(text: str, column: int) -> None:
    with pytest.raises(ParseError) as info:
        parse_filter(text, ARGS)
    assert (info.value.code, info.value.offset) == ("FILTER_SYNTAX", column)


def test_blanks_after_the_filter_and_groups_one_after_another() -> None:
    assert parse_filter("a == 1   ", ARGS) == parse_filter("a == 1", ARGS)
    parse_filter(" or ".join(["(a == 1)"] * 20), ARGS)  # 20 groups, none nested
    with pytest.raises(ParseError) as info:  # a group closed before counts no more
        parse_filter("(a == 1) or " + "(" * 17 + "a == 1" + ")" * 17, ARGS)
    assert info.value.code == "FILTER_TOO_DEEP"


def test_two_fetch_arguments_written_in_place_are_two_values() -> None:
    tree = parse_filter("+8(%si):u32 != 0 and +16(%si):u32 == 5", ARGS)
    first, second = filter_args(tree)
    assert (first.name, second.name) == ("+8(%si):u32", "+16(%si):u32")
    assert matches(tree, {first.name: 1, second.name: 5})
    assert not matches(tree, {first.name: 0, second.name: 5})
    assert not matches(tree, {first.name: 1, second.name: 4})
    assert parse_value("+8(%si):u32").name == "+8(%si):u32"


def test_signed_comparisons_see_a_large_constant_as_the_code_does() -> None:
    args = parse_spec("p main s=%si:s64").args
    assert matches(parse_filter("s == 0xffffffffffffffff", args), {"s": -1})
    assert matches(parse_filter("s == 0x4000000000000000", args), {"s": 1 << 62})
    assert not matches(parse_filter("s < 0x8000000000000000", args), {"s": 5})  # that is -2^63
