"""Function name patterns as uftrace takes them: a regular expression (the default, found
anywhere in the name) or a glob (the whole name), either with an optional `@MODULE`
qualifier (`alloc@libc`: libc's functions only; `main@app`; `malloc@plt`: the program's calls to
malloc, its PLT stub). A pattern with no special
character names one function exactly, as in uftrace: `-F b` is b, not every name with a b."""

from __future__ import annotations

import enum
import fnmatch
import os
import re
from collections.abc import Iterable
from dataclasses import field

from dynprobe.errors import SymbolError
from dynprobe.frozen import frozen

_REGEX_SPECIAL = frozenset(".^$*+?()[]{}|\\")
_GLOB_SPECIAL = frozenset("*?[")
_VERSION = re.compile(r"[A-Z][A-Z0-9_]*_[0-9][0-9.]*")
PLT = "plt"  # FUNC@plt: the calls a file makes to that library function


class MatchKind(enum.Enum):
    REGEX = "regex"
    GLOB = "glob"


@frozen
class NamePattern:
    """A function-name pattern ([MODULE:]NAME): a regex, a glob or a name as is."""

    text: str
    kind: MatchKind = MatchKind.REGEX
    name: str = field(init=False)
    module: str | None = field(init=False)
    _compiled: re.Pattern[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        name, at, module = self.text.rpartition("@")
        if not at or not name or not module or "/" in module or _VERSION.fullmatch(module):
            name, module = self.text, ""  # a symbol version (memcpy@GLIBC_2.2.5) is part of the name
        special = _REGEX_SPECIAL if self.kind is MatchKind.REGEX else _GLOB_SPECIAL
        compiled = None
        if any(c in special for c in name):
            try:
                compiled = re.compile(name if self.kind is MatchKind.REGEX else fnmatch.translate(name))
            except re.error as exc:
                what = f"{self.text!r} is not a regular expression ({exc})"
                raise SymbolError(f"{what}; --match glob takes globs") from None
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "module", module or None)
        object.__setattr__(self, "_compiled", compiled)

    def in_module(self, path: str, *, plt: bool = False) -> bool:
        """Whether a function of the file at `path` (or of that base name) can match:
        `@libc` is libc.so.6, `@app` the program app, `@plt` the PLT stubs (`plt`: the
        function is one, a call the file makes to a library)."""
        if self.module is None:
            return True
        if self.module == PLT:
            return plt
        base = os.path.basename(path)
        return base == self.module or base.startswith(self.module + ".")

    def matches(self, names: Iterable[str], path: str, *, plt: bool = False) -> bool:
        """Whether a function of the file at `path`, known by `names`, is one the pattern names."""
        if not self.in_module(path, plt=plt):
            return False
        compiled = self._compiled
        if compiled is None:
            return self.name in names
        if self.kind is MatchKind.GLOB:
            return any(compiled.match(n) for n in names)
        return any(compiled.search(n) for n in names)


def as_patterns(given: Iterable[str | NamePattern]) -> tuple[NamePattern, ...]:
    """Patterns as the Python API takes them: a string is a glob (ftrace's set_ftrace_filter)."""
    return tuple(p if isinstance(p, NamePattern) else NamePattern(p, MatchKind.GLOB) for p in given)
