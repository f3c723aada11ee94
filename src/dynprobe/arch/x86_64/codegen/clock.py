"""Small functions the tracer itself calls (ctypes) to read the time-stamp counter as generated
code does."""

from __future__ import annotations

import iced_x86 as iced

from dynprobe.arch.x86_64.codegen.asm import Asm, C, R, mem_at, read_tsc


def tsc_readings_code() -> bytes:
    """A C-callable `void f(uint64_t reads, uint64_t *out)`: reads the time-stamp counter `reads`
    times back to back into out[0..reads) (how finely the clock can tell two moments apart)."""
    asm = Asm()
    loop = asm.label()
    asm.bind(loop)
    read_tsc(asm)
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, mem_at(R.RSI), R.RAX))
    asm.add(iced.Instruction.create_reg_i32(C.ADD_RM64_IMM8, R.RSI, 8))
    asm.add(iced.Instruction.create_reg(C.DEC_RM64, R.RDI))
    asm.jump(C.JNE_REL32_64, loop)
    asm.add(iced.Instruction.create(C.RETNQ))
    return asm.encode(0)[0]


def read_tsc_code() -> bytes:
    """A C-callable `uint64_t f(void)` returning the time-stamp counter (for the consumer's clock)."""
    asm = Asm()
    read_tsc(asm)
    asm.add(iced.Instruction.create(C.RETNQ))
    return asm.encode(0)[0]
