"""uftrace's -A/-R value specs: parsed to where the call has each value, written back, refused
with the reason; values shown as uftrace's replay shows them (its rules for large and negative
numbers, characters, floats, strings cut at 95 characters)."""

from __future__ import annotations

import struct

import pytest

from dynprobe.spec.argspec import (
    AUTO_VALUES,
    SHOWN_STRING,
    ArgSpec,
    ArgSpecError,
    parse_value,
    parse_values,
    show_string,
    show_value,
)


@pytest.mark.parametrize(
    ("text", "retval", "spec"),
    [
        ("arg1", False, ArgSpec(1, "d", 64, "rdi")),
        ("arg2/s", False, ArgSpec(2, "s", 64, "rsi")),
        ("arg3/c", False, ArgSpec(3, "c", 8, "rdx")),
        ("arg4/x32", False, ArgSpec(4, "x", 32, "rcx")),
        ("arg5/u16", False, ArgSpec(5, "u", 16, "r8")),
        ("arg6/i8", False, ArgSpec(6, "i", 8, "r9")),
        ("arg7", False, ArgSpec(7, "d", 64, "stack+1")),
        ("arg9/o", False, ArgSpec(9, "o", 64, "stack+3")),
        ("arg1%r12", False, ArgSpec(1, "d", 64, "r12")),
        ("arg2/x%stack+4", False, ArgSpec(2, "x", 64, "stack+4")),
        ("fparg1", False, ArgSpec(1, "f", 64, "xmm0", floating=True)),
        ("fparg8/32", False, ArgSpec(8, "f", 32, "xmm7", floating=True)),
        ("fparg2%xmm5", False, ArgSpec(2, "f", 64, "xmm5", floating=True)),
        ("retval", True, ArgSpec(0, "d", 64, "rax")),
        ("retval/s", True, ArgSpec(0, "s", 64, "rax")),
        ("retval/f32", True, ArgSpec(0, "f", 32, "xmm0")),
        ("retval/i32", True, ArgSpec(0, "i", 32, "rax")),
    ],
)
def test_specs_parse_to_where_the_call_has_the_value(text: str, retval: bool, spec: ArgSpec) -> None:
    assert parse_value(text, retval=retval) == spec
    assert parse_value(spec.text, retval=retval) == spec  # (info.json keeps the text)


@pytest.mark.parametrize(
    ("text", "retval", "message"),
    [
        ("arg0", False, "is not argN, fpargN or retval"),
        ("args", False, "is not argN, fpargN or retval"),
        ("retval", False, "-R records retval"),
        ("arg1", True, "-R records retval"),
        ("arg1/z", False, "format 'z' is not one dynprobe records"),
        ("arg1/S", False, "format 'S' is not one dynprobe records"),
        ("arg1/s32", False, "takes no size"),
        ("arg1/x12", False, "the size is 8 or 16 or 32 or 64 bits"),
        ("fparg1/16", False, "the size is 32 or 64 bits"),
        ("fparg1/x", False, "shown as a number"),
        ("arg1/f", False, "floating-point arguments are fpargN"),
        ("fparg9", False, "fparg1-fparg8 come in registers"),
        ("arg1%rsp", False, "is not a 64-bit register"),
        ("arg1%stack+0", False, "is not a 64-bit register"),
        ("fparg1%rdi", False, "is not xmm0-xmm7"),
        ("retval%rdx", True, "no %LOCATION"),
        ("arg1/8s", False, "after '/' comes a format"),
    ],
)
def test_bad_specs_say_what_is_wrong(text: str, retval: bool, message: str) -> None:
    with pytest.raises(ArgSpecError, match=message):
        parse_value(text, retval=retval)


def test_a_list_of_values_and_its_limits() -> None:
    assert [v.index for v in parse_values("arg1, arg2/s ,fparg1", retval=False)] == [1, 2, 1]
    with pytest.raises(ArgSpecError, match="no value"):
        parse_values(" , ", retval=False)
    assert len(parse_values(",".join(f"arg{n}" for n in range(1, 17)), retval=False)) == 16
    with pytest.raises(ArgSpecError, match="at most 16"):
        parse_values(",".join(f"arg{n}" for n in range(1, 18)), retval=False)
    assert [v.is_string for v in parse_values("arg1/s,arg2/d,arg3/c", retval=False)] == [True, False, False]


def test_the_table_of_library_functions_parses() -> None:
    for arguments, retval in AUTO_VALUES.values():
        if arguments:
            assert all(not v.retval for v in parse_values(arguments, retval=False))
        if retval:
            assert parse_values(retval, retval=True)[0].retval


def _spec(text: str) -> ArgSpec:
    return parse_value(text, retval=text.startswith("retval"))


@pytest.mark.parametrize(
    ("text", "raw", "shown"),
    [
        ("arg1", 3, "3"),
        ("arg1", 100000, "100000"),
        ("arg1", 100001, "0x186a1"),
        ("arg1", -100000 & (2**64 - 1), "-100000"),
        ("arg1", -100001 & (2**64 - 1), "0xfffffffffffe795f"),
        ("arg1", 0xFFFFFFFF, "-1"),  # an int's -1, zero-extended in its register
        ("arg1", 0xFFFF0001, "-65535"),
        ("arg1", 0xFFFF0000, "0xffff0000"),
        ("arg1/d32", 0xFFFFFFFF, "-1"),
        ("arg1/i32", 0x1_FFFF_FFFE, "-2"),  # the upper half is not the value's
        ("arg1/i8", 0x80, "-128"),
        ("arg1/i8", 0x40, "64"),
        ("arg1", 1 << 32, "0x100000000"),
        ("arg1/i", 2**63, str(-(2**63))),
        ("arg1/u", 100000, "100000"),
        ("arg1/u", 100001, "0x186a1"),
        ("arg1/u32", 0xFFFFFFF9, "0xfffffff9"),
        ("arg1/u16", 0x1_0005, "5"),
        ("arg1/x", 0, "0"),
        ("arg1/x", 21, "0x15"),
        ("arg1/x8", 0x1FF, "0xff"),
        ("arg1/o", 8, "010"),
        ("arg1/o", 0, "0"),
        ("arg1/c", ord("a"), "'a'"),
        ("arg1/c", ord("\n"), "'\\n'"),
        ("arg1/c", 0x1B, "'\\x1b'"),
        ("fparg1", struct.unpack("<Q", struct.pack("<d", 1.5))[0], "1.500000"),
        ("fparg1/32", struct.unpack("<I", struct.pack("<f", 3.375))[0] | 0xDEAD << 32, "3.375000"),
        ("fparg1", struct.unpack("<Q", struct.pack("<d", float("inf")))[0], "inf"),
        ("fparg1", struct.unpack("<Q", struct.pack("<d", float("nan")))[0], "nan"),
        ("retval/f", struct.unpack("<Q", struct.pack("<d", -2.25))[0], "-2.250000"),
    ],
)
def test_values_show_as_uftrace_shows_them(text: str, raw: int, shown: str) -> None:
    assert show_value(_spec(text), raw) == shown


def test_strings_show_quoted_escaped_and_cut() -> None:
    assert show_string(b"hello") == '"hello"'
    assert show_string(b'tab\there "q"\n') == '"tab\there "q"\\n"'
    assert show_string(b"\x1b[31mred\x08") == '"\\x1b[31mred\\b"'  # no terminal codes
    assert show_string("é".encode() + b"\xff") == '"é\\xff"'
    long = b"x" * 96  # all a string's 12 pieces of 8 bytes
    assert SHOWN_STRING == 95 and show_string(long, cut=True) == '"' + "x" * 95 + '..."'
    assert show_string(b"\x1f \x7e\x7f") == '"\\x1f ~\\x7f"'
    assert show_string(b"", pointer=0) == '"NULL"'  # (uftrace v0.13's way)
    assert show_string(b"", faulted=True, pointer=16) == '"<0x10>"'
    assert show_string(b"abc", faulted=True) == '"abc..."'
