"""C++ (Itanium ABI) names as people write them.

Symbols are kept mangled everywhere (they are what ELF files hold); names are demangled where a
person reads or writes them: call graphs and reports (uftrace's "simple" form by default:
`app::Counter::add` for `_ZN3app7Counter3addERKNSt7__cxx1112basic_stringIc...`), probe
locations and tracer filters. The demangler is the C++ runtime's own `__cxa_demangle`
(libstdc++, through ctypes): nothing here parses a mangled name. Without a C++ runtime, names
stay mangled.
"""

from __future__ import annotations

import ctypes
import enum
import functools
from collections.abc import Callable, Iterator
from typing import Any


class Demangle(enum.Enum):
    """How names are shown (uftrace's --demangle)."""

    SIMPLE = "simple"  # qualified name only: no template arguments, parameters or return type
    FULL = "full"  # what c++filt prints
    NO = "no"  # the symbol as it is


CXX_RUNTIMES = ("libstdc++.so.6", "libc++.so.1")  # by soname (find_library would run `ldconfig -p`)


@functools.cache
def _runtime() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    for soname in CXX_RUNTIMES:
        try:
            lib = ctypes.CDLL(soname)
            libc = ctypes.CDLL("libc.so.6")
        except OSError:
            continue
        cxa = lib.__cxa_demangle
        cxa.restype = ctypes.c_void_p
        cxa.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        free = libc.free
        free.argtypes = [ctypes.c_void_p]
        return cxa, free
    return None


@functools.lru_cache(maxsize=1 << 16)
def demangle_full(name: str) -> str:
    """`name` demangled (as c++filt prints it), or as it is when it is not a C++ name."""
    if not name.startswith("_Z"):
        return name
    runtime = _runtime()
    if runtime is None:
        return name
    cxa, free = runtime
    status = ctypes.c_int()
    result = cxa(name.encode(), None, None, ctypes.byref(status))
    if not result or status.value != 0:
        return name
    try:
        return ctypes.string_at(result).decode("utf-8", "replace")
    finally:
        free(result)


_OPERATOR = "operator"
_OPERATOR_SYMBOLS = ("()", "[]", "<<=", ">>=", "<=>", "->*", "<<", ">>", "<=", ">=", "->", "<", ">")
_ANONYMOUS = "(anonymous namespace)"
_ANONYMOUS_MARK = "\0"
_QUALIFIERS = (" const", " volatile", " &&", " &", " noexcept")
_THUNKS = ("non-virtual thunk to ", "virtual thunk to ", "covariant return thunk to ", "transaction clone for ")


def _pieces(full: str) -> Iterator[tuple[int, str, int]]:
    """(index, piece, depth of <...> and (...) before it) for each character of `full`; an
    operator's name ('operator<<', 'operator new') and '(anonymous namespace)' are one piece
    (their brackets and spaces are not the name's structure)."""
    depth, i = 0, 0
    while i < len(full):
        word_start = i == 0 or not (full[i - 1].isalnum() or full[i - 1] == "_")
        if depth == 0 and word_start and full.startswith(_OPERATOR, i):
            rest = full[i + len(_OPERATOR) :]
            if rest.startswith(" ") and "(" in rest:  # operator new, operator unsigned int
                symbol = rest[: rest.index("(")]
            else:
                symbol = next((s for s in _OPERATOR_SYMBOLS if rest.startswith(s)), "")
            yield i, _OPERATOR + symbol.rstrip(), 0
            i += len(_OPERATOR) + len(symbol)
            if full.startswith(" <", i):  # 'operator<< <char>(...)': the space is not a return type's
                i += 1
            continue
        if depth == 0 and full.startswith(_ANONYMOUS, i):
            yield i, _ANONYMOUS_MARK, 0  # its space is not a return type's
            i += len(_ANONYMOUS)
            continue
        c = full[i]
        yield i, c, depth
        if c in "<(":
            depth += 1
        elif c in ">)":
            depth = max(depth - 1, 0)
        i += 1


def _without_arguments(full: str) -> str:
    """`full` without what is inside <...> and (...)."""
    return "".join(piece for _, piece, depth in _pieces(full) if depth == 0 and piece not in ("<", "("))


def _without_return_type(full: str) -> str:
    """'long ns::f<long>(long, long)' -> 'ns::f<long>(long, long)'."""
    start, braces = 0, 0
    for i, piece, depth in _pieces(full):
        if depth == 0:
            braces += (piece == "{") - (piece == "}")
            if piece == "(" and braces == 0:
                break
            if piece == " " and braces == 0:
                start = i + 1
    return full[start:]


def simplify(full: str) -> str:
    """A demangled name without template arguments, parameter lists, the qualifiers after them
    and a return type: 'int ns::f<int>(int) const' -> 'ns::f', as uftrace shows names.
    Operators keep their symbol ('ns::T::operator<<', 'operator()', 'operator new');
    '(anonymous namespace)' and lambdas ('{lambda#1}') keep their place."""
    thunk = next((t for t in _THUNKS if full.startswith(t)), "")
    text = _without_arguments(_without_return_type(full[len(thunk) :]))
    while any(text.endswith(q) for q in _QUALIFIERS):
        text = text[: text.rfind(" ")]
    return (thunk + text).replace(_ANONYMOUS_MARK, _ANONYMOUS) if text else full


def names_of(name: str) -> tuple[str, ...]:
    """The names a symbol answers to: as it is and, for a C++ name, simple, full and full without
    its return type (a template function's); an old version's names keep it ('...@GLIBCXX_3.4')."""
    if not name.startswith("_Z"):
        return (name,)
    mangled, version = _version_apart(name)
    full = demangle_full(mangled)
    if full == mangled:
        return (name,)
    signature = full if full.startswith(_THUNKS) else _without_return_type(full)
    names = (simplify(full), full) + ((signature,) if signature != full else ())
    return (name, *(n + version for n in names))


def display(name: str, how: Demangle = Demangle.SIMPLE) -> str:
    """`name` as `how` shows it."""
    if how is Demangle.NO or not name.startswith("_Z"):
        return name
    mangled, version = _version_apart(name)
    full = demangle_full(mangled)
    if full == mangled:
        return name
    return (full if how is Demangle.FULL else simplify(full)) + version


def _version_apart(name: str) -> tuple[str, str]:
    """'_ZN...@GLIBCXX_3.4' -> ('_ZN...', '@GLIBCXX_3.4'): a symbol's old version (symbols/elf.py)
    is no part of its mangled name."""
    mangled, at, version = name.partition("@")
    return mangled, at + version
