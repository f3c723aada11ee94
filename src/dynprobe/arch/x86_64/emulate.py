"""Emulation of simple instructions on a `Regs` value, so a trap probe costs one stop.

`emulate` is pure: it changes the given registers and returns the memory writes the instruction
makes; memory reads go through the caller's `read` function. Anything it cannot do faithfully
(a read that faults, an operand size it does not model) raises `EmulationFault`, and the engine
runs the instruction out of line instead, where the hardware does it.
"""

from __future__ import annotations

from collections.abc import Callable

import iced_x86 as iced

from dynprobe.arch.x86_64.decode import condition_holds
from dynprobe.arch.x86_64.operands import effective_address, gpr_width, is_gpr, read_reg, write_reg
from dynprobe.arch.x86_64.regs import FLAG_TF, FLAG_ZF, MASK64, Regs

ReadMemory = Callable[[int, int], bytes]
MemoryWrite = tuple[int, bytes]

_M = iced.Mnemonic
_OK = iced.OpKind
_FC = iced.FlowControl

# Flags user space may change with popf (CF PF AF ZF SF TF DF OF AC ID); IF/IOPL are ignored.
_POPF_MASK = 0x240DD5
# RF (bit 16) and VM (bit 17) read as 0 in the image pushf stores.
_PUSHF_CLEAR = (1 << 16) | (1 << 17)


class EmulationFault(Exception):
    """The instruction cannot be emulated on these registers; run it out of line instead."""


_NOPS = {_M.NOP, _M.ENDBR64, _M.ENDBR32, _M.PAUSE}

_C = iced.Code
# loop/loopcc/jrcxz: (counter width in bits, decrements the counter, ZF it needs or None)
_COUNTER_BRANCHES: dict[int, tuple[int, bool, bool | None]] = {
    _C.LOOP_REL8_64_RCX: (64, True, None), _C.LOOP_REL8_64_ECX: (32, True, None),
    _C.LOOPE_REL8_64_RCX: (64, True, True), _C.LOOPE_REL8_64_ECX: (32, True, True),
    _C.LOOPNE_REL8_64_RCX: (64, True, False), _C.LOOPNE_REL8_64_ECX: (32, True, False),
    _C.JRCXZ_REL8_64: (64, False, None), _C.JECXZ_REL8_64: (32, False, None),
}  # fmt: skip


def _is_reg(insn: iced.Instruction, op: int) -> bool:
    return bool(insn.op_kind(op) == _OK.REGISTER and is_gpr(insn.op_register(op)))


def can_emulate(insn: iced.Instruction) -> bool:
    """True for the instructions `emulate` models (nops, push/pop, branches, ret, mov, lea, pushf/popf)."""
    m = insn.mnemonic
    if m in _NOPS:
        return True
    if m == _M.PUSH:
        if insn.op0_kind in (_OK.IMMEDIATE8TO64, _OK.IMMEDIATE32TO64):
            return True
        return _is_reg(insn, 0) and gpr_width(insn.op0_register) == 64
    if m == _M.POP:
        return _is_reg(insn, 0) and gpr_width(insn.op0_register) == 64
    if m in (_M.PUSHFQ, _M.POPFQ):
        return True
    if m == _M.RET:
        return insn.code in (iced.Code.RETNQ, iced.Code.RETNQ_IMM16)
    if m in (_M.JMP, _M.CALL):
        if insn.op0_kind == _OK.NEAR_BRANCH64:
            return True
        if _is_reg(insn, 0):
            return gpr_width(insn.op0_register) == 64
        return bool(insn.op0_kind == _OK.MEMORY and insn.memory_size == iced.MemorySize.QWORD_OFFSET)
    if insn.flow_control == _FC.CONDITIONAL_BRANCH and insn.is_jcc_short_or_near:
        return True
    if insn.code in _COUNTER_BRANCHES:
        return True
    if m == _M.MOV and insn.op_count == 2 and _is_reg(insn, 0) and _is_reg(insn, 1):
        return True
    if m == _M.LEA:
        return _is_reg(insn, 0) and gpr_width(insn.op0_register) in (32, 64)
    return False


def _read_u64(read: ReadMemory, addr: int) -> int:
    try:
        data = read(addr, 8)
    except OSError as exc:
        raise EmulationFault(f"cannot read {addr:#x}: {exc}") from exc
    if len(data) != 8:
        raise EmulationFault(f"short read at {addr:#x}")
    return int.from_bytes(data, "little")


def _push(regs: Regs, value: int, writes: list[MemoryWrite]) -> None:
    regs.rsp = (regs.rsp - 8) & MASK64
    writes.append((int(regs.rsp), (value & MASK64).to_bytes(8, "little")))


def _branch_target(insn: iced.Instruction, regs: Regs, read: ReadMemory) -> int:
    if insn.op0_kind == _OK.NEAR_BRANCH64:
        return int(insn.near_branch_target)
    if insn.op0_kind == _OK.REGISTER:
        return read_reg(regs, insn.op0_register)
    return _read_u64(read, effective_address(insn, regs))


def emulate(insn: iced.Instruction, regs: Regs, read: ReadMemory, checked: bool = False) -> list[MemoryWrite]:
    """Execute `insn` (decoded at its real address) on `regs` in place; return its memory writes.

    rip ends where the hardware would leave it. Raises EmulationFault for an instruction
    `can_emulate` refuses (`checked=True` skips that test, for callers whose resume plan already
    made it), and when a memory read fails, before changing any register.
    """
    if not checked and not can_emulate(insn):
        raise EmulationFault(f"{insn} is not emulated")
    writes: list[MemoryWrite] = []
    next_ip = int(insn.next_ip)
    m = insn.mnemonic
    if m in _NOPS:
        regs.rip = next_ip
    elif m == _M.PUSH:
        value = read_reg(regs, insn.op0_register) if insn.op0_kind == _OK.REGISTER else insn.immediate(0)
        _push(regs, value, writes)
        regs.rip = next_ip
    elif m == _M.POP:
        value = _read_u64(read, int(regs.rsp))
        regs.rsp = (regs.rsp + 8) & MASK64
        write_reg(regs, insn.op0_register, value)  # `pop rsp` loads after the increment
        regs.rip = next_ip
    elif m == _M.PUSHFQ:
        _push(regs, int(regs.eflags) & ~_PUSHF_CLEAR & ~FLAG_TF, writes)
        regs.rip = next_ip
    elif m == _M.POPFQ:
        value = _read_u64(read, int(regs.rsp))
        regs.rsp = (regs.rsp + 8) & MASK64
        regs.eflags = (int(regs.eflags) & ~_POPF_MASK) | (value & _POPF_MASK)
        regs.rip = next_ip
    elif m == _M.RET:
        target = _read_u64(read, int(regs.rsp))
        pop = 8 + (insn.immediate16 if insn.code == iced.Code.RETNQ_IMM16 else 0)
        regs.rsp = (regs.rsp + pop) & MASK64
        regs.rip = target
    elif m == _M.JMP:
        regs.rip = _branch_target(insn, regs, read)
    elif m == _M.CALL:
        target = _branch_target(insn, regs, read)
        _push(regs, next_ip, writes)
        regs.rip = target
    elif insn.code in _COUNTER_BRANCHES:
        # loop/loopcc decrement rcx (or ecx) without touching flags; jrcxz only tests it.
        width, decrements, zf_needed = _COUNTER_BRANCHES[insn.code]
        mask = (1 << width) - 1
        count = int(regs.rcx) & mask
        if decrements:
            count = (count - 1) & mask
            regs.rcx = count  # with ecx as the counter, the 32-bit write zero-extends
            taken = count != 0 and (zf_needed is None or bool(regs.eflags & FLAG_ZF) == zf_needed)
        else:
            taken = count == 0
        regs.rip = int(insn.near_branch_target) if taken else next_ip
    elif insn.flow_control == _FC.CONDITIONAL_BRANCH:
        taken = condition_holds(insn.condition_code, int(regs.eflags))
        regs.rip = int(insn.near_branch_target) if taken else next_ip
    elif m == _M.MOV:
        write_reg(regs, insn.op0_register, read_reg(regs, insn.op1_register))
        regs.rip = next_ip
    elif m == _M.LEA:
        write_reg(regs, insn.op0_register, effective_address(insn, regs, with_segment=False))
        regs.rip = next_ip
    else:
        raise EmulationFault(f"{insn} is not emulated")
    return writes


Emulator = Callable[[Regs, ReadMemory], list[MemoryWrite]]


def prepare(insn: iced.Instruction) -> Emulator | None:
    """A function emulating `insn` with everything it needs read out of the decoder once; None if
    `can_emulate` refuses it. Specialized forms for the instructions probes meet most (function
    entries: push reg, nops, mov reg,reg; exits: ret); the general `emulate` for the rest."""
    if not can_emulate(insn):
        return None
    next_ip = int(insn.next_ip)
    m = insn.mnemonic
    if m in _NOPS:

        def nop(regs: Regs, read: ReadMemory) -> list[MemoryWrite]:
            regs.rip = next_ip
            return []

        return nop
    if m == _M.PUSH and insn.op0_kind == _OK.REGISTER:
        reg = insn.op0_register

        def push(regs: Regs, read: ReadMemory) -> list[MemoryWrite]:
            value = read_reg(regs, reg)
            rsp = (regs.rsp - 8) & MASK64
            regs.rsp = rsp
            regs.rip = next_ip
            return [(rsp, value.to_bytes(8, "little"))]

        return push
    if m == _M.RET and insn.code == iced.Code.RETNQ:

        def ret(regs: Regs, read: ReadMemory) -> list[MemoryWrite]:
            target = _read_u64(read, int(regs.rsp))
            regs.rsp = (regs.rsp + 8) & MASK64
            regs.rip = target
            return []

        return ret
    return lambda regs, read: emulate(insn, regs, read, checked=True)
