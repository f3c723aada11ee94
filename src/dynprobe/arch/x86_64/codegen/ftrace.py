"""The function tracer's code (docs/architecture.md §8): the site at a traced function's entry, a
tracer instance's code (entry and exit records, values, a depth, a time threshold, a flight
recorder's snapshot threshold) and list trampolines for several instances."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import iced_x86 as iced

from dynprobe.arch.x86_64.codegen.asm import (
    ENTRY_OFFSET_AT,
    HOOK_ROOM,
    REG,
    SAVED,
    SAVED_AT,
    Asm,
    C,
    R,
    Trampoline,
    encode_with,
    gs_at,
    mem_at,
    read_tsc,
    stack_at,
)
from dynprobe.arch.x86_64.codegen.detours import ENTER_TAIL_BYTES, enter_tail, hook_targets
from dynprobe.arch.x86_64.codegen.records import ring_record, shadow_push
from dynprobe.arch.x86_64.optimize import OptimizePlan, relocate_region
from dynprobe.errors import OptimizeRefusal
from dynprobe.frozen import frozen
from dynprobe.ringbuf import layout as L
from dynprobe.spec.argspec import STRING_PIECES, ArgSpec

if TYPE_CHECKING:  # the enum types exist in the stubs only; at run time the values are ints
    from iced_x86._iced_x86_py import Register as RegisterT


def _frame_tag(asm: Asm, entry_offset: RegisterT, into: RegisterT) -> None:
    """`into` = the kind field of an entry record for the shadow entry at `entry_offset`."""
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, into, entry_offset))
    asm.add(iced.Instruction.create_reg_i32(C.SHR_RM64_IMM8, into, L.SHADOW_ENTRY.bit_length() - 1 - L.FRAME_SHIFT))
    asm.add(iced.Instruction.create_reg_i32(C.ADD_RM64_IMM8, into, 1 << L.FRAME_SHIFT))


SITE_CALL_AT = 10  # a tracer site's `call rel32` starts here (after `lea rsp,[rsp-16]; push imm32`)
_REGION_AFTER_CALL = 5 + ENTER_TAIL_BYTES  # the site's `lea rsp,[rsp+24]` and `enter_tail`, then the region


@frozen
class OpsCode:
    """Where one tracer instance's generated code is: `entry` is called from a site, `body`
    from a list trampoline (esi: the function's id, rdi: its return-address slot), `exit` is
    the return code of its graph-mode shadow entries."""

    entry: int
    body: int
    exit: int
    fixups: tuple[tuple[int, int], ...] = ()  # (a load that may fault, where to go on): data records'


def build_tracer_site(plan: OptimizePlan, function_id: int, target: int, at: int) -> bytes | OptimizeRefusal:
    """A traced function's detour at `at`: room for `hook_targets` below the return address,
    `push FUNCTION_ID; call target` (an ops' entry or a list trampoline: re-pointed by
    rewriting the call), which sets the targets; drop them and the id, `enter_tail`, the
    relocated prologue, and the jump back."""
    encoder, here = iced.Encoder(64), at
    for insn in (
        iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, stack_at(-HOOK_ROOM)),
        iced.Instruction.create_i32(C.PUSHQ_IMM32, function_id),
        iced.Instruction.create_branch(C.CALL_REL32_64, target),
        iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, stack_at(HOOK_ROOM + 8)),
    ):
        here += encoder.encode(insn, here)
    head = bytes(encoder.take_buffer()) + enter_tail()
    assert len(head) == SITE_CALL_AT + 5 + _REGION_AFTER_CALL
    region = relocate_region(plan, at + len(head))
    if region is None:
        return OptimizeRefusal.RIP_REL_OUT_OF_REACH
    return head + region


def call_to(site_detour: int, target: int) -> bytes:
    """The `call rel32` of a tracer site whose detour is at `site_detour`, calling `target`."""
    encoder = iced.Encoder(64)
    encoder.encode(iced.Instruction.create_branch(C.CALL_REL32_64, target), site_detour + SITE_CALL_AT)
    return bytes(encoder.take_buffer())


def _trace_record(
    asm: Asm, layout: L.AreaLayout, ops_index: int, kind: int = L.TRACE_ENTRY, kind_in: RegisterT | None = None,
    publish: bool = True, reserved: Callable[[], None] | None = None,
    function_id: iced.MemoryOperand | None = None, slot: RegisterT = R.RCX, data: _Data | None = None,
) -> None:  # fmt: skip
    """A 16-byte record: u16 ops, u16 kind (`kind`, or the 16-bit register `kind_in`, not ax,
    dx or `slot`'s), u32 function (esi, or the dword at `function_id`), u64 time stamp (rdtsc),
    then the `data` records of its values. Uses rax, rdx and `slot`. `publish`, `reserved`: as
    in ring_record."""
    ring = layout.ring

    def write() -> None:
        if function_id is not None:
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.EAX, function_id))
            asm.add(iced.Instruction.create_mem_reg(C.MOV_RM32_R32, gs_at(ring + L.RECORD_FAULTS, slot), R.EAX))
        read_tsc(asm)
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(ring + L.RECORD_TSC, slot), R.RAX))
        asm.add(iced.Instruction.create_mem_u32(C.MOV_RM16_IMM16, gs_at(ring + L.RECORD_PROBE, slot), ops_index))
        if kind_in is None:
            asm.add(iced.Instruction.create_mem_u32(C.MOV_RM16_IMM16, gs_at(ring + L.RECORD_CPU, slot), kind))
        else:  # (Register values are ints too: hence a parameter of its own)
            asm.add(iced.Instruction.create_mem_reg(C.MOV_RM16_R16, gs_at(ring + L.RECORD_CPU, slot), kind_in))
        if function_id is None:
            asm.add(iced.Instruction.create_mem_reg(C.MOV_RM32_R32, gs_at(ring + L.RECORD_FAULTS, slot), R.ESI))
        if data is not None:
            _data_records(asm, layout, ops_index, data)

    records = 1 + (sum(STRING_PIECES if v.is_string else 1 for v in data.values) if data is not None else 0)
    ring_record(asm, layout, ops_index, slot, write, publish, reserved, records)


_DATA_PUSHED = (R.RCX, R.RSI, R.RDI, R.R8)  # kept across the data records (r8 read from its push)


@frozen
class Captures:
    """The values the entry records (`arguments`) and the exit records (`retval`) of some
    traced functions carry."""

    arguments: tuple[ArgSpec, ...] = ()
    retval: tuple[ArgSpec, ...] = ()


@frozen
class _Data:
    """The values of a record's data records, and where the call's registers are: `frame`
    bytes up from rsp is the base its saved registers (SAVED_AT) and its return-address slot
    (`slot_at`, an entry's) are counted from."""

    values: Sequence[ArgSpec]
    frame: int
    slot_at: int | None = None


def _data_records(asm: Asm, layout: L.AreaLayout, ops_index: int, data: _Data) -> None:
    """After a record at gs:[RESERVE]: the data records of `data.values`, from RESERVE + 1 on;
    gs:[RESERVE] is left at the last (ring_record then publishes them all). Keeps every
    register but rax and rdx."""
    for reg in _DATA_PUSHED:
        asm.add(iced.Instruction.create_reg(C.PUSH_R64, reg))
    frame = data.frame + 8 * len(_DATA_PUSHED)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RSI, gs_at(L.RESERVE)))  # rsi: the next record's number
    asm.add(iced.Instruction.create_reg(C.INC_RM64, R.RSI))
    for number, value in enumerate(data.values):
        _load_source(asm, value.source, frame, data.slot_at)
        if value.is_string:
            _string_records(asm, layout, ops_index, number)
            continue
        _data_slot(asm, layout)
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(layout.ring + L.RECORD_TSC, R.RDX), R.RAX))
        _data_header(asm, layout, ops_index, number, 8)
        asm.add(iced.Instruction.create_reg(C.INC_RM64, R.RSI))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RAX, mem_at(R.RSI, -1)))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(L.RESERVE), R.RAX))
    for reg in reversed(_DATA_PUSHED):
        asm.add(iced.Instruction.create_reg(C.POP_R64, reg))


def _load_source(asm: Asm, source: str, frame: int, slot_at: int | None) -> None:
    """rax = the call's value at `source` (see ArgSpec.source)."""
    if source.startswith("xmm"):
        asm.add(iced.Instruction.create_reg_reg(C.MOVQ_RM64_XMM, R.RAX, getattr(R, source.upper())))
    elif source.startswith("stack+"):
        assert slot_at is not None, "a stack slot at a return"
        at = frame + slot_at + 8 * int(source.removeprefix("stack+"))
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, mem_at(R.RSP, at)))
    elif source in SAVED_AT:
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, mem_at(R.RSP, frame + SAVED_AT[source])))
    elif source == "r8":
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, mem_at(R.RSP, 0)))  # (pushed last)
    else:
        asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, REG[source]))


def _data_slot(asm: Asm, layout: L.AreaLayout) -> None:
    """rdx = the ring offset of record number rsi."""
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RDX, R.RSI))
    asm.add(iced.Instruction.create_reg_i32(C.AND_RM64_IMM32, R.RDX, layout.ring_slots - 1))
    asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RDX, layout.record_size.bit_length() - 1))


def _data_header(asm: Asm, layout: L.AreaLayout, ops_index: int, number: int, held: int | None) -> None:
    """The header of the data record at rdx: `held` (bytes and flags), or eax's."""
    ring = layout.ring
    asm.add(iced.Instruction.create_mem_u32(C.MOV_RM16_IMM16, gs_at(ring + L.RECORD_PROBE, R.RDX), ops_index))
    asm.add(iced.Instruction.create_mem_u32(C.MOV_RM16_IMM16, gs_at(ring + L.RECORD_CPU, R.RDX), L.TRACE_DATA | number))
    if held is None:
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM32_R32, gs_at(ring + L.RECORD_FAULTS, R.RDX), R.EAX))
    else:
        asm.add(iced.Instruction.create_mem_u32(C.MOV_RM32_IMM32, gs_at(ring + L.RECORD_FAULTS, R.RDX), held))


def _string_records(asm: Asm, layout: L.AreaLayout, ops_index: int, number: int) -> None:
    """The string rax points to, 8 bytes a record (rsi: the next record's number, advanced):
    the last record holds fewer bytes and DATA_END, or is full and DATA_CUT (no NUL in
    8 * STRING_PIECES bytes), or DATA_FAULTED (unmapped memory came first: with no byte read,
    the record holds the pointer); a null pointer is one record, DATA_NULL. Uses rax, rcx,
    rdx, rdi, r8."""
    ring = layout.ring
    piece, byte, ended, faulted, some, null, done = (asm.label() for _ in range(7))
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RDI, R.RAX))
    asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RDI, R.RDI))
    asm.jump(C.JE_REL32_64, null)
    asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.ECX, R.ECX))  # ecx: bytes read
    asm.bind(piece)
    _data_slot(asm, layout)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(ring + L.RECORD_TSC, R.RDX), 0))
    asm.bind(byte)
    asm.add(iced.Instruction.create_reg_mem(C.MOVZX_R32_RM8, R.EAX, mem_at(R.RDI, 0, R.RCX)), faulted)
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R32_RM32, R.R8D, R.ECX))
    asm.add(iced.Instruction.create_reg_i32(C.AND_RM32_IMM8, R.R8D, 7))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM8_R8, gs_at(ring + L.RECORD_TSC, R.RDX, R.R8), R.AL))
    asm.add(iced.Instruction.create_reg(C.INC_RM32, R.ECX))
    asm.add(iced.Instruction.create_reg_reg(C.TEST_RM32_R32, R.EAX, R.EAX))
    asm.jump(C.JE_REL32_64, ended)
    asm.add(iced.Instruction.create_reg_i32(C.TEST_RM32_IMM32, R.ECX, 7))
    asm.jump(C.JNE_REL32_64, byte)
    _data_header(asm, layout, ops_index, number, 8)  # a full piece
    asm.add(iced.Instruction.create_reg(C.INC_RM64, R.RSI))
    asm.add(iced.Instruction.create_reg_i32(C.CMP_RM32_IMM32, R.ECX, 8 * STRING_PIECES))
    asm.jump(C.JB_REL32_64, piece)
    asm.add(iced.Instruction.create_mem_u32(C.OR_RM32_IMM32, gs_at(ring + L.RECORD_FAULTS, R.RDX), L.DATA_CUT))
    asm.jump(C.JMP_REL32_64, done)
    asm.bind(ended)  # ecx - 1 bytes before the NUL
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R32_M, R.EAX, mem_at(R.RCX, -1)))
    asm.add(iced.Instruction.create_reg_i32(C.AND_RM32_IMM8, R.EAX, 7))
    asm.add(iced.Instruction.create_reg_i32(C.OR_RM32_IMM32, R.EAX, L.DATA_END))
    _data_header(asm, layout, ops_index, number, None)
    asm.add(iced.Instruction.create_reg(C.INC_RM64, R.RSI))
    asm.jump(C.JMP_REL32_64, done)
    asm.bind(faulted)  # ecx bytes could be read (none: the record holds the address instead)
    asm.add(iced.Instruction.create_reg_reg(C.TEST_RM32_R32, R.ECX, R.ECX))
    asm.jump(C.JNE_REL32_64, some)
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(ring + L.RECORD_TSC, R.RDX), R.RDI))
    asm.bind(some)
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R32_RM32, R.EAX, R.ECX))
    asm.add(iced.Instruction.create_reg_i32(C.AND_RM32_IMM8, R.EAX, 7))
    asm.add(iced.Instruction.create_reg_i32(C.OR_RM32_IMM32, R.EAX, L.DATA_FAULTED))
    _data_header(asm, layout, ops_index, number, None)
    asm.add(iced.Instruction.create_reg(C.INC_RM64, R.RSI))
    asm.jump(C.JMP_REL32_64, done)
    asm.bind(null)
    _data_slot(asm, layout)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(ring + L.RECORD_TSC, R.RDX), 0))
    _data_header(asm, layout, ops_index, number, L.DATA_NULL)
    asm.add(iced.Instruction.create_reg(C.INC_RM64, R.RSI))
    asm.bind(done)


# An entry's frame, from rsp: the saved registers, the return address into the site (its
# region _REGION_AFTER_CALL further), the function's id, HOOK_ROOM, the traced function's
# return-address slot.
_SITE_RET_AT = 8 * len(SAVED)
_ID_AT = _SITE_RET_AT + 8
_SLOT_AT = _ID_AT + 8 + HOOK_ROOM


def _save(asm: Asm) -> None:
    for name in SAVED:
        asm.add(iced.Instruction.create_reg(C.PUSH_R64, REG[name]))


def _hook_and_return(asm: Asm, points: int | None) -> None:
    """An entry's end: `hook_targets` (points: the return trampoline's entry point 0, if the
    return may have been hooked), registers back, return to the site."""

    def load_region() -> None:
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RDX, mem_at(R.RSP, _SITE_RET_AT)))
        asm.add(iced.Instruction.create_reg_i32(C.ADD_RM64_IMM8, R.RDX, _REGION_AFTER_CALL))

    hook_targets(asm, _SLOT_AT, load_region, points)
    for name in reversed(SAVED):
        asm.add(iced.Instruction.create_reg(C.POP_R64, REG[name]))
    asm.add(iced.Instruction.create(C.RETNQ))


def build_list_trampoline(bodies: Sequence[int], at: int, points: int | None) -> bytes:
    """A site traced by several instances calls this: save what the bodies use, esi = the
    function's id, rdi = its return-address slot, call each body in turn, `_hook_and_return`."""
    asm = Asm()
    _save(asm)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.ESI, mem_at(R.RSP, _ID_AT)))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RDI, mem_at(R.RSP, _SLOT_AT)))
    for body in bodies:
        asm.add(iced.Instruction.create_branch(C.CALL_REL32_64, body))
    _hook_and_return(asm, points)
    return asm.encode(at)[0]


def build_ops_code(
    layout: L.AreaLayout, ops_index: int, trampoline: Trampoline | None, at: int, *, depth: int | None,
    threshold: int, captures: Captures | None, snapshot_over: int,
) -> tuple[bytes, OpsCode]:  # fmt: skip
    """One tracer instance's code at `at`: its entry (called from a site: saves, runs the
    body inline, `_hook_and_return`), its body again as a function (for
    list trampolines: esi the id, rdi the return-address slot, kept) and, with a `trampoline`
    (graph mode), `exit`, the return code of its shadow entries, which writes the exit record.
    The body counts the call and writes an entry record; in graph mode it takes a shadow entry
    first, which the entry record names (its frame). With a `depth`, calls nested deeper than
    `depth` traced calls (its pending shadow entries on the thread) are not recorded.

    In graph mode with a `threshold` (time-stamp counter ticks), calls that end sooner leave no
    record: entry records are held back (ring_record) and a call that ends too soon takes its
    own back with everything after it, which is its callees' (shorter still). A call that lasts
    publishes its exit with every held-back entry before it: its callers', which last longer.
    (Records of other writers publish held-back entries too: those calls then show up whatever
    their length, and a reader's threshold hides them.)

    With `captures`, entry and exit records carry the values it names in data records: the
    code of the functions that record values (one instance's code per set of values).

    With `snapshot_over` (graph mode, a flight recorder's rings; ticks), a call that lasted
    that long or longer asks for a snapshot once its exit is written (`_ask_snapshot`)."""
    entry_values = captures.arguments if captures is not None else ()
    exit_values = captures.retval if captures is not None else ()
    maxactive = L.SHADOW_CAPACITY if depth is None else depth
    journal = trampoline is not None and threshold > 0
    held = L.ENTRY_DATA + 8  # in a shadow entry: the sequence number of its held-back entry record
    shadow = layout.shadow

    def body(asm: Asm, inline: bool, exit_at: int) -> None:
        """Inline: in the entry's frame, registers free. Otherwise: esi the id, rdi the slot,
        both kept."""
        hits = iced.Instruction.create_mem(C.INC_RM64, gs_at(layout.counter(ops_index, L.HITS)))
        frame = 0 if inline else 8  # (the list trampoline's call)
        if trampoline is None:
            asm.add(hits)
            data = _Data(entry_values, frame, _SLOT_AT) if entry_values else None
            _trace_record(asm, layout, ops_index, function_id=mem_at(R.RSP, _ID_AT) if inline else None, data=data)
            return
        done = asm.label()
        if depth is not None:
            asm.add(
                iced.Instruction.create_mem_i32(C.CMP_RM64_IMM32, gs_at(layout.counter(ops_index, L.PENDING)), depth)
            )
            asm.jump(C.JAE_REL32_64, done)
        asm.add(hits)
        if inline:
            asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RCX, mem_at(R.RSP, _SLOT_AT)))
            id_at = mem_at(R.RSP, _ID_AT)
        else:
            asm.add(iced.Instruction.create_reg(C.PUSH_R64, R.RSI))
            asm.add(iced.Instruction.create_reg(C.PUSH_R64, R.RDI))
            asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RCX, R.RDI))
            id_at = mem_at(R.RSP, 8)  # the pushed rsi

        def fill() -> None:  # data: the function's id | the entry's kind << 32; the entry record
            _frame_tag(asm, R.RSI, R.RDI)
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.EAX, id_at))
            asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RDX, R.RDI))
            asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RDX, 32))
            asm.add(iced.Instruction.create_reg_reg(C.OR_R64_RM64, R.RDX, R.RAX))
            asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(shadow + L.ENTRY_DATA, R.RSI), R.RDX))
            if journal:  # no entry record held back (yet)
                asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(shadow + held, R.RSI), -1))
            if snapshot_over:  # (its entry record may be written over before it returns)
                read_tsc(asm)
                asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(shadow + L.ENTRY_TSC, R.RSI), R.RAX))

            def reserved() -> None:  # r11: the record's sequence number
                asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(shadow + held, R.RSI), R.R11))

            data = _Data(entry_values, frame if inline else frame + 16, _SLOT_AT) if entry_values else None
            _trace_record(
                asm, layout, ops_index, kind_in=R.DI, publish=not journal, reserved=reserved if journal else None,
                function_id=id_at, slot=R.R11, data=data,
            )  # fmt: skip

        shadow_push(asm, layout, trampoline.points, ops_index, maxactive, exit_at, fill)
        if not inline:
            asm.add(iced.Instruction.create_reg(C.POP_R64, R.RDI))
            asm.add(iced.Instruction.create_reg(C.POP_R64, R.RSI))
        asm.bind(done)

    def assemble(exit_at: int) -> tuple[bytes, dict[int, int], dict[int, int]]:
        asm = Asm()
        callable_body, exit_ = asm.label(), asm.label()
        _save(asm)
        body(asm, True, exit_at)
        _hook_and_return(asm, trampoline.points if trampoline is not None else None)
        asm.bind(callable_body)
        body(asm, False, exit_at)
        asm.add(iced.Instruction.create(C.RETNQ))
        asm.bind(exit_)
        if trampoline is not None:
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RCX, mem_at(R.RSP, ENTRY_OFFSET_AT)))
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.ESI, gs_at(shadow + L.ENTRY_DATA, R.RCX)))
            asm.add(iced.Instruction.create_reg_mem(C.MOVZX_R32_RM16, R.EDI, gs_at(shadow + L.ENTRY_DATA + 4, R.RCX)))
            asm.add(iced.Instruction.create_reg_i32(C.OR_RM32_IMM8, R.EDI, L.TRACE_EXIT))
            if journal:
                _take_back_if_short(asm, layout, ops_index, shadow + held, threshold, trampoline.finish)
            _trace_record(asm, layout, ops_index, kind_in=R.DI, data=_Data(exit_values, 0) if exit_values else None)
            if snapshot_over:
                _ask_snapshot(asm, layout, snapshot_over, trampoline.finish)
            asm.add(iced.Instruction.create_branch(C.JMP_REL32_64, trampoline.finish))
        else:
            asm.add(iced.Instruction.create(C.INT3))
        return encode_with(asm, at, (callable_body, exit_))

    # The shadow entries name the exit's address, known once encoded: a second pass with it (an
    # imm64 either way, so nothing moves).
    _, first, _ = assemble(0)
    exit_at = list(first.values())[1]
    code, addresses, fixups = assemble(exit_at)
    body_at, check = addresses.values()
    assert check == exit_at
    return code, OpsCode(at, body_at, exit_at, tuple(fixups.items()))


def _take_back_if_short(
    asm: Asm, layout: L.AreaLayout, ops_index: int, held: int, threshold: int, finish: int
) -> None:  # fmt: skip
    """At a traced call's return (rcx: its shadow entry's offset; rsi, rdi kept): if its entry
    record is still held back and the call lasted less than `threshold` ticks, take the record
    back with all after it and go to `finish`; otherwise fall through to write the exit record.
    Uses rax, rcx, rdx."""
    missed, short, release, keep, write = (asm.label() for _ in range(5))
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, gs_at(L.BUSY), 0))
    asm.jump(C.JNE_REL32_64, missed)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.BUSY), 1))
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RDX, gs_at(held, R.RCX)))
    asm.add(iced.Instruction.create_reg_mem(C.CMP_R64_RM64, R.RDX, gs_at(L.HEAD)))
    asm.jump(C.JB_REL32_64, keep)  # published already (a callee lasted): the exit follows it
    asm.add(iced.Instruction.create_reg_mem(C.CMP_R64_RM64, R.RDX, gs_at(L.RESERVE)))
    asm.jump(C.JAE_REL32_64, release)  # no entry record (missed, lost, or taken back): none at all
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, R.RDX))
    asm.add(iced.Instruction.create_reg_i32(C.AND_RM64_IMM32, R.RAX, layout.ring_slots - 1))
    asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RAX, layout.record_size.bit_length() - 1))
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RCX, gs_at(layout.ring + L.RECORD_TSC, R.RAX)))
    asm.add(iced.Instruction.create_reg(C.PUSH_R64, R.RDX))
    read_tsc(asm)
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RDX))
    asm.add(iced.Instruction.create_reg_reg(C.SUB_R64_RM64, R.RAX, R.RCX))
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RCX, threshold))
    asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RAX, R.RCX))
    asm.jump(C.JB_REL32_64, short)
    asm.bind(keep)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.BUSY), 0))
    asm.jump(C.JMP_REL32_64, write)
    asm.bind(short)
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(L.RESERVE), R.RDX))
    asm.bind(release)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.BUSY), 0))
    asm.add(iced.Instruction.create_branch(C.JMP_REL32_64, finish))
    asm.bind(missed)
    asm.add(iced.Instruction.create_mem(C.INC_RM64, gs_at(layout.counter(ops_index, L.MISSED))))
    asm.add(iced.Instruction.create_branch(C.JMP_REL32_64, finish))
    asm.bind(write)


def _ask_snapshot(asm: Asm, layout: L.AreaLayout, snapshot_over: int, finish: int) -> None:
    """After a traced call's exit record: if the call lasted `snapshot_over` ticks or more
    (from its shadow entry's ENTRY_TSC), pause the thread's ring (OVERWRITE cleared: what led
    up to the call stays, later records wait for room) and ask for a snapshot (SNAPSHOT_DUE),
    which the reader takes and then resumes the ring; otherwise go to `finish`. Uses rax, rcx,
    rdx."""
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RCX, mem_at(R.RSP, ENTRY_OFFSET_AT)))
    read_tsc(asm)
    asm.add(iced.Instruction.create_reg_mem(C.SUB_R64_RM64, R.RAX, gs_at(layout.shadow + L.ENTRY_TSC, R.RCX)))
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RDX, snapshot_over))
    asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RAX, R.RDX))
    asm.add(iced.Instruction.create_branch(C.JL_REL32_64, finish))  # (signed: stamps of two CPUs may cross)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.OVERWRITE), 0))
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.SNAPSHOT_DUE), 1))
