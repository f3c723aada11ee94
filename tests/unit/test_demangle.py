"""C++ names as shown and as accepted: the C++ runtime demangles, we simplify (uftrace's form)."""

from __future__ import annotations

import pytest

from dynprobe.symbols import demangle
from dynprobe.symbols.demangle import Demangle, display, names_of, simplify
from dynprobe.symbols.elf import load_elf

# mangled -> (simple, full as c++filt prints it)
TABLE = {
    "_ZN3app7Counter3addEl": ("app::Counter::add", "app::Counter::add(long)"),
    "_ZNK3app7CounterclEl": ("app::Counter::operator()", "app::Counter::operator()(long) const"),
    "_ZN3app7CounterD2Ev": ("app::Counter::~Counter", "app::Counter::~Counter()"),
    "_ZN3app7largestIlEET_S1_S1_": ("app::largest", "long app::largest<long>(long, long)"),
    "_ZNSt6vectorIiSaIiEE9push_backEOi": (
        "std::vector::push_back", "std::vector<int, std::allocator<int> >::push_back(int&&)"),
    "_ZlsRSoRK3Foo": ("operator<<", "operator<<(std::ostream&, Foo const&)"),
    "_ZNK3FoossERKS_": ("Foo::operator<=>", "Foo::operator<=>(Foo const&) const"),
    "_ZN3FooptEv": ("Foo::operator->", "Foo::operator->()"),
    "_ZNK3FoocviEv": ("Foo::operator int", "Foo::operator int() const"),
    "_Znwm": ("operator new", "operator new(unsigned long)"),
    "_ZN12_GLOBAL__N_14helpEv": ("(anonymous namespace)::help", "(anonymous namespace)::help()"),
    "_ZZ4mainENKUliE_clEi": ("main::{lambda#1}::operator()", "main::{lambda(int)#1}::operator()(int) const"),
    "_ZThn8_N3Bar1fEv": ("non-virtual thunk to Bar::f", "non-virtual thunk to Bar::f()"),
    "_ZStlsIfcSt11char_traitsIcEERSt13basic_ostreamIT0_T1_ES6_RKSt7complexIT_E": (
        "std::operator<<", "std::basic_ostream<char, std::char_traits<char> >& std::operator<< <float, char, "
        "std::char_traits<char> >(std::basic_ostream<char, std::char_traits<char> >&, std::complex<float> const&)"),
    "_ZNKSt15__exception_ptr13exception_ptrcvMS0_FvvEEv": (
        "std::__exception_ptr::exception_ptr::operator void",
        "std::__exception_ptr::exception_ptr::operator void (std::__exception_ptr::exception_ptr::*)()() const"),
}  # fmt: skip


def test_every_name_of_libstdcxx_simplifies() -> None:
    """Each C++ function of the C++ runtime has a simple name: no parameters, no template
    arguments, nothing left at either end."""
    assert display("_ZN3app7Counter3addEl") == "app::Counter::add"  # the runtime is loaded now
    image = load_elf(_libstdcxx())
    names = [display(f.name) for f in image.functions if f.name.startswith("_Z")]
    assert len(names) > 1000
    for name in names:
        assert name.strip() == name and not name.startswith("_Z"), name
        assert "(" not in name.replace("(anonymous namespace)", "").replace("operator()", ""), name


def _libstdcxx() -> str:
    """The C++ runtime's file, as the process maps it (Python loaded it for the demangler)."""
    with open("/proc/self/maps") as f:
        return next(line.split()[-1] for line in f if "libstdc++" in line)


@pytest.mark.parametrize(("mangled", "names"), TABLE.items(), ids=list(TABLE))
def test_names_shown(mangled: str, names: tuple[str, str]) -> None:
    simple, full = names
    assert display(mangled, Demangle.FULL) == full
    assert display(mangled) == simple == simplify(full)
    assert display(mangled, Demangle.NO) == mangled


def test_names_accepted() -> None:
    """A symbol answers to its simple and full names, and a template function's full name
    without its return type; a thunk does not take its target's signature."""
    assert names_of("_ZN3app7largestIlEET_S1_S1_") == (
        "_ZN3app7largestIlEET_S1_S1_", "app::largest", "long app::largest<long>(long, long)",
        "app::largest<long>(long, long)",
    )  # fmt: skip
    assert names_of("_ZThn8_N3Bar1fEv")[1:] == ("non-virtual thunk to Bar::f", "non-virtual thunk to Bar::f()")
    assert names_of("main") == ("main",) and names_of("_Znot_mangled") == ("_Znot_mangled",)


def test_an_old_version_keeps_its_version_after_the_name() -> None:
    old = "_ZNSt11char_traitsIcE2eqERKcS2_@GLIBCXX_3.4"  # symbols/elf.py names old versions so
    assert display(old) == "std::char_traits::eq@GLIBCXX_3.4"
    assert names_of(old)[:2] == (old, "std::char_traits::eq@GLIBCXX_3.4")


def test_without_a_cxx_runtime_names_stay_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name that is not C++'s is itself; with no C++ runtime library to demangle with (none
    found, or one that does not load), a mangled name is shown as it is, never an error."""
    assert demangle.demangle_full("main") == "main"
    for runtimes in ((), ("/no/such/libstdc++.so.6",)):
        monkeypatch.setattr(demangle, "CXX_RUNTIMES", runtimes)
        demangle._runtime.cache_clear()
        demangle.demangle_full.cache_clear()
        assert demangle.demangle_full("_ZN3app7Counter3addEi") == "_ZN3app7Counter3addEi"
    monkeypatch.undo()
    demangle._runtime.cache_clear()
    demangle.demangle_full.cache_clear()
    assert demangle.demangle_full("_ZN3app7Counter3addEi") == "app::Counter::add(int)"
