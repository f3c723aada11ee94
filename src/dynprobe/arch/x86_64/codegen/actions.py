"""A probe's action program (actions/model.py) as machine code: fetches, the filter, counters,
histogram, record, return entries (`Emitter`), for detours, trap actions and return code alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import iced_x86 as iced

from dynprobe.actions.model import MAX_FIELDS, ActionKind, Compare, Filter, Program, ReturnEntry
from dynprobe.arch.x86_64.codegen.asm import (
    ENTRY_OFFSET_AT,
    FLAGS_AT,
    JCC_SIGNED,
    JCC_UNSIGNED,
    L_MASK64,
    REG,
    RSEQ_CPU_ID,
    SAVED,
    SAVED_AT,
    TSC_AUX_CPU,
    Asm,
    C,
    R,
    Returning,
    Unsupported,
    gs_at,
    mem_at,
    read_tsc,
)
from dynprobe.arch.x86_64.codegen.records import entry_of_point, ring_record, shadow_push
from dynprobe.arch.x86_64.codegen.stacks import emit_stack_count
from dynprobe.arch.x86_64.cpu import has_rdpid
from dynprobe.arch.x86_64.regs import ARG_REGS
from dynprobe.arch.x86_64.relocate import in_rel32_reach
from dynprobe.errors import OptimizeRefusal
from dynprobe.ringbuf import layout as L
from dynprobe.spec.model import (
    Absolute,
    Arg,
    Caller,
    Deref,
    Fetch,
    FetchArg,
    Latency,
    Reg,
    RetVal,
    Stack,
    StackPointer,
    StackSlot,
    SymbolAddr,
    fetch_chain,
)


def _normalize(asm: Asm, arg: FetchArg) -> None:
    """Narrow rax to the argument's type, as the consumer does for records."""
    bits, signed = arg.type.bits, arg.type.kind == "s"
    if bits == 64:
        return
    if signed:
        code = {8: C.MOVSX_R64_RM8, 16: C.MOVSX_R64_RM16, 32: C.MOVSXD_R64_RM32}[bits]
        asm.add(iced.Instruction.create_reg_reg(code, R.RAX, {8: R.AL, 16: R.AX, 32: R.EAX}[bits]))
    elif bits == 32:
        asm.add(iced.Instruction.create_reg_reg(C.MOV_R32_RM32, R.EAX, R.EAX))
    else:
        code = {8: C.MOVZX_R32_RM8, 16: C.MOVZX_R32_RM16}[bits]
        asm.add(iced.Instruction.create_reg_reg(code, R.EAX, {8: R.AL, 16: R.AX}[bits]))


class Emitter:
    """The full form's code, one probe after another."""

    def __init__(
        self, asm: Asm, layout: L.AreaLayout, site: int, red_zone: int, flags_pushed: bool,
        symbol_address: Callable[[str], int | None], returning: Returning | None = None,
        rseq_offset_at: int | None = None,
    ) -> None:  # fmt: skip
        self.asm = asm
        self.rseq_offset_at = rseq_offset_at  # the address of the target's __rseq_offset, if any
        self.layout = layout
        self.site = site
        self.red_zone = red_zone
        self.flags_pushed = flags_pushed
        # bytes between rsp and the thread's rsp at the site (at a return: the trampoline's
        # entry point address pushed where the return address was, then the saved registers)
        self.frame = (
            8 * len(SAVED) + (8 if flags_pushed else 0) + red_zone + (8 if returning and returning.at_return else 0)
        )
        self.symbol_address = symbol_address
        self.returning = returning
        self.in_record = False  # rsi: the record's offset, its time stamp written

    def load_reg(self, name: str) -> None:
        asm = self.asm
        if name in SAVED_AT:
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, mem_at(R.RSP, SAVED_AT[name])))
        elif name == "rsp":
            asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RAX, mem_at(R.RSP, self.frame)))
        elif name == "eflags" and self.flags_pushed:
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, mem_at(R.RSP, FLAGS_AT)))
        elif name == "rip" and self.returning is not None and self.returning.at_return:
            self.caller()  # (a return's %ip is where it returns to, as at a stop)
        elif name == "rip":
            asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, self.site))
        elif name in REG:
            asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, REG[name]))
        else:
            raise Unsupported(OptimizeRefusal.FETCH_UNSUPPORTED)

    def address(self, fetch: Fetch, fault: int) -> None:
        """rax = the address a memory fetch reads from (the address of a string)."""
        asm = self.asm
        if isinstance(fetch, Absolute | SymbolAddr):
            addr = fetch.addr if isinstance(fetch, Absolute) else self.symbol_address(fetch.symbol)
            if addr is None:
                raise Unsupported(OptimizeRefusal.FETCH_UNSUPPORTED)
            if isinstance(fetch, SymbolAddr):
                addr += fetch.offset
            asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, addr & L_MASK64))
        else:  # (the parser gives strings and values no other fetch: BAD_STRING, FILTER_STRING, VALUE_STRING)
            assert isinstance(fetch, Deref), f"no address for {fetch}"
            self.value(fetch.inner, 64, fault)
            if in_rel32_reach(0, fetch.offset):  # (a disp32 reaches it)
                asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RAX, mem_at(R.RAX, fetch.offset)))
            else:
                asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RCX, fetch.offset & L_MASK64))
                asm.add(iced.Instruction.create_reg_reg(C.ADD_R64_RM64, R.RAX, R.RCX))

    def entry_word(self, offset: int) -> None:
        """rax = a word of the shadow-stack entry being returned through."""
        asm = self.asm
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, mem_at(R.RSP, ENTRY_OFFSET_AT)))
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, gs_at(self.layout.shadow + offset, R.RAX)))

    def caller(self) -> None:
        """rax = where the call being returned from returns to: its entry's return address or,
        when that is an entry point of the trampoline (return probes of the same call hooked
        it before), that entry's, and so on."""
        asm = self.asm
        assert self.returning is not None
        self.entry_word(L.ENTRY_RET)
        chain, found = asm.label(), asm.label()
        asm.bind(chain)
        entry_of_point(asm, self.returning.points, found)
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, gs_at(self.layout.shadow + L.ENTRY_RET, R.RDX)))
        asm.jump(C.JMP_REL32_64, chain)
        asm.bind(found)

    def return_value(self, fetch: Fetch) -> bool:
        """The fetches of a return: entry arguments kept at the entry, $retval, $latency, the
        caller. False for any other fetch."""
        asm = self.asm
        if self.returning is None or not self.returning.at_return:
            if isinstance(fetch, RetVal | Latency | Caller):
                raise Unsupported(OptimizeRefusal.FETCH_UNSUPPORTED)
            return False
        if isinstance(fetch, Arg):
            self.entry_word(L.ENTRY_DATA + 8 * (fetch.index - 1))
        elif isinstance(fetch, RetVal):
            self.load_reg("rax")
        elif isinstance(fetch, Caller):
            self.caller()
        elif isinstance(fetch, Latency):
            # ns = ticks * mult >> 32 (the consumer's calibration), in 128 bits: no overflow. In a
            # record, the record's time stamp is the return's: one rdtsc less.
            if self.in_record:
                asm.add(
                    iced.Instruction.create_reg_mem(
                        C.MOV_R64_RM64, R.RDX, gs_at(self.layout.ring + L.RECORD_TSC, R.RSI)
                    )
                )
            else:
                asm.add(iced.Instruction.create(C.RDTSC))
                asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RDX, 32))
                asm.add(iced.Instruction.create_reg_reg(C.OR_R64_RM64, R.RDX, R.RAX))
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, mem_at(R.RSP, ENTRY_OFFSET_AT)))
            asm.add(
                iced.Instruction.create_reg_mem(C.SUB_R64_RM64, R.RDX, gs_at(self.layout.shadow + L.ENTRY_TSC, R.RAX))
            )
            # Two stamps are not ordered (no fence: one costs more than the rest of a return
            # probe), and a thread may move to a CPU whose counter is a little behind: a return
            # stamped before its entry is a call shorter than the clock can tell, 0.
            counted = asm.label()
            asm.jump(C.JNS_REL32_64, counted)
            asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.EDX, R.EDX))
            asm.bind(counted)
            asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, self.returning.tsc_mult))
            asm.add(iced.Instruction.create_reg(C.MUL_RM64, R.RDX))
            asm.add(iced.Instruction.create_reg_reg_u32(C.SHRD_RM64_R64_IMM8, R.RAX, R.RDX, 32))
        else:
            return False
        return True

    def value(self, fetch: Fetch, bits: int, fault: int) -> None:
        """rax = the fetched value (a memory load of `bits` bits zero-extended; registers whole)."""
        asm = self.asm
        if self.return_value(fetch):
            return
        if isinstance(fetch, Reg):
            self.load_reg(fetch.name)
            return
        if isinstance(fetch, Arg):
            self.load_reg(ARG_REGS[fetch.index - 1])
            return
        if isinstance(fetch, StackPointer):
            self.load_reg("rsp")
            return
        if isinstance(fetch, StackSlot):
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, gs_at(L.STACK_SLOT)))
            return
        if isinstance(fetch, Stack):
            self.load_reg("rsp")
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, mem_at(R.RAX, 8 * fetch.index)), fault)
            return
        self.address(fetch, fault)
        src = mem_at(R.RAX)
        if bits == 64:
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, src), fault)
        elif bits == 32:
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.EAX, src), fault)
        else:
            code = C.MOVZX_R32_RM8 if bits == 8 else C.MOVZX_R32_RM16
            asm.add(iced.Instruction.create_reg_mem(code, R.EAX, src), fault)

    def typed_value(self, arg: FetchArg, fault: int) -> None:
        self.value(arg.fetch, arg.type.bits, fault)
        _normalize(self.asm, arg)

    def condition(self, node: Filter, true: int, false: int) -> None:
        asm = self.asm
        if isinstance(node, Compare):
            self.typed_value(node.arg, false)
            asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RCX, node.value & L_MASK64))
            asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RAX, R.RCX))
            jcc = (JCC_SIGNED if node.arg.type.kind == "s" else JCC_UNSIGNED)[node.op]
            asm.jump(jcc, true)
            asm.jump(C.JMP_REL32_64, false)
            return
        middle = asm.label()
        if node.op == "and":
            self.condition(node.left, middle, false)
        else:
            self.condition(node.left, true, middle)
        asm.bind(middle)
        self.condition(node.right, true, false)

    def inc(self, disp: int) -> None:
        self.asm.add(iced.Instruction.create_mem(C.INC_RM64, gs_at(disp)))

    def program(self, prog: Program) -> None:
        asm, layout = self.asm, self.layout
        done = asm.label()
        if prog.filter is not None:
            passed = asm.label()
            self.condition(prog.filter, passed, done)
            asm.bind(passed)
        self.inc(layout.counter(prog.probe_index, L.HITS))
        if prog.stacks is not None:
            if prog.stacks.sums:  # rax: the value (a fault: 0)
                assert prog.value is not None
                valued, faulted = asm.label(), asm.label()
                self.typed_value(prog.value, faulted)
                asm.jump(C.JMP_REL32_64, valued)
                asm.bind(faulted)
                asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.EAX, R.EAX))
                asm.bind(valued)
            at_return = self.returning is not None and self.returning.at_return
            if at_return:  # the walk starts where the return went back to
                value = R.RCX
                asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, value, R.RAX))
                self.caller()
                asm.add(iced.Instruction.create_reg(C.PUSH_R64, R.RAX))
                asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, value))
            emit_stack_count(
                asm, walker=prog.stacks.walker, table=prog.stacks.table, slots=prog.stacks.slots,
                max_frames=prog.stacks.max_frames, probe_index=prog.probe_index,
                site=None if at_return else self.site, frame=self.frame + (8 if at_return else 0),
                missed=layout.counter(prog.probe_index, L.MISSED), at_entry=prog.stacks.at_entry,
                add_value=prog.stacks.sums,
            )  # fmt: skip
            if at_return:
                asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, mem_at(R.RSP, 8)))
        if prog.kind == ActionKind.HIST:
            self.histogram(prog)
        elif prog.kind == ActionKind.RECORD:
            self.record(prog)
        if prog.lang is not None:
            from dynprobe.arch.x86_64.codegen.lang import BodyCompiler  # (only programs in bpftrace's language)

            BodyCompiler(self, prog.lang, prog.probe_index).emit()
        asm.bind(done)

    def return_entry(self, prog: Program, entry: ReturnEntry) -> None:
        """At a return probe's function entry (rsp + frame: the return address): a shadow-stack
        entry keeping the time stamp and the arguments the return needs (see `shadow_push`)."""
        asm = self.asm
        assert self.returning is not None
        shadow = self.layout.shadow

        def fill() -> None:
            if entry.timestamp:
                read_tsc(asm)
                asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(shadow + L.ENTRY_TSC, R.RSI), R.RAX))
            for n in entry.arg_indices:
                self.load_reg(ARG_REGS[n - 1])
                asm.add(iced.Instruction.create_mem_reg(
                    C.MOV_RM64_R64, gs_at(shadow + L.ENTRY_DATA + 8 * (n - 1), R.RSI), R.RAX))  # fmt: skip

        asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RCX, mem_at(R.RSP, self.frame)))
        shadow_push(asm, self.layout, self.returning.points, prog.probe_index, entry.maxactive, entry.handler, fill)

    def histogram(self, prog: Program) -> None:
        asm = self.asm
        assert prog.value is not None
        faulted, zero, store = asm.label(), asm.label(), asm.label()
        self.typed_value(prog.value, faulted)
        asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RAX, R.RAX))
        asm.jump(C.JLE_REL32_64 if prog.value.type.kind == "s" else C.JE_REL32_64, zero)
        asm.add(iced.Instruction.create_reg_reg(C.BSR_R64_RM64, R.RAX, R.RAX))
        asm.add(iced.Instruction.create_reg_i32(C.ADD_RM32_IMM8, R.EAX, 1))
        asm.jump(C.JMP_REL32_64, store)
        asm.bind(zero)
        asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.EAX, R.EAX))
        asm.jump(C.JMP_REL32_64, store)
        asm.bind(faulted)
        asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.EAX, L.HIST_FAULTED))
        asm.bind(store)
        asm.add(iced.Instruction.create_mem(C.INC_RM64, gs_at(self.layout.hist(prog.hist_index), index=R.RAX, scale=8)))

    def record_header(self, probe_index: int) -> None:
        """The header of the record at rsi: the time-stamp counter, the probe, no faults yet,
        the CPU (rax, rcx, rdx used)."""
        asm, ring = self.asm, self.layout.ring
        if has_rdpid():
            asm.add(iced.Instruction.create(C.RDTSC))
            self.cpu_number()
        else:
            asm.add(iced.Instruction.create(C.RDTSCP))
            asm.add(iced.Instruction.create_reg_i32(C.AND_RM32_IMM32, R.ECX, TSC_AUX_CPU))
        asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RDX, 32))
        asm.add(iced.Instruction.create_reg_reg(C.OR_R64_RM64, R.RAX, R.RDX))
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(ring + L.RECORD_TSC, R.RSI), R.RAX))
        # The header's first 8 bytes: the probe, faults none yet (one store), then the CPU
        header = gs_at(ring + L.RECORD_PROBE, R.RSI)
        asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, header, probe_index))
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM16_R16, gs_at(ring + L.RECORD_CPU, R.RSI), R.CX))

    def record(self, prog: Program) -> None:
        asm, ring = self.asm, self.layout.ring

        def write() -> None:
            self.record_header(prog.probe_index)
            self.in_record = True
            for bit, fld in enumerate(prog.fields):
                if not fld.in_record:
                    continue
                at = ring + fld.offset
                after, faulted = asm.label(), asm.label()
                if fld.arg.type.is_string:
                    self.string(fld.arg, at, bit, faulted)
                else:
                    loads = len(asm.may_fault)
                    self.value(fld.arg.fetch, fld.arg.type.bits, faulted)
                    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(at, R.RSI), R.RAX))
                    if len(asm.may_fault) == loads:
                        continue  # a register: nothing to fault
                    asm.jump(C.JMP_REL32_64, after)
                    asm.bind(faulted)
                    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(at, R.RSI), 0))
                    asm.add(iced.Instruction.create_mem_u32(
                        C.OR_RM32_IMM32, gs_at(ring + L.RECORD_FAULTS, R.RSI), 1 << bit))  # fmt: skip
                asm.bind(after)
            self.in_record = False

        ring_record(asm, self.layout, prog.probe_index, R.RSI, write)

    def cpu_number(self) -> None:
        """ecx = the thread's CPU number (and nothing else): from the rseq area glibc registers
        for each thread (the kernel writes the CPU there whenever the thread comes back to user
        space; a load costs less than `rdpid`, ~1.5 ns of a record's 18 here), else by `rdpid`:
        no glibc 2.35+, a thread whose area is not registered yet or any more (a negative
        number), or no thread pointer yet (the loader's first steps: the load faults)."""
        asm = self.asm
        if self.rseq_offset_at is not None:
            known, by_rdpid = asm.label(), asm.label()
            asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RCX, self.rseq_offset_at))
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RCX, mem_at(R.RCX)), by_rdpid)
            rseq_cpu_id = iced.MemoryOperand(R.RCX, displ=RSEQ_CPU_ID, seg=R.FS)
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.ECX, rseq_cpu_id), by_rdpid)
            asm.add(iced.Instruction.create_reg_reg(C.TEST_RM32_R32, R.ECX, R.ECX))
            asm.jump(C.JNS_REL32_64, known)
            asm.bind(by_rdpid)
            asm.add(iced.Instruction.create_reg(C.RDPID_R64, R.RCX))
            asm.add(iced.Instruction.create_reg_i32(C.AND_RM32_IMM32, R.ECX, TSC_AUX_CPU))
            asm.bind(known)
        else:
            asm.add(iced.Instruction.create_reg(C.RDPID_R64, R.RCX))
            asm.add(iced.Instruction.create_reg_i32(C.AND_RM32_IMM32, R.ECX, TSC_AUX_CPU))

    def string(self, arg: FetchArg, at: int, bit: int, faulted: int) -> None:
        """Copy the string a fetch names into the record at `at` (see `copy_string`)."""
        self.address(arg.fetch, faulted)
        self.copy_string(at, bit, faulted)

    def copy_string(self, at: int, bit: int, faulted: int, *, limit: int = L.STRING_CAPACITY,
                    limit_in_ecx: bool = False) -> None:  # fmt: skip
        """Copy the NUL-terminated string at rax, at most `limit` bytes (`limit_in_ecx`: at
        most ecx, no more than `limit`), into the record at `at` (rsi = the record's offset in
        the ring): u16 length, u16 flags, the bytes; none readable: fault `bit` set (rax, rdx,
        rdi used)."""
        asm = self.asm
        loop, truncated, ended = asm.label(), asm.label(), asm.label()
        after = asm.label()
        asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.EDI, R.EDI))
        asm.bind(loop)
        if limit_in_ecx:
            asm.add(iced.Instruction.create_reg_reg(C.CMP_R32_RM32, R.EDI, R.ECX))
        else:
            asm.add(iced.Instruction.create_reg_i32(C.CMP_RM32_IMM32, R.EDI, limit))
        asm.jump(C.JAE_REL32_64, truncated)
        partial = asm.label()
        asm.add(iced.Instruction.create_reg_mem(C.MOVZX_R32_RM8, R.EDX, mem_at(R.RAX, 0, R.RDI)), partial)
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM8_R8, gs_at(at + 4, R.RSI, R.RDI), R.DL))
        asm.add(iced.Instruction.create_reg(C.INC_RM32, R.EDI))
        asm.add(iced.Instruction.create_reg_reg(C.TEST_RM32_R32, R.EDX, R.EDX))
        asm.jump(C.JNE_REL32_64, loop)
        asm.add(iced.Instruction.create_reg(C.DEC_RM32, R.EDI))  # not counting the NUL
        asm.jump(C.JMP_REL32_64, ended)
        asm.bind(partial)  # ran into unmapped memory: what was read, marked truncated; nothing: faulted
        asm.add(iced.Instruction.create_reg_reg(C.TEST_RM32_R32, R.EDI, R.EDI))
        asm.jump(C.JE_REL32_64, faulted)
        asm.bind(truncated)
        asm.add(iced.Instruction.create_mem_u32(C.MOV_RM16_IMM16, gs_at(at + 2, R.RSI), L.STRING_TRUNCATED))
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM16_R16, gs_at(at, R.RSI), R.DI))
        asm.jump(C.JMP_REL32_64, after)
        asm.bind(ended)
        asm.add(iced.Instruction.create_mem_u32(C.MOV_RM16_IMM16, gs_at(at + 2, R.RSI), 0))
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM16_R16, gs_at(at, R.RSI), R.DI))
        asm.jump(C.JMP_REL32_64, after)
        asm.bind(faulted)
        asm.add(iced.Instruction.create_mem_u32(C.MOV_RM32_IMM32, gs_at(at, R.RSI), 0))
        faults = gs_at(self.layout.ring + L.RECORD_FAULTS, R.RSI)
        asm.add(iced.Instruction.create_mem_u32(C.OR_RM32_IMM32, faults, 1 << bit))
        asm.bind(after)


def emit_actions(
    asm: Asm, emitter: Emitter, programs: Sequence[Program], keep_flags: bool, hook: Callable[[Emitter], None] | None
) -> None:  # fmt: skip
    """The actions of `programs` with the registers they use saved and put back (see the
    module's docstring): the stack stepped over by the emitter's red zone, the flags pushed
    (if the emitter pushes them) or kept in r11 (`keep_flags`); `hook` adds the code that
    hooks a function's entry after them."""
    red_zone = emitter.red_zone
    if red_zone:
        asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, mem_at(R.RSP, -red_zone)))
    if emitter.flags_pushed:
        asm.add(iced.Instruction.create(C.PUSHFQ))
    for name in SAVED:
        asm.add(iced.Instruction.create_reg(C.PUSH_R64, REG[name]))
    if keep_flags:
        asm.add(iced.Instruction.create_reg(C.SETO_RM8, R.AL))
        asm.add(iced.Instruction.create(C.LAHF))
        asm.add(iced.Instruction.create_reg_reg(C.MOV_R32_RM32, R.R11D, R.EAX))
    for prog in programs:
        check_fields(prog)
        if prog.entry is not None:
            emitter.return_entry(prog, prog.entry)
        else:
            emitter.program(prog)
    if hook is not None:
        hook(emitter)
    if keep_flags:
        asm.add(iced.Instruction.create_reg_reg(C.MOV_R32_RM32, R.EAX, R.R11D))
        asm.add(iced.Instruction.create_reg_i32(C.ADD_RM8_IMM8, R.AL, 0x7F))  # OF = (al == 1)
        asm.add(iced.Instruction.create(C.SAHF))
    for name in reversed(SAVED):
        asm.add(iced.Instruction.create_reg(C.POP_R64, REG[name]))
    if emitter.flags_pushed:
        asm.add(iced.Instruction.create(C.POPFQ))
    if red_zone:
        asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, mem_at(R.RSP, red_zone)))


def fetches_flags(prog: Program) -> bool:
    return any(isinstance(f, Reg) and f.name == "eflags" for arg in prog.fetch_args() for f in fetch_chain(arg.fetch))


def check_fields(prog: Program) -> None:
    if len(prog.fields) > MAX_FIELDS or (prog.kind == ActionKind.HIST and prog.value is None):
        raise Unsupported(OptimizeRefusal.FETCH_UNSUPPORTED)
