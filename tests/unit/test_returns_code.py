"""Return-probe code as bytes: the trampoline's entry points and common part, the entry part of
a detour, and what /proc says about CET shadow stacks."""

from __future__ import annotations

import iced_x86 as iced

from dynprobe.actions.model import ActionKind, Program, ReturnEntry, record_fields
from dynprobe.arch.x86_64.codegen.asm import SAVED_AT
from dynprobe.arch.x86_64.codegen.detours import build_detour, enter_tail
from dynprobe.arch.x86_64.codegen.returns import build_return_code, build_trampoline, return_stub_code
from dynprobe.arch.x86_64.codegen.upcall import build_return_upcall
from dynprobe.arch.x86_64.decode import iter_instructions
from dynprobe.arch.x86_64.optimize import OptimizePlan
from dynprobe.arch.x86_64.regs import REG_NAMES
from dynprobe.core.returns import shadow_stack_in
from dynprobe.errors import OptimizeRefusal
from dynprobe.ringbuf import layout as L
from dynprobe.spec.parser import parse_probe

AT = 0x7F00_0000_0000
LAYOUT = L.AreaLayout()


def test_each_trampoline_entry_point_calls_the_common_part() -> None:
    code, tramp = build_trampoline(LAYOUT, AT)
    assert tramp.table == AT and tramp.end == AT + len(code) and tramp.points == AT + L.TRAMPOLINE_CALL
    common = AT + L.SHADOW_CAPACITY * L.TRAMPOLINE_STRIDE
    for k in (0, 1, 2, L.SHADOW_CAPACITY - 1):
        at = AT + k * L.TRAMPOLINE_STRIDE
        call, push, jump = iter_instructions(code[at - AT : at - AT + L.TRAMPOLINE_STRIDE], at)
        assert str(call) == "call qword ptr [rsp-18h]" and push.ip == tramp.point(k)  # [S - 16], rsp = S + 8
        assert push.code == iced.Code.PUSHQ_IMM32 and push.immediate(0) == k * L.SHADOW_ENTRY
        assert jump.code == iced.Code.JMP_REL32_64 and jump.near_branch_target == common
    tail = list(iter_instructions(code[common - AT :], common))
    # common: six pushes, the entry's offset, an indirect jump through the entry's handler
    assert [i.mnemonic for i in tail[:6]] == [iced.Mnemonic.PUSH] * 6
    jump = next(i for i in tail if i.mnemonic == iced.Mnemonic.JMP)
    assert jump.segment_prefix == iced.Register.GS and jump.memory_displacement == LAYOUT.shadow + L.ENTRY_HANDLER
    # finish returns to the original return address: the `ret` pairs with the caller's call
    assert any(i.ip == tramp.finish for i in tail) and tail[-1].mnemonic == iced.Mnemonic.RET


def test_a_hooked_entry_goes_into_the_function_through_the_table() -> None:
    tail = list(iter_instructions(enter_tail(), 0x1000))
    assert [str(i) for i in tail] == [
        "cmp qword ptr [rsp-8],0",  # no call to go through: on into the region
        f"je short {0x1000 + len(enter_tail()):016X}h",
        "lea rsp,[rsp+8]",  # rsp = S + 8: the call pushes the entry point into S
        "jmp qword ptr [rsp-10h]",
    ]


def test_return_code_and_stub_end_in_the_trampoline_finish() -> None:
    _, tramp = build_trampoline(LAYOUT, AT)
    spec = parse_probe("r add a=$arg1 r=$retval ns=$latency:u64")
    prog = Program(3, ActionKind.RECORD, record_fields(spec.args))
    code = build_return_code(prog, LAYOUT, AT + 0x10000, tramp, 1 << 32)
    assert isinstance(code, bytes)
    last = list(iter_instructions(code, AT + 0x10000))[-1]
    assert last.mnemonic == iced.Mnemonic.JMP and last.near_branch_target == tramp.finish
    # the trap stub: the return's time stamp into the entry (rsi: its offset), then the trapped jump
    code, trap = return_stub_code(LAYOUT, AT + 0x20000, tramp)
    stub = list(iter_instructions(code, AT + 0x20000))
    assert [str(i) for i in stub[:3]] == [
        "rdtsc", f"mov gs:[rsi+{LAYOUT.shadow + L.ENTRY_RETURN_TSC:X}h],eax",
        f"mov gs:[rsi+{LAYOUT.shadow + L.ENTRY_RETURN_TSC + 4:X}h],edx",
    ]  # fmt: skip
    assert stub[-1].ip == trap and stub[-1].near_branch_target == tramp.finish


def test_the_upcall_stub_stamps_asks_with_its_own_address_and_goes_to_finish() -> None:
    """The return part served by upcalls: the return's time stamp, the return value back in rax
    and rdx (the stamp took them), an upcall (that keeps the function's rsi) whose UPCALL_SITE and
    frame rip are the stub's own address (how the tracer knows a return) and whose
    UPCALL_REGION and unheard paths are where it goes on: the frame's rax and rdx into the
    trampoline's saved ones, and the jump to the trampoline's finish."""
    _, tramp = build_trampoline(LAYOUT, AT)
    at = AT + 0x30000
    code = build_return_upcall(LAYOUT, at, 0x7E00_0000_0000, tramp)
    insns = list(iter_instructions(code, at))
    rax, rdx = (f"[rsp+{SAVED_AT[name]:X}h]" for name in ("rax", "rdx"))
    assert [str(i) for i in insns[:5]] == [
        "rdtsc",
        f"mov gs:[rsi+{LAYOUT.shadow + L.ENTRY_RETURN_TSC:X}h],eax",
        f"mov gs:[rsi+{LAYOUT.shadow + L.ENTRY_RETURN_TSC + 4:X}h],edx",
        f"mov rax,{rax}", f"mov rdx,{rdx}",
    ]  # fmt: skip
    # the function's rsi kept once the frame is saved (after BUSY is taken: a nested return's
    # would not overwrite it), from the trampoline's frame
    kept = next(i for i, insn in enumerate(insns) if str(insn) == f"mov gs:[{L.UPCALL_RSI:X}h],rax")
    assert str(insns[kept - 1]) == f"mov rax,[rax+{SAVED_AT['rsi']:X}h]"
    busy = next(i for i, insn in enumerate(insns) if insn.mnemonic == iced.Mnemonic.XCHG)
    assert busy < kept
    tail = insns[-3:]
    assert [str(i) for i in tail[:2]] == [f"mov {rax},rax", f"mov {rdx},rdx"]
    assert tail[2].mnemonic == iced.Mnemonic.JMP and tail[2].near_branch_target == tramp.finish

    def stored(word: int) -> int:  # the imm64 moved into rax just before `mov gs:[word], rax`
        i = next(n for n, insn in enumerate(insns) if insn.segment_prefix == iced.Register.GS
                 and insn.memory_displacement == word and insn.op0_kind == iced.OpKind.MEMORY)  # fmt: skip
        return int(insns[i - 1].immediate(1))

    assert stored(L.UPCALL_SITE) == stored(L.UPCALL_FRAME + 8 * REG_NAMES.index("rip")) == at
    assert stored(L.UPCALL_REGION) == tail[0].ip
    unheard = [i for i in insns if i.mnemonic == iced.Mnemonic.JMP and i.near_branch_target == tail[0].ip]
    assert len(unheard) == 2  # (no tracer; a nested return)


def test_entry_part_needs_a_function_entry_and_the_trampoline() -> None:
    _, tramp = build_trampoline(LAYOUT, AT)
    insns = tuple(iter_instructions(bytes.fromhex("554889e54883ec10"), 0x1000))
    plan = OptimizePlan(0x1000, insns)
    prog = Program(1, ActionKind.COUNT, entry=ReturnEntry(10, AT + 0x10000, (1,), True))
    assert build_detour(plan, [prog], LAYOUT, AT + 0x3000, True) == OptimizeRefusal.FETCH_UNSUPPORTED
    assert build_detour(plan, [prog], LAYOUT, AT + 0x3000, False, trampoline=tramp) == OptimizeRefusal.FETCH_UNSUPPORTED
    built = build_detour(plan, [prog], LAYOUT, AT + 0x3000, True, trampoline=tramp)
    assert not isinstance(built, OptimizeRefusal)
    insns = list(iter_instructions(built.code, AT + 0x3000))
    assert any(i.mnemonic == iced.Mnemonic.RDTSC for i in insns)  # $latency needs the entry's time
    # the return address becomes entry point k, then the function is entered through the table
    assert any(i.code == iced.Code.MOV_R64_IMM64 and i.immediate(1) == tramp.points for i in insns)
    assert any(i.code == iced.Code.MOV_R64_IMM64 and i.immediate(1) == -tramp.points & (1 << 64) - 1 for i in insns)
    assert not any(i.mnemonic in (iced.Mnemonic.LAHF, iced.Mnemonic.SAHF) for i in insns)  # flags: free here
    assert str(insns[0]) == "lea rsp,[rsp-10h]"  # room for the targets below the return address
    region = AT + 0x3000 + built.action_bytes
    assert built.code[built.action_bytes - len(enter_tail()) : built.action_bytes] == enter_tail()
    assert any(i.mnemonic == iced.Mnemonic.LEA and i.memory_displacement == region for i in insns)
    assert str(next(i for i in insns if i.ip >= region)) == "push rbp"


def test_cet_shadow_stack_from_proc_status() -> None:
    assert shadow_stack_in("Name:\tx\nx86_Thread_features:\tshstk wrss\nx86_Thread_features_locked:\tshstk\n")
    assert not shadow_stack_in("Name:\tx\nx86_Thread_features:\t\nx86_Thread_features_locked:\tshstk wrss\n")
    assert not shadow_stack_in("Name:\tx\n")  # an older kernel: no line, no shadow stacks


def test_tracer_site_pushes_the_id_and_calls_its_target() -> None:
    from dynprobe.arch.x86_64.codegen.ftrace import (
        SITE_CALL_AT,
        build_list_trampoline,
        build_ops_code,
        build_tracer_site,
        call_to,
    )

    site = AT + 0x1000
    plan = OptimizePlan(site, tuple(iter_instructions(bytes.fromhex("554889e590"), site)))  # push rbp; mov; nop
    target = AT + 0x40000
    code = build_tracer_site(plan, 77, target, AT + 0x3000)
    assert isinstance(code, bytes)
    insns = list(iter_instructions(code, AT + 0x3000))
    assert str(insns[0]) == "lea rsp,[rsp-10h]"  # room for the targets below the return address
    assert insns[1].code == iced.Code.PUSHQ_IMM32 and insns[1].immediate(0) == 77
    assert insns[2].ip == AT + 0x3000 + SITE_CALL_AT and insns[2].near_branch_target == target
    assert str(insns[3]) == "lea rsp,[rsp+18h]"  # drop the id and the room
    head = SITE_CALL_AT + 10 + len(enter_tail())
    assert code[SITE_CALL_AT + 10 : head] == enter_tail()
    moved = [i.mnemonic for i in insns if i.ip >= AT + 0x3000 + head]
    assert moved[:3] == [iced.Mnemonic.PUSH, iced.Mnemonic.MOV, iced.Mnemonic.NOP]
    assert insns[-1].mnemonic == iced.Mnemonic.JMP and insns[-1].near_branch_target == site + 5
    # re-pointing rewrites the call alone
    moved = call_to(AT + 0x3000, target + 0x100)
    assert next(iter_instructions(moved, AT + 0x3000 + SITE_CALL_AT)).near_branch_target == target + 0x100
    # an instance's code: its body is called by a list trampoline, which calls each body in turn
    _, tramp = build_trampoline(LAYOUT, AT)
    _, ops = build_ops_code(LAYOUT, 5, tramp, AT + 0x50000, depth=8, threshold=0, captures=None, snapshot_over=0)
    assert ops.entry == AT + 0x50000 and ops.entry < ops.body < ops.exit
    listed = list(iter_instructions(build_list_trampoline([ops.body, ops.body + 0x10], AT + 0x60000, tramp.points),
                                    AT + 0x60000))  # fmt: skip
    assert [i.near_branch_target for i in listed if i.mnemonic == iced.Mnemonic.CALL] == [ops.body, ops.body + 0x10]


def test_a_thread_at_an_entry_call_is_going_into_the_region_it_calls() -> None:
    from dynprobe.core.traced import ProcessReturns

    _, tramp = build_trampoline(LAYOUT, AT)
    returns = ProcessReturns(tramp, tramp.end, tramp.end + 12, tramp.end + 32, tramp.end + 256, tramp.end + 256)
    region, rsp = 0x5555_0000_1234, 0x7FFF_0000_1008  # rsp: the slot + 8, at the call
    memory = {rsp - 24: region}
    call = AT + 7 * L.TRAMPOLINE_STRIDE
    assert returns.going_to(call, rsp, memory.__getitem__) == region
    for elsewhere in (tramp.point(7), call + 1, tramp.finish, AT - 1):
        assert returns.going_to(elsewhere, rsp, memory.__getitem__) == elsewhere
