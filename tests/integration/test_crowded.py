"""A program that leaves no free address within 2 GiB of its code (as sanitizers' and runtimes'
reservations can): whatever needs memory near the code is refused where it is asked for, with
its reason, what needs none works as usual, and the program runs to its own end untouched."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import dynprobe
from dynprobe import OptimizeRefusal, ProbeRefused, Refusal, SessionError
from dynprobe.core.probe import ProbeMode
from tests.conftest import DYNPROBE, build_target

from .helpers import started

CALLS = 20_000  # per thread, 2 threads
TOTAL = 2 * sum(i + 2 for i in range(CALLS))  # work(i) = i + 1 + seed (1)


@pytest.fixture
def crowded() -> Iterator[subprocess.Popen[str]]:
    """The crowded target, attached to nothing yet: its gaps filled, waiting for a line."""
    path = build_target("crowded", flags=("-O1", "-pthread"))
    with started([path, str(CALLS)], "ready", stdin=subprocess.PIPE) as target:
        yield target


def run_to_end(session: dynprobe.Session, target: subprocess.Popen[str]) -> None:
    """Let the target go, run the session to its end, and check what the program printed."""
    assert target.stdin is not None and target.stdout is not None
    target.stdin.write("go\n")
    target.stdin.flush()
    assert session.run(timeout=60) == 0
    assert target.stdout.read() == f"total={TOTAL}\n"


@pytest.mark.parametrize("optimize", [False, True])
def test_a_probe_at_an_emulated_entry_counts_every_call(crowded: subprocess.Popen[str], optimize: bool) -> None:
    """The entry's push is emulated at each stop: no slot needed. Optimizing it would need a
    detour within reach: refused for that reason, and the site stays an exact trap."""
    with dynprobe.attach(crowded.pid) as session:
        session.optimize = optimize
        probe = session.probe(f"{crowded.args[0]}:work", action="count")
        run_to_end(session, crowded)
        assert probe.hits == 2 * CALLS
        assert probe.mode == ProbeMode.TRAP
        assert probe.refusal == (OptimizeRefusal.NO_MEMORY if optimize else OptimizeRefusal.DISABLED)


def test_a_post_handler_at_an_emulated_entry_runs_after_every_call_s_push(crowded: subprocess.Popen[str]) -> None:
    """The push is emulated before the post-handler runs: it sees the stack one word deeper."""
    before: dict[int, int] = {}
    pushed: list[int] = []
    with dynprobe.attach(crowded.pid) as session:
        session.probe(
            f"{crowded.args[0]}:work",
            pre=lambda hit: before.__setitem__(hit.tid, hit.regs.rsp),
            post=lambda hit: pushed.append(before[hit.tid] - hit.regs.rsp),
        )
        run_to_end(session, crowded)
    assert pushed == [8] * (2 * CALLS)


def test_an_instruction_that_must_run_near_its_code_is_refused_at_placement(crowded: subprocess.Popen[str]) -> None:
    """work+9 is `add seed(%rip), %rax`: out of line, its operand must stay within reach."""
    with dynprobe.attach(crowded.pid) as session:
        with pytest.raises(ProbeRefused) as refused:
            session.probe(f"{crowded.args[0]}:work+9", action="count")
        assert refused.value.reason == Refusal.RIP_REL_OUT_OF_REACH
        assert session.probes == []
        run_to_end(session, crowded)


def test_a_return_probe_is_refused_at_placement_for_want_of_a_trampoline(crowded: subprocess.Popen[str]) -> None:
    with dynprobe.attach(crowded.pid) as session:
        with pytest.raises(ProbeRefused) as refused:
            session.retprobe(f"{crowded.args[0]}:work", action="count")
        assert refused.value.reason == Refusal.NO_MEMORY
        assert str(refused.value) == (
            "cannot probe crowded:work: no executable memory could be mapped near the code for the "
            "return trampoline [NO_MEMORY]"
        )
        assert session.probes == []
        run_to_end(session, crowded)


def test_the_function_graph_tracer_says_it_has_no_memory_and_patches_nothing(crowded: subprocess.Popen[str]) -> None:
    with dynprobe.attach(crowded.pid) as session:
        tracer = session.function_tracer(["work"])
        with pytest.raises(SessionError, match=r"^cannot trace function returns: no executable memory"):
            tracer.start()
        run_to_end(session, crowded)


def test_the_flat_function_tracer_counts_each_function_it_could_not_patch(crowded: subprocess.Popen[str]) -> None:
    with dynprobe.attach(crowded.pid) as session:
        tracer = session.function_tracer(["work", "main"], graph=False)
        tracer.start()
        assert dict(tracer.not_patched) == {"NO_MEMORY": 2}
        run_to_end(session, crowded)


def test_the_commands_say_in_one_line_what_cannot_be_done(crowded: subprocess.Popen[str], tmp_path: Path) -> None:
    """`record` and a return probe of `trace`, attached: one line each, exit status 1, and the
    program runs on untouched."""
    commands = {
        ("record", "-o", str(tmp_path / "t.data")): "dynprobe: error: cannot trace function returns: no executable "
        f"memory for the return trampoline in pid {crowded.pid}\n",
        ("trace", "r work"): "dynprobe: error: cannot probe crowded:work: no executable memory could be mapped "
        "near the code for the return trampoline [NO_MEMORY]\n",
    }
    for argv, said in commands.items():
        done = subprocess.run([*DYNPROBE, *argv, "-p", str(crowded.pid)], capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stderr) == (1, said)
    assert crowded.stdin is not None and crowded.stdout is not None
    crowded.stdin.write("go\n")
    crowded.stdin.flush()
    assert crowded.stdout.read() == f"total={TOTAL}\n" and crowded.wait() == 0
