"""The mutator of `make mutate` (tests/mutation.py): which mutants a piece of code gets, what it
leaves alone, and that every edit is undone."""

from __future__ import annotations

import ast
import textwrap

from tests import mutation
from tests.mutation import _edits

SOURCE = textwrap.dedent(
    """
    __all__ = ["f"]
    LIMIT = 4

    def f(a: int = 8, b: bool = True) -> int:
        _debug(f"a is {a + 1}")
        if a < LIMIT and not b:
            g()
            raise ValueError("no")
        a += 2
        self.x = a
        return -a << 1
    """
)


def test_the_mutants_of_a_function() -> None:
    changes = sorted(change for _, change, _ in _edits(ast.parse(SOURCE)))
    assert changes == sorted([
        "4 -> 5", "4 -> 3",  # LIMIT
        "8 -> 9", "8 -> 7", "True -> False",  # defaults
        "< -> <=", "and -> or", "drop not",
        "delete `g()`", "delete `raise ValueError('no')`",
        "+ -> -", "2 -> 3", "2 -> 1", "delete `a += 2`",
        "delete `self.x = a`",
        "drop -", "<< -> >>", "1 -> 2", "1 -> 0",
    ])  # fmt: skip


def test_every_edit_is_undone() -> None:
    tree = ast.parse(SOURCE)
    before = ast.unparse(tree)
    for _, _, edit in list(_edits(tree)):
        edit.swap()
        assert ast.unparse(tree) != before
        edit.swap()
        assert ast.unparse(tree) == before


def test_every_equivalent_mutant_names_a_line_that_is_there() -> None:
    """The table of equivalent mutants names lines as written: one that no module of its entries
    has any more (code moved or reworded) would hide a survivor of the new line's mutants."""
    modules: dict[tuple[str, str], list[str]] = {}
    for module, line, change in mutation.EQUIVALENT:
        modules.setdefault((line, change), []).append(module)
    for (line, _), where in modules.items():
        assert any(line in {x.strip() for x in (mutation.PACKAGE / m).read_text().splitlines()} for m in where), line
