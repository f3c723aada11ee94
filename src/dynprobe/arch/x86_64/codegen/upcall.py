"""The upcall detour: a site whose probes are Python pre-handlers, served without a ptrace stop
(core/upcalls.py serves it). On the target thread, with its thread area (GS base) and its
process's doorbell page:

    lea rsp, [rsp-128]; pushfq; push rax        over the red zone
    xchg gs:[UPCALL_BUSY], 1                    taken: a nested hit (a signal handler's): no
                                                handler, counted missed, on to the region
    the registers into gs:[UPCALL_FRAME]        (user_regs_struct; rip = the site, rsp as it was)
    gs:[UPCALL_PROBE] = probe; gs:[UPCALL_STATE] = REQUEST
    lock inc [RING]; futex(RING, WAKE)          the tracer waits on its process's doorbell
                                                (no system call while it is AWAKE)
    until gs:[UPCALL_STATE] == ANSWERED:        (spin,) futex(STATE, WAIT, REQUEST, timeout);
                                                [GONE] set (no tracer): on to the region unheard
    the registers back from the frame; rsp = frame.rsp - 128; push frame.rip; IDLE, not BUSY;
    ret 128

Where the thread goes on is the frame's rip, which the tracer sets before it answers: the
relocated copy of the site's instruction (the region, after this code), or wherever a handler
that returned True sent it. `ret 128` takes it from below the red zone, so once BUSY is clear
the thread needs nothing of the frame: a signal's nested hit in those two instructions may
have the frame. The flags and every register are the frame's.

Pure: a plan, a probe, a layout and addresses in, bytes out.
"""

from __future__ import annotations

import iced_x86 as iced

from dynprobe.arch.x86_64.codegen.asm import REG, Asm, C, Detour, R, gs_at, mem_at
from dynprobe.arch.x86_64.optimize import OptimizePlan, relocate_region
from dynprobe.arch.x86_64.regs import REG_NAMES
from dynprobe.errors import OptimizeRefusal
from dynprobe.ringbuf import layout as L

SYS_FUTEX = 202
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # shared: the tracer waits on its own mapping of the same page
UPCALL_SPIN = 1  # pauses before a thread sleeps on its answer: the server runs on its CPU (core/loop.py)
_RED_ZONE = 128
_FRAME = {name: L.UPCALL_FRAME + 8 * i for i, name in enumerate(REG_NAMES)}
# Saved and restored by moves; rax, rsp, rip and the flags take a path of their own.
_MOVED = ("rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15")


def _restore(asm: Asm) -> None:
    """Every register and the flags from the frame, but rsp (the stack is still the detour's)."""
    for name in _MOVED:
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, REG[name], gs_at(_FRAME[name])))
    asm.add(iced.Instruction.create_mem(C.PUSH_RM64, gs_at(_FRAME["eflags"])))
    asm.add(iced.Instruction.create(C.POPFQ))
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, gs_at(_FRAME["rax"])))


def _leave(asm: Asm) -> None:
    """The upcall over: the thread's state idle, no longer busy (moves: the flags are the frame's)."""
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM32_IMM32, gs_at(L.UPCALL_STATE), L.UPCALL_IDLE))
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.UPCALL_BUSY), 0))


def _assemble(plan: OptimizePlan, probe_index: int, layout: L.AreaLayout, doorbell: int, region: int, spin: int) -> Asm:
    asm = Asm()
    nested, wait, spinning, answered, gone = (asm.label() for _ in range(5))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, mem_at(R.RSP, -_RED_ZONE)))
    asm.add(iced.Instruction.create(C.PUSHFQ))
    asm.add(iced.Instruction.create_reg(C.PUSH_R64, R.RAX))
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.EAX, 1))
    asm.add(iced.Instruction.create_mem_reg(C.XCHG_RM64_R64, gs_at(L.UPCALL_BUSY), R.RAX))
    asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RAX, R.RAX))
    asm.jump(C.JNE_REL32_64, nested)
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RAX))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(_FRAME["rax"]), R.RAX))
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RAX))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(_FRAME["eflags"]), R.RAX))
    for name in _MOVED:
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(_FRAME[name]), REG[name]))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RAX, mem_at(R.RSP, _RED_ZONE)))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(_FRAME["rsp"]), R.RAX))
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, plan.site))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(_FRAME["rip"]), R.RAX))
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.UPCALL_PROBE), probe_index))
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, region))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(L.UPCALL_REGION), R.RAX))
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM32_IMM32, gs_at(L.UPCALL_STATE), L.UPCALL_REQUEST))
    # The doorbell: rung, and the tracer woken unless it is awake (rcx and r11 are the system
    # call's: in the frame). The locked add orders the request before the look at AWAKE; a
    # tracer that falls asleep meanwhile finds RING changed (futex_waitv's own check).
    awake = asm.label()
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RDI, doorbell + L.DOORBELL_RING))
    ring = iced.Instruction.create_mem(C.INC_RM32, mem_at(R.RDI))
    ring.has_lock_prefix = True
    asm.add(ring)
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, mem_at(R.RDI, L.DOORBELL_AWAKE - L.DOORBELL_RING), 0))
    asm.jump(C.JNE_REL32_64, awake)
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.EAX, SYS_FUTEX))
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.ESI, FUTEX_WAKE))
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.EDX, 1))
    asm.add(iced.Instruction.create(C.SYSCALL))
    asm.bind(awake)
    # The answer: a short spin, then a futex wait with a timeout; no tracer left: unheard
    asm.bind(wait)
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.ECX, spin))
    asm.bind(spinning)
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM32_IMM8, gs_at(L.UPCALL_STATE), L.UPCALL_ANSWERED))
    asm.jump(C.JE_REL32_64, answered)
    asm.add(iced.Instruction.create(C.PAUSE))
    asm.add(iced.Instruction.create_reg(C.DEC_RM32, R.ECX))
    asm.jump(C.JNE_REL32_64, spinning)
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RDI, doorbell))
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, mem_at(R.RDI, L.DOORBELL_GONE), 0))
    asm.jump(C.JNE_REL32_64, gone)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RDI, gs_at(L.UPCALL_SELF)))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.R10, mem_at(R.RDI, L.UPCALL_TIMEOUT)))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RDI, mem_at(R.RDI, L.UPCALL_STATE)))
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.EAX, SYS_FUTEX))
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.ESI, FUTEX_WAIT))
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.EDX, L.UPCALL_REQUEST))
    asm.add(iced.Instruction.create(C.SYSCALL))
    asm.jump(C.JMP_REL32_64, wait)
    # Answered: the frame's registers, and on at the frame's rip, taken from below the red zone
    asm.bind(answered)
    _restore(asm)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RSP, gs_at(_FRAME["rsp"])))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, mem_at(R.RSP, -_RED_ZONE)))
    asm.add(iced.Instruction.create_mem(C.PUSH_RM64, gs_at(_FRAME["rip"])))
    _leave(asm)
    asm.add(iced.Instruction.create_i32(C.RETNQ_IMM16, _RED_ZONE))
    # No tracer. An answer it wrote but did not give (it died in between): taken as given.
    # Else the registers as they were, and the site's instruction.
    asm.bind(gone)
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, plan.site))
    asm.add(iced.Instruction.create_reg_mem(C.CMP_R64_RM64, R.RAX, gs_at(_FRAME["rip"])))
    asm.jump(C.JNE_REL32_64, answered)
    _restore(asm)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RSP, gs_at(_FRAME["rsp"])))
    _leave(asm)
    asm.add(iced.Instruction.create_branch(C.JMP_REL32_64, region))
    # A nested hit: its handlers miss this one
    asm.bind(nested)
    asm.add(iced.Instruction.create_mem(C.INC_RM64, gs_at(layout.counter(probe_index, L.MISSED))))
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RAX))
    asm.add(iced.Instruction.create(C.POPFQ))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, mem_at(R.RSP, _RED_ZONE)))
    asm.add(iced.Instruction.create_branch(C.JMP_REL32_64, region))
    return asm


def build_upcall(
    plan: OptimizePlan, probe_index: int, layout: L.AreaLayout, at: int, doorbell: int, *, spin: int = UPCALL_SPIN
) -> Detour | OptimizeRefusal:
    """The upcall detour of a site (`plan`) whose first probe is `probe_index` (its nested hits
    are counted as its missed), placed at `at`, ringing the doorbell page at `doorbell`; the
    relocated region follows it (`Detour.action_bytes`: where)."""
    length = 0
    while True:  # (the region follows the code: its address moves with the code's length)
        code, _ = _assemble(plan, probe_index, layout, doorbell, at + length, spin).encode(at)
        if len(code) == length:
            break
        length = len(code)
    region = relocate_region(plan, at + length)
    if region is None:
        return OptimizeRefusal.RIP_REL_OUT_OF_REACH
    return Detour(code + region, {}, length)
