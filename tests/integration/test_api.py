"""The Python API's views of what a probe saw: typed arguments, registers and return values in
handlers, and histograms with their bucket ranges, on real processes."""

from __future__ import annotations

import subprocess

import dynprobe
from dynprobe.output.hist import log2_lines
from tests.conftest import build_target


def test_handlers_read_arguments_registers_and_return_values_typed() -> None:
    """`hit.arg(n, type)`, `hit.reg(name, type)` and `hit.ret(type)`, with the fetch arguments'
    type names: an int argument of -7 is -7 as s32, 2^32 - 7 as u32; registers are unsigned."""
    typed = build_target("typed", flags=("-O1",))
    entries: list[tuple[int, ...]] = []
    returns: list[tuple[int, ...]] = []
    with dynprobe.spawn([typed], stdout=subprocess.DEVNULL) as session:
        session.probe("negate", pre=lambda hit: entries.append(
            (hit.arg(1, "s32"), hit.arg(1, "u32"), hit.reg("di", "s32"), hit.reg("%rdi", "u8"), hit.regs.rdi >> 32 == 0)
        ))  # fmt: skip
        session.retprobe("negate", handler=lambda hit: returns.append((hit.ret("s32"), hit.ret("u16"), hit.ret("x8"))))
        assert session.run(timeout=30) == 0
    # (printf's arguments are evaluated last first here: negate(-7), then negate(5))
    assert entries == [(-7, 2**32 - 7, -7, 2**8 - 7, True), (5, 5, 5, 5, True)]
    assert returns == [(7, 7, 7), (-5, 2**16 - 5, 2**8 - 5)]


def test_a_histogram_has_its_buckets_and_prints_as_the_cli(wordcount: str) -> None:
    with dynprobe.spawn([wordcount, "a bb cc dddd eeeee"], stdout=subprocess.DEVNULL) as session:
        lengths = session.probe("p add_word n=%si:u32", action="hist", value="n")
        signed = session.probe("p add_word n=%si:s32", action="hist", value="n")
        assert session.run(timeout=30) == 0
        histogram = lengths.histogram
        assert histogram.total == 5 and histogram.faulted == 0 and list(histogram[:5]) == [0, 1, 2, 2, 0]
        assert [(b.low, b.high, b.label, b.count) for b in histogram.buckets()] == [
            (1, 2, "[1]", 1), (2, 4, "[2, 4)", 2), (4, 8, "[4, 8)", 2),
        ]  # fmt: skip
        assert str(histogram) == "\n".join(log2_lines(list(histogram), "[0]"))
        assert str(histogram).splitlines()[0] == "[1]                       1 |" + "@" * 26 + " " * 26 + "|"
        zero = signed.histogram.buckets(empty=True)[0]
        assert (zero.low, zero.high, zero.label) == (None, 1, "(..., 0]")  # any value up to 0
        assert len(histogram.buckets(empty=True)) == 65
