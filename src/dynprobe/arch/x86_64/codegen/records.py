"""Generated code that writes the thread area: a record in the ring (`ring_record`: full rings
wait, give way or lose, as the area says), a shadow-stack entry (`shadow_push`), and a thread's
resume through its area (`resume_through_area`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import iced_x86 as iced

from dynprobe.arch.x86_64.codegen.asm import (
    FUTEX_WAIT,
    L_MASK64,
    RED_ZONE,
    SYS_FUTEX,
    Asm,
    C,
    R,
    gs_at,
    mem_at,
    read_tsc,
)
from dynprobe.ringbuf import layout as L

if TYPE_CHECKING:  # the enum types exist in the stubs only; at run time the values are ints
    from iced_x86._iced_x86_py import Register as RegisterT


def shadow_push(
    asm: Asm, lay: L.AreaLayout, points: int, probe_index: int, maxactive: int, handler: int,
    fill: Callable[[], None],
) -> None:  # fmt: skip
    """rcx: a return-address slot at a function entry. Take a shadow-stack entry for it (unless
    `maxactive` instances of the probe are pending on the thread: missed), call `fill` to store
    the entry's data (rsi: the entry's offset; rax, rdx free), and point the return address at
    the trampoline's entry point of the same number (`points`: entry point 0). An entry whose
    slot is the new slot belongs to a frame that is gone (longjmp) and is reused, unless the
    return address leads to it (another return probe of this very call); otherwise a free entry
    among the newer ones, or a new one on top. Uses rax, rcx, rdx, rsi, rdi."""
    shadow, size = lay.shadow, L.SHADOW_ENTRY
    missed, full, done = asm.label(), asm.label(), asm.label()
    loop, dup, scanned, take = asm.label(), asm.label(), asm.label(), asm.label()
    pending = lay.counter(probe_index, L.PENDING)
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, gs_at(L.SHADOW_BUSY), 0))
    asm.jump(C.JNE_REL32_64, missed)
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM32, gs_at(pending), maxactive))
    asm.jump(C.JAE_REL32_64, missed)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.SHADOW_BUSY), 1))
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RDX, gs_at(L.SHADOW_TOP)))
    asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RDX, size.bit_length() - 1))
    # From the top down: a frame's callers are older entries with higher slots (the stack grows
    # down), so the first entry above the new slot ends the search: a plain call costs one step
    # whatever the depth. (Entries of other stacks, coroutines', may end it early too: a stale
    # entry below them waits for another reuse, and is never taken for a live one.)
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RSI, R.RDX))
    asm.add(iced.Instruction.create_reg_i32(C.MOV_RM64_IMM32, R.RDI, -1))
    asm.bind(loop)
    asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RSI, R.RSI))
    asm.jump(C.JE_REL32_64, scanned)
    asm.add(iced.Instruction.create_reg_i32(C.SUB_RM64_IMM32, R.RSI, size))
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, gs_at(shadow + L.ENTRY_SLOT, R.RSI)))
    asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RAX, R.RCX))
    asm.jump(C.JE_REL32_64, dup)
    asm.jump(C.JA_REL32_64, scanned)
    asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RAX, R.RAX))
    asm.jump(C.JNE_REL32_64, loop)
    asm.add(iced.Instruction.create_reg_i32(C.CMP_RM64_IMM8, R.RDI, -1))
    asm.jump(C.JNE_REL32_64, loop)
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RDI, R.RSI))  # the topmost free entry
    asm.jump(C.JMP_REL32_64, loop)
    asm.bind(dup)
    # Another return probe of this call may have taken the slot already: the return address
    # then leads, through entry points and their entries' return addresses, to this entry.
    chain, live, stale = asm.label(), asm.label(), asm.label()
    asm.add(iced.Instruction.create_reg(C.PUSH_R64, R.RDX))
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, mem_at(R.RCX)))
    asm.bind(chain)
    entry_of_point(asm, points, stale)
    asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RDX, R.RSI))
    asm.jump(C.JE_REL32_64, live)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, gs_at(shadow + L.ENTRY_RET, R.RDX)))
    asm.jump(C.JMP_REL32_64, chain)
    asm.bind(live)
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RDX))
    asm.jump(C.JMP_REL32_64, loop)
    asm.bind(stale)  # a frame that is gone (longjmp): its entry is taken over
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RDX))
    one_less_pending(asm, lay)
    asm.jump(C.JMP_REL32_64, take)
    asm.bind(scanned)
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RSI, R.RDI))
    asm.add(iced.Instruction.create_reg_i32(C.CMP_RM64_IMM8, R.RSI, -1))
    asm.jump(C.JNE_REL32_64, take)
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RSI, R.RDX))
    asm.add(iced.Instruction.create_reg_i32(C.CMP_RM64_IMM32, R.RSI, L.SHADOW_CAPACITY * size))
    asm.jump(C.JAE_REL32_64, full)
    asm.add(iced.Instruction.create_mem(C.INC_RM64, gs_at(L.SHADOW_TOP)))
    asm.bind(take)
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(shadow + L.ENTRY_SLOT, R.RSI), R.RCX))
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, mem_at(R.RCX)))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(shadow + L.ENTRY_RET, R.RSI), R.RAX))
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, handler))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(shadow + L.ENTRY_HANDLER, R.RSI), R.RAX))
    # the probe index (u32) and the tracer's flags (u32, cleared)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(shadow + L.ENTRY_PROBE, R.RSI), probe_index))
    fill()
    asm.add(iced.Instruction.create_mem(C.INC_RM64, gs_at(pending)))
    # entry k (at offset k * SHADOW_ENTRY) returns through points + k * TRAMPOLINE_STRIDE
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, R.RSI))
    asm.add(iced.Instruction.create_reg_i32(C.SHR_RM64_IMM8, R.RAX, L.SHADOW_ENTRY.bit_length() - 1))
    asm.add(iced.Instruction.create_reg_reg_i32(C.IMUL_R64_RM64_IMM8, R.RAX, R.RAX, L.TRAMPOLINE_STRIDE))
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RDX, points))
    asm.add(iced.Instruction.create_reg_reg(C.ADD_R64_RM64, R.RAX, R.RDX))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, mem_at(R.RCX), R.RAX))
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.SHADOW_BUSY), 0))
    asm.jump(C.JMP_REL32_64, done)
    asm.bind(full)  # every entry is taken
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.SHADOW_BUSY), 0))
    asm.bind(missed)
    asm.add(iced.Instruction.create_mem(C.INC_RM64, gs_at(lay.counter(probe_index, L.MISSED))))
    asm.bind(done)


def one_less_pending(asm: Asm, layout: L.AreaLayout) -> None:
    """One instance less pending for the probe of the shadow entry at rsi (rax used)."""
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.EAX, gs_at(layout.shadow + L.ENTRY_PROBE, R.RSI)))
    asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RAX, L.PROBE_BYTES.bit_length() - 1))
    asm.add(iced.Instruction.create_mem(C.DEC_RM64, gs_at(layout.counter(0, L.PENDING), R.RAX)))


def entry_of_point(asm: Asm, points: int, elsewhere: int) -> None:
    """rax: a return address. If it is an entry point of the trampoline (entry point 0 at
    `points`), rdx = its shadow entry's offset; otherwise go to `elsewhere`."""
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RDX, -points & L_MASK64))
    asm.add(iced.Instruction.create_reg_reg(C.ADD_R64_RM64, R.RDX, R.RAX))
    asm.add(iced.Instruction.create_reg_i32(C.CMP_RM64_IMM32, R.RDX, L.SHADOW_CAPACITY * L.TRAMPOLINE_STRIDE))
    asm.jump(C.JAE_REL32_64, elsewhere)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.EDX, mem_at(R.RAX, 1)))  # the point's push: an offset


def _encoded_resume_return() -> bytes:
    asm = Asm()
    asm.add(iced.Instruction.create_u32(C.RETNQ_IMM16, RED_ZONE))
    return asm.encode(0)[0]


# resume_through_area's last instruction: a thread there goes on at the address at [rsp]
RESUME_RET = _encoded_resume_return()


def resume_through_area(asm: Asm) -> None:
    """Go on at gs:[STAMP_RESUME], registers and flags untouched: through the stack below the
    red zone (`ret 128`), once STAMP_BUSY is clear (a signal handler's hit may then use it)."""
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, mem_at(R.RSP, -RED_ZONE)))
    asm.add(iced.Instruction.create_mem(C.PUSH_RM64, gs_at(L.STAMP_RESUME)))
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.STAMP_BUSY), 0))
    asm.add(iced.Instruction.create_u32(C.RETNQ_IMM16, RED_ZONE))


def ring_record(
    asm: Asm, layout: L.AreaLayout, probe_index: int, slot: RegisterT, write: Callable[[], None],
    publish: bool = True, reserved: Callable[[], None] | None = None, records: int = 1,
) -> None:  # fmt: skip
    """A record in the thread's ring: the next free slot's offset in `slot` (rax used too), then
    `write()` fills it and the head publishes it (x86 keeps stores in order) with every record
    held back before it; a full ring counts the record lost. With `records` > 1, the ring must
    have room for that many, which `write()` may fill after the first (see `_data_records`:
    it leaves gs:[RESERVE] at the last one it wrote). Unless `publish`, the record is
    held back (`RESERVE` passes it, `HEAD` does not): a function tracer with a time threshold
    takes it back if the call ends too soon (`reserved()` sees its sequence number in `slot`).
    A signal handler hitting a probe while this thread writes a record would reuse the slot: the
    re-entrancy flag makes its record missed (counted) instead. A full ring gives up its oldest
    records if it is a flight recorder's (`_take_oldest`), else is waited on (`_wait_for_room`)
    before the record is counted lost."""
    missed, full, room, lost, release, done = (asm.label() for _ in range(6))
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, gs_at(L.BUSY), 0))
    asm.jump(C.JNE_REL32_64, missed)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.BUSY), 1))
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, slot, gs_at(L.RESERVE)))
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, slot))
    asm.add(iced.Instruction.create_reg_mem(C.SUB_R64_RM64, R.RAX, gs_at(L.TAIL)))
    asm.add(iced.Instruction.create_reg_i32(C.CMP_RM64_IMM32, R.RAX, layout.ring_slots - records + 1))
    asm.jump(C.JAE_REL32_64, full)  # also when a scribbled tail is ahead of head
    asm.bind(room)
    if reserved is not None:
        reserved()
    asm.add(iced.Instruction.create_reg_i32(C.AND_RM64_IMM32, slot, layout.ring_slots - 1))
    asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, slot, layout.record_size.bit_length() - 1))
    # The line a page ahead (wrapped in the ring), to be written: the hardware prefetcher stops at
    # page boundaries, and records into lines not in the cache fill the store buffer and stall the
    # thread (return records with latency: 33-36 ns a call without, 27 with; entry records 13 -> 12)
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RAX, mem_at(slot, layout.prefetch_ahead)))
    asm.add(iced.Instruction.create_reg_i32(C.AND_RM64_IMM32, R.RAX, layout.ring_bytes - 1))
    asm.add(iced.Instruction.create_mem(C.PREFETCHW_M8, gs_at(layout.ring, R.RAX)))
    write()
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, gs_at(L.RESERVE)))
    asm.add(iced.Instruction.create_reg(C.INC_RM64, R.RAX))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(L.RESERVE), R.RAX))
    if publish:
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(L.HEAD), R.RAX))
    asm.jump(C.JMP_REL32_64, release)
    asm.bind(full)
    _take_oldest(asm, slot, layout.ring_slots - records + 1, room)
    _wait_for_room(asm, slot, layout.ring_slots - records + 1, room, lost, full)
    asm.bind(lost)
    asm.add(iced.Instruction.create_mem(C.INC_RM64, gs_at(layout.counter(probe_index, L.LOST))))
    asm.bind(release)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.BUSY), 0))
    asm.jump(C.JMP_REL32_64, done)
    asm.bind(missed)
    asm.add(iced.Instruction.create_mem(C.INC_RM64, gs_at(layout.counter(probe_index, L.MISSED))))
    asm.bind(done)


def _take_oldest(asm: Asm, slot: RegisterT, limit: int, room: int) -> None:
    """The ring is full (`slot`: the record's sequence number): a flight recorder's (gs:[OVERWRITE])
    gives up its oldest records to make room (TAIL becomes slot - `limit` + 1; the reader counts
    what it never read) and goes to `room`; another's goes on. rax used."""
    other = asm.label()
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, gs_at(L.OVERWRITE), 0))
    asm.jump(C.JE_REL32_64, other)
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, slot))
    asm.add(iced.Instruction.create_reg_i32(C.SUB_RM64_IMM32, R.RAX, limit - 1))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(L.TAIL), R.RAX))
    asm.jump(C.JMP_REL32_64, room)
    asm.bind(other)


def _wait_for_room(asm: Asm, slot: RegisterT, limit: int, room: int, lost: int, full: int) -> None:
    """The ring is full (`slot`: the record's sequence number; room once slot - TAIL < `limit`):
    wait for the reader to take records, up to gs:[WAIT_TICKS] ticks (0: not at all, which the
    tracer also sets to end every wait when it leaves), spinning for gs:[WAIT_SPIN] of them,
    then asleep (layout.WAIT_SLEEPING); then go to `room`, or to `lost` when none came (and,
    until TAIL moves, at once: WAIT_GAVE_UP); back to `full` if the ring becomes a flight
    recorder's again (the reader pauses one, clearing gs:[OVERWRITE], while it copies it).
    rax used, rdx kept (so `slot` is neither)."""
    assert slot not in (R.RAX, R.RDX), "rax and rdx are the wait's"
    again, gave_up, waited, woken, overwriting = (asm.label() for _ in range(5))
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, gs_at(L.WAIT_TICKS), 0))
    asm.jump(C.JE_REL32_64, lost)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, gs_at(L.TAIL)))
    asm.add(iced.Instruction.create_reg(C.INC_RM64, R.RAX))
    asm.add(iced.Instruction.create_reg_mem(C.CMP_R64_RM64, R.RAX, gs_at(L.WAIT_GAVE_UP)))
    asm.jump(C.JE_REL32_64, lost)
    asm.add(iced.Instruction.create_reg(C.PUSH_R64, R.RDX))
    read_tsc(asm)
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RDX, R.RAX))
    asm.add(iced.Instruction.create_reg_mem(C.ADD_R64_RM64, R.RAX, gs_at(L.WAIT_TICKS)))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(L.WAIT_UNTIL), R.RAX))
    asm.add(iced.Instruction.create_reg_mem(C.ADD_R64_RM64, R.RDX, gs_at(L.WAIT_SPIN)))
    asm.add(iced.Instruction.create_reg(C.PUSH_R64, R.RDX))  # [rsp]: when the spinning ends
    asm.bind(again)
    asm.add(iced.Instruction.create(C.PAUSE))
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, slot))
    asm.add(iced.Instruction.create_reg_mem(C.SUB_R64_RM64, R.RAX, gs_at(L.TAIL)))
    asm.add(iced.Instruction.create_reg_i32(C.CMP_RM64_IMM32, R.RAX, limit))
    asm.jump(C.JB_REL32_64, waited)
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, gs_at(L.OVERWRITE), 0))
    asm.jump(C.JNE_REL32_64, overwriting)
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, gs_at(L.WAIT_TICKS), 0))
    asm.jump(C.JE_REL32_64, gave_up)
    read_tsc(asm)
    asm.add(iced.Instruction.create_reg_mem(C.CMP_R64_RM64, R.RAX, gs_at(L.WAIT_UNTIL)))
    asm.jump(C.JAE_REL32_64, gave_up)
    asm.add(iced.Instruction.create_reg_mem(C.CMP_R64_RM64, R.RAX, mem_at(R.RSP)))
    asm.jump(C.JB_REL32_64, again)
    # Asleep: WAIT_SLEEPING, then TAIL once more with a full barrier between (the reader moves
    # TAIL, then looks at WAIT_SLEEPING: a wake-up it misses costs one SLEEP_TIMEOUT at most),
    # then a futex wait while TAIL's low half is the one that said there is no room (read once:
    # a TAIL moved, and its wake sent, between two reads would be slept through); the system
    # call's registers kept
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.WAIT_SLEEPING), 1))
    fence = iced.Instruction.create_mem_i32(C.OR_RM64_IMM8, mem_at(R.RSP), 0)
    fence.has_lock_prefix = True
    asm.add(fence)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RDX, gs_at(L.TAIL)))
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, slot))
    asm.add(iced.Instruction.create_reg_reg(C.SUB_R64_RM64, R.RAX, R.RDX))
    asm.add(iced.Instruction.create_reg_i32(C.CMP_RM64_IMM32, R.RAX, limit))
    asm.jump(C.JB_REL32_64, woken)
    kept = (R.RCX, R.RSI, R.RDI, R.R10, R.R11)
    for reg in kept:
        asm.add(iced.Instruction.create_reg(C.PUSH_R64, reg))
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RDI, gs_at(L.AREA_SELF)))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.R10, mem_at(R.RDI, L.SLEEP_TIMEOUT)))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RDI, mem_at(R.RDI, L.TAIL)))
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.EAX, SYS_FUTEX))
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.ESI, FUTEX_WAIT))
    asm.add(iced.Instruction.create(C.SYSCALL))
    for reg in reversed(kept):
        asm.add(iced.Instruction.create_reg(C.POP_R64, reg))
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.WAIT_SLEEPING), 0))
    asm.jump(C.JMP_REL32_64, again)
    asm.bind(woken)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.WAIT_SLEEPING), 0))
    asm.bind(waited)
    asm.add(iced.Instruction.create_mem(C.INC_RM64, gs_at(L.WAITS)))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, mem_at(R.RSP, 8)))
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RDX))
    asm.jump(C.JMP_REL32_64, room)
    asm.bind(gave_up)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, gs_at(L.TAIL)))
    asm.add(iced.Instruction.create_reg(C.INC_RM64, R.RAX))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(L.WAIT_GAVE_UP), R.RAX))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, mem_at(R.RSP, 8)))
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RDX))
    asm.jump(C.JMP_REL32_64, lost)
    asm.bind(overwriting)
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, mem_at(R.RSP, 8)))
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RDX))
    asm.jump(C.JMP_REL32_64, full)
