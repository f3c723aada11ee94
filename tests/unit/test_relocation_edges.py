"""Relocation at its edges (arch/x86_64/relocate.py, optimize.py): code above 4 GiB, targets
exactly at the reach of a rel32, the absolute jump's whole target, a RIP-relative instruction
that is not first in the region, calls through the stack, addr32 operands. (A final call above
4 GiB and module targets at any load bias: test_optimize_tables.py; a far out-of-line slot:
test_arch_tables.py.)"""

from __future__ import annotations

import pytest

from dynprobe.arch.x86_64 import decode_one
from dynprobe.arch.x86_64.decode import iter_instructions
from dynprobe.arch.x86_64.optimize import OptimizePlan, can_optimize, relocate_region
from dynprobe.arch.x86_64.relocate import call_as_jump, in_rel32_reach, jump_to, out_of_line, relocate

HIGH = 0x7F3A_9C41_2000  # where shared libraries run: far above 4 GiB
REACH = 1 << 31


@pytest.mark.parametrize(
    ("delta", "reaches"),
    [(0, True), (REACH - 1, True), (REACH, False), (-REACH, True), (-REACH - 1, False)],
)
def test_rel32_reach_at_its_edges(delta: int, reaches: bool) -> None:
    assert in_rel32_reach(HIGH, HIGH + delta) is reaches


@pytest.mark.parametrize("delta", [REACH - 1, -REACH, REACH, -REACH - 1, 1 << 40])
def test_jump_to_lands_on_its_target(delta: int) -> None:
    """A rel32 jmp while the target is in reach, else `jmp [rip+0]` and the whole 8-byte target."""
    source = HIGH
    target = source + 5 + delta
    code = jump_to(source, target)
    jump = decode_one(code, source)
    assert jump is not None
    if in_rel32_reach(source + 5, target):
        assert len(code) == 5 and jump.near_branch_target == target
    else:
        assert code[:6] == bytes.fromhex("ff2500000000") and len(code) == 14
        assert int.from_bytes(code[6:], "little") == target


def test_a_rip_relative_load_exactly_at_the_reach() -> None:
    """`mov rax, [rip+disp]` moved so that its operand is exactly 2^31 - 1 past its end, then one
    byte more."""
    insn = decode_one(bytes.fromhex("488b0510000000"), HIGH)
    assert insn is not None
    operand = int(insn.ip_rel_memory_address)
    last = operand - (REACH - 1) - 7  # the slot where the operand is at disp32 = 2^31 - 1
    moved = relocate(insn, last)
    assert moved is not None
    again = decode_one(moved, last)
    assert again is not None and again.ip_rel_memory_address == operand
    assert relocate(insn, last - 1) is None
    first = operand + REACH - 7  # disp32 = -2^31
    assert relocate(insn, first) is not None and relocate(insn, first + 1) is None


def test_a_rip_relative_instruction_second_in_the_region() -> None:
    """push rbp; mov rax, [rip+0x10]: the load, moved with the push before it, reads the same."""
    code = bytes.fromhex("55" + "488b0510000000" + "5dc3")
    plan = can_optimize(code, HIGH, HIGH)
    assert isinstance(plan, OptimizePlan) and plan.length == 8
    detour = HIGH + 0x4000_0000
    out = relocate_region(plan, detour)
    assert out is not None
    moved = list(iter_instructions(out, detour))
    assert [str(i) for i in moved[:1]] == ["push rbp"]
    assert moved[1].ip_rel_memory_address == HIGH + 8 + 0x10
    assert moved[2].near_branch_target == HIGH + 8 and len(moved) == 3
    assert relocate_region(plan, HIGH + (1 << 33)) is None  # the load would not reach


@pytest.mark.parametrize(
    ("call", "jump"),
    [
        ("ff5424f0", "jmp qword ptr [rsp-8]"),
        ("ff5424f8", "jmp qword ptr [rsp]"),
        ("ff5424f9", "jmp qword ptr [rsp+1]"),
        ("ff1480", None),
    ],
    ids=["[rsp-16]", "[rsp-8]", "[rsp-7]", "[rax+rax*4]"],
)
def test_an_indirect_call_through_the_stack_as_a_jump(call: str, jump: str | None) -> None:
    """Its operand reads 8 bytes further up once the return address is pushed by hand; a
    negative displacement stays one (wraps at 64 bits)."""
    insn = decode_one(bytes.fromhex(call), HIGH)
    assert insn is not None
    moved = call_as_jump(insn)
    if jump is None:  # not based on rsp: the same operand
        assert moved.memory_displacement == insn.memory_displacement
    else:
        assert str(moved) == jump


def test_an_eip_relative_operand_is_refused_where_it_cannot_be_kept() -> None:
    """`mov eax, [eip+disp]` (addr32) reads below 4 GiB: from a slot far above, refused."""
    insn = decode_one(bytes.fromhex("678b0510000000"), 0x40_1000)
    assert insn is not None
    assert relocate(insn, HIGH) is None
    near = relocate(insn, 0x40_2000)
    again = decode_one(near or b"", 0x40_2000)
    assert again is not None and again.ip_rel_memory_address == insn.ip_rel_memory_address


@pytest.mark.parametrize(
    "code", ["0f8410000000", "7410", "e810000000", "e910000000"], ids=["jcc", "short jcc", "call", "jmp"]
)
def test_a_branch_out_of_reach_is_refused_not_rewritten(code: str) -> None:
    """A branch moved beyond the reach of its target: iced-x86 would make a jcc a short one over
    an indirect jmp (a target no longer its own, in a slot that cannot hold the pointer): None;
    an out-of-line slot for it too. In reach, the same branch lands on its target."""
    insn = decode_one(bytes.fromhex(code), HIGH)
    assert insn is not None
    target = int(insn.near_branch_target)
    far = HIGH + (1 << 33)
    assert relocate(insn, far) is None and out_of_line(insn, far) is None
    near = relocate(insn, HIGH + 0x1000)
    assert near is not None
    moved = decode_one(near, HIGH + 0x1000)
    assert moved is not None and moved.near_branch_target == target
