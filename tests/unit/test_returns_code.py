"""Return-probe code as bytes: the trampoline's entry points and common part, the entry part of
a detour, and what /proc says about CET shadow stacks."""

from __future__ import annotations

import iced_x86 as iced

from dynprobe.actions.model import ActionKind, Program, ReturnEntry, record_fields
from dynprobe.arch.x86_64.codegen import (
    build_detour,
    build_return_code,
    build_trampoline,
    enter_hooked,
    return_stub_code,
)
from dynprobe.arch.x86_64.decode import iter_instructions
from dynprobe.arch.x86_64.optimize import OptimizePlan
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
        assert str(call) == "call r11" and push.ip == tramp.point(k)
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
    _, tramp = build_trampoline(LAYOUT, AT)
    at = AT + 0x9000
    code = enter_hooked(tramp.points, at)
    insns = list(iter_instructions(code, at))
    region = at + len(code)
    assert [str(i) for i in insns[1:3]] == ["add r11,[rsp]", "cmp r11,0D000h"]  # 4096 entries of 13 bytes
    assert insns[0].immediate(1) == -tramp.points & (1 << 64) - 1
    assert insns[3].mnemonic == iced.Mnemonic.JAE and insns[3].near_branch_target == region  # not hooked
    assert str(insns[4]) == f"sub qword ptr [rsp],{L.TRAMPOLINE_CALL}"  # entry point k -> its `call r11`
    assert insns[5].mnemonic == iced.Mnemonic.LEA and insns[5].memory_displacement == region
    assert [str(i) for i in insns[6:]] == ["lea rsp,[rsp+8]", "jmp qword ptr [rsp-8]"]


def test_return_code_and_stub_end_in_the_trampoline_finish() -> None:
    _, tramp = build_trampoline(LAYOUT, AT)
    spec = parse_probe("r add a=$arg1 r=$retval ns=$latency:u64")
    prog = Program(3, ActionKind.RECORD, record_fields(spec.args))
    code = build_return_code(prog, LAYOUT, AT + 0x10000, tramp, 1 << 32)
    assert isinstance(code, bytes)
    last = list(iter_instructions(code, AT + 0x10000))[-1]
    assert last.mnemonic == iced.Mnemonic.JMP and last.near_branch_target == tramp.finish
    stub = list(iter_instructions(return_stub_code(AT + 0x20000, tramp), AT + 0x20000))
    assert len(stub) == 1 and stub[0].near_branch_target == tramp.finish


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


def test_cet_shadow_stack_from_proc_status() -> None:
    assert shadow_stack_in("Name:\tx\nx86_Thread_features:\tshstk wrss\nx86_Thread_features_locked:\tshstk\n")
    assert not shadow_stack_in("Name:\tx\nx86_Thread_features:\t\nx86_Thread_features_locked:\tshstk wrss\n")
    assert not shadow_stack_in("Name:\tx\n")  # an older kernel: no line, no shadow stacks


def test_tracer_site_pushes_the_id_and_calls_its_target() -> None:
    from dynprobe.arch.x86_64.codegen import (
        SITE_CALL_AT,
        build_list_trampoline,
        build_ops_code,
        build_tracer_site,
        call_to,
    )

    site = AT + 0x1000
    plan = OptimizePlan(site, tuple(iter_instructions(bytes.fromhex("554889e590"), site)))  # push rbp; mov; nop
    target = AT + 0x40000
    code = build_tracer_site(plan, 77, target, AT + 0x3000, None)
    assert isinstance(code, bytes)
    insns = list(iter_instructions(code, AT + 0x3000))
    assert insns[0].code == iced.Code.PUSHQ_IMM32 and insns[0].immediate(0) == 77
    assert insns[1].ip == AT + 0x3000 + SITE_CALL_AT and insns[1].near_branch_target == target
    assert str(insns[2]) == "lea rsp,[rsp+8]"
    assert [i.mnemonic for i in insns[3:6]] == [iced.Mnemonic.PUSH, iced.Mnemonic.MOV, iced.Mnemonic.NOP]
    assert insns[-1].mnemonic == iced.Mnemonic.JMP and insns[-1].near_branch_target == site + 5
    # with a return trampoline, enter_hooked between the call and the prologue
    _, tramp = build_trampoline(LAYOUT, AT)
    hooked = build_tracer_site(plan, 77, target, AT + 0x3000, tramp.points)
    assert isinstance(hooked, bytes)
    middle = enter_hooked(tramp.points, AT + 0x3000 + SITE_CALL_AT + 10)
    assert hooked == code[: SITE_CALL_AT + 10] + middle + hooked[SITE_CALL_AT + 10 + len(middle) :]
    # re-pointing rewrites the call alone
    moved = call_to(AT + 0x3000, target + 0x100)
    assert next(iter_instructions(moved, AT + 0x3000 + SITE_CALL_AT)).near_branch_target == target + 0x100
    # an instance's code: its body is called by a list trampoline, which calls each body in turn
    _, tramp = build_trampoline(LAYOUT, AT)
    _, ops = build_ops_code(LAYOUT, 5, tramp, AT + 0x50000, depth=8)
    assert ops.entry == AT + 0x50000 and ops.entry < ops.body < ops.exit
    listed = list(iter_instructions(build_list_trampoline([ops.body, ops.body + 0x10], AT + 0x60000), AT + 0x60000))
    assert [i.near_branch_target for i in listed if i.mnemonic == iced.Mnemonic.CALL] == [ops.body, ops.body + 0x10]
