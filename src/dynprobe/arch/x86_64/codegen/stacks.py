"""The stack walker the target runs (issue 20): a routine a detour calls, walking the thread's
stack with the rows of arch/x86_64/unwind.py that dynprobe maps into the target (a directory of
modules, each with its sorted addresses and its rows), frame pointers where no row says, and
the shadow stack for return addresses dynprobe replaced. Every read of the stack and of the
tables may fault (the target owns both): a fault ends the walk, as a cut stack.

The routine, called with the System V ABI's caller-saved registers free:
    in:  rdi pc (the innermost frame, exact), rsi rsp, rdx rbp, rcx where to store the frames
         (0: none): each its address, the number + 1 of the directory's entry it is in at
         MODULE_SHIFT (0: none; the file mapped there then, which a library mapped there later
         does not change), and EXACT_FRAME where the thread was (the first frame, those a
         signal interrupted) rather than a return address; r8 at most this many frames
         (AT_ENTRY set: the first frame is a function's first instruction, whose return
         address is at rsp even where no row says so), r9 the hash's seed
    out: rax a hash of the frames (as stored, and of the seed), rdx the number of frames, bit 63
         set when the walk may have missed frames (cut)
It runs twice for a new stack: once to hash it, once more to store it (core/ decides).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import iced_x86 as iced

from dynprobe.arch.x86_64.codegen.asm import Asm, C, R, gs_at, mem_at
from dynprobe.arch.x86_64.unwind import GREG_RBP, GREG_RIP, GREG_RSP, RSP, UCONTEXT_GREGS, BpRule, Kind, Row, pack
from dynprobe.ringbuf import layout as L

if TYPE_CHECKING:  # the enum types exist in the stubs only; at run time the values are ints
    from iced_x86._iced_x86_py import Code as CodeT
    from iced_x86._iced_x86_py import Register as RegisterT

# The directory of modules in the target: a u64 count, then entries of these u64 fields.
DIR_COUNT, DIR_POINTS, DIR_ENTRIES = 0, 8, 16  # (POINTS: the return trampoline's entry point 0, 0: none)
DIR_START, DIR_SIZE, DIR_BASE, DIR_IPS, DIR_ROWS, DIR_ROW_COUNT, DIR_BLOCKS, DIR_BLOCK_COUNT = range(0, 64, 8)
DIR_ENTRY = 64  # bytes of an entry: the module's runtime [start, start+size), the runtime
# address its table's u32 addresses are offsets from, where its u32 addresses and its u64 rows
# are and how many, and its blocks' u32 bounds: for each BLOCK bytes of code, how many addresses
# are at or below the block's first (a search looks only between a block's bound and the next's,
# as the kernel's ORC lookup table does)
BLOCK_SHIFT = 8
MAX_MODULES = 256
DIR_BYTES = DIR_ENTRIES + MAX_MODULES * DIR_ENTRY
MAX_ROWS = 1 << 24
# The table of stacks a process's probes count by (`emit_stack_count`): slots. A slot is
# claimed for a stack by writing its key (its hash, made odd: never 0); its frames are written
# then, and its probe word last (the probe's index, READY at bit 32): the tracer reads a slot
# once it is ready. Hits add to its count, from any thread (lock inc).
SLOT_KEY, SLOT_COUNT, SLOT_SUM, SLOT_FRAMES_CUT, SLOT_PROBE, SLOT_FRAMES = 0, 8, 16, 24, 32, 40  # frames: n | CUT
SLOT_READY = 1 << 32
MAX_STACK_FRAMES = 127  # as bpftrace's ustack
SLOT_SIZE = SLOT_FRAMES + 8 * MAX_STACK_FRAMES
TABLE_PROBES = 32  # slots looked at for a stack, from its hash's (open addressing)
HASH_MULTIPLIER = 0x9E3779B97F4A7C15  # (Fibonacci hashing's: a table's slot is the hash's top bits)
CUT = 1 << 63
AT_ENTRY = 1 << 62  # in r8 with the frames: the first frame is a function's first instruction
EXACT_FRAME = 1 << 63
MODULE_SHIFT = 48  # (user-space addresses are below 2^47)
FRAME_ADDRESS = (1 << MODULE_SHIFT) - 1
# flags in r11
_EXACT, _BP_LOST, _CUT, _ENTRY = 1, 2, 4, 8


def _mov(dst: RegisterT | iced.MemoryOperand, src: RegisterT | iced.MemoryOperand) -> iced.Instruction:
    if isinstance(src, iced.MemoryOperand):
        assert not isinstance(dst, iced.MemoryOperand)
        return iced.Instruction.create_reg_mem(C.MOV_R64_RM64, dst, src)
    if isinstance(dst, iced.MemoryOperand):
        return iced.Instruction.create_mem_reg(C.MOV_RM64_R64, dst, src)
    return iced.Instruction.create_reg_reg(C.MOV_R64_RM64, dst, src)


def _reg_imm(code: CodeT, reg: RegisterT, value: int) -> iced.Instruction:
    return iced.Instruction.create_reg_i32(code, reg, value)


def build_stack_walker(asm: Asm, *, directory: int, shadow: int) -> None:
    """The routine (see the module's docstring), `directory` the address of the modules'
    directory (with the return trampoline's entry point 0, made after the walker maybe),
    `shadow` the shadow stack's offset in the thread area."""
    callee_saved = (R.RBX, R.R12, R.R13, R.R14, R.R15)
    frame, no_store, modules, no_module, found, record, search, less, searched = (asm.label() for _ in range(9))
    by_frame_pointer, cfa_row, signal, plt, caller, cut, done, not_lost = (asm.label() for _ in range(8))
    base_sp, bp_done, plt_base, translated, to_caller, cut_popped = (asm.label() for _ in range(6))
    started, no_entry = asm.label(), asm.label()
    for reg in callee_saved:
        asm.add(iced.Instruction.create_reg(C.PUSH_R64, reg))
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.R11D, _EXACT))
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R32_RM32, R.R12D, R.R8D))  # max frames
    asm.add(_reg_imm(C.BT_RM64_IMM8, R.R8, AT_ENTRY.bit_length() - 1))
    asm.jump(C.JAE_REL32_64, started)
    asm.add(_reg_imm(C.OR_RM64_IMM8, R.R11, _ENTRY))
    asm.bind(started)
    asm.add(_mov(R.R14, R.R9))  # the hash
    asm.add(_mov(R.R8, R.RDI))  # pc
    asm.add(_mov(R.R9, R.RSI))  # sp
    asm.add(_mov(R.R10, R.RDX))  # bp
    asm.add(_mov(R.RDI, R.RCX))  # where frames go
    asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.R13D, R.R13D))  # frames so far

    asm.bind(frame)  # r8: this frame's address
    # rax: the address to look up (a return address: the call before it)
    asm.add(_mov(R.RAX, R.R8))
    asm.add(iced.Instruction.create_reg_i32(C.TEST_RM64_IMM32, R.R11, _EXACT))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RCX, mem_at(R.RAX, -1)))
    asm.add(iced.Instruction.create_reg_reg(C.CMOVE_R64_RM64, R.RAX, R.RCX))
    # rcx: the module's entry, rsi its number + 1 (a linear search: tens of modules, the first
    # ones the most used); rcx 0 and rsi 0 in none
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RCX, directory))
    asm.add(_mov(R.RDX, mem_at(R.RCX, DIR_COUNT)), fault=cut)
    asm.add(_reg_imm(C.CMP_RM64_IMM32, R.RDX, MAX_MODULES))
    asm.jump(C.JA_REL32_64, no_module)
    asm.add(_mov(R.RSI, R.RDX))
    asm.add(_reg_imm(C.ADD_RM64_IMM32, R.RCX, DIR_ENTRIES))
    asm.bind(modules)
    asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RDX, R.RDX))
    asm.jump(C.JE_REL32_64, no_module)
    asm.add(_mov(R.RBX, R.RAX))
    asm.add(iced.Instruction.create_reg_mem(C.SUB_R64_RM64, R.RBX, mem_at(R.RCX, DIR_START)), fault=cut)
    asm.add(iced.Instruction.create_reg_mem(C.CMP_R64_RM64, R.RBX, mem_at(R.RCX, DIR_SIZE)), fault=cut)
    asm.jump(C.JB_REL32_64, found)
    asm.add(_reg_imm(C.ADD_RM64_IMM32, R.RCX, DIR_ENTRY))
    asm.add(iced.Instruction.create_reg(C.DEC_RM64, R.RDX))
    asm.jump(C.JMP_REL32_64, modules)
    asm.bind(no_module)
    asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.ECX, R.ECX))
    asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.ESI, R.ESI))
    asm.jump(C.JMP_REL32_64, record)
    asm.bind(found)
    asm.add(iced.Instruction.create_reg_reg(C.SUB_R64_RM64, R.RSI, R.RDX))
    asm.add(iced.Instruction.create_reg(C.INC_RM64, R.RSI))

    # The frame: its address, its module's number + 1 (MODULE_SHIFT), EXACT_FRAME; stored, hashed
    asm.bind(record)
    asm.add(_mov(R.RBX, R.RSI))
    asm.add(_reg_imm(C.SHL_RM64_IMM8, R.RBX, MODULE_SHIFT))
    asm.add(iced.Instruction.create_reg_reg(C.OR_R64_RM64, R.RBX, R.R8))
    asm.add(_mov(R.RDX, R.R11))
    asm.add(_reg_imm(C.SHL_RM64_IMM8, R.RDX, 63))
    asm.add(iced.Instruction.create_reg_reg(C.OR_R64_RM64, R.RBX, R.RDX))
    asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RDI, R.RDI))
    asm.jump(C.JE_REL32_64, no_store)
    asm.add(_mov(iced.MemoryOperand(R.RDI, R.R13, 8), R.RBX), fault=cut)
    asm.bind(no_store)
    asm.add(iced.Instruction.create_reg_reg(C.XOR_R64_RM64, R.R14, R.RBX))
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RDX, HASH_MULTIPLIER))
    asm.add(iced.Instruction.create_reg_reg(C.IMUL_R64_RM64, R.R14, R.RDX))
    asm.add(iced.Instruction.create_reg(C.INC_RM64, R.R13))
    asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.R13, R.R12))
    asm.jump(C.JAE_REL32_64, cut)
    asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RCX, R.RCX))
    asm.jump(C.JE_REL32_64, by_frame_pointer)  # in no module with a table (JIT code)

    # eax: the address as an offset in the table; rbx: how many of its addresses are at or below
    # it (the last of them: its row), searched between the bounds its block of code gives
    asm.add(iced.Instruction.create_reg_mem(C.SUB_R64_RM64, R.RAX, mem_at(R.RCX, DIR_BASE)), fault=cut)
    asm.add(_mov(R.RBX, R.RAX))
    asm.add(_reg_imm(C.SHR_RM64_IMM8, R.RBX, 32))
    asm.jump(C.JNE_REL32_64, by_frame_pointer)
    asm.add(iced.Instruction.create_reg(C.PUSH_R64, R.RCX))  # (the entry, popped before a fault goes to `cut`)
    asm.add(_mov(R.RSI, mem_at(R.RCX, DIR_IPS)), fault=cut_popped)
    asm.add(_mov(R.RDX, mem_at(R.RCX, DIR_ROW_COUNT)), fault=cut_popped)
    asm.add(_reg_imm(C.CMP_RM64_IMM32, R.RDX, MAX_ROWS))
    asm.jump(C.JA_REL32_64, cut_popped)
    asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.EBX, R.EBX))  # rbx: low, rdx: high
    asm.add(_mov(R.R15, R.RAX))
    asm.add(_reg_imm(C.SHR_RM64_IMM8, R.R15, BLOCK_SHIFT))
    asm.add(iced.Instruction.create_reg(C.INC_RM64, R.R15))
    asm.add(iced.Instruction.create_reg_mem(C.CMP_R64_RM64, R.R15, mem_at(R.RCX, DIR_BLOCK_COUNT)), fault=cut_popped)
    asm.jump(C.JAE_REL32_64, search)  # (past the blocks: the whole table)
    asm.add(_mov(R.RCX, mem_at(R.RCX, DIR_BLOCKS)), fault=cut_popped)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.EBX, iced.MemoryOperand(R.RCX, R.R15, 4, -4)),
            fault=cut_popped)  # fmt: skip
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.ECX, iced.MemoryOperand(R.RCX, R.R15, 4)),
            fault=cut_popped)  # fmt: skip
    asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RCX, R.RDX))  # (the target may have written them)
    asm.add(iced.Instruction.create_reg_reg(C.CMOVB_R64_RM64, R.RDX, R.RCX))
    asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RBX, R.RDX))
    asm.add(iced.Instruction.create_reg_reg(C.CMOVA_R64_RM64, R.RBX, R.RDX))
    asm.bind(search)
    asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RBX, R.RDX))
    asm.jump(C.JAE_REL32_64, searched)
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RCX, iced.MemoryOperand(R.RBX, R.RDX)))
    asm.add(_reg_imm(C.SHR_RM64_IMM8, R.RCX, 1))
    asm.add(iced.Instruction.create_reg_mem(C.CMP_R32_RM32, R.EAX, iced.MemoryOperand(R.RSI, R.RCX, 4)),
            fault=cut_popped)  # fmt: skip
    asm.jump(C.JB_REL32_64, less)
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RBX, mem_at(R.RCX, 1)))
    asm.jump(C.JMP_REL32_64, search)
    asm.bind(less)
    asm.add(_mov(R.RDX, R.RCX))
    asm.jump(C.JMP_REL32_64, search)
    asm.bind(cut_popped)
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RCX))
    asm.jump(C.JMP_REL32_64, cut)
    asm.bind(searched)
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RCX))
    asm.add(_mov(R.R15, mem_at(R.RCX, DIR_ROWS)), fault=cut)
    asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RBX, R.RBX))
    asm.jump(C.JE_REL32_64, by_frame_pointer)  # below the table's first address
    asm.add(_mov(R.RAX, iced.MemoryOperand(R.R15, R.RBX, 8, -8)), fault=cut)  # the row
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R32_RM32, R.ECX, R.EAX))
    asm.add(_reg_imm(C.AND_RM32_IMM8, R.ECX, 7))
    for kind, label in ((Kind.CFA, cfa_row), (Kind.END, done), (Kind.SIGNAL, signal), (Kind.PLT, plt)):
        asm.add(_reg_imm(C.CMP_RM32_IMM8, R.ECX, kind))
        asm.jump(C.JE_REL32_64, label)

    # No row: frame pointers (rbx the return address, then the caller's sp and bp)
    asm.bind(by_frame_pointer)
    asm.add(_reg_imm(C.TEST_RM64_IMM32, R.R11, _ENTRY))  # (the first frame, at a function's entry:
    asm.jump(C.JE_REL32_64, no_entry)  # its return address at rsp)
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, pack(Row(Kind.CFA, RSP, 8, BpRule.SAME, 0))))
    asm.jump(C.JMP_REL32_64, cfa_row)
    asm.bind(no_entry)
    asm.add(_reg_imm(C.OR_RM64_IMM8, R.R11, _CUT))
    asm.add(_reg_imm(C.TEST_RM64_IMM32, R.R11, _BP_LOST))
    asm.jump(C.JNE_REL32_64, cut)
    asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.R10, R.R9))
    asm.jump(C.JB_REL32_64, cut)
    asm.add(_reg_imm(C.TEST_RM64_IMM32, R.R10, 7))
    asm.jump(C.JNE_REL32_64, cut)
    asm.add(_mov(R.RBX, mem_at(R.R10, 8)), fault=cut)
    asm.add(_mov(R.RCX, mem_at(R.R10)), fault=cut)
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.R9, mem_at(R.R10, 16)))
    asm.add(_mov(R.R10, R.RCX))
    asm.jump(C.JMP_REL32_64, to_caller)

    # A CFA row: rcx the CFA (rsp or rbp plus the row's offset), rbx the return address
    asm.bind(cfa_row)
    asm.add(_mov(R.RCX, R.R9))
    asm.add(_reg_imm(C.TEST_RM32_IMM32, R.EAX, 8))
    asm.jump(C.JE_REL32_64, base_sp)
    asm.add(_reg_imm(C.TEST_RM64_IMM32, R.R11, _BP_LOST))
    asm.jump(C.JNE_REL32_64, cut)
    asm.add(_mov(R.RCX, R.R10))
    asm.bind(base_sp)
    asm.add(_mov(R.RDX, R.RAX))
    asm.add(_reg_imm(C.SAR_RM64_IMM8, R.RDX, 32))
    asm.add(iced.Instruction.create_reg_reg(C.ADD_R64_RM64, R.RCX, R.RDX))
    asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RCX, R.R9))
    asm.jump(C.JBE_REL32_64, cut)  # (a caller's frame is above its callee's)
    asm.add(_mov(R.RBX, mem_at(R.RCX, -8)), fault=cut)
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R32_RM32, R.EDX, R.EAX))
    asm.add(_reg_imm(C.SHR_RM32_IMM8, R.EDX, 4))
    asm.add(_reg_imm(C.AND_RM32_IMM8, R.EDX, 3))
    asm.add(_reg_imm(C.CMP_RM32_IMM8, R.EDX, BpRule.SAVED))
    asm.jump(C.JNE_REL32_64, not_lost)
    asm.add(_mov(R.RDX, R.RAX))
    asm.add(_reg_imm(C.SHL_RM64_IMM8, R.RDX, 32))
    asm.add(_reg_imm(C.SAR_RM64_IMM8, R.RDX, 48))  # the signed 16 bits at bit 16
    asm.add(_mov(R.R10, iced.MemoryOperand(R.RCX, R.RDX)), fault=cut)
    asm.add(_reg_imm(C.AND_RM64_IMM8, R.R11, ~_BP_LOST))
    asm.jump(C.JMP_REL32_64, bp_done)
    asm.bind(not_lost)
    asm.add(_reg_imm(C.CMP_RM32_IMM8, R.EDX, BpRule.LOST))
    asm.jump(C.JNE_REL32_64, bp_done)
    asm.add(_reg_imm(C.OR_RM64_IMM8, R.R11, _BP_LOST))
    asm.bind(bp_done)
    asm.add(_mov(R.R9, R.RCX))
    asm.jump(C.JMP_REL32_64, to_caller)

    # A PLT stub: CFA rsp + offset, 8 more once its push ran ((pc & 15) >= the threshold)
    asm.bind(plt)
    asm.add(_mov(R.RCX, R.RAX))
    asm.add(_reg_imm(C.SAR_RM64_IMM8, R.RCX, 32))
    asm.add(iced.Instruction.create_reg_reg(C.ADD_R64_RM64, R.RCX, R.R9))
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R32_RM32, R.EDX, R.R8D))
    asm.add(_reg_imm(C.AND_RM32_IMM8, R.EDX, 15))
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R32_RM32, R.EBX, R.EAX))
    asm.add(_reg_imm(C.SHR_RM32_IMM8, R.EBX, 16))
    asm.add(iced.Instruction.create_reg_reg(C.CMP_R32_RM32, R.EDX, R.EBX))
    asm.jump(C.JB_REL32_64, plt_base)
    asm.add(_reg_imm(C.ADD_RM64_IMM8, R.RCX, 8))
    asm.bind(plt_base)
    asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RCX, R.R9))
    asm.jump(C.JBE_REL32_64, cut)
    asm.add(_mov(R.RBX, mem_at(R.RCX, -8)), fault=cut)
    asm.add(_mov(R.R9, R.RCX))
    asm.jump(C.JMP_REL32_64, to_caller)

    # A signal frame: the interrupted registers, from the ucontext at rsp
    asm.bind(signal)
    gregs = UCONTEXT_GREGS
    asm.add(_mov(R.RBX, mem_at(R.R9, gregs + 8 * GREG_RIP)), fault=cut)
    asm.add(_mov(R.R10, mem_at(R.R9, gregs + 8 * GREG_RBP)), fault=cut)
    asm.add(_mov(R.R9, mem_at(R.R9, gregs + 8 * GREG_RSP)), fault=cut)
    asm.add(_reg_imm(C.AND_RM64_IMM8, R.R11, ~(_BP_LOST | _ENTRY)))
    asm.add(_reg_imm(C.OR_RM64_IMM8, R.R11, _EXACT))
    asm.jump(C.JMP_REL32_64, caller)

    # rbx: the caller's address, as the trampoline's shadow entries say it is (an interrupted
    # thread at an entry point has returned to what its entry holds)
    asm.bind(to_caller)
    asm.add(_reg_imm(C.AND_RM64_IMM8, R.R11, ~(_EXACT | _ENTRY)))
    asm.bind(caller)
    # rbx a return address: if it is entry point k of the trampoline (entry point 0 + k * STRIDE),
    # the original its shadow entry holds (through a chain of them); one inside an entry point
    # (not at its start) ends the walk
    again = asm.label()
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.ESI, L.SHADOW_CAPACITY))  # (a loop bound)
    asm.bind(again)
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RCX, directory))
    asm.add(_mov(R.RDX, mem_at(R.RCX, DIR_POINTS)), fault=cut)
    asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RDX, R.RDX))
    asm.jump(C.JE_REL32_64, translated)
    asm.add(_mov(R.RAX, R.RBX))
    asm.add(iced.Instruction.create_reg_reg(C.SUB_R64_RM64, R.RAX, R.RDX))
    asm.add(_reg_imm(C.CMP_RM64_IMM32, R.RAX, L.SHADOW_CAPACITY * L.TRAMPOLINE_STRIDE))
    asm.jump(C.JAE_REL32_64, translated)
    asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.EDX, R.EDX))
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.ECX, L.TRAMPOLINE_STRIDE))
    asm.add(iced.Instruction.create_reg(C.DIV_RM64, R.RCX))  # rax = k, rdx = within the entry point
    asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RDX, R.RDX))
    asm.jump(C.JNE_REL32_64, cut)
    asm.add(_reg_imm(C.SHL_RM64_IMM8, R.RAX, L.SHADOW_ENTRY.bit_length() - 1))
    asm.add(_mov(R.RBX, gs_at(shadow + L.ENTRY_RET, R.RAX)), fault=cut)
    asm.add(iced.Instruction.create_reg(C.DEC_RM32, R.ESI))
    asm.jump(C.JNE_REL32_64, again)
    asm.jump(C.JMP_REL32_64, cut)  # (a loop of entries: the target wrote them)
    asm.bind(translated)
    asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RBX, R.RBX))
    asm.jump(C.JE_REL32_64, done)  # (a zero return address: the outermost frame)
    asm.add(_mov(R.R8, R.RBX))
    asm.jump(C.JMP_REL32_64, frame)

    asm.bind(cut)
    asm.add(_reg_imm(C.OR_RM64_IMM8, R.R11, _CUT))
    asm.bind(done)
    asm.add(_mov(R.RAX, R.R14))
    asm.add(_mov(R.RDX, R.R13))
    asm.add(_reg_imm(C.TEST_RM64_IMM32, R.R11, _CUT))
    no_cut = asm.label()
    asm.jump(C.JE_REL32_64, no_cut)
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RCX, CUT))
    asm.add(iced.Instruction.create_reg_reg(C.OR_R64_RM64, R.RDX, R.RCX))
    asm.bind(no_cut)
    for reg in reversed(callee_saved):
        asm.add(iced.Instruction.create_reg(C.POP_R64, reg))
    asm.add(iced.Instruction.create(C.RETNQ))


def emit_stack_count(asm: Asm, *, walker: int, table: int, slots: int, max_frames: int, probe_index: int,
                     site: int | None, frame: int, missed: int, at_entry: bool, add_value: bool) -> None:  # fmt: skip
    """In a detour's actions (rsp + `frame`: the thread's rsp at `site`, a function's first
    instruction if `at_entry`; `site` None: at [rsp], pushed by the caller, as return code
    has it: where the return went back to); rbp the thread's; rax,
    rcx, rdx, rsi, rdi free, r8-r11 kept): add the hit to its stack's slot in the table at
    `table` (`slots` of them, a power of two), claiming one for a stack new to the probe (the
    walker then runs again to store its frames), or, when none is free where it looks, to the
    probe's missed hits (gs:[`missed`]); `add_value`: rax holds a value the slot's SLOT_SUM adds
    up too. The slot's address is left in gs:[STACK_SLOT] (0: none) for the hit's record."""
    assert slots >= 2 and not slots & (slots - 1), "a power of two, 2 or more"
    kept = (R.R8, R.R9, R.R10, R.R11)
    probe, claimed, counted, following, done = (asm.label() for _ in range(5))
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.STACK_SLOT), 0))
    value_at = 8 * len(kept)  # (from rsp, once the kept registers are pushed)
    if add_value:
        asm.add(iced.Instruction.create_reg(C.PUSH_R64, R.RAX))
    for reg in kept:
        asm.add(iced.Instruction.create_reg(C.PUSH_R64, reg))

    def walk(store: bool) -> None:
        """rax, rdx: the walker's hash and frames (rsi, stored: the slot, kept on the stack)."""
        pushed = 8 * len(kept) + (8 if store else 0) + (8 if add_value else 0)
        if site is None:
            asm.add(_mov(R.RDI, mem_at(R.RSP, pushed)))
        else:
            asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RDI, site))
        asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSI, mem_at(R.RSP, frame + pushed)))
        asm.add(_mov(R.RDX, R.RBP))
        if store:
            asm.add(_mov(R.RCX, mem_at(R.RSP)))
            asm.add(_reg_imm(C.ADD_RM64_IMM32, R.RCX, SLOT_FRAMES))
        else:
            asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.ECX, R.ECX))
        asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.R8, max_frames | (AT_ENTRY if at_entry else 0)))
        asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.R9D, probe_index + 1))
        asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, walker))
        asm.add(iced.Instruction.create_reg(C.CALL_RM64, R.RAX))

    walk(store=False)
    asm.add(_mov(R.R8, R.RAX))
    asm.add(_reg_imm(C.OR_RM64_IMM8, R.R8, 1))  # the key
    asm.add(_mov(R.RCX, R.RAX))
    asm.add(_reg_imm(C.SHR_RM64_IMM8, R.RCX, 64 - (slots.bit_length() - 1)))  # (the hash's top bits)
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.R10D, TABLE_PROBES))
    asm.bind(probe)
    asm.add(iced.Instruction.create_reg_reg_i32(C.IMUL_R64_RM64_IMM32, R.RSI, R.RCX, SLOT_SIZE))
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, table))
    asm.add(iced.Instruction.create_reg_reg(C.ADD_R64_RM64, R.RSI, R.RAX))
    asm.add(_mov(R.RAX, mem_at(R.RSI, SLOT_KEY)), fault=done)
    asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RAX, R.R8))
    asm.jump(C.JE_REL32_64, counted)
    asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RAX, R.RAX))
    asm.jump(C.JNE_REL32_64, following)
    # rax 0: the slot is ours if it still is
    cmpxchg = iced.Instruction.create_mem_reg(C.CMPXCHG_RM64_R64, mem_at(R.RSI, SLOT_KEY), R.R8)
    cmpxchg.has_lock_prefix = True
    asm.add(cmpxchg, fault=done)
    asm.jump(C.JE_REL32_64, claimed)
    asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RAX, R.R8))  # taken meanwhile: by this stack?
    asm.jump(C.JE_REL32_64, counted)
    asm.jump(C.JMP_REL32_64, following)
    asm.bind(claimed)
    asm.add(iced.Instruction.create_reg(C.PUSH_R64, R.RSI))
    walk(store=True)
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RSI))
    asm.add(_mov(mem_at(R.RSI, SLOT_FRAMES_CUT), R.RDX), fault=done)
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, SLOT_READY | probe_index))
    asm.add(_mov(mem_at(R.RSI, SLOT_PROBE), R.RAX), fault=done)  # (after its frames: x86 keeps stores in order)
    asm.bind(counted)
    increment = iced.Instruction.create_mem(C.INC_RM64, mem_at(R.RSI, SLOT_COUNT))
    increment.has_lock_prefix = True
    asm.add(increment, fault=done)
    if add_value:
        asm.add(_mov(R.RAX, mem_at(R.RSP, value_at)))
        added = iced.Instruction.create_mem_reg(C.ADD_RM64_R64, mem_at(R.RSI, SLOT_SUM), R.RAX)
        added.has_lock_prefix = True
        asm.add(added, fault=done)
    asm.add(_mov(gs_at(L.STACK_SLOT), R.RSI))  # (for the hit's record)
    asm.jump(C.JMP_REL32_64, done)
    asm.bind(following)
    asm.add(iced.Instruction.create_reg(C.INC_RM32, R.ECX))
    asm.add(_reg_imm(C.AND_RM32_IMM32, R.ECX, slots - 1))
    asm.add(iced.Instruction.create_reg(C.DEC_RM32, R.R10D))
    asm.jump(C.JNE_REL32_64, probe)
    asm.add(iced.Instruction.create_mem(C.INC_RM64, gs_at(missed)))
    asm.bind(done)
    for reg in reversed(kept):
        asm.add(iced.Instruction.create_reg(C.POP_R64, reg))
    if add_value:
        asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, mem_at(R.RSP, 8)))
