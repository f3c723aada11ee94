"""What every code generator here shares: iced-x86's codes and registers, the registers a detour
saves and where, memory operands (GS-relative: the thread area), the small assembler (`Asm`:
labels, branches, fix-ups), and the results (`Detour`, `Trampoline`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import iced_x86 as iced

from dynprobe.arch.x86_64.decode import iter_instructions
from dynprobe.arch.x86_64.regs import GPR64
from dynprobe.errors import OptimizeRefusal
from dynprobe.frozen import frozen
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.shadow import trampoline_point

if TYPE_CHECKING:  # the enum types exist in the stubs only; at run time the values are ints
    from iced_x86._iced_x86_py import Code as CodeT
    from iced_x86._iced_x86_py import Register as RegisterT


C = iced.Code
R = iced.Register
RED_ZONE = 128
L_MASK64 = (1 << 64) - 1
SYS_FUTEX = 202
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # shared: the tracer waits and wakes on its own mapping of the same page

# The full form saves these, so fetches of them read the saved copy. r11 keeps the flags (seto/lahf:
# ~2 ns here, pushfq/popfq ~13 ns); only a probe that fetches %flags makes it push them instead.
SAVED = ("rax", "rcx", "rdx", "rsi", "rdi", "r11")
# Offsets from rsp of the saved registers, in a detour and in the return trampoline's frame.
SAVED_AT = {name: 8 * (len(SAVED) - 1 - i) for i, name in enumerate(SAVED)}
FLAGS_AT = 8 * len(SAVED)  # with pushfq, pushed before the registers
# At a return, in the trampoline's frame: the shadow entry's offset, pushed by the entry point
# where the return address was, above the saved registers (all kept: with IPA-RA a caller may
# keep values in any of them across the call).
ENTRY_OFFSET_AT = 8 * len(SAVED)
REG = {name: getattr(R, name.upper()) for name in GPR64}
JCC_UNSIGNED = {"==": C.JE_REL32_64, "!=": C.JNE_REL32_64, "<": C.JB_REL32_64, "<=": C.JBE_REL32_64,
                 ">": C.JA_REL32_64, ">=": C.JAE_REL32_64}  # fmt: skip
JCC_SIGNED = {**JCC_UNSIGNED, "<": C.JL_REL32_64, "<=": C.JLE_REL32_64, ">": C.JG_REL32_64, ">=": C.JGE_REL32_64}


@frozen
class Trampoline:
    """Where a process's return trampoline is: entry k's call (`enter_tail`) at `table + k *
    TRAMPOLINE_STRIDE`, its entry point right after; a probe's return code ends with a jump to
    `finish`."""

    table: int
    finish: int
    end: int

    @functools.cached_property
    def points(self) -> int:
        """Entry point 0 (asked at every return an upcall serves)."""
        return self.table + L.TRAMPOLINE_CALL

    def point(self, k: int) -> int:
        return trampoline_point(self.points, k)


@frozen
class Returning:
    """What a return probe's code needs of the process: the trampoline, the clock; and where it runs."""

    points: int  # the trampoline's entry point 0
    tsc_mult: int  # ns = ticks * tsc_mult >> 32
    at_return: bool  # the code runs at the return (False: at the entry)


@frozen
class Detour:
    """A detour's code, where its loads that may fault go on instead, and where its copy of the region is."""

    code: bytes
    fixups: dict[int, int]  # address of a load that may fault -> address to continue at
    action_bytes: int  # the actions' part; the relocated region follows
    region_copy: dict[int, int] = field(default_factory=dict)  # a region instruction's address -> its copy's


class Unsupported(Exception):
    def __init__(self, reason: OptimizeRefusal) -> None:
        self.reason = reason


def gs_at(disp: int, base: RegisterT = R.NONE, index: RegisterT = R.NONE, scale: int = 1) -> iced.MemoryOperand:
    """gs:[base + index * scale + disp]: in the thread area."""
    return iced.MemoryOperand(base, index, scale, displ=disp, seg=R.GS)


def mem_at(base: RegisterT, disp: int = 0, index: RegisterT = R.NONE) -> iced.MemoryOperand:
    return iced.MemoryOperand(base, index, displ=disp)


# struct rseq (linux/rseq.h): u32 cpu_id_start, then u32 cpu_id (negative: not registered)
RSEQ_CPU_ID = 4
TSC_AUX_CPU = 0xFFF  # Linux keeps the CPU in TSC_AUX's low 12 bits (the node above them)


def stack_at(disp: int) -> iced.MemoryOperand:
    """[rsp + disp]."""
    return iced.MemoryOperand(R.RSP, displ=disp)


@dataclass
class Asm:
    """Instructions with labels: a branch names a label; labels are bound to the next instruction."""

    items: list[iced.Instruction | tuple[CodeT, int]] = field(default_factory=list)  # or (jcc code, label)
    bound: dict[int, int] = field(default_factory=dict)  # label -> index of the instruction
    may_fault: dict[int, int] = field(default_factory=dict)  # index of a load -> label to resume at
    labels: int = 0
    pending: list[int] = field(default_factory=list)

    def label(self) -> int:
        self.labels += 1
        return self.labels

    def bind(self, label: int) -> None:
        self.pending.append(label)

    def add(self, insn: iced.Instruction | tuple[CodeT, int], fault: int | None = None) -> None:
        for label in self.pending:
            self.bound[label] = len(self.items)
        self.pending.clear()
        if fault is not None:
            self.may_fault[len(self.items)] = fault
        self.items.append(insn)

    def jump(self, code: CodeT, label: int) -> None:
        self.add((code, label))

    def encode(self, at: int) -> tuple[bytes, dict[int, int]]:
        assert not self.pending, "a label bound past the last instruction"
        insns = []
        for i, item in enumerate(self.items):
            insn = iced.Instruction.create_branch(item[0], self.bound[item[1]] + 1) if isinstance(item, tuple) else item
            insn.ip = i + 1  # ips double as labels: the block encoder resolves branches between them
            insns.append(insn)
        encoder = iced.BlockEncoder(64)
        encoder.add_many(insns)
        code = bytes(encoder.encode(at))
        if not self.may_fault:
            return code, {}
        starts = [int(insn.ip) for insn in iter_instructions(code, at)]
        assert len(starts) == len(insns), "the block encoder did not keep one instruction per instruction"
        fixups = {starts[i]: starts[self.bound[label]] for i, label in self.may_fault.items()}
        return code, fixups


# Below a hooking function entry's return-address slot S, in the red zone (a signal frame skips
# it): [S - 8], the call of the trampoline entry to go through (0: none), and [S - 16], the
# function's relocated region, which that call calls. `enter_tail` reads them.
HOOK_ROOM = 16


def read_tsc(asm: Asm) -> None:
    """rax: the time-stamp counter (rdx used)."""
    asm.add(iced.Instruction.create(C.RDTSC))
    asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RDX, 32))
    asm.add(iced.Instruction.create_reg_reg(C.OR_R64_RM64, R.RAX, R.RDX))


def encode_with(asm: Asm, at: int, labels: Sequence[int]) -> tuple[bytes, dict[int, int], dict[int, int]]:
    """Encode, and say where the instructions bound to `labels` landed; the fix-ups too."""
    indices = {label: asm.bound[label] for label in labels}
    code, fixups = asm.encode(at)
    starts = [int(insn.ip) for insn in iter_instructions(code, at)]
    return code, {label: starts[i] for label, i in indices.items()}, fixups
