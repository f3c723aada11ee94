"""Detours of optimized probes: machine code for the actions of a site, then its relocated region.

A detour runs on the target thread with nothing but its registers and its thread area (GS base):

    lea rsp, [rsp-128]              only away from a function entry: step over the red zone
    (count only)  push rax; seto al; lahf; inc qword gs:[hits]...; add al, 0x7f; sahf; pop rax
    (otherwise)   pushfq; push rax, rcx, rdx, rsi, rdi; per probe: filter, counters, histogram,
                  record; pop ...; popfq
    lea rsp, [rsp+128]
    the relocated region (optimize.relocate_region), jmp back

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import iced_x86 as iced

from dynprobe.actions.model import MAX_FIELDS, ActionKind, Compare, Filter, Program, ReturnEntry
from dynprobe.arch.x86_64.cpu import has_rdpid
from dynprobe.arch.x86_64.decode import iter_instructions
from dynprobe.arch.x86_64.optimize import JMP_REL32_LEN, OptimizePlan, relocate_region
from dynprobe.arch.x86_64.regs import ARG_REGS, GPR64
from dynprobe.arch.x86_64.relocate import in_rel32_reach
from dynprobe.errors import OptimizeRefusal
from dynprobe.ringbuf import layout as L
from dynprobe.ringbuf.shadow import trampoline_point
from dynprobe.spec.argspec import STRING_PIECES, ArgSpec
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
    SymbolAddr,
    fetch_chain,
)

if TYPE_CHECKING:  # the enum types exist in the stubs only; at run time the values are ints
    from iced_x86._iced_x86_py import Code as CodeT
    from iced_x86._iced_x86_py import Register as RegisterT

C = iced.Code
R = iced.Register
RED_ZONE = 128
L_MASK64 = (1 << 64) - 1

# The full form saves these, so fetches of them read the saved copy. r11 keeps the flags (seto/lahf:
# ~2 ns here, pushfq/popfq ~13 ns); only a probe that fetches %flags makes it push them instead.
_SAVED = ("rax", "rcx", "rdx", "rsi", "rdi", "r11")
# Offsets from rsp of the saved registers, in a detour and in the return trampoline's frame.
SAVED_AT = {name: 8 * (len(_SAVED) - 1 - i) for i, name in enumerate(_SAVED)}
_FLAGS_AT = 8 * len(_SAVED)  # with pushfq, pushed before the registers
# At a return, in the trampoline's frame: the shadow entry's offset, pushed by the entry point
# where the return address was, above the saved registers (all kept: with IPA-RA a caller may
# keep values in any of them across the call).
_ENTRY_OFFSET_AT = 8 * len(_SAVED)
_REG = {name: getattr(R, name.upper()) for name in GPR64}
_JCC_UNSIGNED = {"==": C.JE_REL32_64, "!=": C.JNE_REL32_64, "<": C.JB_REL32_64, "<=": C.JBE_REL32_64,
                 ">": C.JA_REL32_64, ">=": C.JAE_REL32_64}  # fmt: skip
_JCC_SIGNED = {**_JCC_UNSIGNED, "<": C.JL_REL32_64, "<=": C.JLE_REL32_64, ">": C.JG_REL32_64, ">=": C.JGE_REL32_64}


@dataclass(frozen=True)
class Trampoline:
    """Where a process's return trampoline is: entry k's call (`enter_tail`) at `table + k *
    TRAMPOLINE_STRIDE`, its entry point right after; a probe's return code ends with a jump to
    `finish`."""

    table: int
    finish: int
    end: int

    @property
    def points(self) -> int:
        """Entry point 0."""
        return self.table + L.TRAMPOLINE_CALL

    def point(self, k: int) -> int:
        return trampoline_point(self.points, k)


@dataclass(frozen=True)
class _Returning:
    points: int  # the trampoline's entry point 0
    tsc_mult: int  # ns = ticks * tsc_mult >> 32
    at_return: bool  # the code runs at the return (False: at the entry)


@dataclass(frozen=True)
class Detour:
    code: bytes
    fixups: dict[int, int]  # address of a load that may fault -> address to continue at
    action_bytes: int  # the actions' part; the relocated region follows


class _Unsupported(Exception):
    def __init__(self, reason: OptimizeRefusal) -> None:
        self.reason = reason


def _gs(disp: int, base: RegisterT = R.NONE, index: RegisterT = R.NONE, scale: int = 1) -> iced.MemoryOperand:
    """gs:[base + index * scale + disp]: in the thread area."""
    return iced.MemoryOperand(base, index, scale, displ=disp, seg=R.GS)


def _mem(base: RegisterT, disp: int = 0, index: RegisterT = R.NONE) -> iced.MemoryOperand:
    return iced.MemoryOperand(base, index, displ=disp)


# struct rseq (linux/rseq.h): u32 cpu_id_start, then u32 cpu_id (negative: not registered)
RSEQ_CPU_ID = 4
_TSC_AUX_CPU = 0xFFF  # Linux keeps the CPU in TSC_AUX's low 12 bits (the node above them)


def _stack(disp: int) -> iced.MemoryOperand:
    """[rsp + disp]."""
    return iced.MemoryOperand(R.RSP, displ=disp)


@dataclass
class _Asm:
    """Instructions with labels: a branch names a label; labels are bound to the next instruction."""

    items: list[iced.Instruction | tuple[CodeT, int]] = field(default_factory=list)  # or (jcc code, label)
    bound: dict[int, int] = field(default_factory=dict)  # label -> index of the instruction
    may_fault: dict[int, int] = field(default_factory=dict)  # index of a load -> label to resume at
    labels: int = 0
    pending: list[int] = field(default_factory=list)

    def label(self) -> int:
        self.labels += 1
        return self.labels

    def bind(self, label: int) -> None:
        self.pending.append(label)

    def add(self, insn: iced.Instruction | tuple[CodeT, int], fault: int | None = None) -> None:
        for label in self.pending:
            self.bound[label] = len(self.items)
        self.pending.clear()
        if fault is not None:
            self.may_fault[len(self.items)] = fault
        self.items.append(insn)

    def jump(self, code: CodeT, label: int) -> None:
        self.add((code, label))

    def encode(self, at: int) -> tuple[bytes, dict[int, int]]:
        assert not self.pending, "a label bound past the last instruction"
        insns = []
        for i, item in enumerate(self.items):
            insn = iced.Instruction.create_branch(item[0], self.bound[item[1]] + 1) if isinstance(item, tuple) else item
            insn.ip = i + 1  # ips double as labels: the block encoder resolves branches between them
            insns.append(insn)
        encoder = iced.BlockEncoder(64)
        encoder.add_many(insns)
        code = bytes(encoder.encode(at))
        if not self.may_fault:
            return code, {}
        starts = [int(insn.ip) for insn in iter_instructions(code, at)]
        assert len(starts) == len(insns), "the block encoder did not keep one instruction per instruction"
        fixups = {starts[i]: starts[self.bound[label]] for i, label in self.may_fault.items()}
        return code, fixups


def _normalize(asm: _Asm, arg: FetchArg) -> None:
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


class _Emitter:
    """The full form's code, one probe after another."""

    def __init__(
        self, asm: _Asm, layout: L.AreaLayout, site: int, red_zone: int, flags_pushed: bool,
        symbol_address: Callable[[str], int | None], returning: _Returning | None = None,
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
            8 * len(_SAVED) + (8 if flags_pushed else 0) + red_zone + (8 if returning and returning.at_return else 0)
        )
        self.symbol_address = symbol_address
        self.returning = returning
        self.in_record = False  # rsi: the record's offset, its time stamp written

    def load_reg(self, name: str) -> None:
        asm = self.asm
        if name in SAVED_AT:
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, _mem(R.RSP, SAVED_AT[name])))
        elif name == "rsp":
            asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RAX, _mem(R.RSP, self.frame)))
        elif name == "eflags" and self.flags_pushed:
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, _mem(R.RSP, _FLAGS_AT)))
        elif name == "rip" and self.returning is not None and self.returning.at_return:
            self.caller()  # (a return's %ip is where it returns to, as at a stop)
        elif name == "rip":
            asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, self.site))
        elif name in _REG:
            asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, _REG[name]))
        else:
            raise _Unsupported(OptimizeRefusal.FETCH_UNSUPPORTED)

    def address(self, fetch: Fetch, fault: int) -> None:
        """rax = the address a memory fetch reads from (the address of a string)."""
        asm = self.asm
        if isinstance(fetch, Absolute | SymbolAddr):
            addr = fetch.addr if isinstance(fetch, Absolute) else self.symbol_address(fetch.symbol)
            if addr is None:
                raise _Unsupported(OptimizeRefusal.FETCH_UNSUPPORTED)
            if isinstance(fetch, SymbolAddr):
                addr += fetch.offset
            asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, addr & L_MASK64))
        else:  # (the parser gives strings and values no other fetch: BAD_STRING, FILTER_STRING, VALUE_STRING)
            assert isinstance(fetch, Deref), f"no address for {fetch}"
            self.value(fetch.inner, 64, fault)
            if in_rel32_reach(0, fetch.offset):  # (a disp32 reaches it)
                asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RAX, _mem(R.RAX, fetch.offset)))
            else:
                asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RCX, fetch.offset & L_MASK64))
                asm.add(iced.Instruction.create_reg_reg(C.ADD_R64_RM64, R.RAX, R.RCX))

    def entry_word(self, offset: int) -> None:
        """rax = a word of the shadow-stack entry being returned through."""
        asm = self.asm
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, _mem(R.RSP, _ENTRY_OFFSET_AT)))
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, _gs(self.layout.shadow + offset, R.RAX)))

    def caller(self) -> None:
        """rax = where the call being returned from returns to: its entry's return address or,
        when that is an entry point of the trampoline (return probes of the same call hooked
        it before), that entry's, and so on."""
        asm = self.asm
        assert self.returning is not None
        self.entry_word(L.ENTRY_RET)
        chain, found = asm.label(), asm.label()
        asm.bind(chain)
        _entry_of_point(asm, self.returning.points, found)
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, _gs(self.layout.shadow + L.ENTRY_RET, R.RDX)))
        asm.jump(C.JMP_REL32_64, chain)
        asm.bind(found)

    def return_value(self, fetch: Fetch) -> bool:
        """The fetches of a return: entry arguments kept at the entry, $retval, $latency, the
        caller. False for any other fetch."""
        asm = self.asm
        if self.returning is None or not self.returning.at_return:
            if isinstance(fetch, RetVal | Latency | Caller):
                raise _Unsupported(OptimizeRefusal.FETCH_UNSUPPORTED)
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
                    iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RDX, _gs(self.layout.ring + L.RECORD_TSC, R.RSI))
                )
            else:
                asm.add(iced.Instruction.create(C.RDTSC))
                asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RDX, 32))
                asm.add(iced.Instruction.create_reg_reg(C.OR_R64_RM64, R.RDX, R.RAX))
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, _mem(R.RSP, _ENTRY_OFFSET_AT)))
            asm.add(
                iced.Instruction.create_reg_mem(C.SUB_R64_RM64, R.RDX, _gs(self.layout.shadow + L.ENTRY_TSC, R.RAX))
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
        if isinstance(fetch, Stack):
            self.load_reg("rsp")
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, _mem(R.RAX, 8 * fetch.index)), fault)
            return
        self.address(fetch, fault)
        src = _mem(R.RAX)
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
            jcc = (_JCC_SIGNED if node.arg.type.kind == "s" else _JCC_UNSIGNED)[node.op]
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
        self.asm.add(iced.Instruction.create_mem(C.INC_RM64, _gs(disp)))

    def program(self, prog: Program) -> None:
        asm, layout = self.asm, self.layout
        done = asm.label()
        if prog.filter is not None:
            passed = asm.label()
            self.condition(prog.filter, passed, done)
            asm.bind(passed)
        self.inc(layout.counter(prog.probe_index, L.HITS))
        if prog.kind == ActionKind.HIST:
            self.histogram(prog)
        elif prog.kind == ActionKind.RECORD:
            self.record(prog)
        asm.bind(done)

    def return_entry(self, prog: Program, entry: ReturnEntry) -> None:
        """At a return probe's function entry (rsp + frame: the return address): a shadow-stack
        entry keeping the time stamp and the arguments the return needs (see `shadow_push`)."""
        asm = self.asm
        assert self.returning is not None
        shadow = self.layout.shadow

        def fill() -> None:
            if entry.timestamp:
                _read_tsc(asm)
                asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(shadow + L.ENTRY_TSC, R.RSI), R.RAX))
            for n in entry.arg_indices:
                self.load_reg(ARG_REGS[n - 1])
                asm.add(iced.Instruction.create_mem_reg(
                    C.MOV_RM64_R64, _gs(shadow + L.ENTRY_DATA + 8 * (n - 1), R.RSI), R.RAX))  # fmt: skip

        asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RCX, _mem(R.RSP, self.frame)))
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
        asm.add(iced.Instruction.create_mem(C.INC_RM64, _gs(self.layout.hist(prog.hist_index), index=R.RAX, scale=8)))

    def record(self, prog: Program) -> None:
        asm, ring = self.asm, self.layout.ring

        def write() -> None:
            # The time-stamp counter, and in ecx the CPU
            if has_rdpid():
                asm.add(iced.Instruction.create(C.RDTSC))
                self.cpu_number()
            else:
                asm.add(iced.Instruction.create(C.RDTSCP))
                asm.add(iced.Instruction.create_reg_i32(C.AND_RM32_IMM32, R.ECX, _TSC_AUX_CPU))
            asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RDX, 32))
            asm.add(iced.Instruction.create_reg_reg(C.OR_R64_RM64, R.RAX, R.RDX))
            asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(ring + L.RECORD_TSC, R.RSI), R.RAX))
            # The header's first 8 bytes: the probe, faults none yet (one store), then the CPU
            header = _gs(ring + L.RECORD_PROBE, R.RSI)
            asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, header, prog.probe_index))
            asm.add(iced.Instruction.create_mem_reg(C.MOV_RM16_R16, _gs(ring + L.RECORD_CPU, R.RSI), R.CX))
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
                    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(at, R.RSI), R.RAX))
                    if len(asm.may_fault) == loads:
                        continue  # a register: nothing to fault
                    asm.jump(C.JMP_REL32_64, after)
                    asm.bind(faulted)
                    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _gs(at, R.RSI), 0))
                    asm.add(iced.Instruction.create_mem_u32(
                        C.OR_RM32_IMM32, _gs(ring + L.RECORD_FAULTS, R.RSI), 1 << bit))  # fmt: skip
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
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RCX, _mem(R.RCX)), by_rdpid)
            rseq_cpu_id = iced.MemoryOperand(R.RCX, displ=RSEQ_CPU_ID, seg=R.FS)
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.ECX, rseq_cpu_id), by_rdpid)
            asm.add(iced.Instruction.create_reg_reg(C.TEST_RM32_R32, R.ECX, R.ECX))
            asm.jump(C.JNS_REL32_64, known)
            asm.bind(by_rdpid)
            asm.add(iced.Instruction.create_reg(C.RDPID_R64, R.RCX))
            asm.add(iced.Instruction.create_reg_i32(C.AND_RM32_IMM32, R.ECX, _TSC_AUX_CPU))
            asm.bind(known)
        else:
            asm.add(iced.Instruction.create_reg(C.RDPID_R64, R.RCX))
            asm.add(iced.Instruction.create_reg_i32(C.AND_RM32_IMM32, R.ECX, _TSC_AUX_CPU))

    def string(self, arg: FetchArg, at: int, bit: int, faulted: int) -> None:
        """Copy a NUL-terminated string of at most STRING_CAPACITY bytes into the record at `at`
        (rsi = the record's offset in the ring): u16 length, u16 flags, the bytes."""
        asm = self.asm
        loop, truncated, ended = asm.label(), asm.label(), asm.label()
        after = asm.label()
        self.address(arg.fetch, faulted)
        asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.EDI, R.EDI))
        asm.bind(loop)
        asm.add(iced.Instruction.create_reg_i32(C.CMP_RM32_IMM32, R.EDI, L.STRING_CAPACITY))
        asm.jump(C.JAE_REL32_64, truncated)
        partial = asm.label()
        asm.add(iced.Instruction.create_reg_mem(C.MOVZX_R32_RM8, R.EDX, _mem(R.RAX, 0, R.RDI)), partial)
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM8_R8, _gs(at + 4, R.RSI, R.RDI), R.DL))
        asm.add(iced.Instruction.create_reg(C.INC_RM32, R.EDI))
        asm.add(iced.Instruction.create_reg_reg(C.TEST_RM32_R32, R.EDX, R.EDX))
        asm.jump(C.JNE_REL32_64, loop)
        asm.add(iced.Instruction.create_reg(C.DEC_RM32, R.EDI))  # not counting the NUL
        asm.jump(C.JMP_REL32_64, ended)
        asm.bind(partial)  # ran into unmapped memory: what was read, marked truncated; nothing: faulted
        asm.add(iced.Instruction.create_reg_reg(C.TEST_RM32_R32, R.EDI, R.EDI))
        asm.jump(C.JE_REL32_64, faulted)
        asm.bind(truncated)
        asm.add(iced.Instruction.create_mem_u32(C.MOV_RM16_IMM16, _gs(at + 2, R.RSI), L.STRING_TRUNCATED))
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM16_R16, _gs(at, R.RSI), R.DI))
        asm.jump(C.JMP_REL32_64, after)
        asm.bind(ended)
        asm.add(iced.Instruction.create_mem_u32(C.MOV_RM16_IMM16, _gs(at + 2, R.RSI), 0))
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM16_R16, _gs(at, R.RSI), R.DI))
        asm.jump(C.JMP_REL32_64, after)
        asm.bind(faulted)
        asm.add(iced.Instruction.create_mem_u32(C.MOV_RM32_IMM32, _gs(at, R.RSI), 0))
        faults = _gs(self.layout.ring + L.RECORD_FAULTS, R.RSI)
        asm.add(iced.Instruction.create_mem_u32(C.OR_RM32_IMM32, faults, 1 << bit))
        asm.bind(after)


def shadow_push(
    asm: _Asm, lay: L.AreaLayout, points: int, probe_index: int, maxactive: int, handler: int,
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
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, _gs(L.SHADOW_BUSY), 0))
    asm.jump(C.JNE_REL32_64, missed)
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM32, _gs(pending), maxactive))
    asm.jump(C.JAE_REL32_64, missed)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _gs(L.SHADOW_BUSY), 1))
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RDX, _gs(L.SHADOW_TOP)))
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
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, _gs(shadow + L.ENTRY_SLOT, R.RSI)))
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
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, _mem(R.RCX)))
    asm.bind(chain)
    _entry_of_point(asm, points, stale)
    asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RDX, R.RSI))
    asm.jump(C.JE_REL32_64, live)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, _gs(shadow + L.ENTRY_RET, R.RDX)))
    asm.jump(C.JMP_REL32_64, chain)
    asm.bind(live)
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RDX))
    asm.jump(C.JMP_REL32_64, loop)
    asm.bind(stale)  # a frame that is gone (longjmp): its entry is taken over
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RDX))
    _one_less_pending(asm, lay)
    asm.jump(C.JMP_REL32_64, take)
    asm.bind(scanned)
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RSI, R.RDI))
    asm.add(iced.Instruction.create_reg_i32(C.CMP_RM64_IMM8, R.RSI, -1))
    asm.jump(C.JNE_REL32_64, take)
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RSI, R.RDX))
    asm.add(iced.Instruction.create_reg_i32(C.CMP_RM64_IMM32, R.RSI, L.SHADOW_CAPACITY * size))
    asm.jump(C.JAE_REL32_64, full)
    asm.add(iced.Instruction.create_mem(C.INC_RM64, _gs(L.SHADOW_TOP)))
    asm.bind(take)
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(shadow + L.ENTRY_SLOT, R.RSI), R.RCX))
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, _mem(R.RCX)))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(shadow + L.ENTRY_RET, R.RSI), R.RAX))
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, handler))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(shadow + L.ENTRY_HANDLER, R.RSI), R.RAX))
    # the probe index (u32) and the tracer's flags (u32, cleared)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _gs(shadow + L.ENTRY_PROBE, R.RSI), probe_index))
    fill()
    asm.add(iced.Instruction.create_mem(C.INC_RM64, _gs(pending)))
    # entry k (at offset k * SHADOW_ENTRY) returns through points + k * TRAMPOLINE_STRIDE
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, R.RSI))
    asm.add(iced.Instruction.create_reg_i32(C.SHR_RM64_IMM8, R.RAX, L.SHADOW_ENTRY.bit_length() - 1))
    asm.add(iced.Instruction.create_reg_reg_i32(C.IMUL_R64_RM64_IMM8, R.RAX, R.RAX, L.TRAMPOLINE_STRIDE))
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RDX, points))
    asm.add(iced.Instruction.create_reg_reg(C.ADD_R64_RM64, R.RAX, R.RDX))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _mem(R.RCX), R.RAX))
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _gs(L.SHADOW_BUSY), 0))
    asm.jump(C.JMP_REL32_64, done)
    asm.bind(full)  # every entry is taken
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _gs(L.SHADOW_BUSY), 0))
    asm.bind(missed)
    asm.add(iced.Instruction.create_mem(C.INC_RM64, _gs(lay.counter(probe_index, L.MISSED))))
    asm.bind(done)


def _one_less_pending(asm: _Asm, layout: L.AreaLayout) -> None:
    """One instance less pending for the probe of the shadow entry at rsi (rax used)."""
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.EAX, _gs(layout.shadow + L.ENTRY_PROBE, R.RSI)))
    asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RAX, L.PROBE_BYTES.bit_length() - 1))
    asm.add(iced.Instruction.create_mem(C.DEC_RM64, _gs(layout.counter(0, L.PENDING), R.RAX)))


def _entry_of_point(asm: _Asm, points: int, elsewhere: int) -> None:
    """rax: a return address. If it is an entry point of the trampoline (entry point 0 at
    `points`), rdx = its shadow entry's offset; otherwise go to `elsewhere`."""
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RDX, -points & L_MASK64))
    asm.add(iced.Instruction.create_reg_reg(C.ADD_R64_RM64, R.RDX, R.RAX))
    asm.add(iced.Instruction.create_reg_i32(C.CMP_RM64_IMM32, R.RDX, L.SHADOW_CAPACITY * L.TRAMPOLINE_STRIDE))
    asm.jump(C.JAE_REL32_64, elsewhere)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.EDX, _mem(R.RAX, 1)))  # the point's push: an offset


_PLACEHOLDER = 0x7FFF_FFF0  # a displacement to patch (disp32 whatever the value it becomes)


@functools.cache
def _count_only_template(counters: int, red_zone: int) -> tuple[bytes, tuple[int, ...]]:
    """Hit counters without touching the flags: seto/lahf save OF and the arithmetic flags in
    al/ah (the sequence of Valgrind and DynamoRIO), cheaper than pushfq/popfq. No branch and no
    RIP-relative operand: the bytes run anywhere, so they are encoded once per shape, with a
    placeholder for each counter's displacement; returns them and where the displacements are."""
    asm = _Asm()
    if red_zone:
        asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, _mem(R.RSP, -red_zone)))
    asm.add(iced.Instruction.create_reg(C.PUSH_R64, R.RAX))
    asm.add(iced.Instruction.create_reg(C.SETO_RM8, R.AL))
    asm.add(iced.Instruction.create(C.LAHF))
    for _ in range(counters):
        asm.add(iced.Instruction.create_mem(C.INC_RM64, _gs(_PLACEHOLDER)))
    asm.add(iced.Instruction.create_reg_i32(C.ADD_RM8_IMM8, R.AL, 0x7F))  # OF = (al == 1)
    asm.add(iced.Instruction.create(C.SAHF))
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RAX))
    if red_zone:
        asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, _mem(R.RSP, red_zone)))
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
    if all(p.kind == ActionKind.COUNT and p.filter is None and p.entry is None for p in programs):
        return _then_region(plan, _count_only(programs, layout, red_zone), {}, at)
    push_flags = any(_fetches_flags(prog) for prog in programs if prog.entry is None)
    keep_flags = not push_flags and not hooks  # (hook_targets changes them: free at a function entry)
    returning = _Returning(trampoline.points, 0, at_return=False) if trampoline is not None else None

    def assemble(region: int) -> tuple[bytes, dict[int, int]]:
        asm = _Asm()

        def hook(emitter: _Emitter) -> None:
            assert returning is not None

            def load_region() -> None:
                asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RDX, iced.MemoryOperand(R.RIP, displ=region)))

            hook_targets(asm, emitter.frame, load_region, returning.points)

        _emit_actions(
            asm, _Emitter(asm, layout, plan.site, red_zone, push_flags, symbol_address, returning, rseq_offset_at),
            programs, keep_flags, hook if hooks else None,
        )  # fmt: skip
        code, fixups = asm.encode(at)
        return (code + enter_tail(), fixups) if hooks else (code, fixups)

    try:
        code, fixups = assemble(at)
        if hooks:  # the region's address is known once the code's length is (its lea is a disp32)
            code, fixups = assemble(at + len(code))
    except _Unsupported as exc:
        return exc.reason
    return _then_region(plan, code, fixups, at)


def _emit_actions(
    asm: _Asm, emitter: _Emitter, programs: Sequence[Program], keep_flags: bool, hook: Callable[[_Emitter], None] | None
) -> None:  # fmt: skip
    """The actions of `programs` with the registers they use saved and put back (see the
    module's docstring): the stack stepped over by the emitter's red zone, the flags pushed
    (if the emitter pushes them) or kept in r11 (`keep_flags`); `hook` adds the code that
    hooks a function's entry after them."""
    red_zone = emitter.red_zone
    if red_zone:
        asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, _mem(R.RSP, -red_zone)))
    if emitter.flags_pushed:
        asm.add(iced.Instruction.create(C.PUSHFQ))
    for name in _SAVED:
        asm.add(iced.Instruction.create_reg(C.PUSH_R64, _REG[name]))
    if keep_flags:
        asm.add(iced.Instruction.create_reg(C.SETO_RM8, R.AL))
        asm.add(iced.Instruction.create(C.LAHF))
        asm.add(iced.Instruction.create_reg_reg(C.MOV_R32_RM32, R.R11D, R.EAX))
    for prog in programs:
        _check_fields(prog)
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
    for name in reversed(_SAVED):
        asm.add(iced.Instruction.create_reg(C.POP_R64, _REG[name]))
    if emitter.flags_pushed:
        asm.add(iced.Instruction.create(C.POPFQ))
    if red_zone:
        asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, _mem(R.RSP, red_zone)))


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
    asm = _Asm()
    push_flags = any(_fetches_flags(prog) for prog in programs)
    emitter = _Emitter(asm, layout, site, RED_ZONE, push_flags, symbol_address, None, rseq_offset_at)
    try:
        _emit_actions(asm, emitter, programs, not push_flags, None)
    except _Unsupported as exc:
        return exc.reason
    _resume_through_area(asm)
    code, fixups = asm.encode(at)
    return Detour(code, fixups, len(code))


def _resume_through_area(asm: _Asm) -> None:
    """Go on at gs:[STAMP_RESUME], registers and flags untouched: through the stack below the
    red zone (`ret 128`), once STAMP_BUSY is clear (a signal handler's hit may then use it)."""
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, _mem(R.RSP, -RED_ZONE)))
    asm.add(iced.Instruction.create_mem(C.PUSH_RM64, _gs(L.STAMP_RESUME)))
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _gs(L.STAMP_BUSY), 0))
    asm.add(iced.Instruction.create_u32(C.RETNQ_IMM16, RED_ZONE))


# Below a hooking function entry's return-address slot S, in the red zone (a signal frame skips
# it): [S - 8], the call of the trampoline entry to go through (0: none), and [S - 16], the
# function's relocated region, which that call calls. `enter_tail` reads them.
HOOK_ROOM = 16


def hook_targets(asm: _Asm, slot_at: int, load_region: Callable[[], None], points: int | None) -> None:
    """At a function entry whose return may have been hooked (rsp + `slot_at`: its return-address
    slot S; rax, rcx, rdx and the flags free), after the code that hooks it: if the return
    address is entry point k of the trampoline (entry point 0 at `points`), [S - 8] = entry k's
    call and [S - 16] = the region (`load_region()` puts it in rdx), else [S - 8] = 0."""
    plain, done = asm.label(), asm.label()
    if points is not None:
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, _mem(R.RSP, slot_at)))
        asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RCX, -points & L_MASK64))
        asm.add(iced.Instruction.create_reg_reg(C.ADD_R64_RM64, R.RCX, R.RAX))
        asm.add(iced.Instruction.create_reg_i32(C.CMP_RM64_IMM32, R.RCX, L.SHADOW_CAPACITY * L.TRAMPOLINE_STRIDE))
        asm.jump(C.JAE_REL32_64, plain)
        asm.add(iced.Instruction.create_reg_i32(C.SUB_RM64_IMM8, R.RAX, L.TRAMPOLINE_CALL))
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _mem(R.RSP, slot_at - 8), R.RAX))
        load_region()
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _mem(R.RSP, slot_at - 16), R.RDX))
        asm.jump(C.JMP_REL32_64, done)
    asm.bind(plain)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _mem(R.RSP, slot_at - 8), 0))
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
        iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, _stack(-8), 0),
        iced.Instruction.create_branch(C.JE_REL8_64, _ENTER_TAIL_BYTES),  # the region
        iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, _stack(8)),
        iced.Instruction.create_mem(C.JMP_RM64, _stack(-16)),
    )
    for insn in tail:
        here += encoder.encode(insn, here)
    assert here == _ENTER_TAIL_BYTES
    return bytes(encoder.take_buffer())


_ENTER_TAIL_BYTES = 17


def _then_region(plan: OptimizePlan, code: bytes, fixups: dict[int, int], at: int) -> Detour | OptimizeRefusal:
    """The detour: the action code placed at `at`, then the relocated region."""
    region = relocate_region(plan, at + len(code))
    if region is None:
        return OptimizeRefusal.RIP_REL_OUT_OF_REACH
    return Detour(code + region, fixups, len(code))


def _fetches_flags(prog: Program) -> bool:
    return any(isinstance(f, Reg) and f.name == "eflags" for arg in prog.fetch_args() for f in fetch_chain(arg.fetch))


def _check_fields(prog: Program) -> None:
    if len(prog.fields) > MAX_FIELDS or (prog.kind == ActionKind.HIST and prog.value is None):
        raise _Unsupported(OptimizeRefusal.FETCH_UNSUPPORTED)


def build_trampoline(layout: L.AreaLayout, at: int) -> tuple[bytes, Trampoline]:
    """The return trampoline of a process, placed at `at`: SHADOW_CAPACITY entries, entry k a
    call (`call [rsp-24]`: see `enter_tail`) then entry point k, `push OFFSET; jmp common`
    (OFFSET: entry k's offset in the shadow stack; the push lands where the return address was),
    then the common part, which saves the registers a probe's return code may use and jumps to
    that code (rsi: the entry's offset, kept on the stack too); the code jumps back to
    `finish`, which frees the entry and returns to the original return address. The function
    was entered by the call of its entry, so the CPU predicted its `ret` and predicts this one:
    the caller's call is the one it pairs with. (A frame entered otherwise, a trap probe's,
    mispredicts both.) Flags are not kept: no caller expects them to survive a call (GCC's flags
    register is fixed: even IPA-RA takes every call to clobber it)."""
    common_at = at + L.SHADOW_CAPACITY * L.TRAMPOLINE_STRIDE
    encoder = iced.Encoder(64)  # entries one by one: the near jump keeps its 5 bytes
    for k in range(L.SHADOW_CAPACITY):
        call = at + k * L.TRAMPOLINE_STRIDE
        encoder.encode(iced.Instruction.create_mem(C.CALL_RM64, _stack(-8 - HOOK_ROOM)), call)
        point = call + L.TRAMPOLINE_CALL
        encoder.encode(iced.Instruction.create_i32(C.PUSHQ_IMM32, k * L.SHADOW_ENTRY), point)
        encoder.encode(iced.Instruction.create_branch(C.JMP_REL32_64, common_at), point + 5)
    table = bytes(encoder.take_buffer())
    assert len(table) == common_at - at
    asm = _Asm()
    finish, popping, popped = asm.label(), asm.label(), asm.label()
    shadow, shift = layout.shadow, L.SHADOW_ENTRY.bit_length() - 1
    slot_at = _ENTRY_OFFSET_AT  # the pushed offset, where the return address was
    for name in _SAVED:
        asm.add(iced.Instruction.create_reg(C.PUSH_R64, _REG[name]))
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RSI, _mem(R.RSP, slot_at)))
    asm.add(iced.Instruction.create_mem(C.JMP_RM64, _gs(shadow + L.ENTRY_HANDLER, R.RSI)))
    asm.bind(finish)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RSI, _mem(R.RSP, slot_at)))
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, _gs(shadow + L.ENTRY_RET, R.RSI)))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _mem(R.RSP, slot_at), R.RAX))
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _gs(L.SHADOW_BUSY), 1))
    _one_less_pending(asm, layout)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _gs(shadow + L.ENTRY_SLOT, R.RSI), 0))
    # Free entries on top go: the stack shrinks back as frames return in order.
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RCX, _gs(L.SHADOW_TOP)))
    asm.bind(popping)
    asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RCX, R.RCX))
    asm.jump(C.JE_REL32_64, popped)
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RDX, _mem(R.RCX, -1)))
    asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RDX, shift))
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, _gs(shadow + L.ENTRY_SLOT, R.RDX), 0))
    asm.jump(C.JNE_REL32_64, popped)
    asm.add(iced.Instruction.create_reg(C.DEC_RM64, R.RCX))
    asm.jump(C.JMP_REL32_64, popping)
    asm.bind(popped)
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(L.SHADOW_TOP), R.RCX))
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _gs(L.SHADOW_BUSY), 0))
    for name in reversed(_SAVED):
        asm.add(iced.Instruction.create_reg(C.POP_R64, _REG[name]))
    asm.add(iced.Instruction.create(C.RETNQ))
    finish_index = asm.bound[finish]
    code, _ = asm.encode(common_at)
    starts = [int(insn.ip) for insn in iter_instructions(code, common_at)]
    return table + code, Trampoline(at, starts[finish_index], common_at + len(code))


def build_return_code(
    prog: Program, layout: L.AreaLayout, at: int, trampoline: Trampoline, tsc_mult: int,
    symbol_address: Callable[[str], int | None] = lambda name: None, rseq_offset_at: int | None = None,
) -> bytes | OptimizeRefusal:  # fmt: skip
    """The return part of a return probe, placed at `at`: its filter, counters, histogram or
    record, run by the trampoline (registers saved as a detour saves them), then back to it."""
    asm = _Asm()
    returning = _Returning(trampoline.points, tsc_mult, at_return=True)
    emitter = _Emitter(asm, layout, 0, 0, False, symbol_address, returning, rseq_offset_at)
    try:
        _check_fields(prog)
        emitter.program(prog)
    except _Unsupported as exc:
        return exc.reason
    asm.add(iced.Instruction.create_branch(C.JMP_REL32_64, trampoline.finish))
    return asm.encode(at)[0]


def _stamp(asm: _Asm, base: RegisterT, disp: int) -> None:
    """The time-stamp counter into the u64 at gs:[base + disp], flags untouched (rax, rdx used)."""
    asm.add(iced.Instruction.create(C.RDTSC))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM32_R32, _gs(disp, base), R.EAX))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM32_R32, _gs(disp + 4, base), R.EDX))


def return_stub_code(layout: L.AreaLayout, at: int, trampoline: Trampoline) -> tuple[bytes, int]:
    """The return code of probes whose return part runs in the tracer, placed at `at`: the
    return's time into the entry (rsi: its offset; rax and rdx saved by the trampoline), then
    `jmp finish`, where an int3 goes: the tracer's clock at the stop would count the trap in the
    call's latency. Returns the code and the address of the jump."""
    asm = _Asm()
    _stamp(asm, R.RSI, layout.shadow + L.ENTRY_RETURN_TSC)
    asm.add(iced.Instruction.create_branch(C.JMP_REL32_64, trampoline.finish))
    code = asm.encode(at)[0]
    return code, at + len(code) - JMP_REL32_LEN


def build_entry_stamp() -> bytes:
    """Where a thread stopped at a return probe's trap entry resumes (see L.STAMP_BUSY): the
    time-stamp counter into the words the tracer named, registers and flags as they were, then
    on to the resume address. That goes through the stack below the red zone (`ret 128`), not a
    register, and only once STAMP_BUSY is clear: a signal handler's trap entry may then reuse the
    stub. Position-independent."""
    asm = _Asm()
    saved = [(reg, L.STAMP_SAVED + 8 * i) for i, reg in enumerate((R.RAX, R.RDX, R.RSI))]
    for reg, at in saved:
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(at), reg))
    asm.add(iced.Instruction.create(C.RDTSC))
    for i in range(L.STAMP_TARGETS_MAX):
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RSI, _gs(L.STAMP_TARGETS + 8 * i)))
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM32_R32, _gs(0, R.RSI), R.EAX))
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM32_R32, _gs(4, R.RSI), R.EDX))
    for reg, at in saved:
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, reg, _gs(at)))
    _resume_through_area(asm)
    return asm.encode(0)[0]


# --- the function tracer (docs/architecture.md §8) ---------------------------------------------------------


def _frame_tag(asm: _Asm, entry_offset: RegisterT, into: RegisterT) -> None:
    """`into` = the kind field of an entry record for the shadow entry at `entry_offset`."""
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, into, entry_offset))
    asm.add(iced.Instruction.create_reg_i32(C.SHR_RM64_IMM8, into, L.SHADOW_ENTRY.bit_length() - 1 - L.FRAME_SHIFT))
    asm.add(iced.Instruction.create_reg_i32(C.ADD_RM64_IMM8, into, 1 << L.FRAME_SHIFT))


SITE_CALL_AT = 10  # a tracer site's `call rel32` starts here (after `lea rsp,[rsp-16]; push imm32`)
_REGION_AFTER_CALL = 5 + _ENTER_TAIL_BYTES  # the site's `lea rsp,[rsp+24]` and `enter_tail`, then the region


@dataclass(frozen=True)
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
        iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, _stack(-HOOK_ROOM)),
        iced.Instruction.create_i32(C.PUSHQ_IMM32, function_id),
        iced.Instruction.create_branch(C.CALL_REL32_64, target),
        iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RSP, _stack(HOOK_ROOM + 8)),
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


def ring_record(
    asm: _Asm, layout: L.AreaLayout, probe_index: int, slot: RegisterT, write: Callable[[], None],
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
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, _gs(L.BUSY), 0))
    asm.jump(C.JNE_REL32_64, missed)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _gs(L.BUSY), 1))
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, slot, _gs(L.RESERVE)))
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, slot))
    asm.add(iced.Instruction.create_reg_mem(C.SUB_R64_RM64, R.RAX, _gs(L.TAIL)))
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
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RAX, _mem(slot, layout.prefetch_ahead)))
    asm.add(iced.Instruction.create_reg_i32(C.AND_RM64_IMM32, R.RAX, layout.ring_bytes - 1))
    asm.add(iced.Instruction.create_mem(C.PREFETCHW_M8, _gs(layout.ring, R.RAX)))
    write()
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, _gs(L.RESERVE)))
    asm.add(iced.Instruction.create_reg(C.INC_RM64, R.RAX))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(L.RESERVE), R.RAX))
    if publish:
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(L.HEAD), R.RAX))
    asm.jump(C.JMP_REL32_64, release)
    asm.bind(full)
    _take_oldest(asm, slot, layout.ring_slots - records + 1, room)
    _wait_for_room(asm, slot, layout.ring_slots - records + 1, room, lost, full)
    asm.bind(lost)
    asm.add(iced.Instruction.create_mem(C.INC_RM64, _gs(layout.counter(probe_index, L.LOST))))
    asm.bind(release)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _gs(L.BUSY), 0))
    asm.jump(C.JMP_REL32_64, done)
    asm.bind(missed)
    asm.add(iced.Instruction.create_mem(C.INC_RM64, _gs(layout.counter(probe_index, L.MISSED))))
    asm.bind(done)


def _read_tsc(asm: _Asm) -> None:
    """rax: the time-stamp counter (rdx used)."""
    asm.add(iced.Instruction.create(C.RDTSC))
    asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RDX, 32))
    asm.add(iced.Instruction.create_reg_reg(C.OR_R64_RM64, R.RAX, R.RDX))


def _take_oldest(asm: _Asm, slot: RegisterT, limit: int, room: int) -> None:
    """The ring is full (`slot`: the record's sequence number): a flight recorder's (gs:[OVERWRITE])
    gives up its oldest records to make room (TAIL becomes slot - `limit` + 1; the reader counts
    what it never read) and goes to `room`; another's goes on. rax used."""
    other = asm.label()
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, _gs(L.OVERWRITE), 0))
    asm.jump(C.JE_REL32_64, other)
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, slot))
    asm.add(iced.Instruction.create_reg_i32(C.SUB_RM64_IMM32, R.RAX, limit - 1))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(L.TAIL), R.RAX))
    asm.jump(C.JMP_REL32_64, room)
    asm.bind(other)


def _wait_for_room(asm: _Asm, slot: RegisterT, limit: int, room: int, lost: int, full: int) -> None:
    """The ring is full (`slot`: the record's sequence number; room once slot - TAIL < `limit`):
    wait for the reader to take records, up to gs:[WAIT_TICKS] ticks (0: not at all, which the
    tracer also sets to end every wait when it leaves), then go to `room`, or to `lost` when
    none came; back to `full` if the ring becomes a flight recorder's again (the reader pauses
    one, clearing gs:[OVERWRITE], while it copies it). rax used, rdx kept."""
    again, gave_up, waited, overwriting = asm.label(), asm.label(), asm.label(), asm.label()
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, _gs(L.WAIT_TICKS), 0))
    asm.jump(C.JE_REL32_64, lost)
    asm.add(iced.Instruction.create_reg(C.PUSH_R64, R.RDX))
    _read_tsc(asm)
    asm.add(iced.Instruction.create_reg_mem(C.ADD_R64_RM64, R.RAX, _gs(L.WAIT_TICKS)))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(L.WAIT_UNTIL), R.RAX))
    asm.bind(again)
    asm.add(iced.Instruction.create(C.PAUSE))
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, slot))
    asm.add(iced.Instruction.create_reg_mem(C.SUB_R64_RM64, R.RAX, _gs(L.TAIL)))
    asm.add(iced.Instruction.create_reg_i32(C.CMP_RM64_IMM32, R.RAX, limit))
    asm.jump(C.JB_REL32_64, waited)
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, _gs(L.OVERWRITE), 0))
    asm.jump(C.JNE_REL32_64, overwriting)
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, _gs(L.WAIT_TICKS), 0))
    asm.jump(C.JE_REL32_64, gave_up)
    _read_tsc(asm)
    asm.add(iced.Instruction.create_reg_mem(C.CMP_R64_RM64, R.RAX, _gs(L.WAIT_UNTIL)))
    asm.jump(C.JB_REL32_64, again)
    asm.bind(gave_up)
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RDX))
    asm.jump(C.JMP_REL32_64, lost)
    asm.bind(waited)
    asm.add(iced.Instruction.create_mem(C.INC_RM64, _gs(L.WAITS)))
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RDX))
    asm.jump(C.JMP_REL32_64, room)
    asm.bind(overwriting)
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RDX))
    asm.jump(C.JMP_REL32_64, full)


def _trace_record(
    asm: _Asm, layout: L.AreaLayout, ops_index: int, kind: int = L.TRACE_ENTRY, kind_in: RegisterT | None = None,
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
            asm.add(iced.Instruction.create_mem_reg(C.MOV_RM32_R32, _gs(ring + L.RECORD_FAULTS, slot), R.EAX))
        _read_tsc(asm)
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(ring + L.RECORD_TSC, slot), R.RAX))
        asm.add(iced.Instruction.create_mem_u32(C.MOV_RM16_IMM16, _gs(ring + L.RECORD_PROBE, slot), ops_index))
        if kind_in is None:
            asm.add(iced.Instruction.create_mem_u32(C.MOV_RM16_IMM16, _gs(ring + L.RECORD_CPU, slot), kind))
        else:  # (Register values are ints too: hence a parameter of its own)
            asm.add(iced.Instruction.create_mem_reg(C.MOV_RM16_R16, _gs(ring + L.RECORD_CPU, slot), kind_in))
        if function_id is None:
            asm.add(iced.Instruction.create_mem_reg(C.MOV_RM32_R32, _gs(ring + L.RECORD_FAULTS, slot), R.ESI))
        if data is not None:
            _data_records(asm, layout, ops_index, data)

    records = 1 + (sum(STRING_PIECES if v.is_string else 1 for v in data.values) if data is not None else 0)
    ring_record(asm, layout, ops_index, slot, write, publish, reserved, records)


_DATA_PUSHED = (R.RCX, R.RSI, R.RDI, R.R8)  # kept across the data records (r8 read from its push)


@dataclass(frozen=True)
class Captures:
    """The values the entry records (`arguments`) and the exit records (`retval`) of some
    traced functions carry."""

    arguments: tuple[ArgSpec, ...] = ()
    retval: tuple[ArgSpec, ...] = ()


@dataclass(frozen=True)
class _Data:
    """The values of a record's data records, and where the call's registers are: `frame`
    bytes up from rsp is the base its saved registers (SAVED_AT) and its return-address slot
    (`slot_at`, an entry's) are counted from."""

    values: Sequence[ArgSpec]
    frame: int
    slot_at: int | None = None


def _data_records(asm: _Asm, layout: L.AreaLayout, ops_index: int, data: _Data) -> None:
    """After a record at gs:[RESERVE]: the data records of `data.values`, from RESERVE + 1 on;
    gs:[RESERVE] is left at the last (ring_record then publishes them all). Keeps every
    register but rax and rdx."""
    for reg in _DATA_PUSHED:
        asm.add(iced.Instruction.create_reg(C.PUSH_R64, reg))
    frame = data.frame + 8 * len(_DATA_PUSHED)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RSI, _gs(L.RESERVE)))  # rsi: the next record's number
    asm.add(iced.Instruction.create_reg(C.INC_RM64, R.RSI))
    for number, value in enumerate(data.values):
        _load_source(asm, value.source, frame, data.slot_at)
        if value.is_string:
            _string_records(asm, layout, ops_index, number)
            continue
        _data_slot(asm, layout)
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(layout.ring + L.RECORD_TSC, R.RDX), R.RAX))
        _data_header(asm, layout, ops_index, number, 8)
        asm.add(iced.Instruction.create_reg(C.INC_RM64, R.RSI))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RAX, _mem(R.RSI, -1)))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(L.RESERVE), R.RAX))
    for reg in reversed(_DATA_PUSHED):
        asm.add(iced.Instruction.create_reg(C.POP_R64, reg))


def _load_source(asm: _Asm, source: str, frame: int, slot_at: int | None) -> None:
    """rax = the call's value at `source` (see ArgSpec.source)."""
    if source.startswith("xmm"):
        asm.add(iced.Instruction.create_reg_reg(C.MOVQ_RM64_XMM, R.RAX, getattr(R, source.upper())))
    elif source.startswith("stack+"):
        assert slot_at is not None, "a stack slot at a return"
        at = frame + slot_at + 8 * int(source.removeprefix("stack+"))
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, _mem(R.RSP, at)))
    elif source in SAVED_AT:
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, _mem(R.RSP, frame + SAVED_AT[source])))
    elif source == "r8":
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, _mem(R.RSP, 0)))  # (pushed last)
    else:
        asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, _REG[source]))


def _data_slot(asm: _Asm, layout: L.AreaLayout) -> None:
    """rdx = the ring offset of record number rsi."""
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RDX, R.RSI))
    asm.add(iced.Instruction.create_reg_i32(C.AND_RM64_IMM32, R.RDX, layout.ring_slots - 1))
    asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RDX, layout.record_size.bit_length() - 1))


def _data_header(asm: _Asm, layout: L.AreaLayout, ops_index: int, number: int, held: int | None) -> None:
    """The header of the data record at rdx: `held` (bytes and flags), or eax's."""
    ring = layout.ring
    asm.add(iced.Instruction.create_mem_u32(C.MOV_RM16_IMM16, _gs(ring + L.RECORD_PROBE, R.RDX), ops_index))
    asm.add(iced.Instruction.create_mem_u32(C.MOV_RM16_IMM16, _gs(ring + L.RECORD_CPU, R.RDX), L.TRACE_DATA | number))
    if held is None:
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM32_R32, _gs(ring + L.RECORD_FAULTS, R.RDX), R.EAX))
    else:
        asm.add(iced.Instruction.create_mem_u32(C.MOV_RM32_IMM32, _gs(ring + L.RECORD_FAULTS, R.RDX), held))


def _string_records(asm: _Asm, layout: L.AreaLayout, ops_index: int, number: int) -> None:
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
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _gs(ring + L.RECORD_TSC, R.RDX), 0))
    asm.bind(byte)
    asm.add(iced.Instruction.create_reg_mem(C.MOVZX_R32_RM8, R.EAX, _mem(R.RDI, 0, R.RCX)), faulted)
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R32_RM32, R.R8D, R.ECX))
    asm.add(iced.Instruction.create_reg_i32(C.AND_RM32_IMM8, R.R8D, 7))
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM8_R8, _gs(ring + L.RECORD_TSC, R.RDX, R.R8), R.AL))
    asm.add(iced.Instruction.create_reg(C.INC_RM32, R.ECX))
    asm.add(iced.Instruction.create_reg_reg(C.TEST_RM32_R32, R.EAX, R.EAX))
    asm.jump(C.JE_REL32_64, ended)
    asm.add(iced.Instruction.create_reg_i32(C.TEST_RM32_IMM32, R.ECX, 7))
    asm.jump(C.JNE_REL32_64, byte)
    _data_header(asm, layout, ops_index, number, 8)  # a full piece
    asm.add(iced.Instruction.create_reg(C.INC_RM64, R.RSI))
    asm.add(iced.Instruction.create_reg_i32(C.CMP_RM32_IMM32, R.ECX, 8 * STRING_PIECES))
    asm.jump(C.JB_REL32_64, piece)
    asm.add(iced.Instruction.create_mem_u32(C.OR_RM32_IMM32, _gs(ring + L.RECORD_FAULTS, R.RDX), L.DATA_CUT))
    asm.jump(C.JMP_REL32_64, done)
    asm.bind(ended)  # ecx - 1 bytes before the NUL
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R32_M, R.EAX, _mem(R.RCX, -1)))
    asm.add(iced.Instruction.create_reg_i32(C.AND_RM32_IMM8, R.EAX, 7))
    asm.add(iced.Instruction.create_reg_i32(C.OR_RM32_IMM32, R.EAX, L.DATA_END))
    _data_header(asm, layout, ops_index, number, None)
    asm.add(iced.Instruction.create_reg(C.INC_RM64, R.RSI))
    asm.jump(C.JMP_REL32_64, done)
    asm.bind(faulted)  # ecx bytes could be read (none: the record holds the address instead)
    asm.add(iced.Instruction.create_reg_reg(C.TEST_RM32_R32, R.ECX, R.ECX))
    asm.jump(C.JNE_REL32_64, some)
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(ring + L.RECORD_TSC, R.RDX), R.RDI))
    asm.bind(some)
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R32_RM32, R.EAX, R.ECX))
    asm.add(iced.Instruction.create_reg_i32(C.AND_RM32_IMM8, R.EAX, 7))
    asm.add(iced.Instruction.create_reg_i32(C.OR_RM32_IMM32, R.EAX, L.DATA_FAULTED))
    _data_header(asm, layout, ops_index, number, None)
    asm.add(iced.Instruction.create_reg(C.INC_RM64, R.RSI))
    asm.jump(C.JMP_REL32_64, done)
    asm.bind(null)
    _data_slot(asm, layout)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _gs(ring + L.RECORD_TSC, R.RDX), 0))
    _data_header(asm, layout, ops_index, number, L.DATA_NULL)
    asm.add(iced.Instruction.create_reg(C.INC_RM64, R.RSI))
    asm.bind(done)


# An entry's frame, from rsp: the saved registers, the return address into the site (its
# region _REGION_AFTER_CALL further), the function's id, HOOK_ROOM, the traced function's
# return-address slot.
_SITE_RET_AT = 8 * len(_SAVED)
_ID_AT = _SITE_RET_AT + 8
_SLOT_AT = _ID_AT + 8 + HOOK_ROOM


def _save(asm: _Asm) -> None:
    for name in _SAVED:
        asm.add(iced.Instruction.create_reg(C.PUSH_R64, _REG[name]))


def _hook_and_return(asm: _Asm, points: int | None) -> None:
    """An entry's end: `hook_targets` (points: the return trampoline's entry point 0, if the
    return may have been hooked), registers back, return to the site."""

    def load_region() -> None:
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RDX, _mem(R.RSP, _SITE_RET_AT)))
        asm.add(iced.Instruction.create_reg_i32(C.ADD_RM64_IMM8, R.RDX, _REGION_AFTER_CALL))

    hook_targets(asm, _SLOT_AT, load_region, points)
    for name in reversed(_SAVED):
        asm.add(iced.Instruction.create_reg(C.POP_R64, _REG[name]))
    asm.add(iced.Instruction.create(C.RETNQ))


def build_list_trampoline(bodies: Sequence[int], at: int, points: int | None) -> bytes:
    """A site traced by several instances calls this: save what the bodies use, esi = the
    function's id, rdi = its return-address slot, call each body in turn, `_hook_and_return`."""
    asm = _Asm()
    _save(asm)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.ESI, _mem(R.RSP, _ID_AT)))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RDI, _mem(R.RSP, _SLOT_AT)))
    for body in bodies:
        asm.add(iced.Instruction.create_branch(C.CALL_REL32_64, body))
    _hook_and_return(asm, points)
    return asm.encode(at)[0]


def build_ops_code(
    layout: L.AreaLayout, ops_index: int, trampoline: Trampoline | None, at: int, *, depth: int | None,
    threshold: int, captures: Captures | None, snapshot_over: int = 0,
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

    def body(asm: _Asm, inline: bool, exit_at: int) -> None:
        """Inline: in the entry's frame, registers free. Otherwise: esi the id, rdi the slot,
        both kept."""
        hits = iced.Instruction.create_mem(C.INC_RM64, _gs(layout.counter(ops_index, L.HITS)))
        frame = 0 if inline else 8  # (the list trampoline's call)
        if trampoline is None:
            asm.add(hits)
            data = _Data(entry_values, frame, _SLOT_AT) if entry_values else None
            _trace_record(asm, layout, ops_index, function_id=_mem(R.RSP, _ID_AT) if inline else None, data=data)
            return
        done = asm.label()
        if depth is not None:
            asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM32, _gs(layout.counter(ops_index, L.PENDING)), depth))
            asm.jump(C.JAE_REL32_64, done)
        asm.add(hits)
        if inline:
            asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RCX, _mem(R.RSP, _SLOT_AT)))
            id_at = _mem(R.RSP, _ID_AT)
        else:
            asm.add(iced.Instruction.create_reg(C.PUSH_R64, R.RSI))
            asm.add(iced.Instruction.create_reg(C.PUSH_R64, R.RDI))
            asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RCX, R.RDI))
            id_at = _mem(R.RSP, 8)  # the pushed rsi

        def fill() -> None:  # data: the function's id | the entry's kind << 32; the entry record
            _frame_tag(asm, R.RSI, R.RDI)
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.EAX, id_at))
            asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RDX, R.RDI))
            asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RDX, 32))
            asm.add(iced.Instruction.create_reg_reg(C.OR_R64_RM64, R.RDX, R.RAX))
            asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(shadow + L.ENTRY_DATA, R.RSI), R.RDX))
            if journal:  # no entry record held back (yet)
                asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _gs(shadow + held, R.RSI), -1))
            if snapshot_over:  # (its entry record may be written over before it returns)
                _read_tsc(asm)
                asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(shadow + L.ENTRY_TSC, R.RSI), R.RAX))

            def reserved() -> None:  # r11: the record's sequence number
                asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(shadow + held, R.RSI), R.R11))

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
        asm = _Asm()
        callable_body, exit_ = asm.label(), asm.label()
        _save(asm)
        body(asm, True, exit_at)
        _hook_and_return(asm, trampoline.points if trampoline is not None else None)
        asm.bind(callable_body)
        body(asm, False, exit_at)
        asm.add(iced.Instruction.create(C.RETNQ))
        asm.bind(exit_)
        if trampoline is not None:
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RCX, _mem(R.RSP, _ENTRY_OFFSET_AT)))
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.ESI, _gs(shadow + L.ENTRY_DATA, R.RCX)))
            asm.add(iced.Instruction.create_reg_mem(C.MOVZX_R32_RM16, R.EDI, _gs(shadow + L.ENTRY_DATA + 4, R.RCX)))
            asm.add(iced.Instruction.create_reg_i32(C.OR_RM32_IMM8, R.EDI, L.TRACE_EXIT))
            if journal:
                _take_back_if_short(asm, layout, ops_index, shadow + held, threshold, trampoline.finish)
            _trace_record(asm, layout, ops_index, kind_in=R.DI, data=_Data(exit_values, 0) if exit_values else None)
            if snapshot_over:
                _ask_snapshot(asm, layout, snapshot_over, trampoline.finish)
            asm.add(iced.Instruction.create_branch(C.JMP_REL32_64, trampoline.finish))
        else:
            asm.add(iced.Instruction.create(C.INT3))
        return _encode_with(asm, at, (callable_body, exit_))

    # The shadow entries name the exit's address, known once encoded: a second pass with it (an
    # imm64 either way, so nothing moves).
    _, first, _ = assemble(0)
    exit_at = list(first.values())[1]
    code, addresses, fixups = assemble(exit_at)
    body_at, check = addresses.values()
    assert check == exit_at
    return code, OpsCode(at, body_at, exit_at, tuple(fixups.items()))


def _take_back_if_short(
    asm: _Asm, layout: L.AreaLayout, ops_index: int, held: int, threshold: int, finish: int
) -> None:  # fmt: skip
    """At a traced call's return (rcx: its shadow entry's offset; rsi, rdi kept): if its entry
    record is still held back and the call lasted less than `threshold` ticks, take the record
    back with all after it and go to `finish`; otherwise fall through to write the exit record.
    Uses rax, rcx, rdx."""
    missed, short, release, keep, write = (asm.label() for _ in range(5))
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, _gs(L.BUSY), 0))
    asm.jump(C.JNE_REL32_64, missed)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _gs(L.BUSY), 1))
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RDX, _gs(held, R.RCX)))
    asm.add(iced.Instruction.create_reg_mem(C.CMP_R64_RM64, R.RDX, _gs(L.HEAD)))
    asm.jump(C.JB_REL32_64, keep)  # published already (a callee lasted): the exit follows it
    asm.add(iced.Instruction.create_reg_mem(C.CMP_R64_RM64, R.RDX, _gs(L.RESERVE)))
    asm.jump(C.JAE_REL32_64, release)  # no entry record (missed, lost, or taken back): none at all
    asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, R.RDX))
    asm.add(iced.Instruction.create_reg_i32(C.AND_RM64_IMM32, R.RAX, layout.ring_slots - 1))
    asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RAX, layout.record_size.bit_length() - 1))
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RCX, _gs(layout.ring + L.RECORD_TSC, R.RAX)))
    asm.add(iced.Instruction.create_reg(C.PUSH_R64, R.RDX))
    _read_tsc(asm)
    asm.add(iced.Instruction.create_reg(C.POP_R64, R.RDX))
    asm.add(iced.Instruction.create_reg_reg(C.SUB_R64_RM64, R.RAX, R.RCX))
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RCX, threshold))
    asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RAX, R.RCX))
    asm.jump(C.JB_REL32_64, short)
    asm.bind(keep)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _gs(L.BUSY), 0))
    asm.jump(C.JMP_REL32_64, write)
    asm.bind(short)
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _gs(L.RESERVE), R.RDX))
    asm.bind(release)
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _gs(L.BUSY), 0))
    asm.add(iced.Instruction.create_branch(C.JMP_REL32_64, finish))
    asm.bind(missed)
    asm.add(iced.Instruction.create_mem(C.INC_RM64, _gs(layout.counter(ops_index, L.MISSED))))
    asm.add(iced.Instruction.create_branch(C.JMP_REL32_64, finish))
    asm.bind(write)


def _ask_snapshot(asm: _Asm, layout: L.AreaLayout, snapshot_over: int, finish: int) -> None:
    """After a traced call's exit record: if the call lasted `snapshot_over` ticks or more
    (from its shadow entry's ENTRY_TSC), pause the thread's ring (OVERWRITE cleared: what led
    up to the call stays, later records wait for room) and ask for a snapshot (SNAPSHOT_DUE),
    which the reader takes and then resumes the ring; otherwise go to `finish`. Uses rax, rcx,
    rdx."""
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RCX, _mem(R.RSP, _ENTRY_OFFSET_AT)))
    _read_tsc(asm)
    asm.add(iced.Instruction.create_reg_mem(C.SUB_R64_RM64, R.RAX, _gs(layout.shadow + L.ENTRY_TSC, R.RCX)))
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RDX, snapshot_over))
    asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RAX, R.RDX))
    asm.add(iced.Instruction.create_branch(C.JB_REL32_64, finish))
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _gs(L.OVERWRITE), 0))
    asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, _gs(L.SNAPSHOT_DUE), 1))


def _encode_with(asm: _Asm, at: int, labels: Sequence[int]) -> tuple[bytes, dict[int, int], dict[int, int]]:
    """Encode, and say where the instructions bound to `labels` landed; the fix-ups too."""
    indices = {label: asm.bound[label] for label in labels}
    code, fixups = asm.encode(at)
    starts = [int(insn.ip) for insn in iter_instructions(code, at)]
    return code, {label: starts[i] for label, i in indices.items()}, fixups


def tsc_readings_code() -> bytes:
    """A C-callable `void f(uint64_t reads, uint64_t *out)`: reads the time-stamp counter `reads`
    times back to back into out[0..reads) (how finely the clock can tell two moments apart)."""
    asm = _Asm()
    loop = asm.label()
    asm.bind(loop)
    _read_tsc(asm)
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, _mem(R.RSI), R.RAX))
    asm.add(iced.Instruction.create_reg_i32(C.ADD_RM64_IMM8, R.RSI, 8))
    asm.add(iced.Instruction.create_reg(C.DEC_RM64, R.RDI))
    asm.jump(C.JNE_REL32_64, loop)
    asm.add(iced.Instruction.create(C.RETNQ))
    return asm.encode(0)[0]


def read_tsc_code() -> bytes:
    """A C-callable `uint64_t f(void)` returning the time-stamp counter (for the consumer's clock)."""
    asm = _Asm()
    _read_tsc(asm)
    asm.add(iced.Instruction.create(C.RETNQ))
    return asm.encode(0)[0]
