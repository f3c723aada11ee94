"""Hazards 7-11: instruction boundaries, faults in slots, signals during steps, the target's own traps."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import dynprobe
from dynprobe.arch.x86_64 import ResumeKind, decode_one
from dynprobe.errors import ProbeRefused, Refusal
from dynprobe.symbols.elf import load_elf
from tests.conftest import build_target

from .helpers import at, run_plain, symbols, traced


@pytest.fixture(scope="module")
def faults() -> str:
    return build_target("faults", flags=("-O1",))


@pytest.fixture(scope="module")
def signals() -> str:
    return build_target("signals", flags=("-O1",))


def every_instruction(path: str, functions: list[str]) -> list[int]:
    """File-relative addresses of every instruction of the named functions."""
    image = load_elf(path)
    out = []
    for name in functions:
        func = image.by_name[name]
        code = image.code(func.addr, func.size)
        addr = func.addr
        while addr < func.end:
            insn = decode_one(code[addr - func.addr :], addr)
            assert insn is not None
            out.append(addr)
            addr += insn.len
    return out


def test_probing_every_instruction_leaves_results_unchanged(wordcount: str) -> None:
    """Hazard 7: a probe on every instruction of several functions at once; same output."""
    argv = [wordcount, "a b c a b a", "x y z x"]
    plain = run_plain(argv).stdout
    addrs = every_instruction(wordcount, ["hash", "add_word", "main"])
    assert len(addrs) > 60

    def setup(session: dynprobe.Session) -> list[dynprobe.Probe]:
        return [session.probe(at(wordcount, a)) for a in addrs]

    status, out, probes = traced(argv, setup)
    assert status == 0 and out == plain
    hash_entry = probes[addrs.index(load_elf(wordcount).by_name["hash"].addr)]
    assert hash_entry.hits == 10  # one call per word
    kinds = {k for p in probes for k in p.resumes}
    assert ResumeKind.EMULATE in kinds and ResumeKind.BOOST in kinds


def test_offset_inside_an_instruction_is_refused(wordcount: str) -> None:
    image = load_elf(wordcount)
    func = image.by_name["add_word"]
    insn = decode_one(image.code(func.addr, 15), func.addr)
    assert insn is not None and insn.len > 1
    with dynprobe.spawn([wordcount]) as session, pytest.raises(ProbeRefused) as info:
        session.probe(f"add_word+{insn.len - 1}")
    assert info.value.reason == Refusal.NOT_INSN_BOUNDARY


_REBUILT = """
    .text
    .globl step
    .type step, @function
step:
    {body}
    ret
    .size step, .-step
    .globl main
    .type main, @function
main:
    call step
    xor %eax, %eax
    ret
    .size main, .-main
    .section .note.GNU-stack,"",@progbits
"""


def test_a_program_rebuilt_in_place_has_its_new_instruction_boundaries(tmp_path: Path) -> None:
    """One script, the program rebuilt between two sessions: step() is at the same address with
    the same size, but step+1, an instruction's start before, is inside one now."""
    program = tmp_path / "rebuilt"
    for body, inside in (("nop; nop", False), ("xchg %ax, %ax", True)):  # 90 90 c3, then 66 90 c3
        (tmp_path / "rebuilt.S").write_text(_REBUILT.format(body=body))
        subprocess.run(["gcc", "-o", str(program), str(tmp_path / "rebuilt.S")], check=True)
        with dynprobe.spawn([str(program)]) as session:
            if inside:
                with pytest.raises(ProbeRefused) as info:
                    session.probe("step+1")
                assert info.value.reason == Refusal.NOT_INSN_BOUNDARY
            probe = session.probe("step+2" if inside else "step+1", pre=lambda hit: None)
            assert session.run(timeout=20) == 0 and probe.hits == 1


@pytest.mark.parametrize("post", [False, True], ids=["boosted", "single-stepped"])
def test_fault_in_slot_is_reported_at_the_original_address(faults: str, post: bool) -> None:
    """Hazard 9: divide by zero, bad load and ud2 run out of line; the target's SA_SIGINFO handler
    sees the original rip and si_addr."""
    plain = run_plain([faults]).stdout
    syms = symbols(faults)
    handler = (lambda h: None) if post else None
    status, out, probes = traced(
        [faults],
        lambda s: [s.probe(at(faults, syms[n]), post=handler) for n in ("fault_div", "fault_load", "fault_ud2")],
    )
    assert status == 0 and out == plain, out
    assert [p.hits for p in probes] == [2, 1, 1]


@pytest.mark.parametrize("post", [False, True], ids=["emulated", "with-post-handler"])
def test_signal_storm_over_probed_loop(signals: str, post: bool) -> None:
    """Hazard 10: SIGALRM every 200 us while every call of a probed function traps."""
    plain = run_plain([signals, "storm", "3000"]).stdout.split(" alarms")[0]
    handler = (lambda h: None) if post else None
    status, out, probe = traced([signals, "storm", "3000"], lambda s: s.probe("step_me", post=handler))
    assert status == 0
    assert out.split(" alarms")[0] == plain
    assert "alarms>0=1" in out  # the storm really hit the traced run
    assert probe.hits == 3000


def test_target_that_single_steps_itself(signals: str) -> None:
    """Hazard 10: TF set by the target: its SIGTRAP count is the same with probes on the stepped code."""
    plain = run_plain([signals, "selfstep"]).stdout
    addrs = every_instruction(signals, ["step_me"])
    status, out, probes = traced([signals, "selfstep"], lambda s: [s.probe(at(signals, a)) for a in addrs])
    assert status == 0 and out == plain
    assert all(p.hits == 1 for p in probes)


def test_target_own_int3_reaches_its_handler_once(signals: str) -> None:
    """Hazard 11: the target's own int3 is not mistaken for ours."""
    plain = run_plain([signals, "own"]).stdout
    assert plain.startswith("own_traps=1")
    status, out, probe = traced([signals, "own"], lambda s: s.probe("step_me"))
    assert status == 0 and out == plain and probe.hits == 1
    image = load_elf(signals)
    own = next(a for a in every_instruction(signals, ["main"]) if image.code(a, 1) == b"\xcc")
    with dynprobe.spawn([signals, "own"]) as session, pytest.raises(ProbeRefused) as info:
        session.probe(at(signals, own))  # a probe on that int3 itself: its trap would be taken for ours
    assert info.value.reason == Refusal.FOREIGN_INT3
