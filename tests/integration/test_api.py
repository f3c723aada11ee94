"""The Python API's views of what a probe saw: typed arguments, registers and return values in
handlers, and histograms with their bucket ranges, on real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

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


def counter() -> str:
    return build_target("counter", flags=("-O1", "-pthread"))


def test_a_session_runs_in_a_thread_other_than_the_main_one() -> None:
    """As in a notebook or a server: spawn, run (untimed and timed) and close in a worker thread,
    where no signal handler can be set and none is needed."""
    results: list[object] = []

    def work() -> None:
        for timeout in (None, 60.0):
            with dynprobe.spawn([counter(), "1000", "2"], stdout=subprocess.DEVNULL) as session:
                traps = session.probe("work", pre=lambda hit: None)
                results.append((session.run(timeout=timeout), traps.hits))

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert results == [(0, 2000), (0, 2000)]


def test_removing_one_probe_of_a_site_leaves_the_others() -> None:
    with dynprobe.spawn([counter(), "1000", "1"], stdout=subprocess.DEVNULL) as session:
        kept = session.probe("work", pre=lambda hit: None)
        gone = session.probe("work", action="count")
        gone.remove()
        gone.remove()  # (twice: nothing more happens)
        assert session.probes == [kept] and session.run(timeout=60) == 0
        assert kept.hits == 1000 and gone.hits == 0


def test_an_interrupt_before_a_run_ends_that_run_only() -> None:
    """`interrupt_wait` (a Ctrl-C) before `run()`: that run ends at once, the next one runs on;
    `request_stop()` between runs ends none (each run starts with no stop asked for)."""
    with dynprobe.spawn([counter(), "1000", "1"], stdout=subprocess.DEVNULL) as session:
        probe = session.probe("work", pre=lambda hit: None)
        session.interrupt_wait(signal.SIGINT, None)
        assert session.run(timeout=60) is None and probe.hits == 0
        session.request_stop()
        assert session.run(timeout=60) == 0 and probe.hits == 1000


def test_a_tracer_on_one_cpu_runs_unpinned() -> None:
    """With one CPU allowed (taskset), the tracer is not pinned apart from its target."""
    code = (
        "import subprocess, sys, dynprobe\n"
        f"with dynprobe.spawn([{counter()!r}, '1000', '1'], stdout=subprocess.DEVNULL) as s:\n"
        "    p = s.probe('work', pre=lambda hit: None)\n"
        "    print(s.run(timeout=60), p.hits)\n"
    )
    cpu = str(min(os.sched_getaffinity(0)))
    r = subprocess.run(["taskset", "-c", cpu, sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout == "0 1000\n", r.stdout + r.stderr


def test_a_consumer_made_during_a_run_is_not_left_on_the_tracer_s_cpu() -> None:
    """A return probe with Python handlers makes its thread areas, and so the consumer's thread,
    at its first hit, while `run()` keeps the tracer on one CPU: the thread, born with that
    affinity, gets every CPU back when the run ends, as one made before it does."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("one CPU allowed: the tracer is never pinned")
    with dynprobe.spawn([counter(), "100", "1"], stdout=subprocess.DEVNULL) as session:
        session.upcalls = False  # (served by upcalls, its areas are made before the run)
        returns = session.retprobe("work", handler=lambda hit: None)
        assert session._runtime.data.consumer is None
        assert session.run(timeout=60) == 0 and returns.hits == 100
        consumer = session._runtime.data.consumer
        assert consumer is not None and consumer._thread is not None and consumer._thread.native_id is not None
        assert os.sched_getaffinity(consumer._thread.native_id) == allowed == os.sched_getaffinity(0)


def test_a_batch_inside_a_batch_places_its_probes_with_the_outer_one() -> None:
    """Nested blocks: the outer one optimizes everything at its end; `drain()` with no consumer
    (trap probes only) delivers nothing and returns."""
    told: list[tuple[int, int]] = []
    with dynprobe.spawn([counter(), "1000", "1"], stdout=subprocess.DEVNULL) as session:
        with session.batch(progress=lambda done, total: told.append((done, total))):
            outer = session.probe("work", action="count")
            with session.batch():
                inner = session.probe("pushy", action="count")
            assert inner.mode == dynprobe.ProbeMode.TRAP  # (not optimized yet: the outer block does it)
        assert outer.mode == inner.mode == dynprobe.ProbeMode.OPTIMIZED and told[-1] == (2, 2)
        assert session.run(timeout=60) == 0 and outer.hits == 1000 and inner.hits == 0
    with dynprobe.spawn([counter(), "10", "1"], stdout=subprocess.DEVNULL) as session:
        traps = session.probe("work", pre=lambda hit: None)
        session.drain()
        assert session.run(timeout=60) == 0 and traps.hits == 10
        session.drain()
