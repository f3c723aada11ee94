"""`session.program()`: a bpftrace program placed through the API, its bodies run wherever the
site runs its actions: optimized into a detour, or, at a site left a trap, by the trap's
actions run in the target as the thread resumes (never skipped)."""

from __future__ import annotations

import subprocess

import pytest

import dynprobe
from dynprobe.core.probe import ProbeMode
from tests.conftest import build_target


@pytest.mark.parametrize("optimize", [False, True])
def test_a_body_runs_at_every_hit_trap_or_jump(optimize: bool) -> None:
    counter = build_target("counter", flags=("-O1", "-pthread"))
    with dynprobe.spawn([counter, "100", "1"], stdout=subprocess.DEVNULL) as session:
        session.optimize = optimize
        program = session.program(f'uprobe:{counter}:work {{ @c = count(); @s = sum(arg0); printf("%d\\n", arg0); }}')
        printed: list[str] = []
        program.write = printed.append
        assert session.run(timeout=60) == 0
        session.drain()
    [probe] = program.probes
    assert probe.mode == (ProbeMode.OPTIMIZED if optimize else ProbeMode.TRAP)
    assert (probe.hits, probe.nmissed) == (100, 0)
    assert dict(program.entries("c")) == {(): 100} and dict(program.entries("s")) == {(): 4950}
    assert printed == [f"{i}\n" for i in range(100)]


def test_maps_as_a_python_program_reads_them(capsys: pytest.CaptureFixture[str]) -> None:
    """`program.maps`: bpftrace's shapes (a key alone, several as a tuple; an avg's average,
    stats as a dict, a hist's counts by bucket as bpftrace labels them); `print()`: every map
    as `dynprobe run` prints them at the end."""
    counter = build_target("counter", flags=("-O1", "-pthread"))
    with dynprobe.spawn([counter, "5", "1"], stdout=subprocess.DEVNULL) as session:
        program = session.program(
            f"uprobe:{counter}:work {{ @c[arg0 % 2] = count(); @k[arg0, 1] = sum(arg0); @a = avg(arg0);"
            " @s = stats(arg0); @h = hist(arg0); @l = lhist(arg0, 0, 10, 2); @w = comm; @n = count(); }"
        )  # fmt: skip
        assert session.run(timeout=60) == 0
    assert program.maps == {
        "a": 2, "c": {0: 3, 1: 2}, "h": {"[0]": 1, "[1]": 1, "[2, 4)": 2, "[4, 8)": 1},
        "k": {(i, 1): i for i in range(5)}, "l": {"[0, 2)": 2, "[2, 4)": 2, "[4, 6)": 1}, "n": 5,
        "s": {"count": 5, "average": 2, "total": 10}, "w": "counter",
    }  # fmt: skip
    program.print()
    assert capsys.readouterr().out == program.format_maps() and "@n: 5\n" in program.format_maps()
