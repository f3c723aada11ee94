"""The upcall detour: a site whose probes are Python handlers, served without a ptrace stop
(core/upcalls.py serves it). Its parts: an upcall before the site's instruction (for
pre-handlers), the relocated instruction, an upcall after it (for post-handlers: its frame's rip
is the next instruction), the rest of the relocated region and the jump back. An upcall, on the
target thread, with its thread area (GS base) and its process's doorbell page:

    lea rsp, [rsp-128]; pushfq; push rax        over the red zone
    gs:[MAGIC] is not ours                      the program set its own GS base: counted in
                                                [FOREIGN], on (unheard)
    xchg gs:[UPCALL_BUSY], 1                    taken: a nested hit (a signal handler's): no
                                                handler, counted missed, on (unheard)
    the registers into gs:[UPCALL_FRAME]        (user_regs_struct; rip = where it is, rsp as it was)
    gs:[UPCALL_SITE], [UPCALL_REGION] = the site, where the relocated instruction is;
    gs:[UPCALL_STATE] = REQUEST
    lock inc [RING]; futex(RING, WAKE)          the tracer waits on its process's doorbell
                                                (no system call while it is AWAKE)
    until gs:[UPCALL_STATE] == ANSWERED:        looked for during [SPIN] ticks (pause) unless
                                                the server runs on this CPU ([CPU]), then
                                                SLEEPING; futex(STATE, WAIT, REQUEST, timeout);
                                                [GONE] set (no tracer): on, unheard
    the registers back from the frame; frame.rip still where it is: rsp = frame.rsp; IDLE,
    not SLEEPING, not BUSY; jmp to the relocated copy of the instruction (`Detour.region_copy`);
    else rsp = frame.rsp - 128; push frame.rip; IDLE, not SLEEPING, not BUSY; ret 128

The tracer writes only what a handler changed, rip included (wherever it sent the thread), so
the frame's cache lines stay the thread's CPU's when nothing was. Either way, once BUSY is clear
the thread needs nothing of the frame (`ret 128` takes rip from below the red zone): a signal's
nested hit in those last instructions may have the frame. The flags and every register are the
frame's. Return probes with Python handlers upcall from their entry (the
detour takes their shadow entries first, `UpcallReturns`) and from a return stub the trampoline
calls (`build_return_upcall`).

Pure: a plan, a probe, a layout and addresses in, bytes out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import iced_x86 as iced

from dynprobe.arch.x86_64.codegen.asm import (
    FUTEX_WAIT,
    FUTEX_WAKE,
    REG,
    SAVED_AT,
    SYS_FUTEX,
    Asm,
    C,
    Detour,
    R,
    Trampoline,
    gs_at,
    mem_at,
    read_tsc,
)
from dynprobe.arch.x86_64.codegen.records import shadow_push
from dynprobe.arch.x86_64.codegen.returns import stamp
from dynprobe.arch.x86_64.optimize import OptimizePlan, relocate_region_map
from dynprobe.arch.x86_64.regs import ARG_REGS, REG_NAMES
from dynprobe.arch.x86_64.relocate import jump_to, relocate
from dynprobe.errors import OptimizeRefusal
from dynprobe.frozen import frozen
from dynprobe.ringbuf import layout as L

_RED_ZONE = 128
_CPUNODE_SELECTOR = 15 * 8 + 3  # GDT_ENTRY_CPUNODE, user privilege
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


def _read_cpu(asm: Asm) -> None:
    """rax = the CPU this thread runs on, as the kernel's getcpu() reads it on every x86-64
    (the limit of the per-CPU segment of the GDT, entry 15: the node above bit 12)."""
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.EAX, _CPUNODE_SELECTOR))
    asm.add(iced.Instruction.create_reg_reg(C.LSL_R32_R32M16, R.EAX, R.EAX))
    asm.add(iced.Instruction.create_reg_u32(C.AND_EAX_IMM32, R.EAX, 0xFFF))


def _leave(asm: Asm) -> None:
    """The upcall over: the thread's state idle, no longer busy (moves: the flags are the frame's)."""
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM32_IMM32, gs_at(L.UPCALL_STATE), L.UPCALL_IDLE))
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.UPCALL_SLEEPING), 0))
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.UPCALL_BUSY), 0))


@frozen
class UpcallReturns:
    """The return probes at an upcall site, a function's entry: the detour takes their shadow
    entries, as an optimized return probe's does, before it asks."""

    probes: tuple[tuple[int, int], ...]  # (probe index, maxactive) each, in the site's order
    layout: L.AreaLayout
    stub: int  # their return code: the process's upcall return stub
    points: int  # the trampoline's entry point 0


def _take_entries(asm: Asm, returns: UpcallReturns | None) -> None:
    """The shadow entries of the site's return probes (the registers are in the frame: all
    free), each with the entry's arguments, and for each a word of UPCALL_ENTRIES: its probe's
    index in the upper half, the entry's offset in the lower (ENTRIES_MISSED: none), then
    ENTRIES_END unless all of them are used. Every upcall writes them (with no return probes,
    ENTRIES_END alone): the tracer never reads a word this upcall did not write."""
    count = 0 if returns is None else len(returns.probes)
    if count < L.UPCALL_ENTRIES_MAX:
        asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.UPCALL_ENTRIES + 8 * count), -1))  # (END)
    if returns is None:
        return
    shadow = returns.layout.shadow
    for i, (index, maxactive) in enumerate(returns.probes):
        word = gs_at(L.UPCALL_ENTRIES + 8 * i)
        asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, index << 32 | L.ENTRIES_MISSED))
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, word, R.RAX))

        def fill(word: iced.MemoryOperand = word) -> None:  # (rsi: the entry's offset)
            asm.add(iced.Instruction.create_mem_reg(C.MOV_RM32_R32, word, R.ESI))
            stamp(asm, R.RSI, shadow + L.ENTRY_TSC)  # (again as the thread goes on: see _stamp_entries)
            for n, name in enumerate(ARG_REGS):
                asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, gs_at(_FRAME[name])))
                at = gs_at(shadow + L.ENTRY_DATA + 8 * n, R.RSI)
                asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, at, R.RAX))

        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RCX, gs_at(_FRAME["rsp"])))
        shadow_push(asm, returns.layout, returns.points, index, maxactive, returns.stub, fill)


def _stamp_entries(asm: Asm, returns: UpcallReturns) -> None:
    """The entries taken get their time as the thread goes on (their calls' latency is not the
    upcall's); rax, rdx, rsi and the flags are in the frame."""
    for i in range(len(returns.probes)):
        missed = asm.label()
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.ESI, gs_at(L.UPCALL_ENTRIES + 8 * i)))
        asm.add(iced.Instruction.create_reg_i32(C.CMP_RM32_IMM8, R.ESI, -1))  # (ENTRIES_MISSED)
        asm.jump(C.JE_REL32_64, missed)
        stamp(asm, R.RSI, returns.layout.shadow + L.ENTRY_TSC)
        asm.bind(missed)


def _upcall(
    asm: Asm, *, rip: int, site: int, missed: Callable[[Asm], None], doorbell: int, region: int, unheard: int,
    returns: UpcallReturns | None = None, ask: bool = True, keep: Callable[[Asm], None] | None = None,
) -> None:  # fmt: skip
    """One upcall at original address `rip` of `site`'s region, whose relocated first instruction
    is at `region`; unheard (no tracer) or nested (`missed` counts it, rax free), the thread goes
    on at `unheard`. `returns`: the return probes' shadow entries are taken first; without
    `ask` (no handler to run: return probes with no entry handler), only that, and on. `keep`
    writes more for the tracer once the frame is saved (every register free: it is the
    thread's own, a nested one goes by before)."""
    nested, foreign, out, spin, wait, answered, go_on, moved, awake = (asm.label() for _ in range(9))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, mem_at(R.RSP, -_RED_ZONE)))
    asm.add(iced.Instruction.create(C.PUSHFQ))
    asm.add(iced.Instruction.create_reg(C.PUSH_R64, R.RAX))
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, L.AREA_MAGIC))
    asm.add(iced.Instruction.create_mem_reg(C.CMP_RM64_R64, gs_at(L.MAGIC), R.RAX))
    asm.jump(C.JNE_REL32_64, foreign)
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
    if keep is not None:
        keep(asm)
    _take_entries(asm, returns)
    if not ask:
        asm.jump(C.JMP_REL32_64, go_on)
    for word, value in ((_FRAME["rip"], rip), (L.UPCALL_SITE, site), (L.UPCALL_REGION, region)):
        asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, value))
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(word), R.RAX))
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM32_IMM32, gs_at(L.UPCALL_STATE), L.UPCALL_REQUEST))
    # The doorbell: rung, and the tracer woken unless it is awake (rcx and r11 are the system
    # call's: in the frame). The locked add orders the request before the look at AWAKE; a
    # tracer that falls asleep meanwhile finds RING changed (futex_waitv's own check).
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
    # The answer: looked for until the doorbell's SPIN ticks have passed, unless the server runs
    # on this CPU (rax, rdx and r8 are in the frame), then a futex wait with a timeout, again and
    # again; no tracer left: unheard
    _read_cpu(asm)
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(L.UPCALL_CPU), R.RAX))
    asm.add(iced.Instruction.create_reg_mem(C.CMP_R64_RM64, R.RAX, mem_at(R.RDI, L.DOORBELL_CPU - L.DOORBELL_RING)))
    asm.jump(C.JE_REL32_64, wait)
    read_tsc(asm)
    asm.add(iced.Instruction.create_reg_mem(C.ADD_R64_RM64, R.RAX, mem_at(R.RDI, L.DOORBELL_SPIN - L.DOORBELL_RING)))
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.R8, R.RAX))
    asm.bind(spin)
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM32_IMM8, gs_at(L.UPCALL_STATE), L.UPCALL_ANSWERED))
    asm.jump(C.JE_REL32_64, answered)
    asm.add(iced.Instruction.create(C.PAUSE))
    read_tsc(asm)
    asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RAX, R.R8))
    asm.jump(C.JB_REL32_64, spin)
    asm.bind(wait)
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM32_IMM8, gs_at(L.UPCALL_STATE), L.UPCALL_ANSWERED))
    asm.jump(C.JE_REL32_64, answered)
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RDI, doorbell))
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, mem_at(R.RDI, L.DOORBELL_GONE), 0))
    asm.jump(C.JNE_REL32_64, answered)
    # SLEEPING, then the state once more, with a full barrier between (the tracer stores the
    # state, then looks at SLEEPING: one of the two sees the other's store, no wake-up is lost)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.UPCALL_SLEEPING), 1))
    fence = iced.Instruction.create_mem_i32(C.OR_RM64_IMM8, mem_at(R.RSP), 0)
    fence.has_lock_prefix = True
    asm.add(fence)
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM32_IMM8, gs_at(L.UPCALL_STATE), L.UPCALL_ANSWERED))
    asm.jump(C.JE_REL32_64, answered)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RDI, gs_at(L.AREA_SELF)))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.R10, mem_at(R.RDI, L.SLEEP_TIMEOUT)))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RDI, mem_at(R.RDI, L.UPCALL_STATE)))
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.EAX, SYS_FUTEX))
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.ESI, FUTEX_WAIT))
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.EDX, L.UPCALL_REQUEST))
    asm.add(iced.Instruction.create(C.SYSCALL))
    asm.jump(C.JMP_REL32_64, wait)
    # Answered: the entries' time, the frame's registers, and on at `unheard` if the frame's rip
    # is still `rip` (the tracer wrote nothing it need not: the frame's cache lines stay this
    # CPU's), else at the frame's rip, taken from below the red zone. No tracer left: the
    # frame as it is (an answer it wrote but did not give, taken as given).
    asm.bind(answered)
    if returns is not None:
        _stamp_entries(asm, returns)
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, rip))
    asm.add(iced.Instruction.create_reg_mem(C.CMP_R64_RM64, R.RAX, gs_at(_FRAME["rip"])))
    asm.jump(C.JNE_REL32_64, moved)
    asm.bind(go_on)
    _restore(asm)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RSP, gs_at(_FRAME["rsp"])))
    _leave(asm)
    asm.add(iced.Instruction.create_branch(C.JMP_REL32_64, unheard))
    asm.bind(moved)
    _restore(asm)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RSP, gs_at(_FRAME["rsp"])))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, mem_at(R.RSP, -_RED_ZONE)))
    asm.add(iced.Instruction.create_mem(C.PUSH_RM64, gs_at(_FRAME["rip"])))
    _leave(asm)
    asm.add(iced.Instruction.create_i32(C.RETNQ_IMM16, _RED_ZONE))
    # A nested hit: its handlers miss this one. A GS base that is not ours (the program set its
    # own since): nothing of it is touched, no handler runs, the doorbell's FOREIGN counts it.
    asm.bind(nested)
    missed(asm)
    asm.jump(C.JMP_REL32_64, out)
    asm.bind(foreign)
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, doorbell + L.DOORBELL_FOREIGN))
    count = iced.Instruction.create_mem(C.INC_RM64, mem_at(R.RAX))
    count.has_lock_prefix = True
    asm.add(count)
    asm.bind(out)
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RAX))
    asm.add(iced.Instruction.create(C.POPFQ))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, mem_at(R.RSP, _RED_ZONE)))
    asm.add(iced.Instruction.create_branch(C.JMP_REL32_64, unheard))


def _count_missed(layout: L.AreaLayout, probe_index: int) -> Callable[[Asm], None]:
    def count(asm: Asm) -> None:
        asm.add(iced.Instruction.create_mem(C.INC_RM64, gs_at(layout.counter(probe_index, L.MISSED))))

    return count


def build_upcall(
    plan: OptimizePlan, probe_index: int, layout: L.AreaLayout, at: int, doorbell: int, *, pre: bool = True,
    post: bool = False, returns: UpcallReturns | None = None,
) -> Detour | OptimizeRefusal:  # fmt: skip
    """The upcall detour of a site (`plan`) whose first probe is `probe_index` (its nested hits
    are counted as its missed), placed at `at`, ringing the doorbell page at `doorbell`: an
    upcall before the site's instruction if `pre` (which takes the shadow entries of the
    site's `returns` probes first; without `pre`, they are taken all the same), one after it if
    `post` (not after a branch: POST_HANDLER). `action_bytes`: where the relocated instruction is."""
    first, rest = plan.region[0], plan.region[1:]
    if post and first.flow_control != iced.FlowControl.NEXT:
        return OptimizeRefusal.POST_HANDLER
    next_ip = int(first.next_ip)
    lengths = [0, 0]  # of the two upcalls' code: their addresses follow from them
    while True:
        region = at + lengths[0]
        upcall = functools.partial(
            _upcall, site=plan.site, missed=_count_missed(layout, probe_index), doorbell=doorbell, region=region
        )
        before = Asm()
        if pre or returns is not None:
            upcall(before, rip=plan.site, unheard=region, returns=returns, ask=pre)
        before_code = before.encode(at)[0] if pre or returns is not None else b""
        if not post:
            moved = relocate_region_map(plan, region)
            if moved is None:
                return OptimizeRefusal.RIP_REL_OUT_OF_REACH
            if len(before_code) == lengths[0]:
                return Detour(before_code + moved[0], {}, len(before_code), moved[1])
            lengths[0] = len(before_code)
            continue
        copied = relocate(first, region)
        if copied is None:
            return OptimizeRefusal.RIP_REL_OUT_OF_REACH
        after_at = region + len(copied)
        rest_at = after_at + lengths[1]
        after = Asm()
        upcall(after, rip=next_ip, unheard=rest_at)
        after_code = after.encode(after_at)[0]
        if rest:
            moved = relocate_region_map(OptimizePlan(next_ip, rest), rest_at)
            if moved is None:
                return OptimizeRefusal.RIP_REL_OUT_OF_REACH
            tail, resume = moved
        else:
            tail, resume = jump_to(rest_at, plan.resume_at), {next_ip: rest_at}
        if (len(before_code), len(after_code)) == tuple(lengths):
            code = before_code + copied + after_code + tail
            return Detour(code, {}, len(before_code), {plan.site: region, **resume})
        lengths = [len(before_code), len(after_code)]


def build_return_upcall(layout: L.AreaLayout, at: int, doorbell: int, trampoline: Trampoline) -> bytes:
    """The return part of return probes whose handlers are Python's served by upcalls, placed at
    `at` (the trampoline comes here with its registers saved and rsi the shadow entry's offset):
    the return's time into the entry, an upcall (core/upcalls.py runs the return handlers; the
    frame's rsp is the trampoline's frame, as at the trap stub, its rax and rdx the return
    value, its rsi the entry's offset and UPCALL_RSI the function's; UPCALL_SITE is `at`, which
    tells the tracer what asks), then the frame's rax and rdx into the trampoline's (a handler
    may have changed them) and on to its `finish`. A nested return (a signal handler's, during
    the upcall) runs no handler and counts a miss of its entry's probe."""

    def missed(asm: Asm) -> None:  # (the entry's probe number, as one_less_pending finds it)
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.EAX, gs_at(layout.shadow + L.ENTRY_PROBE, R.RSI)))
        asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RAX, L.PROBE_BYTES.bit_length() - 1))
        asm.add(iced.Instruction.create_mem(C.INC_RM64, gs_at(layout.counter(0, L.MISSED), R.RAX)))

    def saved(name: str) -> iced.MemoryOperand:
        return mem_at(R.RSP, SAVED_AT[name])

    def keep_rsi(asm: Asm) -> None:  # (the function's, saved by the trampoline: rsp is the frame's)
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, gs_at(_FRAME["rsp"])))
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, mem_at(R.RAX, SAVED_AT["rsi"])))
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(L.UPCALL_RSI), R.RAX))

    resume = at
    while True:
        asm = Asm()
        stamp(asm, R.RSI, layout.shadow + L.ENTRY_RETURN_TSC)
        for name in ("rax", "rdx"):  # (the stamp took them)
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, REG[name], saved(name)))
        _upcall(asm, rip=at, site=at, missed=missed, doorbell=doorbell, region=resume, unheard=resume, keep=keep_rsi)
        body = asm.encode(at)[0]
        if at + len(body) == resume:
            back = Asm()
            for name in ("rax", "rdx"):
                back.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, saved(name), REG[name]))
            tail = back.encode(resume)[0]
            return body + tail + jump_to(resume + len(tail), trampoline.finish)
        resume = at + len(body)
