"""Hazard 8: a corpus of single instructions, each snapshotted by the target itself (every GPR,
rflags, xmm0/xmm1, a 64 KiB memory region, a RIP-relative store target): the snapshot with a probe
on the instruction must be bit-identical to the one without, and the expected resume path ran."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import dynprobe
from dynprobe.arch.x86_64 import ResumeKind

from .helpers import symbols

E, B, S = ResumeKind.EMULATE, ResumeKind.BOOST, ResumeKind.STEP

EXPECTED = {
    "push_rbp": E, "push_r12": E, "push_rsp": E, "pop_rsp": E, "pop_rbx": E, "push_imm": E, "push_riprel": B,
    "nop": E, "nopl": E, "nop66": E, "endbr64": E, "mov_rbp_rsp": E, "mov32": E, "mov8_high": E, "lea_sib": E,
    "lea_rip": E, "jmp8": E, "jmp32": E, "jz_taken": E, "jnz_not_taken": E, "call_rel32": E, "call_mem": E,
    "jmp_mem": E, "ret": E, "ret_imm16": E, "pushf": E, "popf": E, "load_riprel": B, "store_riprel": B,
    "vex_load_riprel": B, "vex_andn_riprel": B, "div": B, "cmpxchg16b": B, "mulx": B, "sub_rsp": B,
    "rep_movsb": B, "lock_xadd": B, "xchg": B, "cmovz": B, "adc": B, "bswap": B, "imul3": B, "xor32": B,
    "movzx": B, "syscall_getuid": S, "stosq": B, "shld": B, "loop_taken": E, "loope_taken": E,
    "loopne_not_taken": E, "loop_ecx": E, "jrcxz_not_taken": E,
}  # fmt: skip
# Emulated pushes on sites that stay traps run from a slot, which is cheaper
# (analysis.boost_is_cheaper); emulated still with a post-handler.
PUSHES = {"push_rbp", "push_r12", "push_rsp", "push_imm", "pushf"}


@pytest.fixture(scope="module")
def corpus(build: object) -> str:
    from tests.conftest import build_target

    return build_target("corpus", "corpus.S", "corpus_main.c", flags=("-no-pie",))


def snapshot_lines(text: str) -> dict[str, str]:
    return {line.split()[0]: line for line in text.splitlines() if line.strip()}


def traced_run(
    corpus: str, post: bool, optimize: bool = False, **kw: str
) -> tuple[dict[str, str], dict[str, dynprobe.Probe]]:
    syms = symbols(corpus)
    read_fd, write_fd = os.pipe()
    saved = os.dup(1)
    os.dup2(write_fd, 1)  # the target inherits our stdout: capture it through a pipe
    try:
        with dynprobe.spawn([corpus]) as session:
            session.optimize = optimize
            probes = {
                name: session.probe(syms[f"insn_{name}"], post=(lambda hit: None) if post else None, **kw)
                for name in EXPECTED
            }
            status = session.run(timeout=60)
    finally:
        os.dup2(saved, 1)
        os.close(write_fd)
        os.close(saved)
    with os.fdopen(read_fd) as f:
        out = f.read()
    assert status == 0
    return snapshot_lines(out), probes


def test_corpus_is_complete(corpus: str) -> None:
    plain = subprocess.run([corpus], capture_output=True, text=True, check=True).stdout
    assert set(snapshot_lines(plain)) == set(EXPECTED)


@pytest.mark.parametrize("post", [False, True], ids=["pre-only", "with-post-handler"])
def test_snapshots_identical_with_probe(corpus: str, post: bool) -> None:
    if "bmi2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU lacks BMI2 (mulx, andn): the corpus needs it")
    plain = snapshot_lines(subprocess.run([corpus], capture_output=True, text=True, check=True).stdout)
    sys.stdout.flush()
    traced, probes = traced_run(corpus, post)
    for name in EXPECTED:
        assert traced[name] == plain[name], f"{name}: snapshot differs under a probe"
    for name, kind in EXPECTED.items():
        want = S if post and kind == B else B if name in PUSHES and not post else kind
        assert probes[name].hits == 1, name
        assert dict(probes[name].resumes) == {want: 1}, f"{name}: {dict(probes[name].resumes)}"


@pytest.mark.parametrize("kw", [{}, {"filter": "%ax != 12345 and %flags != 0"}, {"filter": "%cx != 7"}],
                         ids=["count", "filter-reading-flags", "filter"])  # fmt: skip
def test_snapshots_identical_at_optimized_sites(corpus: str, kw: dict[str, str]) -> None:
    """Hazard 8 for jumps: a count probe on each instruction, optimized where the rules allow;
    the snapshots (registers, flags, xmm, memory outside the scratch below the red zone) are
    bit-identical, and the instructions that can be relocated were run from a detour. Each form
    of detour: count only (seto/lahf), full with flags in r11, full with pushfq."""
    if "bmi2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU lacks BMI2 (mulx, andn): the corpus needs it")
    plain = snapshot_lines(subprocess.run([corpus], capture_output=True, text=True, check=True).stdout)
    sys.stdout.flush()
    traced, probes = traced_run(corpus, post=False, optimize=True, **kw)
    for name in EXPECTED:
        assert traced[name] == plain[name], f"{name}: snapshot differs under an optimized probe"
        assert probes[name].hits == 1, name
    modes = {name: p.mode for name, p in probes.items()}
    optimized = {name for name, mode in modes.items() if mode == dynprobe.ProbeMode.OPTIMIZED}
    # ret, syscall and jumps out of the region cannot run from a detour; most others must.
    assert {"ret", "ret_imm16", "syscall_getuid"}.isdisjoint(optimized)
    assert {"push_rbp", "load_riprel", "vex_load_riprel", "div", "cmpxchg16b", "pushf", "popf", "lea_rip"} <= optimized
