"""Byte tables for the x86-64 layer: resume plans, emulation and relocation, no process involved."""

from __future__ import annotations

import pytest

from dynprobe.arch.x86_64 import (
    Fixup,
    Regs,
    ResumeKind,
    ResumePlan,
    decode_one,
    emulate,
    instruction_starts,
    out_of_line,
    plan_resume,
    relocate,
)
from dynprobe.arch.x86_64.emulate import EmulationFault
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


class FakeMemory:
    def __init__(self, words: dict[int, int] | None = None) -> None:
        self.words = dict(words or {})

    def read(self, addr: int, size: int) -> bytes:
        if addr not in self.words:
            raise OSError(14, "bad address")
        return self.words[addr].to_bytes(8, "little")[:size]


def regs(**values: int) -> Regs:
    r = Regs()
    r.rsp = 0x7FFF0000
    r.eflags = 0x202
    for name, value in values.items():
        r[name] = value
    return r


def run(code: str, r: Regs, mem: FakeMemory | None = None) -> list[tuple[int, bytes]]:
    insn = decode_one(bytes.fromhex(code), SITE)
    assert insn is not None
    r.rip = SITE
    return emulate(insn, r, (mem or FakeMemory()).read)


def test_emulate_push_rbp() -> None:
    r = regs(rbp=0x1122334455667788)
    writes = run("55", r)
    assert writes == [(0x7FFF0000 - 8, (0x1122334455667788).to_bytes(8, "little"))]
    assert r.rsp == 0x7FFF0000 - 8 and r.rip == SITE + 1


def test_emulate_push_rsp_pushes_old_value() -> None:
    r = regs()
    writes = run("54", r)
    assert writes == [(0x7FFF0000 - 8, (0x7FFF0000).to_bytes(8, "little"))]


def test_emulate_pop_rsp_loads_after_increment() -> None:
    r = regs()
    run("5c", r, FakeMemory({0x7FFF0000: 0x12345678}))
    assert r.rsp == 0x12345678 and r.rip == SITE + 1


def test_emulate_ret_and_ret_imm16() -> None:
    r = regs()
    run("c3", r, FakeMemory({0x7FFF0000: 0x400123}))
    assert (r.rip, r.rsp) == (0x400123, 0x7FFF0008)
    r = regs()
    run("c21000", r, FakeMemory({0x7FFF0000: 0x400123}))
    assert (r.rip, r.rsp) == (0x400123, 0x7FFF0018)


def test_emulate_call_rel32_pushes_return_address() -> None:
    r = regs()
    writes = run("e810000000", r)
    assert r.rip == SITE + 5 + 0x10
    assert writes == [(0x7FFF0000 - 8, (SITE + 5).to_bytes(8, "little"))]


def test_emulate_jcc_taken_and_not() -> None:
    r = regs(eflags=0x202 | 0x40)  # ZF
    run("7405", r)
    assert r.rip == SITE + 2 + 5
    r = regs()
    run("7405", r)
    assert r.rip == SITE + 2


def test_emulate_jl_uses_sf_of() -> None:
    r = regs(eflags=0x202 | 0x80)  # SF != OF
    run("7c10", r)
    assert r.rip == SITE + 2 + 0x10


def test_emulate_mov32_zero_extends() -> None:
    r = regs(rax=0xFFFFFFFFFFFFFFFF, rdi=0xAAAAAAAA12345678)
    run("89f8", r)
    assert r.rax == 0x12345678


def test_emulate_mov8_merges() -> None:
    r = regs(rax=0x1111111111111111, rbx=0x22)
    run("88d8", r)  # mov al, bl
    assert r.rax == 0x1111111111111122


def test_emulate_lea_rip_relative() -> None:
    r = regs()
    run("488d3d00010000", r)
    assert r.rdi == SITE + 7 + 0x100


def test_emulate_jmp_through_plt_slot() -> None:
    r = regs()
    run("ff2510000000", r, FakeMemory({SITE + 6 + 0x10: 0x7F0000001000}))
    assert r.rip == 0x7F0000001000


def test_emulate_popf_keeps_privileged_flags() -> None:
    r = regs(eflags=0x202)
    run("9d", r, FakeMemory({0x7FFF0000: 0x3000 | 0x1 | 0x40}))  # IOPL bits, CF, ZF
    assert r.eflags == 0x202 | 0x1 | 0x40


def test_emulate_pushf_clears_tf() -> None:
    r = regs(eflags=0x202 | 0x100)
    writes = run("9c", r)
    assert writes[0][1] == (0x202).to_bytes(8, "little")


def test_emulate_faulting_read_raises() -> None:
    with pytest.raises(EmulationFault):
        run("c3", regs(), FakeMemory())


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


def test_out_of_line_far_slot_uses_absolute_jump() -> None:
    insn = decode_one(bytes.fromhex("4883ec10"), SITE)
    assert insn is not None
    built = out_of_line(insn, SITE + (1 << 40))
    assert built is not None
    assert built[0][4:10] == bytes.fromhex("ff2500000000")


def test_instruction_starts() -> None:
    code = bytes.fromhex("554889e5897dfc8b45fc5dc3")
    assert instruction_starts(code, 0x1000) == [0x1000, 0x1001, 0x1004, 0x1007, 0x100A, 0x100B]
