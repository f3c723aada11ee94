"""Detours of optimized probes: machine code for the actions of a site, then its relocated region.

A detour runs on the target thread with nothing but its registers and its thread area (GS base):

    lea rsp, [rsp-128]              only away from a function entry: step over the red zone
    (count only)  push rax; seto al; lahf; inc qword gs:[hits]...; add al, 0x7f; sahf; pop rax
    (otherwise)   pushfq; push rax, rcx, rdx, rsi, rdi; per probe: filter, counters, histogram,
                  record; pop ...; popfq
    lea rsp, [rsp+128]
    the relocated region (optimize.relocate_region_map), jmp back

Every counter and histogram update is one `inc` on memory: an instruction is never split by a
signal, so a signal handler that hits the same probe cannot lose an update. Records take a
re-entrancy flag instead (a nested hit is counted as missed), as the kernel's kprobes do.

A load from an address the target supplies may fault: each such load is listed in `fixups` with
the code to continue at; the tracer moves a thread that faults there to it (docs/architecture.md §6).

Pure: programs + layout + addresses in, bytes + fix-up table out. Encoding is iced-x86's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import iced_x86 as iced

from dynprobe.actions.model import ActionKind, Program
from dynprobe.arch.x86_64.codegen.actions import Emitter, emit_actions, fetches_flags
from dynprobe.arch.x86_64.codegen.asm import (
    HOOK_ROOM,
    L_MASK64,
    RED_ZONE,
    Asm,
    C,
    Detour,
    R,
    Returning,
    Trampoline,
    Unsupported,
    gs_at,
    mem_at,
    stack_at,
)
from dynprobe.arch.x86_64.codegen.records import resume_through_area
from dynprobe.arch.x86_64.optimize import OptimizePlan, relocate_region_map
from dynprobe.errors import OptimizeRefusal
from dynprobe.ringbuf import layout as L

_PLACEHOLDER = 0x7FFF_FFF0  # a displacement to patch (disp32 whatever the value it becomes)


@functools.cache
def _count_only_template(counters: int, red_zone: int) -> tuple[bytes, tuple[int, ...]]:
    """Hit counters without touching the flags: seto/lahf save OF and the arithmetic flags in
    al/ah (the sequence of Valgrind and DynamoRIO), cheaper than pushfq/popfq. No branch and no
    RIP-relative operand: the bytes run anywhere, so they are encoded once per shape, with a
    placeholder for each counter's displacement; returns them and where the displacements are."""
    asm = Asm()
    if red_zone:
        asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, mem_at(R.RSP, -red_zone)))
    asm.add(iced.Instruction.create_reg(C.PUSH_R64, R.RAX))
    asm.add(iced.Instruction.create_reg(C.SETO_RM8, R.AL))
    asm.add(iced.Instruction.create(C.LAHF))
    for _ in range(counters):
        asm.add(iced.Instruction.create_mem(C.INC_RM64, gs_at(_PLACEHOLDER)))
    asm.add(iced.Instruction.create_reg_i32(C.ADD_RM8_IMM8, R.AL, 0x7F))  # OF = (al == 1)
    asm.add(iced.Instruction.create(C.SAHF))
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RAX))
    if red_zone:
        asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, mem_at(R.RSP, red_zone)))
    code, _ = asm.encode(0)
    decoder = iced.Decoder(64, code)
    offsets = [
        int(insn.ip) + decoder.get_constant_offsets(insn).displacement_offset
        for insn in decoder
        if insn.memory_displacement == _PLACEHOLDER
    ]
    assert len(offsets) == counters
    return code, tuple(offsets)


def _count_only(programs: Sequence[Program], layout: L.AreaLayout, red_zone: int) -> bytes:
    code, offsets = _count_only_template(len(programs), red_zone)
    out = bytearray(code)
    for at, prog in zip(offsets, programs, strict=True):
        out[at : at + 4] = layout.counter(prog.probe_index, L.HITS).to_bytes(4, "little")
    return bytes(out)


def build_detour(
    plan: OptimizePlan,
    programs: Sequence[Program],
    layout: L.AreaLayout,
    at: int,
    function_entry: bool,
    symbol_address: Callable[[str], int | None] = lambda name: None,
    trampoline: Trampoline | None = None,
    rseq_offset_at: int | None = None,
) -> Detour | OptimizeRefusal:
    """The detour for a site whose probes run `programs`, placed at `at` (return probes among
    them need the process's `trampoline`, and go into the function through `hook_targets`;
    `rseq_offset_at`: where the process's glibc keeps __rseq_offset, see `cpu_number`)."""
    hooks = any(p.entry is not None for p in programs)
    if hooks and (trampoline is None or not function_entry):
        return OptimizeRefusal.FETCH_UNSUPPORTED
    red_zone = HOOK_ROOM if hooks else 0 if function_entry else RED_ZONE
    if all(
        p.kind == ActionKind.COUNT and p.filter is None and p.entry is None and p.stacks is None and p.lang is None
        for p in programs
    ):
        return _then_region(plan, _count_only(programs, layout, red_zone), {}, at)
    push_flags = any(fetches_flags(prog) for prog in programs if prog.entry is None)
    keep_flags = not push_flags and not hooks  # (hook_targets changes them: free at a function entry)
    returning = Returning(trampoline.points, 0, at_return=False) if trampoline is not None else None

    def assemble(region: int) -> tuple[bytes, dict[int, int]]:
        asm = Asm()

        def hook(emitter: Emitter) -> None:
            assert returning is not None

            def load_region() -> None:
                asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RDX, iced.MemoryOperand(R.RIP, displ=region)))

            hook_targets(asm, emitter.frame, load_region, returning.points)

        emit_actions(
            asm, Emitter(asm, layout, plan.site, red_zone, push_flags, symbol_address, returning, rseq_offset_at),
            programs, keep_flags, hook if hooks else None,
        )  # fmt: skip
        code, fixups = asm.encode(at)
        return (code + enter_tail(), fixups) if hooks else (code, fixups)

    try:
        code, fixups = assemble(at)
        if hooks:  # the region's address is known once the code's length is (its lea is a disp32)
            code, fixups = assemble(at + len(code))
    except Unsupported as exc:
        return exc.reason
    return _then_region(plan, code, fixups, at)


def build_trap_actions(
    programs: Sequence[Program],
    layout: L.AreaLayout,
    site: int,
    at: int,
    symbol_address: Callable[[str], int | None] = lambda name: None,
    rseq_offset_at: int | None = None,
) -> Detour | OptimizeRefusal:
    """The actions of a trap site's probes (at `site`), placed at `at`, for a thread resuming
    from a hit: they run as a detour's do, on the registers of the hit, then the thread goes
    on where the tracer put in gs:[STAMP_RESUME] (the site's slot), as from the entry stamp.
    A hit costs its stop and nothing more: no memory of the target read at the stop."""
    asm = Asm()
    push_flags = any(fetches_flags(prog) for prog in programs)
    emitter = Emitter(asm, layout, site, RED_ZONE, push_flags, symbol_address, None, rseq_offset_at)
    try:
        emit_actions(asm, emitter, programs, not push_flags, None)
    except Unsupported as exc:
        return exc.reason
    resume_through_area(asm)
    code, fixups = asm.encode(at)
    return Detour(code, fixups, len(code))


def hook_targets(asm: Asm, slot_at: int, load_region: Callable[[], None], points: int | None) -> None:
    """At a function entry whose return may have been hooked (rsp + `slot_at`: its return-address
    slot S; rax, rcx, rdx and the flags free), after the code that hooks it: if the return
    address is entry point k of the trampoline (entry point 0 at `points`), [S - 8] = entry k's
    call and [S - 16] = the region (`load_region()` puts it in rdx), else [S - 8] = 0."""
    plain, done = asm.label(), asm.label()
    if points is not None:
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, mem_at(R.RSP, slot_at)))
        asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RCX, -points & L_MASK64))
        asm.add(iced.Instruction.create_reg_reg(C.ADD_R64_RM64, R.RCX, R.RAX))
        asm.add(iced.Instruction.create_reg_i32(C.CMP_RM64_IMM32, R.RCX, L.SHADOW_CAPACITY * L.TRAMPOLINE_STRIDE))
        asm.jump(C.JAE_REL32_64, plain)
        asm.add(iced.Instruction.create_reg_i32(C.SUB_RM64_IMM8, R.RAX, L.TRAMPOLINE_CALL))
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, mem_at(R.RSP, slot_at - 8), R.RAX))
        load_region()
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, mem_at(R.RSP, slot_at - 16), R.RDX))
        asm.jump(C.JMP_REL32_64, done)
    asm.bind(plain)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, mem_at(R.RSP, slot_at - 8), 0))
    asm.bind(done)


@functools.cache
def enter_tail() -> bytes:
    """A hooking function entry's last bytes, the registers back (rsp: the return-address slot
    S), the relocated region right after them: with a call in [S - 8], go there with rsp = S +
    8: the call pushes the entry point the return address already is, into S. A `ret` then
    pairs with a `call`, as the CPU predicts: replacing the return address alone costs a
    misprediction at the function's return and at the trampoline's (12-15 ns a call here). No
    register is used to get there: GCC's IPA-RA keeps values in call-clobbered registers (r11
    too) across calls to functions that do not touch them. Position-independent."""
    encoder, here = iced.Encoder(64), 0
    tail = (
        iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, stack_at(-8), 0),
        iced.Instruction.create_branch(C.JE_REL8_64, ENTER_TAIL_BYTES),  # the region
        iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, stack_at(8)),
        iced.Instruction.create_mem(C.JMP_RM64, stack_at(-16)),
    )
    for insn in tail:
        here += encoder.encode(insn, here)
    assert here == ENTER_TAIL_BYTES
    return bytes(encoder.take_buffer())


ENTER_TAIL_BYTES = 17


def _then_region(plan: OptimizePlan, code: bytes, fixups: dict[int, int], at: int) -> Detour | OptimizeRefusal:
    """The detour: the action code placed at `at`, then the relocated region."""
    moved = relocate_region_map(plan, at + len(code))
    if moved is None:
        return OptimizeRefusal.RIP_REL_OUT_OF_REACH
    region, copies = moved
    return Detour(code + region, fixups, len(code), copies)
