"""dynprobe killed (SIGKILL) at random moments while it traces a hot program, in every mode:
trap probes (counted, recorded in the target, with Python pre- and post-handlers), optimized
probes, return probes (optimized and trap) and the function tracer; during the attach, the
optimization, the steady state and the detach. The program runs on and ends as it would have,
every time (`make stress-kill` runs many more: tests/killing.py)."""

from __future__ import annotations

import random

import pytest

from tests.killing import MODES, hot_program, kill_once

RUNS = 5  # per mode here


@pytest.mark.parametrize("mode", list(MODES))
def test_a_killed_dynprobe_never_takes_the_program_with_it(mode: str) -> None:
    rng = random.Random(mode)  # the same moments every run of the suite
    hot = hot_program()
    failures = [o for o in (kill_once(mode, rng, hot) for _ in range(RUNS)) if not o.survived]
    assert not failures, "; ".join(f"killed at {o.delay:.3f} s: {o.why}" for o in failures)
