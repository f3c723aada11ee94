"""bpftrace's language checked (lang/check.py): the types of maps and variables, and each error
bpftrace reports before running anything, as it words it (compared with bpftrace itself, where
it is installed, for those worded alike)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from dynprobe.errors import ProgramError
from dynprobe.lang import syntax as S
from dynprobe.lang.check import INT64, STACK, UINT64, Checked, Type, check_program
from dynprobe.lang.parser import parse_program


def checked(source: str) -> Checked:
    return check_program(parse_program(source), source)


def test_the_types_of_maps_and_variables() -> None:
    program = checked(
        'uprobe:libc:malloc /arg0 > 16/ { @bytes[comm, tid] = sum(arg0); @n = count(); @sizes = hist(arg0);\n'
        '  @lin = lhist(arg0, 0, 1024, 64); $s = str(arg1, 8); @last[func] = $s; @seen[ustack] = count();\n'
        '  @total += arg0; @calls++; $x = (int8)arg0 + 1; @ns[tid] = nsecs }\n'
        'uretprobe:libc:malloc { @ret[retval] = count(); if (@total > 100) { printf("%s %d\\n", comm, @calls) } }\n'
        'interval:s:1 { print(@bytes); print(@n, 5); clear(@sizes); zero(@lin); delete(@last["x"]); exit() }\n'
        'END { $i++; $j = -$i; $k = $j > 0 ? $i : 2; $e = comm == "sh"; @stacks[ustack(5)] = count();\n'
        '  time("%H:%M:%S\\n"); printf("%s\\n", ustack) }'
    )  # fmt: skip
    end = program.program.probes[-1].body
    assert [str(program.type_of(s.value)) for s in end[1:4] if isinstance(s, S.Assign)] == ["int64"] * 3
    shapes = {name: ([str(k) for k in info.keys or ()], str(info.value)) for name, info in program.maps.items()}
    assert shapes == {
        "bytes": (["string[64]", "int64"], "sum"), "n": ([], "count"), "sizes": ([], "hist"), "lin": ([], "lhist"),
        "last": (["string[64]"], "string[9]"), "seen": (["stack"], "count"), "total": ([], "int64"),
        "calls": ([], "int64"), "ns": (["int64"], "int64"), "ret": (["int64"], "count"), "stacks": (["stack"], "count"),
    }  # fmt: skip


def test_types_as_bpftrace_names_them() -> None:
    assert [str(t) for t in (INT64, UINT64, Type("int", 8), Type("string", size=2), STACK, Type("hist"))] == [
        "int64", "unsigned int64", "int8", "string[2]", "stack", "hist",
    ]  # fmt: skip


ERRORS = [
    ("BEGIN { @x = count(1); }", "stdin:1:14-22: ERROR: count() requires no arguments (1 provided)"),
    ("BEGIN { @x = foo(1); }", "stdin:1:14-17: ERROR: Unknown function: foo"),
    ("BEGIN { @x = sum(); }", "stdin:1:14-19: ERROR: sum() requires one argument (0 provided)"),
    ('BEGIN { @x = hist("a"); }', "stdin:1:14-23: ERROR: hist() only supports integer arguments (string[2] provided)"),
    ('BEGIN { $x = 1; $x = "a"; }', "stdin:1:22-25: ERROR: Type mismatch for $x: trying to assign value of type "
     "'string[2]' when variable already contains a value of type 'int64'"),
    ('BEGIN { @x[1] = 1; @x["a"] = 1; }', "stdin:1:20-27: ERROR: Argument mismatch for @x: trying to access with "
     "arguments: [string[2]] when map expects arguments: [unsigned int64]"),
    ("BEGIN { @x = count(); @x = 1; }", "stdin:1:28-29: ERROR: Type mismatch for @x: trying to assign value of "
     "type 'int64' when map already contains a value of type 'count'"),
    ("BEGIN { printf(\"%d\\n\", $y); }", "stdin:1:24-26: ERROR: Undefined or undeclared variable: $y"),
    ("BEGIN { @x = lhist(1, 0, 10); }", "stdin:1:14-29: ERROR: lhist() requires 4 arguments (3 provided)"),
    ('BEGIN { printf("%d %d\\n", 1); }',
     "stdin:1:9-29: ERROR: printf: Not enough arguments for format string (1 supplied, 2 expected)"),
    ('BEGIN { printf("%d\\n", 1, 2); }',
     "stdin:1:9-29: ERROR: printf: Too many arguments for format string (2 supplied, 1 expected)"),
    ("BEGIN { printf(1); }", "stdin:1:9-18: ERROR: printf() expects a string literal (integer provided)"),
    ('BEGIN { printf("%s\\n", 1); }',
     "stdin:1:24-25: ERROR: printf: %s specifier expects a value of type string (integer supplied)"),
    ("BEGIN { @x = str(1, 2, 3); }", "stdin:1:14-26: ERROR: str() takes up to 2 arguments (3 provided)"),
    ("BEGIN { @x = str(); }", "stdin:1:14-19: ERROR: str() requires at least one argument (0 provided)"),
    ("BEGIN { @x = 1 + count(); }", "stdin:1:18-25: ERROR: count() should be directly assigned to a map"),
    ("BEGIN { $x = count(); }", "stdin:1:14-21: ERROR: count() should be directly assigned to a map"),
    ("BEGIN { delete(@x); }", "stdin:1:16-18: ERROR: Undefined map: @x"),
    ("BEGIN { @x++; @x = count(); }", "stdin:1:20-27: ERROR: Type mismatch for @x: trying to assign value of type "
     "'count' when map already contains a value of type 'int64'"),
    ("BEGIN { exit(1, 2); }", "stdin:1:9-19: ERROR: exit() requires no arguments (2 provided)"),
    ("BEGIN { @ = retval; }", "stdin:1:13-19: ERROR: The retval builtin can only be used with 'uretprobe' probes"),
    ("BEGIN { @x = arg0; }", "stdin:1:14-18: ERROR: The arg0 builtin can only be used with 'uprobe' probes"),
    ("u:libc:f, ur:libc:f { @x = arg0; }",
     "stdin:1:28-32: ERROR: The arg0 builtin can only be used with 'uprobe' probes"),
    ("BEGIN { @x = func; }",
     "stdin:1:14-18: ERROR: The func builtin can only be used with 'uprobe' and 'uretprobe' probes"),
    ('BEGIN { $x = "a" + 1; }', "stdin:1:14-21: ERROR: Type mismatch for '+': comparing 'string[2]' with "
     "'int64'"),
    ('BEGIN { $x = 1 ? "a" : 2; }', "stdin:1:14-25: ERROR: Ternary operator must return the same type: have "
     "'string' and 'integer'"),
    ('BEGIN { if ("a") { } }', "stdin:1:13-16: ERROR: if needs an integer (string[2] provided)"),
    ('BEGIN { $x = !"a"; }', "stdin:1:15-18: ERROR: '!' needs an integer (string[2] provided)"),
    ('BEGIN { $x = (int8)"a"; }', "stdin:1:20-23: ERROR: a cast needs an integer (string[2] provided)"),
    ('BEGIN { $x = "a"; $x++; }', "stdin:1:19-23: ERROR: The ++ operator must be applied to an integer"),
    ('BEGIN { $x += 1; }', "stdin:1:9-11: ERROR: Undefined or undeclared variable: $x"),
    ('BEGIN { @x = "a"; @x += "b"; }', "stdin:1:25-28: ERROR: += needs an integer (string[2] provided)"),
    ("BEGIN { $x = count(); }", "stdin:1:14-21: ERROR: count() should be directly assigned to a map"),
    ("BEGIN { @x = count(); $y = @x + 1; @z = hist(1); $w = @z; }",
     "stdin:1:28-34: ERROR: Type mismatch for '+': comparing 'count' with 'int64'"),
    ("BEGIN { @z = hist(1); $w = @z; }", "stdin:1:28-30: ERROR: @z holds a hist: it can only be printed"),
    ("BEGIN { @x = lhist(1, 0, $y, 1); }", "stdin:1:26-28: ERROR: Undefined or undeclared variable: $y"),
    ("BEGIN { $m = 5; @x = lhist(1, 0, $m, 1); }",
     "stdin:1:34-36: ERROR: lhist() min, max and step must be integer literals"),
    ("BEGIN { @x = lhist(1, -4, 4, 2); }", "stdin:1:14-32: ERROR: lhist() min must be non-negative (provided min -4)"),
    ("BEGIN { @x = lhist(1, 10, 0, 1); }", "stdin:1:14-32: ERROR: lhist() needs min < max and a step above 0"),
    ("BEGIN { @x = 1; print(@x[1]); }", "stdin:1:23-28: ERROR: print() expects a map without keys"),
    ("BEGIN { $n = 1; @x = 1; print(@x, $n); }",
     "stdin:1:35-37: ERROR: print()'s second argument is how many entries: an integer literal"),
    ("BEGIN { delete(1); }", "stdin:1:16-17: ERROR: delete() expects a map"),
    ("BEGIN { @x[1] = 1; delete(@x); }", "stdin:1:27-29: ERROR: Argument mismatch for @x: trying to access with "
     "arguments: [] when map expects arguments: [unsigned int64]"),
    ("BEGIN { time(1); }", "stdin:1:9-16: ERROR: time() expects a string literal (integer provided)"),
    ("BEGIN { $x = printf(\"a\"); }", "stdin:1:14-25: ERROR: printf() should be a statement of its own"),
    ("BEGIN { @x = ustack(0); }",
     "stdin:1:21-22: ERROR: ustack()'s frames are a number: an integer literal from 1 to 127"),
    ('BEGIN { @x[count()] = 1; }', "stdin:1:12-19: ERROR: count() should be directly assigned to a map"),
    ('BEGIN { @x = printf("a"); }', "stdin:1:14-25: ERROR: printf() should be a statement of its own"),
    ("BEGIN { printf(); }", "stdin:1:9-17: ERROR: printf() requires at least one argument (0 provided)"),
    ("BEGIN { $x = @y; }", "stdin:1:14-16: ERROR: Undefined map: @y"),
]  # fmt: skip


@pytest.mark.parametrize(("source", "first"), ERRORS, ids=[s for s, _ in ERRORS])
def test_errors(source: str, first: str) -> None:
    with pytest.raises(ProgramError) as caught:
        checked(source)
    assert str(caught.value) == first


SAME_AS_BPFTRACE = [
    "BEGIN { @x = count(1); }", "BEGIN { @x = foo(1); }", "BEGIN { @x = sum(); }", "BEGIN { @x = lhist(1, 0, 10); }",
    "BEGIN { @x = str(1, 2, 3); }", "BEGIN { @x = 1 + count(); }", "BEGIN { exit(1, 2); }",
    'BEGIN { printf("%d %d\\n", 1); }',
]  # fmt: skip


@pytest.mark.skipif(shutil.which("bpftrace") is None, reason="bpftrace is not installed (make toolchains installs it)")
@pytest.mark.parametrize("source", SAME_AS_BPFTRACE)
def test_errors_are_bpftraces(source: str) -> None:
    ours = next(first for s, first in ERRORS if s == source)
    theirs = subprocess.run(["bpftrace", "-e", source], capture_output=True, text=True, timeout=60).stderr
    assert ours in theirs.splitlines(), theirs
