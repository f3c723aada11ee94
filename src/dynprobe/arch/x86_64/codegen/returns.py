"""The return machinery's code (docs/architecture.md §7): the trampoline each process gets, a
probe's return code, the trap stub of returns served at a stop, and the entry stamp of a thread
resuming from a trap entry."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import iced_x86 as iced

from dynprobe.actions.model import Program
from dynprobe.arch.x86_64.codegen.actions import Emitter, check_fields
from dynprobe.arch.x86_64.codegen.asm import (
    ENTRY_OFFSET_AT,
    HOOK_ROOM,
    REG,
    SAVED,
    Asm,
    C,
    R,
    Returning,
    Trampoline,
    Unsupported,
    gs_at,
    mem_at,
    stack_at,
)
from dynprobe.arch.x86_64.codegen.records import one_less_pending, resume_through_area
from dynprobe.arch.x86_64.decode import iter_instructions
from dynprobe.arch.x86_64.optimize import JMP_REL32_LEN
from dynprobe.errors import OptimizeRefusal
from dynprobe.ringbuf import layout as L

if TYPE_CHECKING:  # the enum types exist in the stubs only; at run time the values are ints
    from iced_x86._iced_x86_py import Register as RegisterT


def build_trampoline(layout: L.AreaLayout, at: int) -> tuple[bytes, Trampoline]:
    """The return trampoline of a process, placed at `at`: SHADOW_CAPACITY entries, entry k a
    call (`call [rsp-24]`: see `enter_tail`) then entry point k, `push OFFSET; jmp common`
    (OFFSET: entry k's offset in the shadow stack; the push lands where the return address was),
    then the common part, which saves the registers a probe's return code may use and jumps to
    that code (rsi: the entry's offset, kept on the stack too); the code jumps back to
    `finish`, which frees the entry and returns to the original return address. The function
    was entered by the call of its entry, so the CPU predicted its `ret` and predicts this one:
    the caller's call is the one it pairs with. (A frame entered otherwise, a trap probe's,
    mispredicts both.) Flags are not kept: no caller expects them to survive a call (GCC's flags
    register is fixed: even IPA-RA takes every call to clobber it)."""
    common_at = at + L.SHADOW_CAPACITY * L.TRAMPOLINE_STRIDE
    encoder = iced.Encoder(64)  # entries one by one: the near jump keeps its 5 bytes
    for k in range(L.SHADOW_CAPACITY):
        call = at + k * L.TRAMPOLINE_STRIDE
        encoder.encode(iced.Instruction.create_mem(C.CALL_RM64, stack_at(-8 - HOOK_ROOM)), call)
        point = call + L.TRAMPOLINE_CALL
        encoder.encode(iced.Instruction.create_i32(C.PUSHQ_IMM32, k * L.SHADOW_ENTRY), point)
        encoder.encode(iced.Instruction.create_branch(C.JMP_REL32_64, common_at), point + 5)
    table = bytes(encoder.take_buffer())
    assert len(table) == common_at - at
    asm = Asm()
    finish, popping, popped = asm.label(), asm.label(), asm.label()
    shadow, shift = layout.shadow, L.SHADOW_ENTRY.bit_length() - 1
    slot_at = ENTRY_OFFSET_AT  # the pushed offset, where the return address was
    for name in SAVED:
        asm.add(iced.Instruction.create_reg(C.PUSH_R64, REG[name]))
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RSI, mem_at(R.RSP, slot_at)))
    asm.add(iced.Instruction.create_mem(C.JMP_RM64, gs_at(shadow + L.ENTRY_HANDLER, R.RSI)))
    asm.bind(finish)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RSI, mem_at(R.RSP, slot_at)))
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, gs_at(shadow + L.ENTRY_RET, R.RSI)))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, mem_at(R.RSP, slot_at), R.RAX))
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.SHADOW_BUSY), 1))
    one_less_pending(asm, layout)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(shadow + L.ENTRY_SLOT, R.RSI), 0))
    # Free entries on top go: the stack shrinks back as frames return in order.
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RCX, gs_at(L.SHADOW_TOP)))
    asm.bind(popping)
    asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RCX, R.RCX))
    asm.jump(C.JE_REL32_64, popped)
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RDX, mem_at(R.RCX, -1)))
    asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RDX, shift))
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, gs_at(shadow + L.ENTRY_SLOT, R.RDX), 0))
    asm.jump(C.JNE_REL32_64, popped)
    asm.add(iced.Instruction.create_reg(C.DEC_RM64, R.RCX))
    asm.jump(C.JMP_REL32_64, popping)
    asm.bind(popped)
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(L.SHADOW_TOP), R.RCX))
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.SHADOW_BUSY), 0))
    for name in reversed(SAVED):
        asm.add(iced.Instruction.create_reg(C.POP_R64, REG[name]))
    asm.add(iced.Instruction.create(C.RETNQ))
    finish_index = asm.bound[finish]
    code, _ = asm.encode(common_at)
    starts = [int(insn.ip) for insn in iter_instructions(code, common_at)]
    return table + code, Trampoline(at, starts[finish_index], common_at + len(code))


def build_return_code(
    prog: Program, layout: L.AreaLayout, at: int, trampoline: Trampoline, tsc_mult: int,
    symbol_address: Callable[[str], int | None] = lambda name: None, rseq_offset_at: int | None = None,
) -> bytes | OptimizeRefusal:  # fmt: skip
    """The return part of a return probe, placed at `at`: its filter, counters, histogram or
    record, run by the trampoline (registers saved as a detour saves them), then back to it."""
    asm = Asm()
    returning = Returning(trampoline.points, tsc_mult, at_return=True)
    emitter = Emitter(asm, layout, 0, 0, False, symbol_address, returning, rseq_offset_at)
    try:
        check_fields(prog)
        emitter.program(prog)
    except Unsupported as exc:
        return exc.reason
    asm.add(iced.Instruction.create_branch(C.JMP_REL32_64, trampoline.finish))
    return asm.encode(at)[0]


def stamp(asm: Asm, base: RegisterT, disp: int) -> None:
    """The time-stamp counter into the u64 at gs:[base + disp], flags untouched (rax, rdx used)."""
    asm.add(iced.Instruction.create(C.RDTSC))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM32_R32, gs_at(disp, base), R.EAX))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM32_R32, gs_at(disp + 4, base), R.EDX))


def return_stub_code(layout: L.AreaLayout, at: int, trampoline: Trampoline) -> tuple[bytes, int]:
    """The return code of probes whose return part runs in the tracer, placed at `at`: the
    return's time into the entry (rsi: its offset; rax and rdx saved by the trampoline), then
    `jmp finish`, where an int3 goes: the tracer's clock at the stop would count the trap in the
    call's latency. Returns the code and the address of the jump."""
    asm = Asm()
    stamp(asm, R.RSI, layout.shadow + L.ENTRY_RETURN_TSC)
    asm.add(iced.Instruction.create_branch(C.JMP_REL32_64, trampoline.finish))
    code = asm.encode(at)[0]
    return code, at + len(code) - JMP_REL32_LEN


def build_entry_stamp() -> bytes:
    """Where a thread stopped at a return probe's trap entry resumes (see L.STAMP_BUSY): the
    time-stamp counter into the words the tracer named, registers and flags as they were, then
    on to the resume address. That goes through the stack below the red zone (`ret 128`), not a
    register, and only once STAMP_BUSY is clear: a signal handler's trap entry may then reuse the
    stub. Position-independent."""
    asm = Asm()
    saved = [(reg, L.STAMP_SAVED + 8 * i) for i, reg in enumerate((R.RAX, R.RDX, R.RSI))]
    for reg, at in saved:
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(at), reg))
    asm.add(iced.Instruction.create(C.RDTSC))
    for i in range(L.STAMP_TARGETS_MAX):
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RSI, gs_at(L.STAMP_TARGETS + 8 * i)))
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM32_R32, gs_at(0, R.RSI), R.EAX))
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM32_R32, gs_at(4, R.RSI), R.EDX))
    for reg, at in saved:
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, reg, gs_at(at)))
    resume_through_area(asm)
    return asm.encode(0)[0]
