"""x86-64: the narrow interface generic code uses. Pure: never imports ptrace/ or core/.

Maps bytes + address to bytes + offsets: decoding, the resume plan of a trap probe, emulation
on a `Regs` value, relocation to an out-of-line slot.
"""

from __future__ import annotations

from dynprobe.arch.x86_64.analysis import (
    Fixup,
    ResumeKind,
    ResumePlan,
    boost_is_cheaper,
    needs_step_for_post_handler,
    plan_resume,
)
from dynprobe.arch.x86_64.decode import (
    INT3,
    MAX_INSN_LEN,
    Instruction,
    decode_one,
    format_insn,
    instruction_starts,
)
from dynprobe.arch.x86_64.emulate import EmulationFault, Emulator, MemoryWrite, can_emulate, emulate, prepare
from dynprobe.arch.x86_64.regs import FLAG_TF, Regs, canonical_name
from dynprobe.arch.x86_64.relocate import jump_to, out_of_line, relocate

SLOT_SIZE = 64  # relocated instruction (<= 15, a far jcc grows to ~21) + jmp back (<= 14)
# syscall; jmp $: the tracer takes the thread at its syscall's exit (PTRACE_SYSCALL); one left
# there by a tracer that died waits in the loop for the guardian, which puts its registers back
REMOTE_SYSCALL = b"\x0f\x05\xeb\xfe"

__all__ = [
    "FLAG_TF",
    "INT3",
    "MAX_INSN_LEN",
    "REMOTE_SYSCALL",
    "SLOT_SIZE",
    "EmulationFault",
    "Emulator",
    "Fixup",
    "Instruction",
    "MemoryWrite",
    "Regs",
    "ResumeKind",
    "ResumePlan",
    "boost_is_cheaper",
    "can_emulate",
    "canonical_name",
    "decode_one",
    "emulate",
    "format_insn",
    "instruction_starts",
    "jump_to",
    "needs_step_for_post_handler",
    "out_of_line",
    "plan_resume",
    "prepare",
    "relocate",
]
