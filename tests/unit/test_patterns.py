"""Function name patterns (uftrace's: regular expressions by default, globs on request, an
optional @MODULE) and the call filters built on them, on hand-made event streams."""

from __future__ import annotations

import numpy as np
import pytest

from dynprobe.errors import SymbolError
from dynprobe.output.callfilter import CallFilter, _callers, _filtered
from dynprobe.symbols.patterns import MatchKind, NamePattern, as_patterns
from dynprobe.tracefile import Chunk

LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"


@pytest.mark.parametrize(
    ("text", "kind", "name", "path", "matches"),
    [
        ("b", MatchKind.REGEX, "b", "/bin/app", True),
        ("b", MatchKind.REGEX, "ab", "/bin/app", False),  # no special character: that function only
        ("^pa.*e$", MatchKind.REGEX, "parse", "/bin/app", True),
        ("ars", MatchKind.REGEX, "parse", "/bin/app", False),
        ("ar.", MatchKind.REGEX, "parse", "/bin/app", True),  # a regular expression is found anywhere
        ("alloc.*@libc", MatchKind.REGEX, "alloc_perturb", LIBC, True),
        ("alloc.*@libc", MatchKind.REGEX, "alloc_buffer", "/bin/app", False),
        ("main@app", MatchKind.REGEX, "main", "/bin/app", True),
        ("main@app", MatchKind.REGEX, "main", "/bin/application", False),
        ("cfree@GLIBC_2.2.5", MatchKind.REGEX, "cfree@GLIBC_2.2.5", LIBC, True),  # a version, not a module
        ("parse_*", MatchKind.GLOB, "parse_line", "/bin/app", True),
        ("parse_*", MatchKind.GLOB, "do_parse_line", "/bin/app", False),  # a glob is the whole name
        ("str*@libc", MatchKind.GLOB, "strlen", LIBC, True),
        ("malloc@plt", MatchKind.REGEX, "malloc", "/bin/app", False),  # the function, not a call of it
    ],
)
def test_name_patterns(text: str, kind: MatchKind, name: str, path: str, matches: bool) -> None:
    assert NamePattern(text, kind).matches({name}, path) is matches


def test_at_plt_names_the_calls_a_file_makes() -> None:
    assert NamePattern("malloc@plt").matches({"malloc"}, "/bin/app", plt=True)
    assert NamePattern(".*@plt").matches({"printf"}, "/bin/app", plt=True)
    assert NamePattern("malloc@app").matches({"malloc"}, "/bin/app", plt=True)  # (a stub of app's)
    assert not NamePattern("malloc@libc").matches({"malloc"}, "/bin/app", plt=True)


def test_a_bad_regular_expression_is_one_clear_error() -> None:
    with pytest.raises(SymbolError, match=r"'a\(' is not a regular expression .*--match glob takes globs"):
        NamePattern("a(")


def test_the_python_api_s_strings_are_globs() -> None:
    (pattern,) = as_patterns(["parse_*"])
    assert pattern.kind is MatchKind.GLOB and pattern.matches({"parse_x"}, "/bin/app")


FUNCTIONS = [["main", "app", 0, 1], ["a", "app", 0, 1], ["b", "app", 0, 1], ["c", "app", 0, 1]]
MAIN, A, B, C = range(4)


def run(events: list[tuple[int, int, int]], calls: CallFilter) -> list[tuple[int, int]]:
    """(kind, function) of the events kept, from (kind, function, frame) events of one thread."""
    kind, func, frame = (np.array(column) for column in zip(*events, strict=True))
    chunk = Chunk(1, 1, kind.astype(np.uint16), frame.astype(np.uint16), func.astype(np.uint32),
                  np.arange(len(events), dtype=np.int64))  # fmt: skip
    kept = list(_filtered(iter([chunk]), calls.masks(FUNCTIONS)))
    return [(k, f) for c in kept for k, f in zip(c.kind.tolist(), c.func.tolist(), strict=True)]


# main { a { b { c } } b }: a call is (entry, exit) in its frame
NESTED = [(0, MAIN, 1), (0, A, 2), (0, B, 3), (0, C, 4), (1, C, 4), (1, B, 3), (1, A, 2), (0, B, 2), (1, B, 2),
          (1, MAIN, 1)]  # fmt: skip


@pytest.mark.parametrize(
    ("calls", "kept"),
    [
        (CallFilter(as_patterns(["b"])), [(0, B), (0, C), (1, C), (1, B), (0, B), (1, B)]),
        (CallFilter((), as_patterns(["a"])), [(0, MAIN), (0, B), (1, B), (1, MAIN)]),
        (CallFilter((), (), 2), [(0, MAIN), (0, A), (1, A), (0, B), (1, B), (1, MAIN)]),
        (CallFilter(as_patterns(["a"]), (), 1), [(0, A), (1, A)]),
        (CallFilter(as_patterns(["main"]), as_patterns(["b"])), [(0, MAIN), (0, A), (1, A), (1, MAIN)]),
    ],
)
def test_filters_keep_and_drop_whole_subtrees(calls: CallFilter, kept: list[tuple[int, int]]) -> None:
    assert run(NESTED, calls) == kept


def test_a_frame_entered_again_ends_what_a_longjmp_left() -> None:
    """b calls c, which longjmps back into main: c and b never return; main then calls a in
    b's frame. Under -F b, a is not b's callee."""
    events = [(0, MAIN, 1), (0, B, 2), (0, C, 3), (0, A, 2), (1, A, 2), (1, MAIN, 1)]
    assert run(events, CallFilter(as_patterns(["b"]))) == [(0, B), (0, C)]
    assert run(events, CallFilter((), as_patterns(["b"]))) == [(0, MAIN), (0, A), (1, A), (1, MAIN)]


@pytest.mark.parametrize(
    ("name", "kept"),
    [
        ("c", [(0, MAIN), (0, A), (0, B), (0, C), (1, C), (1, B), (1, A), (1, MAIN)]),
        ("b", [(0, MAIN), (0, A), (0, B), (1, B), (1, A), (0, B), (1, B), (1, MAIN)]),  # c: b's, hidden
        ("nothing", []),
    ],
)
def test_callers_keep_a_function_s_calls_and_the_way_to_them(name: str, kept: list[tuple[int, int]]) -> None:
    kind, func, frame = (np.array(column) for column in zip(*NESTED, strict=True))
    chunk = Chunk(1, 1, kind.astype(np.uint16), frame.astype(np.uint16), func.astype(np.uint32),
                  np.arange(len(NESTED), dtype=np.int64))  # fmt: skip
    masks = CallFilter(callers=as_patterns([name])).masks(FUNCTIONS)
    assert masks.callers is not None
    out = list(_callers(iter([chunk]), masks.callers))
    assert [(k, f) for c in out for k, f in zip(c.kind.tolist(), c.func.tolist(), strict=True)] == kept
