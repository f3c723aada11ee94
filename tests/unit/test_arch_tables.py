"""Byte tables for the x86-64 layer: resume plans and relocation, no process involved (emulation:
test_emulate.py)."""

from __future__ import annotations

import pytest

from dynprobe.arch.x86_64 import (
    Fixup,
    ResumeKind,
    ResumePlan,
    decode_one,
    instruction_starts,
    out_of_line,
    plan_resume,
    relocate,
)
from dynprobe.errors import Refusal

SITE = 0x401000
SLOT = 0x402000

E, B, S = ResumeKind.EMULATE, ResumeKind.BOOST, ResumeKind.STEP

# (name, bytes, expected plan)
PLANS = [
    ("push rbp", "55", E),
    ("push r12", "4154", E),
    ("push rsp", "54", E),
    ("pop rsp", "5c", E),
    ("pop r15", "415f", E),
    ("push imm8", "6a05", E),
    ("nop", "90", E),
    ("nop 66 90", "6690", E),
    ("nopl 0(rax,rax)", "0f1f440000", E),
    ("nopw cs:0(rax,rax)", "662e0f1f840000000000", E),
    ("endbr64", "f30f1efa", E),
    ("ret", "c3", E),
    ("ret imm16", "c21000", E),
    ("call rel32", "e800000000", E),
    ("jmp rel8", "eb05", E),
    ("jmp rel32", "e900010000", E),
    ("je rel8", "7405", E),
    ("jne rel32", "0f8500010000", E),
    ("mov rbp,rsp", "4889e5", E),
    ("mov eax,edi", "89f8", E),
    ("lea rax,[rbp+0x10]", "488d4510", E),
    ("lea rdi,[rip+0x100]", "488d3d00010000", E),
    ("jmp [rip+0x10] (plt)", "ff2510000000", E),
    ("call [rax+8]", "ff5008", E),
    ("call rax", "ffd0", E),
    ("pushfq", "9c", E),
    ("popfq", "9d", E),
    ("mov rax,[rip+0x10]", "488b0510000000", B),
    ("mov [rip+0x10],rbx", "48891d10000000", B),
    ("vmovdqu xmm0,[rip+0x10] (VEX)", "c5fa6f0510000000", B),
    ("andn rax,rbx,[rip+0x10] (VEX GPR)", "c4e2e0f20510000000", B),
    ("div rcx", "48f7f1", B),
    ("cmpxchg16b [rsi]", "480fc70e", B),
    ("mulx r8,r9,rdx", "c462b3f6c2", B),
    ("sub rsp,0x10", "4883ec10", B),
    ("rep movsb", "f3a4", B),
    ("lock xadd [rdi],eax", "f00fc107", B),
    ("ud2", "0f0b", B),
    ("syscall", "0f05", S),
    ("loopne to itself", "e0fe", E),
    ("loop ecx", "67e2fe", E),
    ("jrcxz", "e3fe", E),
]


@pytest.mark.parametrize(("name", "code", "kind"), PLANS, ids=[p[0] for p in PLANS])
def test_resume_plan(name: str, code: str, kind: ResumeKind) -> None:
    insn = decode_one(bytes.fromhex(code), SITE)
    assert insn is not None and insn.len == len(code) // 2
    plan = plan_resume(insn)
    assert isinstance(plan, ResumePlan), plan
    assert plan.kind == kind
    if name == "syscall":
        assert plan.fixup == Fixup.SYSCALL_REGS


@pytest.mark.parametrize("code", ["cc", "cd80", "ca0800", "48cf", "c7f800000000"])
def test_refused_instructions(code: str) -> None:
    insn = decode_one(bytes.fromhex(code), SITE)
    assert insn is not None
    assert plan_resume(insn) == Refusal.UNSUPPORTED_INSN


def test_undecodable() -> None:
    assert decode_one(bytes.fromhex("e81000"), SITE) is None  # call rel32 cut short
    assert decode_one(b"\x48", SITE) is None  # a lone prefix
    assert decode_one(bytes.fromhex("0f0b"), SITE) is not None  # ud2 is an instruction


def test_relocate_rip_relative_load_and_store() -> None:
    for code in ("488b0510000000", "48891d10000000", "c5fa6f0510000000", "c4e2e0f20510000000"):
        insn = decode_one(bytes.fromhex(code), SITE)
        assert insn is not None
        moved = relocate(insn, SLOT)
        assert moved is not None and len(moved) == len(code) // 2
        again = decode_one(moved, SLOT)
        assert again is not None and again.ip_rel_memory_address == insn.ip_rel_memory_address


def test_relocate_call_rel32_keeps_target() -> None:
    insn = decode_one(bytes.fromhex("e810000000"), SITE)
    assert insn is not None
    moved = relocate(insn, SLOT)
    assert moved is not None
    again = decode_one(moved, SLOT)
    assert again is not None and again.near_branch_target == SITE + 5 + 0x10


def test_relocate_jcc_rel8_pushed_out_of_range() -> None:
    insn = decode_one(bytes.fromhex("7405"), SITE)
    assert insn is not None
    moved = relocate(insn, SLOT)
    assert moved is not None and len(moved) == 6  # became jcc rel32
    again = decode_one(moved, SLOT)
    assert again is not None and again.near_branch_target == SITE + 7


def test_relocate_rip_relative_out_of_reach_is_refused() -> None:
    insn = decode_one(bytes.fromhex("488b0510000000"), SITE)
    assert insn is not None
    assert relocate(insn, SITE + (1 << 33)) is None


def test_out_of_line_ends_with_jump_back() -> None:
    insn = decode_one(bytes.fromhex("4883ec10"), SITE)
    assert insn is not None
    built = out_of_line(insn, SLOT)
    assert built is not None
    code, n = built
    assert code[:n] == bytes.fromhex("4883ec10")
    back = decode_one(code[n:], SLOT + n)
    assert back is not None and back.near_branch_target == SITE + 4


@pytest.mark.parametrize(("site", "slot"), [(SITE, SITE + (1 << 40)), (0x7F3A_9C41_2000, 0x7F3A_9C41_2000 - (1 << 40))])
def test_out_of_line_far_slot_uses_absolute_jump(site: int, slot: int) -> None:
    """Out of rel32 reach (either way): `jmp [rip+0]` and the whole 8-byte address back."""
    insn = decode_one(bytes.fromhex("4883ec10"), site)
    assert insn is not None
    built = out_of_line(insn, slot)
    assert built is not None
    code, length = built
    assert code[:length] == bytes.fromhex("4883ec10")
    assert code[4:10] == bytes.fromhex("ff2500000000")
    assert code[length:] == bytes.fromhex("ff2500000000") + (site + 4).to_bytes(8, "little")


def test_instruction_starts() -> None:
    code = bytes.fromhex("554889e5897dfc8b45fc5dc3")
    assert instruction_starts(code, 0x1000) == [0x1000, 0x1001, 0x1004, 0x1007, 0x100A, 0x100B]
