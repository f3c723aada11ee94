"""bpftrace's language read (lang/parser.py): programs into their trees, errors as bpftrace shows
them (checked against bpftrace itself where it is installed), and any tree written back as text
(syntax.to_source) read back the same."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynprobe.errors import ProgramError
from dynprobe.lang import syntax as S
from dynprobe.lang.parser import BINARY, BUILTINS, INTEGER_TYPES, parse_program

NO = (0, 0)  # (spans are not compared)


def body(source: str) -> tuple[S.Statement, ...]:
    return parse_program(source).probes[0].body


def test_attach_points() -> None:
    program = parse_program(
        "uprobe:/bin/bash:readline, u:libc:str*, ur:libc:malloc, uprobe:libc:main+0x10,\n"
        '  uprobe:/usr/lib/libstdc++.so.6:"std::foo::bar()" { }\nBEGIN { } END { } interval:ms:250 { }'
    )
    assert [str(p) for b in program.probes for p in b.attach_points] == [
        "uprobe:/bin/bash:readline", "uprobe:libc:str*", "uretprobe:libc:malloc", "uprobe:libc:main+16",
        'uprobe:/usr/lib/libstdc++.so.6:"std::foo::bar()"', "BEGIN", "END", "interval:ms:250",
    ]  # fmt: skip


def test_statements_and_precedence() -> None:
    assert body("BEGIN { @[tid] = count(); $x = 1 + 2 * 3 - 4 / 2 % 3; @m[pid, comm] += arg0 << 2 | 1 }") == (
        S.Assign(S.MapRef("", (S.Builtin("tid", span=NO),), span=NO), "=", S.Call("count", span=NO), span=NO),
        S.Assign(S.Var("x", span=NO), "=", S.Binary("-",
            S.Binary("+", S.Int(1, span=NO), S.Binary("*", S.Int(2, span=NO), S.Int(3, span=NO), span=NO), span=NO),
            S.Binary("%", S.Binary("/", S.Int(4, span=NO), S.Int(2, span=NO), span=NO), S.Int(3, span=NO), span=NO),
            span=NO), span=NO),
        S.Assign(S.MapRef("m", (S.Builtin("pid", span=NO), S.Builtin("comm", span=NO)), span=NO), "+=",
                 S.Binary("|", S.Binary("<<", S.Builtin("arg0", span=NO), S.Int(2, span=NO), span=NO),
                          S.Int(1, span=NO), span=NO), span=NO),
    )  # fmt: skip


def test_predicates_casts_steps_and_branches() -> None:
    [probe] = parse_program(
        'ur:libc:malloc /retval != 0 && (4/2 == 2)/ { @n++; --$x; $v = *(uint32 *)arg0; $w = (int8)arg1;\n'
        '  if ($v > 3) { printf("big %d\\n", $v) } else if (!$w) { @s[str(arg0, 8)] = hist($v) } else { exit() } }'
    ).probes  # fmt: skip
    assert probe.predicate == S.Binary(
        "&&", S.Binary("!=", S.Builtin("retval", span=NO), S.Int(0, span=NO), span=NO),
        S.Binary("==", S.Binary("/", S.Int(4, span=NO), S.Int(2, span=NO), span=NO), S.Int(2, span=NO), span=NO),
        span=NO,
    )  # fmt: skip
    step, prefix, deref, cast, branch = probe.body
    assert step == S.ExprStatement(S.Step("++", S.MapRef("n", span=NO), False, span=NO), span=NO)
    assert prefix == S.ExprStatement(S.Step("--", S.Var("x", span=NO), True, span=NO), span=NO)
    assert deref == S.Assign(S.Var("v", span=NO), "=", S.Unary("*", S.Cast("uint32", True, S.Builtin("arg0", span=NO),
                                                                            span=NO), span=NO), span=NO)  # fmt: skip
    assert cast == S.Assign(S.Var("w", span=NO), "=", S.Cast("int8", False, S.Builtin("arg1", span=NO), span=NO),
                            span=NO)  # fmt: skip
    assert isinstance(branch, S.If) and isinstance(branch.otherwise[0], S.If)
    assert branch.then == (S.ExprStatement(S.Call("printf", (S.Str("big %d\n", span=NO), S.Var("v", span=NO)),
                                                  span=NO), span=NO),)  # fmt: skip
    assert branch.otherwise[0].otherwise == (S.ExprStatement(S.Call("exit", span=NO), span=NO),)


def test_literals_and_comments() -> None:
    [a, b, c] = body('BEGIN { // a comment\n $a = 0x1F + 017 + 9; /* and\n another */ $b = "t\\t\\"q\\"\\x41\\\\"; '
                     "$c = 18446744073709551615 }")  # fmt: skip
    assert isinstance(a, S.Assign) and a.value == S.Binary(
        "+", S.Binary("+", S.Int(31, span=NO), S.Int(15, span=NO), span=NO), S.Int(9, span=NO), span=NO
    )  # fmt: skip
    assert isinstance(b, S.Assign) and b.value == S.Str('t\t"q"A\\', span=NO)
    assert isinstance(c, S.Assign) and c.value == S.Int((1 << 64) - 1, span=NO)


# Each bad program and the error's three lines: where and what, the line, the span underlined.
ERRORS = [
    ("uprobe:libc:malloc { @ = count( }", "stdin:1:33-34: ERROR: syntax error, unexpected }", 32, 1),
    ('BEGIN { printf("%d\\n", foo); }', "stdin:1:24-27: ERROR: Unknown identifier: 'foo'", 23, 3),
    ("BEGIN { @x = 1 @y = 2; }", "stdin:1:16-18: ERROR: syntax error, unexpected map, expecting ; or }", 15, 2),
    ("BEGIN { $x = ; }", "stdin:1:14-15: ERROR: syntax error, unexpected ;", 13, 1),
    ("BEGIN { 1 + ; }", "stdin:1:13-14: ERROR: syntax error, unexpected ;", 12, 1),
    ("BEGIN { @x[1 = 2; }", 'stdin:1:14-15: ERROR: syntax error, unexpected =, expecting ] or ","', 13, 1),
    ("BEGIN { if (1) { } else }", "stdin:1:25-26: ERROR: syntax error, unexpected }, expecting { or if", 24, 1),
    ('BEGIN { "abc }', "stdin:1:9-15: ERROR: unterminated string", 8, 6),
    ("BEGIN { (1 + 2; }", "stdin:1:15-16: ERROR: syntax error, unexpected ;, expecting )", 14, 1),  # (no tuples)
    ("BEGIN { @x = 1 ? 2; }", "stdin:1:19-20: ERROR: syntax error, unexpected ;, expecting :", 18, 1),
    ("BEGIN { @x = 08; }", "stdin:1:14-16: ERROR: invalid integer: 08", 13, 2),
    ("BEGIN { 3 = 4; }", "stdin:1:9-10: ERROR: only a variable ($x) or a map (@m) can be assigned to", 8, 1),
    ("BEGIN { 3++; }", "stdin:1:9-10: ERROR: only a variable ($x) or a map (@m) can be stepped (++, --)", 8, 1),
    ("BEGIN { @x = 1;", "stdin:1:16-17: ERROR: syntax error, unexpected end of file, expecting }", 15, 1),
    ("BEGIN { @x = 1 # }", "stdin:1:16-17: ERROR: invalid character '#'", 15, 1),
    ("BEGIN { /* never closed }", "stdin:1:9-26: ERROR: unterminated comment", 8, 17),
    ("kprobe:vfs_read { }", "stdin:1:1-7: ERROR: kprobe probes are the kernel's: dynprobe attaches uprobe, "
     "uretprobe, BEGIN, END and interval probes", 0, 6),
    ("usdt:/bin/x:p:n { }", "stdin:1:1-5: ERROR: usdt probes (a program's static tracepoints) are not attached yet: "
     "dynprobe attaches uprobe, uretprobe, BEGIN, END and interval probes", 0, 4),
    ("u:/bin/x:f { @ = args.size; }", "stdin:1:18-23: ERROR: args.NAME (arguments by their DWARF names) is not "
     "supported yet: use arg0..arg9", 17, 5),
    ("uprobe:libc { }", "stdin:1:1-12: ERROR: invalid probe: uprobe:libc (uprobe:FILE:FUNCTION, uretprobe:..., "
     "BEGIN, END, interval:s:N)", 0, 11),
    ("uprobe::malloc { }", "stdin:1:1-15: ERROR: a uprobe needs a file or a library: uprobe:FILE:FUNCTION", 0, 14),
    ("ur:libc:malloc+4 { }", "stdin:1:1-17: ERROR: a uretprobe is at a function's return: no offset", 0, 16),
    ("interval:s:0 { }", "stdin:1:1-13: ERROR: an interval of 0", 0, 12),
    ("BEGIN { }\n  END { @x = 1 }}", "stdin:2:17-18: ERROR: invalid probe: } (uprobe:FILE:FUNCTION, uretprobe:..., "
     "BEGIN, END, interval:s:N)", 16, 1),
    ("", "stdin:1:1-2: ERROR: no probes in the program", 0, 1),
]  # fmt: skip


@pytest.mark.parametrize(("source", "first", "column", "width"), ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_point_where_bpftrace_would(source: str, first: str, column: int, width: int) -> None:
    with pytest.raises(ProgramError) as caught:
        parse_program(source)
    line_number = int(first.split(":")[1])
    line = source.split("\n")[line_number - 1]
    assert caught.value.render() == f"{first}\n{line}\n{' ' * column}{'~' * width}"
    assert str(caught.value) == first


# The programs whose error bpftrace words as dynprobe does (the others: where bison's grammar says
# something only it could, or a check dynprobe makes that bpftrace does not)
SAME_AS_BPFTRACE = ["uprobe:libc:malloc { @ = count( }", 'BEGIN { printf("%d\\n", foo); }', "BEGIN { $x = ; }",
                    "BEGIN { 1 + ; }", "BEGIN { @x[1 = 2; }", "BEGIN { if (1) { } else }",
                    'BEGIN { "abc }']  # fmt: skip


@pytest.mark.skipif(shutil.which("bpftrace") is None, reason="bpftrace is not installed (make bench installs it)")
@pytest.mark.parametrize("source", SAME_AS_BPFTRACE)
def test_errors_are_bpftraces(source: str) -> None:
    """bpftrace is the oracle: its first error line, for the same program, is ours."""
    ours = next(first for s, first, _, _ in ERRORS if s == source)
    theirs = subprocess.run(["bpftrace", "-e", source], capture_output=True, text=True, timeout=60).stderr
    assert ours in theirs.splitlines(), theirs


# --- any tree, to text and back ----------------------------------------------------------------------
def names() -> st.SearchStrategy[str]:
    return st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True).filter(lambda n: n not in ("if", "else"))


def expressions() -> st.SearchStrategy[S.Expr]:
    leaves = st.one_of(
        st.integers(0, (1 << 64) - 1).map(lambda v: S.Int(v, span=NO)),
        st.text(st.characters(min_codepoint=1, max_codepoint=127), max_size=8).map(lambda v: S.Str(v, span=NO)),
        st.sampled_from(sorted(BUILTINS)).map(lambda n: S.Builtin(n, span=NO)),
        names().map(lambda n: S.Var(n, span=NO)),
        names().map(lambda n: S.MapRef(n, span=NO)),
    )

    def compound(inner: st.SearchStrategy[S.Expr]) -> st.SearchStrategy[S.Expr]:
        targets = st.one_of(names().map(lambda n: S.Var(n, span=NO)),
                            st.builds(lambda n, k: S.MapRef(n, tuple(k), span=NO), names(),
                                      st.lists(inner, max_size=2)))  # fmt: skip
        return st.one_of(
            st.builds(lambda n, k: S.MapRef(n, tuple(k), span=NO), names(), st.lists(inner, min_size=1, max_size=3)),
            st.builds(lambda n, a: S.Call(n, tuple(a), span=NO), names(), st.lists(inner, max_size=3)),
            st.builds(lambda o, e: S.Unary(o, e, span=NO), st.sampled_from("!-~*"), inner),
            st.builds(lambda o, a, b: S.Binary(o, a, b, span=NO), st.sampled_from(sorted(BINARY)), inner, inner),
            st.builds(lambda c, a, b: S.Ternary(c, a, b, span=NO), inner, inner, inner),
            st.builds(lambda t, p, e: S.Cast(t, p, e, span=NO), st.sampled_from(sorted(INTEGER_TYPES)), st.booleans(),
                      inner),
            st.builds(lambda o, t, p: S.Step(o, t, p, span=NO), st.sampled_from(["++", "--"]), targets, st.booleans()),
        )  # fmt: skip

    return st.recursive(leaves, compound, max_leaves=12)


def statements() -> st.SearchStrategy[S.Statement]:
    simple = st.one_of(
        expressions().map(lambda e: S.ExprStatement(e, span=NO)),
        st.builds(lambda t, o, v: S.Assign(t, o, v, span=NO),
                  st.one_of(names().map(lambda n: S.Var(n, span=NO)), names().map(lambda n: S.MapRef(n, span=NO))),
                  st.sampled_from(["=", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", "<<=", ">>="]), expressions()),
    )  # fmt: skip
    return st.recursive(simple, lambda inner: st.builds(
        lambda c, t, o: S.If(c, tuple(t), tuple(o), span=NO), expressions(), st.lists(inner, max_size=2),
        st.lists(inner, max_size=2)), max_leaves=4)  # fmt: skip


attach_points = st.one_of(
    st.sampled_from(["BEGIN", "END"]).map(lambda k: S.AttachPoint(k, span=NO)),
    st.builds(lambda u, n: S.AttachPoint("interval", u, "", n, span=NO), st.sampled_from(["s", "ms"]),
              st.integers(1, 10**6)),
    st.builds(lambda k, t, f, o: S.AttachPoint(k, t, f, 0 if k == "uretprobe" else o, span=NO),
              st.sampled_from(["uprobe", "uretprobe"]), st.sampled_from(["libc", "/bin/bash", "./a.out"]),
              st.sampled_from(["malloc", "str*", "std::vector<int>::push_back", "a.b"]), st.integers(0, 4096)),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(st.builds(lambda p, c, b: S.ProbeBlock(tuple(p), c, tuple(b), span=NO),
                          st.lists(attach_points, min_size=1, max_size=3), st.none() | expressions(),
                          st.lists(statements(), max_size=4)), min_size=1, max_size=3))  # fmt: skip
def test_any_tree_written_back_reads_the_same(probes: list[S.ProbeBlock]) -> None:
    program = S.Program(tuple(probes), span=NO)
    assert parse_program(S.to_source(program)) == program
