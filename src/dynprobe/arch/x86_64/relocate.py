"""Relocation of instructions to a new address, and out-of-line slot contents.

iced-x86's BlockEncoder re-encodes RIP-relative operands and branches for the new address; we
check the result by decoding it again, because an encoding that silently changes what an operand
refers to (e.g. an addr32 form) is worse than a refusal.
"""

from __future__ import annotations

import iced_x86 as iced

from dynprobe.arch.x86_64.decode import decode_one, iter_instructions

REL32_REACH = 1 << 31


def in_rel32_reach(source_next_ip: int, target: int) -> bool:
    delta = target - source_next_ip
    return -REL32_REACH <= delta < REL32_REACH


def _refers_to(insn: iced.Instruction) -> tuple[int | None, int | None]:
    mem = int(insn.ip_rel_memory_address) if insn.is_ip_rel_memory_operand else None
    branch = int(insn.near_branch_target) if insn.op0_kind in (
        iced.OpKind.NEAR_BRANCH16, iced.OpKind.NEAR_BRANCH32, iced.OpKind.NEAR_BRANCH64) else None  # fmt: skip
    return mem, branch


def relocate(insn: iced.Instruction, new_ip: int) -> bytes | None:
    """`insn` re-encoded to run at `new_ip` with the same effect, or None if that cannot be done."""
    mem, branch = _refers_to(insn)
    if mem is None and branch is None:  # nothing relative to where it is: as it is
        plain = iced.Encoder(64)
        try:
            plain.encode(insn, new_ip)
        except ValueError:
            return None
        return bytes(plain.take_buffer())
    encoder = iced.BlockEncoder(64)
    encoder.add(insn)
    try:
        code = bytes(encoder.encode(new_ip))
    except ValueError:
        return None
    moved = decode_one(code, new_ip)
    if moved is None:
        return None
    new_mem, _ = _refers_to(moved)
    if mem is not None and (new_mem != mem or code[0] == 0x67):
        return None
    if branch is not None:
        # A far-away branch target may become a short jcc over an indirect jmp; check every target.
        targets = {t for i in iter_instructions(code, new_ip) for t in [_refers_to(i)[1]] if t is not None}
        if branch not in targets:
            return None
    return code


def retarget(branch: iced.Instruction, target: int) -> bytes | None:
    """The direct `branch` (jmp, jcc or call, at its own address) re-encoded to land at `target`
    with a 32-bit displacement: as long as it is for a rel32 one, 5 bytes for a `jmp rel8`; None
    for a branch of another kind (a `jcc rel8`, whose 6 bytes would run into the next
    instruction; `loop`, `jrcxz`), one whose encoding would change length (a redundant prefix),
    or a target out of reach."""
    near = branch.copy()
    if branch.code == iced.Code.JMP_REL8_64:
        near.code = iced.Code.JMP_REL32_64
    elif branch.len < 5 or not (branch.is_jmp_near or branch.is_jcc_near or branch.is_call_near):
        return None
    near.near_branch64 = target
    if not in_rel32_reach(int(branch.ip) + max(branch.len, 5), target):
        return None
    encoder = iced.Encoder(64)
    try:
        encoder.encode(near, int(branch.ip))
    except ValueError:
        return None
    aimed = bytes(encoder.take_buffer())
    # (a redundant prefix would go: a shorter branch leaves a byte that runs, or moves a return address)
    return aimed if len(aimed) == max(branch.len, 5) else None


def call_as_jump(call: iced.Instruction) -> iced.Instruction:
    """An indirect `call` (CALL_RM64)'s target as a `jmp`, for after the return address was
    pushed by hand: an operand that reads the stack reads 8 bytes further up."""
    jump = call.copy()
    jump.code = iced.Code.JMP_RM64
    if call.op0_kind == iced.OpKind.MEMORY and call.memory_base == iced.Register.RSP:
        jump.memory_displacement = (call.memory_displacement + 8) & ((1 << 64) - 1)
        jump.memory_displ_size = max(call.memory_displ_size, 1)
    return jump


def jump_to(source: int, target: int) -> bytes:
    """A `jmp target` placed at `source`: rel32 when in reach, else `jmp [rip+0]; dq target`."""
    if in_rel32_reach(source + 5, target):
        return b"\xe9" + ((target - source - 5) & 0xFFFFFFFF).to_bytes(4, "little")
    return b"\xff\x25\x00\x00\x00\x00" + target.to_bytes(8, "little")


def out_of_line(insn: iced.Instruction, slot: int) -> tuple[bytes, int] | None:
    """Slot contents for running `insn` at `slot`: the relocated instruction, then `jmp` back.

    Returns (code, length of the relocated instruction), or None when it cannot be relocated.
    """
    moved = relocate(insn, slot)
    if moved is None:
        return None
    return moved + jump_to(slot + len(moved), int(insn.next_ip)), len(moved)
