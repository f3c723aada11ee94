"""A bpftrace program's probe body (lang/) as machine code, run in a detour's full form
(codegen/actions.py's `Emitter`: the saved registers, fault fix-ups): its predicate, its
statements, its maps updated in place in the program's region (lang/maps.py) with atomic
instructions (plain ones where each entry has one writer: `MapTable.one_writer`), its printf()
calls as records in the thread's ring (lang/target.py's `PrintfRecord`), a `str()` key read
into NUL-padded words, a `ustack` key the slot the probe counted the hit's stack in, a `comm`
key the thread's pid and tid and a `func` or `probe` key the probe's index plus 1 (the tracer
names them). (lang/target.py refuses beforehand what is not compiled here: a stack as a value;
a string but as a map's key or value, or a printf() argument.)

A value is 64 bits in rax. The left operand of an operation waits in the thread area while the
right one is worked out (`LANG_TEMPS`, a word a level of nesting: the detour's stack holds the
saved registers at fixed offsets), as do a map's keys while their hash is taken; scratch
variables live there too (`LANG_VARS`). rax, rcx, rdx, rdi and r11 are used: the detour saved
them. A read that faults gives 0, as bpftrace's reads of user memory do. A signal handler that
hits a probe while the thread runs a body (its temporaries in use) skips the body, counted as
missed. Arithmetic is bpftrace's (0.17): division, remainder and `>>` unsigned, a comparison
signed when both sides are (a literal is); a division by zero gives 0, a remainder by zero the
dividend, as BPF's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import iced_x86 as iced

from dynprobe.arch.x86_64.codegen.asm import L_MASK64, Asm, C, R, Unsupported, gs_at, mem_at, read_tsc
from dynprobe.arch.x86_64.codegen.records import ring_record
from dynprobe.arch.x86_64.cpu import has_rdpid
from dynprobe.arch.x86_64.regs import ARG_REGS
from dynprobe.errors import OptimizeRefusal
from dynprobe.lang import syntax as S
from dynprobe.lang.check import STRING_WORDS
from dynprobe.lang.maps import HASH_MULTIPLIER, HASH_SEED, PROBES, SLOT_READY, LangBody, MapTable
from dynprobe.lang.target import STACK_KINDS, TRACER_NAMES
from dynprobe.ringbuf import layout as L

if TYPE_CHECKING:
    from iced_x86._iced_x86_py import Code as CodeT

_SIGNED_SETCC = {"==": C.SETE_RM8, "!=": C.SETNE_RM8, "<": C.SETL_RM8, "<=": C.SETLE_RM8, ">": C.SETG_RM8,
               ">=": C.SETGE_RM8}  # fmt: skip
_UNSIGNED_SETCC = {**_SIGNED_SETCC, "<": C.SETB_RM8, "<=": C.SETBE_RM8, ">": C.SETA_RM8, ">=": C.SETAE_RM8}
_ARITHMETIC = {"+": C.ADD_R64_RM64, "-": C.SUB_R64_RM64, "&": C.AND_R64_RM64, "|": C.OR_R64_RM64,
               "^": C.XOR_R64_RM64}  # fmt: skip
_CAST_SIGNED = {8: C.MOVSX_R64_RM8, 16: C.MOVSX_R64_RM16, 32: C.MOVSXD_R64_RM32}
_LOW = {8: R.AL, 16: R.AX, 32: R.EAX}


class Emitting(Protocol):
    """What a body needs of the detour's code generator (codegen/actions.py's `Emitter`)."""

    asm: Asm
    layout: L.AreaLayout

    def load_reg(self, name: str) -> None: ...  # rax = the register at the site (its saved copy)

    def cpu_number(self) -> None: ...  # ecx = the thread's CPU

    def record_header(self, probe_index: int) -> None: ...  # the header of the record at rsi

    def copy_string(self, at: int, bit: int, faulted: int, *, limit: int, limit_in_ecx: bool) -> None: ...  # rax's


class BodyCompiler:
    """Emits one `LangBody` through an `Emitter` (whose asm it appends to)."""

    def __init__(self, emitter: Emitting, body: LangBody, probe_index: int) -> None:
        self.emitter = emitter
        self.asm: Asm = emitter.asm
        self.body = body
        self.probe_index = probe_index
        self.missed = emitter.layout.counter(probe_index, L.MISSED)
        self.variables: dict[str, int] = {}  # a scratch variable's word in LANG_VARS

    # --- the body ------------------------------------------------------------------------------
    def emit(self) -> None:
        asm = self.asm
        done, skipped = asm.label(), asm.label()
        asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, gs_at(L.LANG_BUSY), 0))
        asm.jump(C.JNE_REL32_64, skipped)
        asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.LANG_BUSY), 1))
        finished = asm.label()
        if self.body.block.predicate is not None:
            self.expression(self.body.block.predicate, 0)
            asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RAX, R.RAX))
            asm.jump(C.JE_REL32_64, finished)
        self.statements(self.body.block.body)
        asm.bind(finished)
        asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.LANG_BUSY), 0))
        asm.jump(C.JMP_REL32_64, done)
        asm.bind(skipped)
        asm.add(iced.Instruction.create_mem(C.INC_RM64, gs_at(self.missed)))
        asm.bind(done)

    def statements(self, statements: tuple[S.Statement, ...]) -> None:
        for statement in statements:
            self.statement(statement)

    def statement(self, statement: S.Statement) -> None:
        asm = self.asm
        match statement:
            case S.If(condition=condition, then=then, otherwise=otherwise):
                other, after = asm.label(), asm.label()
                self.expression(condition, 0)
                asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RAX, R.RAX))
                asm.jump(C.JE_REL32_64, other)
                self.statements(then)
                asm.jump(C.JMP_REL32_64, after)
                asm.bind(other)
                self.statements(otherwise)
                asm.bind(after)
            case S.Assign(target=S.MapRef() as target, op="=", value=S.Call(name=name) as call) if name in _UPDATES:
                self.aggregate(target, call)
            case S.Assign(target=S.MapRef() as target, value=S.Call(name="str") as call):
                self.assign_string(target, call)
            case S.Assign(target=S.MapRef() as target, value=S.Builtin(name=name)) if name in TRACER_NAMES:
                self.assign_named(target, name)  # (a map of comm, func or probe: lang/target.py)
            case S.Assign(target=target, op=op, value=value):
                self.assign(target, op, value)
            case S.ExprStatement(expr=S.Call(name="delete", args=(S.MapRef() as target,))):
                self.delete(target)
            case S.ExprStatement(expr=S.Call(name="clear" | "zero" as name, args=(S.MapRef() as target,))):
                self.clear(self.body.tables[target.name], keep_keys=name == "zero")
            case S.ExprStatement(expr=S.Call(name="printf" | "print" | "time") as call):
                self.printf(call)
            case S.ExprStatement(expr=S.Call(name="exit")):
                asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, self.body.exit_flag))
                asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, mem_at(R.RAX), 1))
            case S.ExprStatement(expr=expr) if not isinstance(expr, S.Call):
                self.expression(expr, 0)
            case _:  # (lang/target.py refuses every other statement in a probe body)
                raise AssertionError(statement)

    def printf(self, call: S.Call) -> None:
        """A record of the printf's values in the thread's ring (a full ring: waited on, or
        counted lost, as any record); a print()'s or a time()'s, its number alone. None once
        the program called exit(): what it prints ends there, as bpftrace's does (its maps
        still count what comes before the tracer sees the exit)."""
        asm, layout = self.asm, self.emitter.layout
        record = self.body.printfs[call]
        if L.RECORD_HEADER + record.size > layout.record_size:  # (the rings' record size was fixed before)
            raise Unsupported(OptimizeRefusal.RECORD_TOO_LARGE)
        exited = asm.label()
        asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, self.body.exit_flag))
        asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, mem_at(R.RAX), 0))
        asm.jump(C.JNE_REL32_64, exited)

        def write() -> None:
            self.emitter.record_header(self.probe_index)
            payload = layout.ring + L.RECORD_HEADER
            asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(payload, R.RSI), record.number))
            values = call.args[1:] if record.prints is None else ()
            for bit, (arg, expr) in enumerate(zip(record.args, values, strict=True)):
                at = payload + arg.offset
                if arg.kind == "int" or arg.kind.endswith(" word"):  # (a map's word the tracer names: as read)
                    self.expression(expr, 0)
                    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(at, R.RSI), R.RAX))
                elif arg.kind == "str" and isinstance(expr, S.MapRef):  # (a map of strings' value: ours, no fault)
                    absent, copied = asm.label(), asm.label()
                    self.find_slot(expr, self.body.tables[expr.name], 0, claim=False, absent=absent)
                    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RAX, mem_at(R.RDI, self.body.tables[
                        expr.name].value_at)))  # fmt: skip
                    self.emitter.copy_string(at, bit, asm.label(), limit=arg.chars, limit_in_ecx=False)
                    asm.jump(C.JMP_REL32_64, copied)
                    asm.bind(absent)
                    asm.add(iced.Instruction.create_mem_u32(C.MOV_RM32_IMM32, gs_at(at, R.RSI), 0))  # (empty)
                    asm.bind(copied)
                elif arg.kind == "str":
                    assert isinstance(expr, S.Call)
                    dynamic = self.string_address(expr, 0, chars=arg.chars)
                    self.emitter.copy_string(at, bit, asm.label(), limit=arg.chars, limit_in_ecx=dynamic)

        ring_record(asm, layout, self.probe_index, R.RSI, write)
        asm.bind(exited)

    # --- expressions ---------------------------------------------------------------------------
    def expression(self, expr: S.Expr, depth: int) -> None:
        """rax = the value of `expr`; temporaries from LANG_TEMPS word `depth` on."""
        asm = self.asm
        match expr:
            case S.Int(value=value):
                self.constant(value)
            case S.Builtin(name=name):
                self.builtin(name)
            case S.Var(name=name):
                asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, gs_at(self.variable(name))))
            case S.MapRef():
                self.map_read(expr, depth)
            case S.Unary(op="*", operand=S.Cast(pointer=True, type_name=type_name, operand=operand)):
                self.expression(operand, depth)
                self.load(int(type_name.removeprefix("u").removeprefix("int")), not type_name.startswith("u"))
            case S.Unary(op="*", operand=operand):
                self.expression(operand, depth)
                self.load(64, True)
            case S.Unary(op=op, operand=operand):
                self.expression(operand, depth)
                if op == "-":
                    asm.add(iced.Instruction.create_reg(C.NEG_RM64, R.RAX))
                elif op == "~":
                    asm.add(iced.Instruction.create_reg(C.NOT_RM64, R.RAX))
                else:  # !
                    asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RAX, R.RAX))
                    self.truth(C.SETE_RM8)
            case S.Cast(pointer=True, operand=operand):
                self.expression(operand, depth)
            case S.Cast(type_name=type_name, operand=operand):
                self.expression(operand, depth)
                self.narrow(int(type_name.removeprefix("u").removeprefix("int")), not type_name.startswith("u"))
            case S.Binary(op="&&" | "||" as op, left=left, right=right):
                self.logical(op, left, right, depth)
            case S.Binary(op=op, left=left, right=right):
                self.expression(left, depth)
                asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, self.temp(depth), R.RAX))
                self.expression(right, depth + 1)
                asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RCX, R.RAX))
                asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, self.temp(depth)))
                self.operate(op, signed=self.signed(left) and self.signed(right))
            case S.Ternary(condition=condition, then=then, otherwise=otherwise):
                other, after = asm.label(), asm.label()
                self.expression(condition, depth)
                asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RAX, R.RAX))
                asm.jump(C.JE_REL32_64, other)
                self.expression(then, depth)
                asm.jump(C.JMP_REL32_64, after)
                asm.bind(other)
                self.expression(otherwise, depth)
                asm.bind(after)
            case S.Step(op=op, target=target, prefix=prefix):
                self.step(op, target, prefix=prefix, depth=depth)
            case _:  # (strings, stacks, str(), ustack: lang/target.py refuses them)
                raise AssertionError(expr)

    def signed(self, expr: S.Expr) -> bool:
        """Whether bpftrace takes `expr` as signed where signedness matters (a literal is)."""
        return isinstance(expr, S.Int) or self.body.checked.type_of(expr).signed

    def constant(self, value: int) -> None:
        self.asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, value & L_MASK64))

    def temp(self, depth: int) -> iced.MemoryOperand:
        return gs_at(L.LANG_TEMPS + 8 * depth)

    def variable(self, name: str) -> int:
        return L.LANG_VARS + 8 * self.variables.setdefault(name, len(self.variables))

    def truth(self, setcc: CodeT) -> None:
        """rax = 1 if the flags meet `setcc`'s condition, else 0 (after a test or a compare)."""
        asm = self.asm
        asm.add(iced.Instruction.create_reg(setcc, R.AL))
        asm.add(iced.Instruction.create_reg_reg(C.MOVZX_R32_RM8, R.EAX, R.AL))

    def narrow(self, bits: int, signed: bool) -> None:
        asm = self.asm
        if bits == 64:
            return
        if signed:
            asm.add(iced.Instruction.create_reg_reg(_CAST_SIGNED[bits], R.RAX, _LOW[bits]))
        elif bits == 32:
            asm.add(iced.Instruction.create_reg_reg(C.MOV_R32_RM32, R.EAX, R.EAX))
        else:
            code = C.MOVZX_R32_RM8 if bits == 8 else C.MOVZX_R32_RM16
            asm.add(iced.Instruction.create_reg_reg(code, R.EAX, _LOW[bits]))

    def load(self, bits: int, signed: bool) -> None:
        """rax = the `bits`-bit value at address rax (a fault: 0)."""
        asm = self.asm
        faulted, after = asm.label(), asm.label()
        source = mem_at(R.RAX)
        if bits == 64:
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, source), faulted)
        elif signed:
            code = {8: C.MOVSX_R64_RM8, 16: C.MOVSX_R64_RM16, 32: C.MOVSXD_R64_RM32}[bits]
            asm.add(iced.Instruction.create_reg_mem(code, R.RAX, source), faulted)
        elif bits == 32:
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.EAX, source), faulted)
        else:
            code = C.MOVZX_R32_RM8 if bits == 8 else C.MOVZX_R32_RM16
            asm.add(iced.Instruction.create_reg_mem(code, R.EAX, source), faulted)
        asm.jump(C.JMP_REL32_64, after)
        asm.bind(faulted)
        asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.EAX, R.EAX))
        asm.bind(after)

    def operate(self, op: str, *, signed: bool) -> None:
        """rax = rax op rcx."""
        asm = self.asm
        if op in _ARITHMETIC:
            asm.add(iced.Instruction.create_reg_reg(_ARITHMETIC[op], R.RAX, R.RCX))
        elif op == "*":
            asm.add(iced.Instruction.create_reg_reg(C.IMUL_R64_RM64, R.RAX, R.RCX))
        elif op in ("/", "%"):
            by_zero, after = asm.label(), asm.label()
            asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RCX, R.RCX))
            asm.jump(C.JE_REL32_64, by_zero)
            asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.EDX, R.EDX))
            asm.add(iced.Instruction.create_reg(C.DIV_RM64, R.RCX))
            if op == "%":
                asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, R.RDX))
            asm.jump(C.JMP_REL32_64, after)
            asm.bind(by_zero)
            if op == "/":
                asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.EAX, R.EAX))
            asm.bind(after)
        elif op in ("<<", ">>"):
            asm.add(iced.Instruction.create_reg_reg(C.SHL_RM64_CL if op == "<<" else C.SHR_RM64_CL, R.RAX, R.CL))
        else:
            asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RAX, R.RCX))
            self.truth((_SIGNED_SETCC if signed else _UNSIGNED_SETCC)[op])

    def logical(self, op: str, left: S.Expr, right: S.Expr, depth: int) -> None:
        asm = self.asm
        decided = asm.label()
        self.expression(left, depth)
        asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RAX, R.RAX))
        asm.jump(C.JE_REL32_64 if op == "&&" else C.JNE_REL32_64, decided)
        self.expression(right, depth)
        asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RAX, R.RAX))
        asm.bind(decided)
        asm.add(iced.Instruction.create_reg(C.SETNE_RM8, R.AL))
        asm.add(iced.Instruction.create_reg_reg(C.MOVZX_R32_RM8, R.EAX, R.AL))

    def builtin(self, name: str) -> None:
        asm, emitter = self.asm, self.emitter
        if name.startswith("arg"):
            emitter.load_reg(ARG_REGS[int(name[3:])])
        elif name == "retval":
            emitter.load_reg("rax")
        elif name == "tid":
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, gs_at(L.TID)))
        elif name == "pid":
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, gs_at(L.TGID)))
        elif name in ("nsecs", "elapsed"):
            clock = self.body.clock
            read_tsc(asm)
            asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RCX, clock.mult))
            asm.add(iced.Instruction.create_reg(C.MUL_RM64, R.RCX))
            asm.add(iced.Instruction.create_reg_reg_u32(C.SHRD_RM64_R64_IMM8, R.RAX, R.RDX, 32))
            offset = clock.offset - clock.start if name == "elapsed" else clock.offset
            asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RCX, offset & L_MASK64))
            asm.add(iced.Instruction.create_reg_reg(C.ADD_R64_RM64, R.RAX, R.RCX))
        elif name == "cpu":
            if has_rdpid():
                emitter.cpu_number()
            else:
                asm.add(iced.Instruction.create(C.RDTSCP))
            asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.EAX, 0xFFF))
            asm.add(iced.Instruction.create_reg_reg(C.AND_R32_RM32, R.EAX, R.ECX))
        else:  # (comm, func, probe, ustack: lang/target.py refuses them)
            raise AssertionError(name)

    # --- scratch variables and maps ------------------------------------------------------------
    def assign(self, target: S.Var | S.MapRef, op: str, value: S.Expr) -> None:
        asm = self.asm
        self.expression(value, 0)
        if isinstance(target, S.Var):
            at = gs_at(self.variable(target.name))
            if op != "=":
                asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RCX, R.RAX))
                asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, at))
                self.operate(op[:-1], signed=self.signed(target))
            asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, at, R.RAX))
            return
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, self.temp(0), R.RAX))
        table = self.body.tables[target.name]
        self.find_slot(target, table, 1, claim=True)
        slot = mem_at(R.RDI, table.value_at)
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RCX, self.temp(0)))
        if op in ("+=", "-="):
            if op == "-=":
                asm.add(iced.Instruction.create_reg(C.NEG_RM64, R.RCX))
            add = iced.Instruction.create_mem_reg(C.ADD_RM64_R64, slot, R.RCX)
            add.has_lock_prefix = not table.one_writer
            asm.add(add)
        else:  # (`*=` and the like read, then write: as racy as bpftrace's own)
            if op != "=":
                asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, slot))
                self.operate(op[:-1], signed=True)
                asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RCX, R.RAX))
            asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, slot, R.RCX))
        self.found(table)

    def named_word(self, kind: str) -> None:
        """rax = the word the tracer names `comm` (the thread: pid << 32 | tid), `func` or
        `probe` (the probe's index, plus 1) by: never 0, which names nothing (a value zero() set)."""
        asm = self.asm
        if kind == "comm":
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, gs_at(L.TGID)))
            asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RAX, 32))
            asm.add(iced.Instruction.create_reg_mem(C.OR_R64_RM64, R.RAX, gs_at(L.TID)))
        else:
            self.constant(self.probe_index + 1)

    def assign_named(self, target: S.MapRef, kind: str) -> None:
        """`@m[keys] = comm` (or func, probe): the word the tracer names into the entry's value."""
        table = self.body.tables[target.name]
        self.find_slot(target, table, 0, claim=True)
        self.named_word(kind)
        self.asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, mem_at(R.RDI, table.value_at), R.RAX))
        self.found(table)

    def assign_string(self, target: S.MapRef, call: S.Call) -> None:
        """`@m[keys] = str(ptr[, n])`: the string read into the temporaries (as a key's), then
        its words into the entry's value (a plain copy: a read meanwhile may see part of it)."""
        asm = self.asm
        table = self.body.tables[target.name]
        self.string_key(call, 0)
        self.find_slot(target, table, STRING_WORDS, claim=True)
        for word in range(STRING_WORDS):
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, self.temp(word)))
            asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, mem_at(R.RDI, table.value_at + 8 * word), R.RAX))
        self.found(table)

    def step(self, op: str, target: S.Var | S.MapRef, *, prefix: bool, depth: int) -> None:
        """rax = the value before (`x++`) or after (`++x`) the step."""
        asm = self.asm
        delta = 1 if op == "++" else -1
        if isinstance(target, S.Var):
            at = gs_at(self.variable(target.name))
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, at))
            asm.add(iced.Instruction.create_reg(C.INC_RM64 if op == "++" else C.DEC_RM64, R.RAX))
            asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, at, R.RAX))
        else:
            table = self.body.tables[target.name]
            self.find_slot(target, table, depth, claim=True)
            asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, delta & L_MASK64))
            xadd = iced.Instruction.create_mem_reg(C.XADD_RM64_R64, mem_at(R.RDI, table.value_at), R.RAX)
            xadd.has_lock_prefix = not table.one_writer
            asm.add(xadd)
            asm.add(iced.Instruction.create_reg_i32(C.ADD_RM64_IMM8, R.RAX, delta))  # (the new value)
            self.found(table)
        if not prefix:
            asm.add(iced.Instruction.create_reg_i32(C.ADD_RM64_IMM8, R.RAX, -delta))

    def aggregate(self, target: S.MapRef, call: S.Call) -> None:
        """`@m[keys] = count()` and the other aggregations: the entry's value words updated
        atomically (min and max: compare and exchange until no other thread came between), or,
        in a map keyed by the thread (`one_writer`), by plain instructions."""
        asm = self.asm
        table = self.body.tables[target.name]
        if call.args:
            self.expression(call.args[0], 0)
            asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, self.temp(0), R.RAX))
        self.find_slot(target, table, 1, claim=True)
        value = mem_at(R.RDI, table.value_at)
        if call.args:
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RCX, self.temp(0)))
        name = call.name
        if name in ("count", "sum", "avg", "stats"):
            if name == "count":
                asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.ECX, 1))
            elif name in ("avg", "stats"):
                inc = iced.Instruction.create_mem(C.INC_RM64, value)
                inc.has_lock_prefix = not table.one_writer
                asm.add(inc)
                value = mem_at(R.RDI, table.value_at + 8)
            add = iced.Instruction.create_mem_reg(C.ADD_RM64_R64, value, R.RCX)
            add.has_lock_prefix = not table.one_writer
            asm.add(add)
        elif name in ("min", "max"):
            again, kept = asm.label(), asm.label()
            asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, value))
            asm.bind(again)
            asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RCX, R.RAX))
            asm.jump(C.JGE_REL32_64 if name == "min" else C.JLE_REL32_64, kept)
            exchange = iced.Instruction.create_mem_reg(C.CMPXCHG_RM64_R64, value, R.RCX)
            exchange.has_lock_prefix = not table.one_writer
            asm.add(exchange)  # (rax: what the word held, if another thread changed it)
            asm.jump(C.JNE_REL32_64, again)
            asm.bind(kept)
        else:
            self.bucket(name, table)
            inc = iced.Instruction.create_mem(C.INC_RM64, iced.MemoryOperand(R.RDI, R.RAX, 8, displ=table.value_at))
            inc.has_lock_prefix = not table.one_writer
            asm.add(inc)
        self.found(table)

    def bucket(self, name: str, table: MapTable) -> None:
        """rax = the word of the value in rcx in a hist (bucket + 1: negative, 0, 1, [2, 4)...) or
        an lhist (below min, each step, max and above)."""
        asm = self.asm
        after = asm.label()
        if name == "hist":
            positive = asm.label()
            asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.EAX, R.EAX))
            asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RCX, R.RCX))
            asm.jump(C.JS_REL32_64, after)  # negative: 0
            asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.EAX, 1))
            asm.jump(C.JNE_REL32_64, positive)
            asm.jump(C.JMP_REL32_64, after)  # zero: 1
            asm.bind(positive)
            asm.add(iced.Instruction.create_reg_reg(C.BSR_R64_RM64, R.RAX, R.RCX))
            asm.add(iced.Instruction.create_reg_i32(C.ADD_RM64_IMM8, R.RAX, 2))
        else:
            low, high, step = table.lhist
            below, above = asm.label(), asm.label()
            asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, low & L_MASK64))
            asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RCX, R.RAX))
            asm.jump(C.JL_REL32_64, below)
            asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, high & L_MASK64))
            asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RCX, R.RAX))
            asm.jump(C.JGE_REL32_64, above)
            asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, R.RCX))
            asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RCX, low & L_MASK64))
            asm.add(iced.Instruction.create_reg_reg(C.SUB_R64_RM64, R.RAX, R.RCX))
            asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RCX, step))
            asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.EDX, R.EDX))
            asm.add(iced.Instruction.create_reg(C.DIV_RM64, R.RCX))
            asm.add(iced.Instruction.create_reg(C.INC_RM64, R.RAX))
            asm.jump(C.JMP_REL32_64, after)
            asm.bind(below)
            asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.EAX, R.EAX))
            asm.jump(C.JMP_REL32_64, after)
            asm.bind(above)
            asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.EAX, table.value_words - 1))
        asm.bind(after)

    def map_read(self, ref: S.MapRef, depth: int) -> None:
        """rax = the entry's value (an integer's: an aggregation's is only printed), 0 if it has none."""
        asm = self.asm
        table = self.body.tables[ref.name]
        absent, after = asm.label(), asm.label()
        # (a deleted entry's value is back at 0, as is one whose keys are being written)
        self.find_slot(ref, table, depth, claim=False, absent=absent)
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, mem_at(R.RDI, table.value_at)))
        asm.jump(C.JMP_REL32_64, after)
        asm.bind(absent)
        asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.EAX, R.EAX))
        asm.bind(after)

    def delete(self, ref: S.MapRef) -> None:
        """The entry hidden (its ready word cleared) and its value words back to their start: the
        next update of its keys starts it afresh."""
        asm = self.asm
        table = self.body.tables[ref.name]
        absent = asm.label()
        self.find_slot(ref, table, 0, claim=False, absent=absent)
        asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, mem_at(R.RDI, SLOT_READY), 0))
        asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, table.initial))
        for word in range(table.value_words):
            asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, mem_at(R.RDI, table.value_at + 8 * word), R.RAX))
        asm.bind(absent)

    def clear(self, table: MapTable, *, keep_keys: bool) -> None:
        """`clear(@m)`: every entry hidden and its value words back to their start; `zero(@m)`:
        the value words alone (as the tracer's MapTable.clear)."""
        asm = self.asm
        next_slot, next_word = asm.label(), asm.label()
        asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RDI, self.body.region + table.offset))
        asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.R11D, table.slots))
        asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, table.initial))
        asm.bind(next_slot)
        if not keep_keys:
            asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, mem_at(R.RDI, SLOT_READY), 0))
        asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.RDX, mem_at(R.RDI, table.value_at)))
        asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.ECX, table.value_words))
        asm.bind(next_word)
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, mem_at(R.RDX), R.RAX))
        asm.add(iced.Instruction.create_reg_i32(C.ADD_RM64_IMM8, R.RDX, 8))
        asm.add(iced.Instruction.create_reg(C.DEC_RM32, R.ECX))
        asm.jump(C.JNE_REL32_64, next_word)
        asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RDI, R.RDX))  # (the next slot: values end a slot)
        asm.add(iced.Instruction.create_reg(C.DEC_RM32, R.R11D))
        asm.jump(C.JNE_REL32_64, next_slot)

    def string_key(self, call: S.Call, word: int) -> None:
        """The string `str(ptr[, n])` reads, in the temporaries from `word` on: its bytes up to
        the NUL (at most n, and what its type holds less the NUL), the rest zeros; unreadable: what
        was read (nothing: an empty string, as bpftrace's)."""
        asm = self.asm
        chars = self.body.checked.type_of(call).size - 1
        if not self.string_address(call, word, chars=chars):
            asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.ECX, chars))
        for i in range(STRING_WORDS):
            asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, self.temp(word + i), 0))
        loop, done = asm.label(), asm.label()
        asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.EDI, R.EDI))
        asm.bind(loop)
        asm.add(iced.Instruction.create_reg_reg(C.CMP_R32_RM32, R.EDI, R.ECX))
        asm.jump(C.JAE_REL32_64, done)
        asm.add(iced.Instruction.create_reg_mem(C.MOVZX_R32_RM8, R.EDX, mem_at(R.RAX, 0, R.RDI)), done)
        asm.add(iced.Instruction.create_reg_reg(C.TEST_RM32_R32, R.EDX, R.EDX))
        asm.jump(C.JE_REL32_64, done)
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM8_R8, gs_at(L.LANG_TEMPS + 8 * word, R.RDI), R.DL))
        asm.add(iced.Instruction.create_reg(C.INC_RM32, R.EDI))
        asm.jump(C.JMP_REL32_64, loop)
        asm.bind(done)

    def string_address(self, call: S.Call, depth: int, *, chars: int) -> bool:
        """rax = the address `str(ptr[, n])` reads; True when its length is worked out here (n
        not a literal): then ecx = n, unsigned, at most `chars` (temporaries from `depth` on)."""
        asm = self.asm
        if len(call.args) < 2 or isinstance(call.args[1], S.Int):
            self.expression(call.args[0], depth)
            return False
        self.expression(call.args[1], depth)
        clamped = asm.label()
        asm.add(iced.Instruction.create_reg_i32(C.CMP_RM64_IMM32, R.RAX, chars))
        asm.jump(C.JBE_REL32_64, clamped)
        asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.EAX, chars))
        asm.bind(clamped)
        asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, self.temp(depth), R.RAX))
        self.expression(call.args[0], depth + 1)
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R32_RM32, R.ECX, self.temp(depth)))
        return True

    def found(self, table: MapTable) -> None:
        """After an update of the entry at rdi: it exists (again, after a delete)."""
        self.asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, mem_at(R.RDI, SLOT_READY), 1))

    def find_slot(self, ref: S.MapRef, table: MapTable, depth: int, *, claim: bool, absent: int | None = None) -> None:
        """rdi = the slot of `ref`'s keys (worked out into temporaries from `depth` on): found by
        its hash from the hash's home on, or (`claim`) a free one claimed and its keys written.
        None within PROBES slots: to `absent`, or (`claim`) the update counted as dropped and
        pointed at the table's sink, a slot past its last that nothing reads."""
        asm = self.asm
        word = depth
        for key, kind in zip(ref.keys, table.key_kinds, strict=True):
            if kind == "string":  # (lang/target.py lets only a str() be one)
                assert isinstance(key, S.Call)
                self.string_key(key, word)
                word += STRING_WORDS
            else:
                if kind in STACK_KINDS.values():  # (the hit's stack, counted by the probe before the body: its slot)
                    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, gs_at(L.STACK_SLOT)))
                elif kind in TRACER_NAMES:
                    self.named_word(kind)
                else:
                    self.expression(key, word)
                asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, self.temp(word), R.RAX))
                word += 1
        # rdx = the hash (lang/maps.py's key_hash)
        asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RDX, HASH_SEED))
        asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RCX, HASH_MULTIPLIER))
        for i in range(table.keys):
            asm.add(iced.Instruction.create_reg_mem(C.XOR_R64_RM64, R.RDX, self.temp(depth + i)))
            asm.add(iced.Instruction.create_reg_reg(C.IMUL_R64_RM64, R.RDX, R.RCX))
            asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.RAX, R.RDX))
            asm.add(iced.Instruction.create_reg_i32(C.SHR_RM64_IMM8, R.RAX, 32))
            asm.add(iced.Instruction.create_reg_reg(C.XOR_R64_RM64, R.RDX, R.RAX))
        asm.add(iced.Instruction.create_reg_i32(C.OR_RM64_IMM8, R.RDX, 1))
        # r11 = the slot's index (from the hash's home), rcx = slots left to look at
        asm.add(iced.Instruction.create_reg_reg(C.MOV_R64_RM64, R.R11, R.RDX))
        asm.add(iced.Instruction.create_reg_i32(C.SHR_RM64_IMM8, R.R11, 1))
        asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.ECX, min(PROBES, table.slots)))
        again, found, next_slot, claimed, done = (asm.label() for _ in range(5))
        asm.bind(again)
        asm.add(iced.Instruction.create_reg_i32(C.AND_RM64_IMM32, R.R11, table.slots - 1))
        asm.add(iced.Instruction.create_reg_reg_i32(C.IMUL_R64_RM64_IMM32, R.RDI, R.R11, table.slot_bytes))
        asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, self.body.region + table.offset))
        asm.add(iced.Instruction.create_reg_reg(C.ADD_R64_RM64, R.RDI, R.RAX))
        asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, mem_at(R.RDI)))
        asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RAX, R.RDX))
        asm.jump(C.JE_REL32_64, found)
        asm.add(iced.Instruction.create_reg_reg(C.TEST_RM64_R64, R.RAX, R.RAX))
        if claim:
            asm.jump(C.JNE_REL32_64, next_slot)
            exchange = iced.Instruction.create_mem_reg(C.CMPXCHG_RM64_R64, mem_at(R.RDI), R.RDX)
            exchange.has_lock_prefix = True
            asm.add(exchange)  # (rax 0: claimed if still free; else rax = the hash another thread put)
            asm.jump(C.JE_REL32_64, claimed)
            asm.add(iced.Instruction.create_reg_reg(C.CMP_R64_RM64, R.RAX, R.RDX))
            asm.jump(C.JE_REL32_64, found)
        else:
            assert absent is not None
            asm.jump(C.JE_REL32_64, absent)
        asm.bind(next_slot)
        asm.add(iced.Instruction.create_reg(C.INC_RM64, R.R11))
        asm.add(iced.Instruction.create_reg(C.DEC_RM32, R.ECX))
        asm.jump(C.JNE_REL32_64, again)
        if claim:
            counter = iced.Instruction.create_mem(C.INC_RM64, mem_at(R.RAX))
            counter.has_lock_prefix = True
            asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, self.body.region + table.dropped_at))
            asm.add(counter)
            asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RDI, self.body.region + table.sink))
            asm.jump(C.JMP_REL32_64, done)
            asm.bind(claimed)
            for i in range(table.keys):
                asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, self.temp(depth + i)))
                asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, mem_at(R.RDI, 16 + 8 * i), R.RAX))
        else:
            assert absent is not None
            asm.jump(C.JMP_REL32_64, absent)
        asm.bind(found)
        asm.bind(done)


_UPDATES = ("count", "sum", "min", "max", "avg", "stats", "hist", "lhist")
