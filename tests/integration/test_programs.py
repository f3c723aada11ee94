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
