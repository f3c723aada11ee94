"""Register and memory operand access on a `Regs` value, with x86-64 write semantics."""

from __future__ import annotations

import iced_x86 as iced

from dynprobe.arch.x86_64.regs import GPR64, MASK64, Regs

_R = iced.Register

# iced register -> (64-bit register name, bit offset, width in bits)
_GPR: dict[int, tuple[str, int, int]] = {}
for _i, _name in enumerate(GPR64):
    _GPR[getattr(_R, _name.upper())] = (_name, 0, 64)
_LEGACY = ("AX", "CX", "DX", "BX", "SP", "BP", "SI", "DI")
for _i, _name in enumerate(GPR64):
    if _i < 8:
        _GPR[getattr(_R, "E" + _LEGACY[_i])] = (_name, 0, 32)
        _GPR[getattr(_R, _LEGACY[_i])] = (_name, 0, 16)
    else:
        _GPR[getattr(_R, f"R{_i}D")] = (_name, 0, 32)
        _GPR[getattr(_R, f"R{_i}W")] = (_name, 0, 16)
        _GPR[getattr(_R, f"R{_i}L")] = (_name, 0, 8)
for _reg, _name in (("AL", "rax"), ("CL", "rcx"), ("DL", "rdx"), ("BL", "rbx"),
                    ("SPL", "rsp"), ("BPL", "rbp"), ("SIL", "rsi"), ("DIL", "rdi")):  # fmt: skip
    _GPR[getattr(_R, _reg)] = (_name, 0, 8)
for _reg, _name in (("AH", "rax"), ("CH", "rcx"), ("DH", "rdx"), ("BH", "rbx")):
    _GPR[getattr(_R, _reg)] = (_name, 8, 8)


def is_gpr(reg: int) -> bool:
    return reg in _GPR


def gpr_width(reg: int) -> int:
    return _GPR[reg][2]


def read_reg(regs: Regs, reg: int) -> int:
    name, shift, width = _GPR[reg]
    return (int(getattr(regs, name)) >> shift) & ((1 << width) - 1)


def write_reg(regs: Regs, reg: int, value: int) -> None:
    """Write with hardware semantics: 32-bit writes zero-extend, 8/16-bit writes merge."""
    name, shift, width = _GPR[reg]
    value &= (1 << width) - 1
    if width == 64 or width == 32:
        setattr(regs, name, value)
        return
    mask = ((1 << width) - 1) << shift
    old = int(getattr(regs, name))
    setattr(regs, name, (old & ~mask & MASK64) | (value << shift))


def effective_address(insn: iced.Instruction, regs: Regs, with_segment: bool = True) -> int:
    """The address a memory operand names (RIP-relative and fs/gs bases included)."""
    if insn.is_ip_rel_memory_operand:
        addr = int(insn.ip_rel_memory_address)
    else:
        addr = int(insn.memory_displacement)
        if insn.memory_base != _R.NONE:
            addr += read_reg(regs, insn.memory_base)
        if insn.memory_index != _R.NONE:
            addr += read_reg(regs, insn.memory_index) * insn.memory_index_scale
    if with_segment:
        if insn.memory_segment == _R.FS:
            addr += int(regs.fs_base)
        elif insn.memory_segment == _R.GS:
            addr += int(regs.gs_base)
    return addr & MASK64
