"""How a trap probe resumes past the probed instruction: emulate, boost, or single-step.

The kernel's uprobes choose the same way (arch/x86/kernel/uprobes.c): emulate what is cheap to
model exactly, otherwise run a copy from an out-of-line slot. Here an out-of-line copy ends in a
`jmp` back ("boosted", as kprobes calls it), so it needs no second stop; a single-step is needed
only when a post-handler must run after the instruction, or the copy needs a register fixed after
it ran.
"""

from __future__ import annotations

import enum

import iced_x86 as iced

from dynprobe.arch.x86_64.emulate import can_emulate
from dynprobe.errors import Refusal
from dynprobe.frozen import frozen

_M = iced.Mnemonic


class ResumeKind(enum.Enum):
    EMULATE = "emulated"
    BOOST = "boosted"
    STEP = "single-step"

    # Members are singletons: identity hashing is exact, and C-fast (counted on every probe hit).
    __hash__ = object.__hash__


class Fixup(enum.Flag):
    NONE = 0
    # `syscall` leaves the address after itself in rcx (the slot's, which must read as the site's)
    # and rflags in r11 (with the TF of our single-step, which the target did not set).
    SYSCALL_REGS = enum.auto()


@frozen
class ResumePlan:
    """How a trap probe's thread goes on past the site's instruction, and what its copy needs fixed."""

    kind: ResumeKind
    fixup: Fixup = Fixup.NONE


# Instructions that change privilege, leave the process or depend on where they run in ways no
# relocation can keep.
_REFUSED = {
    _M.INT, _M.INT1, _M.INT3, _M.INTO, _M.IRET, _M.IRETD, _M.IRETQ, _M.SYSENTER, _M.SYSEXIT,
    _M.SYSRET, _M.SYSRETQ, _M.RETF, _M.XBEGIN,
}  # fmt: skip


def plan_resume(insn: iced.Instruction) -> ResumePlan | Refusal:
    """The cheapest correct way to resume past `insn` in trap mode (without a post-handler)."""
    if (
        insn.mnemonic in _REFUSED
        or insn.is_jmp_far
        or insn.is_call_far
        or insn.is_jmp_far_indirect
        or insn.is_call_far_indirect
    ):
        return Refusal.UNSUPPORTED_INSN
    if can_emulate(insn):
        return ResumePlan(ResumeKind.EMULATE)
    if insn.mnemonic == _M.SYSCALL:
        return ResumePlan(ResumeKind.STEP, Fixup.SYSCALL_REGS)
    if insn.mnemonic in (_M.CALL, _M.RET):  # forms not emulated (16-bit operand size, ...)
        return Refusal.UNSUPPORTED_INSN
    return ResumePlan(ResumeKind.BOOST)


def boost_is_cheaper(insn: iced.Instruction) -> bool:
    """Whether an emulated instruction is better run from a slot where the site stays a trap:
    both cost one stop, but a push's emulation writes the stack through /proc/PID/mem (a system
    call, ~7 us a hit here), which the CPU does for nothing. The other emulated instructions
    change registers alone; and a call run from a slot would push the slot's address."""
    return insn.mnemonic in (_M.PUSH, _M.PUSHFQ)


def needs_step_for_post_handler(plan: ResumePlan) -> ResumePlan:
    """With a post-handler, an out-of-line copy must stop right after the instruction."""
    if plan.kind == ResumeKind.BOOST:
        return ResumePlan(ResumeKind.STEP, plan.fixup)
    return plan
