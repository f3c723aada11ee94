"""bpftrace's printing of maps (lang/output.py), byte for byte: the maps a BEGIN program makes,
printed by bpftrace at its exit and by dynprobe from the same values (bpftrace is the oracle
where it is installed; the expected text is written here too)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from dynprobe.lang.output import Entry, format_map, hist_bucket


def hist_of(*values: int) -> dict[int, int]:
    buckets: dict[int, int] = {}
    for value in values:
        buckets[hist_bucket(value)] = buckets.get(hist_bucket(value), 0) + 1
    return buckets


def lhist_of(low: int, high: int, step: int, *values: int) -> dict[int, int]:
    buckets: dict[int, int] = {}
    for value in values:
        bucket = -1 if value < low else min(value, high) // step - low // step
        buckets[bucket] = buckets.get(bucket, 0) + 1
    return buckets


# (the BEGIN program's statements, then each map: name, kind, entries, lhist bounds)
CASES: list[tuple[str, list[tuple[str, str, list[Entry], tuple[int, int, int]]]]] = [
    ("@c[1] = count(); @c[2] = count(); @c[2] = count(); @i = 42; @neg = -7;", [
        ("c", "count", [((1,), 1), ((2,), 2)], (0, 0, 1)), ("i", "int", [((), 42)], (0, 0, 1)),
        ("neg", "int", [((), -7)], (0, 0, 1)),
    ]),
    ('@s["ab", 3] = sum(10); @s["x", 1] = sum(-5); @mn = min(7); @mn = min(3); @mx = max(7); @mx = max(9);', [
        ("mn", "min", [((), 3)], (0, 0, 1)), ("mx", "max", [((), 9)], (0, 0, 1)),
        ("s", "sum", [(("ab", 3), 10), (("x", 1), -5)], (0, 0, 1)),
    ]),
    ("@a = avg(4); @a = avg(9); @st = stats(4); @st = stats(8); @an = avg(-3); @an = avg(-4);", [
        ("a", "avg", [((), (2, 13))], (0, 0, 1)), ("an", "avg", [((), (2, -7))], (0, 0, 1)),
        ("st", "stats", [((), (2, 12))], (0, 0, 1)),
    ]),
    ("@h = hist(5); @h = hist(100); @h = hist(0); @h = hist(-3); @k = hist(3000); @k = hist(3000); @k = hist(70000);"
     " @k = hist(1);", [
        ("h", "hist", [((), hist_of(5, 100, 0, -3))], (0, 0, 1)),
        ("k", "hist", [((), hist_of(3000, 3000, 70000, 1))], (0, 0, 1)),
    ]),
    ("@l = lhist(15, 0, 100, 10); @l = lhist(200, 0, 100, 10); @l = lhist(-1, 0, 100, 10); "
     "@m = lhist(5, 0, 10, 5);", [
        ("l", "lhist", [((), lhist_of(0, 100, 10, 15, 200, -1))], (0, 100, 10)),
        ("m", "lhist", [((), lhist_of(0, 10, 5, 5))], (0, 10, 5)),
    ]),
    ('@hk[2] = hist(1); @hk[1] = hist(8); @hk[1] = hist(8); @str[3] = "b"; @str[1] = "a"; @str[2] = "c";', [
        ("hk", "hist", [((2,), hist_of(1)), ((1,), hist_of(8, 8))], (0, 0, 1)),
        ("str", "string", [((3,), "b"), ((1,), "a"), ((2,), "c")], (0, 0, 1)),
    ]),
]  # fmt: skip

EXPECTED = [
    "@c[1]: 1\n@c[2]: 2\n@i: 42\n@neg: -7\n",
    "@mn: 3\n@mx: 9\n@s[x, 1]: -5\n@s[ab, 3]: 10\n",
    "@a: 6\n\n@an: -3\n\n@st: count 2, average 6, total 12\n\n",
]


def printed(maps: list[tuple[str, str, list[Entry], tuple[int, int, int]]]) -> str:
    return "".join(format_map(name, kind, entries, lhist=bounds) for name, kind, entries, bounds in maps)


@pytest.mark.parametrize(("index", "expected"), list(enumerate(EXPECTED)))
def test_maps_as_bpftrace_prints_them(index: int, expected: str) -> None:
    assert printed(CASES[index][1]) == expected


def test_a_histogram_as_bpftrace_draws_it() -> None:
    assert printed(CASES[3][1][:1]) == (
        "@h: \n"
        "(..., 0)               1 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@|\n"
        "[0]                    1 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@|\n"
        "[1]                    0 |                                                    |\n"
        "[2, 4)                 0 |                                                    |\n"
        "[4, 8)                 1 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@|\n"
        "[8, 16)                0 |                                                    |\n"
        "[16, 32)               0 |                                                    |\n"
        "[32, 64)               0 |                                                    |\n"
        "[64, 128)              1 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@|\n\n"
    )
    assert "[512, 1K)" in printed(CASES[3][1][1:])
    # 5e9 is in [4G, 8G): bpftrace 0.17 draws it in [2G, 4G) (its log2 of values past 2^32)
    assert "[4G, 8G)" in format_map("g", "hist", [((), hist_of(5_000_000_000))])


def test_print_n_keeps_the_last_n() -> None:
    entries: list[Entry] = [((1,), 1), ((2,), 5), ((3,), 3)]
    assert format_map("c", "count", entries, top=2) == "@c[3]: 3\n@c[2]: 5\n"


@pytest.mark.skipif(shutil.which("bpftrace") is None, reason="bpftrace is not installed (make toolchains installs it)")
@pytest.mark.parametrize(("statements", "maps"), CASES, ids=[c[0][:40] for c in CASES])
def test_the_same_as_bpftrace(statements: str, maps: list[tuple[str, str, list[Entry], tuple[int, int, int]]]) -> None:
    run = subprocess.run(["bpftrace", "-e", f"BEGIN {{ {statements} exit(); }}"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    if run.returncode != 0:
        pytest.skip(f"bpftrace cannot run a BEGIN probe here: {run.stderr.strip().splitlines()[-1:]}")
    assert run.stdout == "Attaching 1 probe...\n\n\n" + printed(maps)


def test_zeroed_maps_as_bpftrace_prints_them() -> None:
    """After zero(): histograms with no count print their heading alone, averages and stats of
    no value 0 (bpftrace 0.17's output of `zero()` on each, checked by hand)."""
    maps = [("a", "avg", [((), (0, 0))], (0, 0, 1)), ("h", "hist", [((), {3: 0})], (0, 0, 1)),
            ("l", "lhist", [((), {1: 0})], (0, 10, 2)), ("s", "stats", [((), (0, 0))], (0, 0, 1))]  # fmt: skip
    assert printed(maps) == "@a: 0\n\n@h: \n\n@l: \n\n@s: count 0, average 0, total 0\n\n"
