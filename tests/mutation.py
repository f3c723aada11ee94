"""Mutation testing of dynprobe's pure core (`make mutate`): does a test fail when the code is
wrong? Each module is mutated one change at a time (a comparison flipped, an arithmetic or
bitwise operator swapped, an integer constant +-1, a boolean negated, a statement deleted) and
its unit tests are run against each mutant; a mutant no test fails on "survived".

    python -m tests.mutation [--module SUBSTRING ...] [--jobs N] [--list] [--survivors]

Our own AST mutator rather than mutmut or cosmic-ray: the pure modules are mostly module-level
constants and tables (ringbuf/layout.py), which mutmut 3's per-function trampolines do not
mutate, and a run must fit in minutes, which a process started per mutant does not. Each
worker keeps a copy of the package with compiled bytecode; a mutant is written into it and the
tests run in a child forked from a worker that has already imported pytest and the heavy
dependencies, so a mutant costs its tests, not an interpreter start.
"""

from __future__ import annotations

import argparse
import ast
import compileall
import functools
import gc
import importlib
import json
import multiprocessing
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "dynprobe"
UNIT = ROOT / "tests" / "unit"

# module (under src/dynprobe) -> the unit test files that exercise it
MODULES: dict[str, tuple[str, ...]] = {
    "spec/fetch.py": ("test_fetch.py", "test_parser.py"),
    "spec/model.py": ("test_parser.py", "test_fetch.py", "test_filter.py"),
    "spec/parser.py": ("test_parser.py", "test_fetch.py", "test_filter.py", "test_public_api.py"),
    "spec/argspec.py": ("test_argspec.py",),
    "actions/filter.py": ("test_filter.py", "test_codegen.py"),
    "actions/model.py": ("test_filter.py", "test_codegen.py", "test_native_returns.py"),
    "arch/x86_64/relocate.py": ("test_arch_tables.py", "test_optimize_tables.py", "test_relocation_edges.py"),
    "arch/x86_64/optimize.py": (
        "test_optimize_tables.py",
        "test_jumptables.py",
        "test_relocation_edges.py",
        "test_codegen.py",
    ),
    "arch/x86_64/jumptables.py": ("test_jumptables.py",),
    "arch/x86_64/emulate.py": ("test_emulate.py", "test_arch_tables.py", "test_properties.py"),
    **dict.fromkeys(
        (
            f"arch/x86_64/codegen/{name}.py"
            for name in ("asm", "records", "actions", "detours", "returns", "ftrace", "clock")
        ),
        (
            "test_codegen.py",
            "test_native_returns.py",
            "test_native_tracer.py",
            "test_returns_code.py",
            "test_callgraph.py",
        ),
    ),
    "arch/x86_64/codegen/stacks.py": ("test_native_stacks.py",),
    "arch/x86_64/codegen/lang.py": ("test_lang_code.py", "test_layout.py"),
    "lang/tracer.py": ("test_lang_target.py", "test_lang_code.py"),
    "arch/x86_64/unwind.py": ("test_unwind.py", "test_unwind_cfi.py", "test_native_stacks.py"),
    "ringbuf/layout.py": (
        "test_layout.py",
        "test_consumer.py",
        "test_codegen.py",
        "test_returns_code.py",
        "test_rescue_handler.py",
        "test_guardian_journal.py",
    ),
}

# Survivors no test can kill, because the mutant means the same: (module, the mutated line as
# written, the change) -> why.
_TUNABLE = "a tunable: any value in its range is as correct"
_FLAG_BIT = "a flag: any one bit does, and no other flag shares its word"
EQUIVALENT: dict[tuple[str, str, str], str] = {
    **{
        ("lang/tracer.py", line, "0 -> -1"): "the maps a tracer's body assigns, counts, sums, minimizes or steps "
        "hold one word: its first is its last"
        for line in (
            'words[0] = new if op == "=" else operate(op[:-1], words[0], new, signed=False)',
            "words[0] = (words[0] + value) & MASK64",
            "words[0] = min(value, words[0], key=as_signed)",
            "words[0] = max(value, words[0], key=as_signed)",
            "old = words[0]",
            "words[0] = new = (old + delta) & MASK64",
        )
    },
    **{
        ("lang/tracer.py", line, "False -> True"): "only comparisons look at `signed`; no compound assignment is one"
        for line in (
            'words[0] = new if op == "=" else operate(op[:-1], words[0], new, signed=False)',
            "new = operate(op[:-1], self.integer(target), new, signed=False)",
        )
    },
    ("lang/tracer.py", "raise AssertionError(expr)  # (check_tracer_block refuses the rest)",
     "delete `raise AssertionError(expr)`"): "unreachable: lang/target.py refuses these programs first",
    ("arch/x86_64/relocate.py",
     "elif branch.len < 5 or not (branch.is_jmp_near or branch.is_jcc_near or branch.is_call_near):", "5 -> 4"): (
        "no near jmp, jcc or call is 4 bytes long in 64-bit code"
    ),
    **{
        ("ringbuf/layout.py", line, change): _TUNABLE
        for line, changes in {
            "DEFAULT_RING_BYTES = 1 << 20": ("1 -> 2", "20 -> 21", "20 -> 19"),
            "MAX_RING_BYTES = 1 << 30": ("1 -> 2", "30 -> 31", "30 -> 29"),
            "MIN_RING_BYTES = 1 << 12": ("1 -> 2", "12 -> 13"),
            "MAX_RECORD_SIZE = 1 << 12": ("12 -> 11",),
            "STRING_CAPACITY = 64": ("64 -> 63", "64 -> 65"),
            "MARGIN_NS = 1_000_000_000  # a record's time stamp is at most this far outside its session": (
                "1000000000 -> 1000000001", "1000000000 -> 999999999",
            ),
            "max_probes: int = 16384  # the record's probe index is a u16": ("16384 -> 16385", "16384 -> 16383"),
            "max_hists: int = 512": ("512 -> 513", "512 -> 511"),
            "RESCUE_CAPACITY = 1 << 15  # entries per half": ("1 -> 2", "15 -> 16", "15 -> 14"),
            "LANG_TEMPS_WORDS = 64  # (so an expression nests 64 deep at most, a map's keys with it)": ("64 -> 63",),
            "LANG_VARS_WORDS = 64": ("64 -> 65", "64 -> 63"),
        }.items()
        for change in changes
    },
    **{
        ("ringbuf/layout.py", line, "1 -> 2"): _FLAG_BIT
        for line in (
            "STRING_TRUNCATED = 1",
            "ENTRY_RESTORED = 1  # flag: the tracer put the original return address back while the unwinder ran",
            "RESCUE_WAIT = 1  # flag: wait for the guardian first (an unwinder's entry: pending returns go back)",
        )
    },
    ("actions/model.py", "return self.size > 0", "0 -> 1"): "a field's size is 0, 8 or 68",
    **{
        ("actions/model.py", "hist_index: int = 0", change): "only a histogram program reads it, and each is given one"
        for change in ("0 -> 1", "0 -> -1")
    },
    ("spec/argspec.py", 'number = struct.unpack("<f" if bits == 32 else "<d", value.to_bytes(bits // 8, "little"))[0]',
     "0 -> -1"): "struct.unpack of one value: [0] and [-1] are the same",
    ("actions/filter.py", "pos = 0", "0 -> -1"): "re's match() takes a negative position as 0",
    ("actions/filter.py", "while pos < len(text):", "< -> <="): "at the end no token matches: the same break",
    **{
        ("actions/filter.py", 'arg = parse_fetch_arg(text, 0, 1, text, "p")', change): (
            "the column and index of a fetch written in place: its errors become the filter's own, its name its text"
        )
        for change in ("0 -> 1", "0 -> -1", "1 -> 2", "1 -> 0")
    },
    ("arch/x86_64/emulate.py", "return lambda regs, read: emulate(insn, regs, read, checked=True)", "True -> False"): (
        "`checked` only skips a test `prepare` has already passed"
    ),
    ("arch/x86_64/emulate.py", "if m == _M.RET and insn.code == iced.Code.RETNQ:", "== -> !="): (
        "prepare's fast path for `ret`: without it the general path gives the same result"
    ),
    ("arch/x86_64/emulate.py", "if insn.flow_control == _FC.CONDITIONAL_BRANCH and insn.is_jcc_short_or_near:",
     "and -> or"): "every conditional branch that is no jcc is a counter branch, emulated the line after",
    **{
        ("arch/x86_64/emulate.py", line, "64 -> 65"): "a 65-bit mask keeps the same 64 bits of a 64-bit register"
        for line in (
            "_C.LOOPE_REL8_64_RCX: (64, True, True), _C.LOOPE_REL8_64_ECX: (32, True, True),",
            "_C.LOOPNE_REL8_64_RCX: (64, True, False), _C.LOOPNE_REL8_64_ECX: (32, True, False),",
            "_C.JRCXZ_REL8_64: (64, False, None), _C.JECXZ_REL8_64: (32, False, None),",
            "_C.LOOP_REL8_64_RCX: (64, True, None), _C.LOOP_REL8_64_ECX: (32, True, None),",
        )
    },
    ("spec/parser.py", "reg = canonical_name(body[1:])", "1 -> 0"): "canonical_name takes a leading '%' off itself",
    ("arch/x86_64/unwind.py", "if union and start <= union[-1][1]:", "<= -> <"): (
        "ranges that only touch, kept apart, meet what they met together"
    ),
    ("arch/x86_64/jumptables.py", "elif insn.mnemonic == iced.Mnemonic.ADD and kinds == (iced.OpKind.REGISTER, "
     "iced.OpKind.REGISTER):", "and -> or"): (
        "an add of anything else, or another instruction of two registers, finds no table: UNBOUNDED either way"
    ),
    **{
        ("arch/x86_64/jumptables.py", "while prev >= 0 and self.insns[prev].mnemonic in (iced.Mnemonic.NOP, "
         "iced.Mnemonic.INT3):", change): (
            "nops from the entry on run into what follows them whether or not the first is looked at (and a "
            "negative index reads the function's end, padding or a jump: it stops there)"
        )
        for change in (">= -> >", "0 -> 1", "0 -> -1")
    },
    **{
        ("arch/x86_64/jumptables.py", line, change): why
        for line, changes, why in (
            ("MERGES, MERGE_WAYS = 3, 8  # places where branches meet walked through (each up to this many "
             "branches)", ("3 -> 4", "3 -> 2", "8 -> 9", "8 -> 7"), _TUNABLE),
            ("if 1 < len(sources) <= MERGE_WAYS:", ("< -> <=", "1 -> 0"),
             "one source is followed before, none is not a merge either way"),
            ("if 1 < len(sources) <= MERGE_WAYS:", ("<= -> <",), _TUNABLE),
        )
        for change in changes
    },
    **{
        ("arch/x86_64/jumptables.py", "table = (table + movsxd.memory_displacement) & ((1 << 64) - 1)", change): (
            "a table's address is below 2^47 and even: a 63-bit mask, or one without bit 0, keeps it"
        )
        for change in ("1 -> 2", "64 -> 63")
    },
    ("spec/parser.py", "if m.group(2):", "2 -> 3"): "the sign (group 2) and the offset (group 3) come together",
    ("spec/parser.py", 'if eq >= 0 and (word.find("(") < 0 or eq < word.find("(")):', "< -> <="): (
        "'=' and '(' are never at the same index"
    ),
    ("spec/parser.py", 'head = stripped.split(None, 1)[0] if stripped else ""', "1 -> 2"): (
        "the first piece of a split is the same whatever the most splits"
    ),
    ("spec/parser.py", 'kind = head.split(":", 1)[0]', "1 -> 2"): (
        "the first piece of a split is the same whatever the most splits"
    ),
    **{
        ("arch/x86_64/codegen/lang.py", line, change): (
            "where a body's temporaries begin: any free words of the thread area serve (the words below LANG_TEMPS "
            "are free, and lang/target.py keeps the nesting 16 words short of the end)"
        )
        for line, changes in {
            "self.expression(self.body.block.predicate, 0)": ("0 -> 1", "0 -> -1"),
            "self.expression(condition, 0)": ("0 -> 1", "0 -> -1"),
            "self.expression(expr, 0)": ("0 -> 1", "0 -> -1"),
            "self.expression(value, 0)": ("0 -> 1", "0 -> -1"),
            "self.expression(call.args[0], 0)": ("0 -> 1", "0 -> -1"),
            "dynamic = self.string_address(expr, 0, chars=arg.chars)": ("0 -> 1", "0 -> -1"),
            "self.expression(call.args[0], depth + 1)": ("1 -> 2",),
            "self.find_slot(target, table, 1, claim=True)": ("1 -> 2",),
            "self.find_slot(ref, table, 0, claim=False, absent=absent)": ("0 -> 1", "0 -> -1"),
            "self.find_slot(expr, self.body.tables[expr.name], 0, claim=False, absent=absent)": ("0 -> 1", "0 -> -1"),
            "self.find_slot(target, table, 0, claim=True)": ("0 -> 1", "0 -> -1"),
        }.items()
        for change in changes
    },
    **{
        ("arch/x86_64/codegen/lang.py", line, "8 -> 9"): "9-byte strides: the words still do not overlap (x86 "
        "loads and stores unaligned words the same)"
        for line in (
            "return gs_at(L.LANG_TEMPS + 8 * depth)",
            "return L.LANG_VARS + 8 * self.variables.setdefault(name, len(self.variables))",
        )
    },
    **{
        ("arch/x86_64/codegen/lang.py", f"raise AssertionError({what})", "delete `raise AssertionError"
         f"({what})`"): "unreachable: lang/target.py refuses these programs before any code is made"
        for what in ("statement", "expr", "name")
    },
    ("arch/x86_64/codegen/lang.py", "self.load(64, True)", "True -> False"): "a 64-bit load has no sign to extend",
    **{
        ("arch/x86_64/codegen/lang.py",
         "inc = iced.Instruction.create_mem(C.INC_RM64, iced.MemoryOperand(R.RDI, R.RAX, 8, displ=table.value_at))",
         change): "iced encodes a scale of 7 or 9 as 8: the same bytes"
        for change in ("8 -> 7", "8 -> 9")
    },
    **{
        ("arch/x86_64/codegen/lang.py", "self.operate(op[:-1], signed=True)", change): (
            "only comparisons look at `signed`; no compound assignment is one"
        )
        for change in ("True -> False",)
    },
    ("arch/x86_64/codegen/lang.py", "asm.jump(C.JE_REL32_64, absent)", "delete `asm.jump(C.JE_REL32_64, absent)`"): (
        "a free slot ends a lookup early; without it the lookup ends with the same answer past PROBES slots"
    ),
    ("ringbuf/layout.py", "return (n + PAGE - 1) & ~(PAGE - 1)", "1 -> 2"): (
        "rounds every size the layout passes (multiples of 16) to the same page"
    ),
    **{
        (module, line, change): why
        for module in MODULES
        if module.startswith("arch/x86_64/codegen/")
        for why, lines in {
            "label numbers: any distinct ones do": {
                "labels: int = 0": ("0 -> 1", "0 -> -1"), "self.labels += 1": ("+ -> -", "1 -> 2"),
            },
            "iced encodes any scale but 1, 2 and 4 as 8": {
                "asm.add(iced.Instruction.create_mem(C.INC_RM64, gs_at(self.layout.hist(prog.hist_index), index=R.RAX, "
                "scale=8)))": ("8 -> 9", "8 -> 7"),
            },
            "adds a zero (RECORD_PROBE, ENTRY_SLOT: the first field)": {
                line: ("+ -> -",) for line in (
                    "header = gs_at(ring + L.RECORD_PROBE, R.RSI)",
                    "asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, gs_at(shadow + L.ENTRY_SLOT, "
                    "R.RSI)))",
                    "asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, gs_at(shadow + L.ENTRY_SLOT, R.RSI), "
                    "R.RCX))",
                    "asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(shadow + L.ENTRY_SLOT, R.RSI), "
                    "0))",
                    "asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, gs_at(shadow + L.ENTRY_SLOT, R.RDX), 0))",
                    "asm.add(iced.Instruction.create_mem_u32(C.MOV_RM16_IMM16, gs_at(ring + L.RECORD_PROBE, slot), "
                    "ops_index))",
                    "asm.add(iced.Instruction.create_mem_u32(C.MOV_RM16_IMM16, gs_at(ring + L.RECORD_PROBE, R.RDX), "
                    "ops_index))",
                )
            },
            "position-independent code: the address it is encoded at changes nothing": {
                "code, _ = asm.encode(0)": ("0 -> 1",), "return asm.encode(0)[0]": ("0 -> 1",),
            },
            "the first pass only measures: the exit's address is an imm64 whatever its value": {
                "_, first, _ = assemble(0)": ("0 -> 1",),
            },
            "a placeholder: any disp32 no counter has": {
                "_PLACEHOLDER = 0x7FFF_FFF0  # a displacement to patch (disp32 whatever the value it becomes)": (
                    "2147483632 -> 2147483633", "2147483632 -> 2147483631",
                ),
            },
            "as many placeholders as programs, always": {
                "for at, prog in zip(offsets, programs, strict=True):": ("True -> False",),
            },
            "the code after it never runs: a register load cannot fault": {
                "continue  # a register: nothing to fault": ("delete `continue`",),
            },
            "an emitter of a return's code has one program; at an entry no fetch reads it ($latency is refused)": {
                "self.in_record = False": ("delete `self.in_record = False`", "False -> True"),
            },
            "unused at an entry: $latency is refused there": {
                "returning = Returning(trampoline.points, 0, at_return=False) if trampoline is not None else None": (
                    "0 -> 1", "0 -> -1",
                ),
            },
            "unused at a return: %ip there is the caller": {
                "emitter = Emitter(asm, layout, 0, 0, False, symbol_address, returning, rseq_offset_at)": (
                    "0 -> 1", "0 -> -1",
                ),
            },
            "any word of the entry no other field uses": {
                "held = L.ENTRY_DATA + 8  # in a shadow entry: the sequence number of its held-back entry record": (
                    "+ -> -", "8 -> 9", "8 -> 7",
                ),
            },
            "any number past every record says none is held back": {
                "asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(shadow + held, R.RSI), -1))": (
                    "1 -> 2",
                ),
            },
            "the piece's first byte is always written over (the NUL at least)": {
                "asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(ring + L.RECORD_TSC, R.RDX), 0))": (
                    "0 -> 1",
                ),
            },
            "any value but 0 says busy": {
                line: ("1 -> 2",) for line in (
                    "asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.SHADOW_BUSY), 1))",
                    "asm.add(iced.Instruction.create_mem_i32(C.MOV_RM64_IMM32, gs_at(L.BUSY), 1))",
                )
            },
            "rax holds the entry point shadow_push just wrote there (or, with none written, no entry point)": {
                "asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RAX, mem_at(R.RSP, slot_at)))": (
                    "delete `asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.RA`",
                ),
            },
            "a hint to the CPU (a spinning thread's pause): the wait does the same without it": {
                "asm.add(iced.Instruction.create(C.PAUSE))": ("delete `asm.add(iced.Instruction.create(C.PAUSE))`",),
            },
            "TSC_AUX's node bits are 0 on a machine of one NUMA node (this one): the mask changes nothing here": {
                "asm.add(iced.Instruction.create_reg_i32(C.AND_RM32_IMM32, R.ECX, TSC_AUX_CPU))": (
                    "delete `asm.add(iced.Instruction.create_reg_i32(C.AND_RM32_IMM32, R.`",
                ),
            },
        }.items()
        for line, changes in lines.items()
        for change in changes
    },
    **{
        ("arch/x86_64/codegen/stacks.py", line, change): why
        for why, lines in {
            _TUNABLE: {
                "BLOCK_SHIFT = 8": ("8 -> 9", "8 -> 7"),  # (core/stackmaps' bounds are made with the same)
                "MAX_MODULES = 256": ("256 -> 257", "256 -> 255"),
                "MAX_ROWS = 1 << 24": ("1 -> 2", "24 -> 25", "24 -> 23"),
                "MAX_STACK_FRAMES = 127  # as bpftrace's ustack": ("127 -> 128", "127 -> 126"),
                "TABLE_PROBES = 32  # slots looked at for a stack, from its hash's (open addressing)": (
                    "32 -> 33", "32 -> 31",
                ),
                "HASH_MULTIPLIER = 0x9E3779B97F4A7C15  # (Fibonacci hashing's: a table's slot is the hash's "
                "top bits)": (
                    "11400714819323198485 -> 11400714819323198486", "11400714819323198485 -> 11400714819323198484",
                ),
            },
            _FLAG_BIT: {
                "SLOT_READY = 1 << 32": ("1 -> 2", "32 -> 33"),
                "CUT = 1 << 63": ("63 -> 62",),
                "AT_ENTRY = 1 << 62  # in r8 with the frames: the first frame is a function's first instruction": (
                    "1 -> 2", "62 -> 63", "62 -> 61",
                ),
            },
            "the module's tag anywhere from bit 47 to 55: above user-space addresses, 9 bits within the word": {
                "MODULE_SHIFT = 48  # (user-space addresses are below 2^47)": ("48 -> 49", "48 -> 47"),
            },
            "range(0, 63, 8) is the same eight offsets": {
                "DIR_START, DIR_SIZE, DIR_BASE, DIR_IPS, DIR_ROWS, DIR_ROW_COUNT, DIR_BLOCKS, DIR_BLOCK_COUNT = "
                "range(0, 64, 8)": ("64 -> 63",),
            },
            "iced encodes any scale but 1, 2 and 4 as 8": {
                "asm.add(_mov(iced.MemoryOperand(R.RDI, R.R13, 8), R.RBX), fault=cut)": ("8 -> 9", "8 -> 7"),
                "asm.add(_mov(R.RAX, iced.MemoryOperand(R.R15, R.RBX, 8, -8)), fault=cut)  # the row": (
                    "8 -> 9", "8 -> 7",
                ),
            },
            "rbx is the offset >> 32, which the branch before found 0": {
                "asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.EBX, R.EBX))  # rbx: low, rdx: high": (
                    "delete `asm.add(iced.Instruction.create_reg_reg(C.XOR_R32_RM32, R.EB`",
                ),
            },
            "the rbp offset of a row whose rbp is the same is never read": {
                "asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.RAX, pack(Row(Kind.CFA, RSP, 8, "
                "BpRule.SAME, 0))))": ("0 -> 1", "0 -> -1"),
            },
            "for 2 slots or more, slots & (slots - 2) is 0 for the powers of two alone": {
                'assert slots >= 2 and not slots & (slots - 1), "a power of two, 2 or more"': ("1 -> 2",),
            },
        }.items()
        for line, changes in lines.items()
        for change in changes
    },
    **{
        ("arch/x86_64/unwind.py", line, change): why
        for why, lines in {
            "a kind's number: any distinct one in 3 bits does (the walker and the tables name them)": {
                "NONE = 0  # nothing known (no rule dynprobe follows): frame pointers are tried": ("0 -> -1",),
                "PLT = 4  # a PLT stub: CFA = rsp + offset, 8 more once (rip & 15) >= the threshold (the push)": (
                    "4 -> 5",
                ),
            },
            "a uleb's shift goes by 7: none lies between 63 and 64": {"if at >= end or shift > 63:": ("63 -> 64",)},
            "a NUL found is past the CIE's first byte: never at index 0": {"if end < 0:": ("< -> <=", "0 -> 1")},
            "a pointer only stepped over: its value is never used": {"return 0": ("0 -> 1", "0 -> -1")},
            "the offset of a rule that has none: any value, the same in every comparison": {
                "offset: int = 0": ("0 -> 1", "0 -> -1"),
            },
            _TUNABLE: {
                "_MAX_STATES = 64  # remembered states (DW_CFA_remember_state) a description may stack": ("64 -> 63",),
            },
            "an expression shorter than the PLT's fails the shape check that follows": {
                "if len(expression) < 2 or expression[0] != 0x77:  # DW_OP_breg7 (rsp)": (
                    "< -> <=", "2 -> 3", "2 -> 1",
                ),
            },
            "val_offset_sf's operand is not used: read as a uleb or a sleb, the same bytes are consumed": {
                "offset = (reader.sleb() if op in (0x11, 0x15) else reader.uleb()) * data_align": (
                    "21 -> 22", "21 -> 20",
                ),
            },
            "a CFA expression that is not the PLT's: its register is neither rsp nor rbp, its offset unread": {
                "state.cfa_reg = RSP if plt is not None else -1": ("1 -> 2", "1 -> 0", "drop -"),
                "state.cfa_offset, state.cfa_plt = plt if plt is not None else (0, None)": ("0 -> 1", "0 -> -1"),
            },
            "no entry fits in fewer than 8 bytes: the bound decides only where the loop ends, past any entry": {
                "while at + 4 <= len(data):": ("<= -> <", "+ -> -", "4 -> 5", "4 -> 3"),
            },
            "a 64-bit length cut off gives an end past the section, as the loop's end does": {
                "if at + 12 > len(data):": ("> -> >=", "+ -> -", "12 -> 13", "12 -> 11"),
                "break  # (a 64-bit length cut off: no entry)": ("delete `break`",),
            },
            "a length's eighth byte is 0 for any section below 2^56 bytes": {
                'length, header = int.from_bytes(data[at + 4 : at + 12], "little"), 12': ("12 -> 11",),
                "size = reader.take(8) if debug_frame else reader.pointer(cie.fde_encoding & 0x0F, vaddr)": ("8 -> 7",),
            },
            "a CIE read as it is met, or when an FDE names it: the same": {
                "cies[at] = _read_cie(data, body, end)": ("delete `cies[at] = _read_cie(data, body, end)`",),
                "cies[at] = None": ("delete `cies[at] = None`",),
            },
            "a row left equal to the one before it: the merge drops it anyway": {
                "if len(rows) > 1 and rows[-2][1] == packed:": ("1 -> 2", "1 -> 0"),
                "rows.pop()": ("delete `rows.pop()`",),
                "elif not rows or rows[-1][1] != packed:": ("1 -> 0",),
            },
            "a description's rows begin at its start: sorted by them, by its start": {
                "described.sort(key=lambda d: d[0])": ("0 -> -1",),
            },
            "no description starts below 0": {"last_end = -1": ("1 -> 2", "1 -> 0")},
        }.items()
        for line, changes in lines.items()
        for change in changes
    },
}  # fmt: skip

_COMPARE_SWAPS: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
}  # fmt: skip
_OPERATOR_SWAPS: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult, ast.Div: ast.Mult,
    ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.LShift: ast.RShift, ast.RShift: ast.LShift,
    ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd, ast.BitXor: ast.BitOr,
}  # fmt: skip
_SYMBOLS: dict[type[ast.AST], str] = {
    ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.In: "in",
    ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not", ast.Add: "+", ast.Sub: "-", ast.Mult: "*",
    ast.FloorDiv: "//", ast.Div: "/", ast.Mod: "%", ast.Pow: "**", ast.LShift: "<<", ast.RShift: ">>",
    ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^", ast.And: "and", ast.Or: "or", ast.Not: "not",
    ast.USub: "-", ast.Invert: "~",
}  # fmt: skip
# Calls whose deletion changes only what is logged.
_QUIET_CALLS = {"_debug", "debug"}


@dataclass(frozen=True)
class Mutant:
    module: str
    line: int
    text: str  # the line as written
    change: str
    statement: int = 0  # the line of the statement it is in (coverage counts statements by their first line)

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: {self.change}    | {self.text}"


@dataclass
class _Edit:
    """One change to the tree: `holder.field` (or `holder.field[index]`) set to `value`."""

    holder: ast.AST
    field: str
    value: object
    index: int | None = None

    def swap(self) -> None:
        """Apply the edit, and make this edit its own undo (the old value kept in its place)."""
        container = getattr(self.holder, self.field)
        if self.index is None:
            old = container
            setattr(self.holder, self.field, self.value)
        else:
            old = container[self.index]
            container[self.index] = self.value
        self.value = old


def _skipped(node: ast.AST) -> Iterator[ast.AST]:
    """Subtrees never mutated: messages (f-strings), annotations, decorators, `__all__`, blocks
    only type checkers read, and debug logging."""
    for child in ast.walk(node):
        if isinstance(child, ast.JoinedStr):
            yield child
        elif isinstance(child, ast.arg) and child.annotation is not None:
            yield child.annotation
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from child.decorator_list
            if child.returns is not None:
                yield child.returns
        elif isinstance(child, ast.ClassDef):
            yield from child.decorator_list
        elif isinstance(child, ast.AnnAssign):
            yield child.annotation
        elif _only_for_tools(child):
            yield child
        elif isinstance(child, ast.Expr) and isinstance(child.value, ast.Call):
            func = child.value.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in _QUIET_CALLS:
                yield child


def _only_for_tools(node: ast.AST) -> bool:
    """`__all__ = ...`, or an `if TYPE_CHECKING:` block."""
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _edits(tree: ast.Module) -> Iterator[tuple[ast.AST, str, _Edit]]:
    """Every mutation of `tree`: (the node it is at, what it does, the edit)."""
    skip = {id(n) for s in _skipped(tree) for n in ast.walk(s)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in _COMPARE_SWAPS:
                    new = _COMPARE_SWAPS[type(op)]()
                    yield node, f"{_SYMBOLS[type(op)]} -> {_SYMBOLS[type(new)]}", _Edit(node, "ops", new, i)
        elif isinstance(node, ast.BinOp | ast.AugAssign) and type(node.op) in _OPERATOR_SWAPS:
            new_op = _OPERATOR_SWAPS[type(node.op)]()
            yield node, f"{_SYMBOLS[type(node.op)]} -> {_SYMBOLS[type(new_op)]}", _Edit(node, "op", new_op)
        elif isinstance(node, ast.BoolOp):
            other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            yield node, f"{_SYMBOLS[type(node.op)]} -> {_SYMBOLS[type(other)]}", _Edit(node, "op", other)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not | ast.USub | ast.Invert):
            yield node, f"drop {_SYMBOLS[type(node.op)]}", _Edit(node, "op", ast.UAdd())
        elif isinstance(node, ast.Constant) and type(node.value) is bool:
            yield node, f"{node.value} -> {not node.value}", _Edit(node, "value", not node.value)
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            for delta in (1, -1):
                yield node, f"{node.value} -> {node.value + delta}", _Edit(node, "value", node.value + delta)
        for field in ("body", "orelse", "finalbody"):
            statements = getattr(node, field, None)
            if not isinstance(statements, list):
                continue
            for i, statement in enumerate(statements):
                if id(statement) in skip or not _deletable(statement):
                    continue
                text = ast.unparse(statement).splitlines()[0][:60]
                yield statement, f"delete `{text}`", _Edit(node, field, ast.Pass(), i)


def _deletable(statement: ast.stmt) -> bool:
    """A statement whose deletion leaves valid code that may still run: a call for its effect,
    a raise, a store into an object or a container, an augmented assignment, continue, break."""
    if isinstance(statement, ast.Expr):
        return isinstance(statement.value, ast.Call)
    if isinstance(statement, ast.Assign):
        return all(isinstance(t, ast.Attribute | ast.Subscript) for t in statement.targets)
    return isinstance(statement, ast.Raise | ast.AugAssign | ast.Continue | ast.Break | ast.Delete)


def mutants_of(module: str) -> list[Mutant]:
    """Every mutant of `module` (a path under src/dynprobe), in a stable order."""
    lines = (PACKAGE / module).read_text().splitlines()
    tree, edits = _parsed(module)
    statements = {id(node): s.lineno for s in ast.walk(tree) if isinstance(s, ast.stmt) for node in ast.walk(s)}
    out = []
    for node, change, _ in edits:
        line = getattr(node, "lineno", 0)
        out.append(Mutant(module, line, lines[line - 1].strip() if line else "", change, statements[id(node)]))
    return out


@functools.cache
def _parsed(module: str) -> tuple[ast.Module, list[tuple[ast.AST, str, _Edit]]]:
    """The module's tree (parsed once a process: its edits are applied to it and undone) and its edits."""
    tree = ast.parse((PACKAGE / module).read_text())
    return tree, list(_edits(tree))


def mutated_source(module: str, index: int) -> str:
    """The source of mutant `index` of `module` (as `mutants_of` orders them)."""
    tree, edits = _parsed(module)
    edit = edits[index][2]
    edit.swap()
    try:
        return ast.unparse(tree)
    finally:
        edit.swap()


# --- running ------------------------------------------------------------------------------------

_worker_copy: Path | None = None


def _start_worker(scratch: str) -> None:
    """A copy of the package, compiled, for this worker's mutants (in `scratch`, which the run
    removes at its end); the heavy imports done once."""
    global _worker_copy
    for heavy in ("iced_x86", "numpy", "elftools.elf.elffile", "rich.console", "hypothesis", "pytest"):
        importlib.import_module(heavy)
    from _pytest.config import default_plugins  # (what each pytest.main imports otherwise)

    for plugin in (*(f"_pytest.{name}" for name in default_plugins), "hypothesis.extra.pytestplugin"):
        importlib.import_module(plugin)

    _worker_copy = Path(tempfile.mkdtemp(dir=scratch))
    shutil.copytree(PACKAGE, _worker_copy / "dynprobe", ignore=shutil.ignore_patterns("__pycache__"))
    compileall.compile_dir(_worker_copy, quiet=1)
    # What the children share is never collected again: a collection in a child (pytest makes
    # them) would walk every object imported here.
    gc.freeze()


def _in_child(work: Callable[[], int], timeout: float) -> str:
    """`work()` in a child of this worker, against the copy (its exit status `work`'s result):
    'killed' (non-zero), 'survived' (zero) or 'timeout'."""
    assert _worker_copy is not None
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            os.chdir(_worker_copy)  # (hypothesis keeps its database in the working directory)
            sys.path.insert(0, str(_worker_copy))
            sys.dont_write_bytecode = True
            os.environ["PYTHONPATH"] = os.pathsep.join([str(_worker_copy), str(ROOT)])
            os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
            os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # (xdist and others: none is used)
            os.environ["DYNPROBE_CACHE"] = "0"  # (unwind tables each mutant compiles, never another's)
            os._exit(work())
        finally:
            os._exit(99)
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
        if not ready:
            os.killpg(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(pidfd)
    if not ready:
        return "timeout"
    return "survived" if os.waitstatus_to_exitcode(status) == 0 else "killed"


def _pytest(tests: Sequence[str], plugins: Sequence[object] = ()) -> int:
    """Run `tests` (unit test files, or node ids) in this process; pytest's exit status."""
    import pytest

    # (one seed for hypothesis: a mutant meets the same examples in every run, so scores repeat)
    # (a temporary directory of the worker's own: pytest's default would look through every run's
    # numbered directories in /tmp at each run's end)
    assert _worker_copy is not None
    args = ["-x", "-q", "-p", "no:cacheprovider", "-p", "hypothesis.extra.pytestplugin", "--hypothesis-seed", "0",
            "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"),
            "--basetemp", str(_worker_copy / "tmp")]  # fmt: skip
    return int(pytest.main([*args, *(str(UNIT / t) for t in tests)], plugins=list(plugins)))


def _run_tests(tests: Sequence[str], timeout: float) -> str:
    return _in_child(lambda: _pytest(tests), timeout)


class BrokenTests(Exception):
    """A module's tests fail unmutated. (Not SystemExit: a pool's worker that raises that dies
    without an answer, and the pool waits for it forever.)"""


@dataclass(frozen=True)
class Baseline:
    """A module's unit tests, unmutated, under coverage: which run each of its lines and how long
    each took, which set a mutant's tests and their timeout."""

    by_line: dict[int, list[str]]  # node ids relative to tests/unit, the quickest first; "" for import
    durations: dict[str, float]  # node id -> seconds (slowed by coverage: an upper bound)
    overhead: float  # seconds outside any test: start-up, collection

    def timeout(self, tests: Sequence[str]) -> float:
        """Long enough for `tests` (node ids, or whole files) to pass twice over as they did under
        coverage (which slows them two to three times): a mutant that outlasts it hangs, which
        counts as killed."""
        chosen = set(tests)
        seconds = sum(s for n, s in self.durations.items() if n in chosen or n.split("::")[0] in chosen)
        return 2 * (self.overhead + seconds) + 1


def _baselines(modules: Sequence[str]) -> dict[str, Baseline]:
    """The `Baseline` of each of `modules`, which share their unit tests, from one run of them
    under coverage; quickest first, since a mutant's run stops at the first test that fails and
    most fail a quick one."""
    assert _worker_copy is not None
    targets = {m: str(_worker_copy / "dynprobe" / m) for m in modules}
    names = ["dynprobe." + m.removesuffix(".py").replace("/", ".") for m in modules]
    out = Path(tempfile.mkstemp(dir=_worker_copy.parent, suffix=".json")[1])

    def work() -> int:
        import coverage
        import pytest

        cov = coverage.Coverage(data_file=None, include=list(targets.values()), config_file=False)
        durations: dict[str, float] = {}

        class Contexts:
            @pytest.hookimpl(hookwrapper=True)
            def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
                # A function whose results are cached runs in the first test that calls it
                # only: every test that calls it must be seen to.
                for name in names:
                    imported = sys.modules.get(name)
                    for value in vars(imported).values() if imported is not None else ():
                        if callable(getattr(value, "cache_clear", None)):
                            value.cache_clear()
                cov.switch_context(item.nodeid)
                started = time.perf_counter()
                yield
                durations[item.nodeid] = time.perf_counter() - started
                cov.switch_context("")

        started = time.perf_counter()
        cov.start()
        # Imported here, outside any test: what runs at import is every test's (a module a test
        # imports lazily would have its constants put down to that test alone)
        for name in names:
            importlib.import_module(name)
        status = _pytest(MODULES[modules[0]], [Contexts()])
        cov.stop()
        unit = str(UNIT.relative_to(ROOT)) + "/"
        found = {}
        for module, target in targets.items():
            by_line = cov.get_data().contexts_by_lineno(target)
            found[module] = {n: sorted(tests, key=lambda c: durations.get(c, 0.0)) for n, tests in by_line.items()}
        report = {
            "by_line": {m: {n: [c.removeprefix(unit) for c in t] for n, t in f.items()} for m, f in found.items()},
            "durations": {n.removeprefix(unit): s for n, s in durations.items()},
            "overhead": time.perf_counter() - started - sum(durations.values()),
        }
        out.write_text(json.dumps(report))
        return status

    try:
        if _in_child(work, timeout=1200) != "survived":
            raise BrokenTests(f"the unit tests of {', '.join(modules)} fail without any mutant: fix them first")
        report = json.loads(out.read_text())
        return {
            m: Baseline({int(n): t for n, t in report["by_line"][m].items()}, report["durations"], report["overhead"])
            for m in modules
        }
    finally:
        out.unlink()


def _try(job: tuple[Mutant, int, float, Sequence[str]]) -> tuple[Mutant, str, float]:
    """The mutant's outcome, and the seconds its tests took."""
    mutant, index, timeout, tests = job
    assert _worker_copy is not None
    source = mutated_source(mutant.module, index)
    path = _worker_copy / "dynprobe" / mutant.module
    original = (PACKAGE / mutant.module).read_text()
    stamp = path.stat().st_mtime_ns
    try:
        path.write_text(source)
        # Its compiled original must not be taken for it: a mutant of the same size written in
        # the same second would be. (Python checks a .pyc by the source's size and mtime.)
        os.utime(path, ns=(stamp + 10**12, stamp + 10**12))
        started = time.monotonic()
        outcome = _run_tests(tests, timeout)
        return mutant, outcome, time.monotonic() - started
    finally:
        path.write_text(original)
        os.utime(path, ns=(stamp, stamp))


def _compile_tests(tests: Sequence[str]) -> None:
    """The unit tests compiled once, with pytest's assertion rewriting, into their __pycache__:
    each mutant's child then loads them (it writes no bytecode: the mutants' must not be kept)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    compileall.compile_dir(ROOT / "tests", quiet=1)
    files = sorted(str(UNIT / t) for t in set(tests))
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
    subprocess.run(command, env=env, cwd=ROOT, capture_output=True, check=False)


def tests_for(mutant: Mutant, by_line: dict[int, list[str]]) -> Sequence[str]:
    """The tests that may kill `mutant`: those that run its statement; all of the module's for a
    statement run at import (a constant every test may depend on) or that no test runs in this
    process (one may in a process of its own)."""
    found = by_line.get(mutant.statement, [])
    if not found or "" in found:
        return MODULES[mutant.module]
    return found  # (the quickest first)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", action="append", default=[], help="only modules whose path contains this")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--survivors", action="store_true", help="print every survivor")
    args = parser.parse_args()
    modules = [m for m in MODULES if not args.module or any(s in m for s in args.module)]
    if not modules:
        parser.error(f"no module matches {args.module}; known: {', '.join(MODULES)}")
    everything = {m: mutants_of(m) for m in modules}
    if args.list:
        for found in everything.values():
            for mutant in found:
                print(mutant)
        return 0
    from rich.progress import Progress

    _compile_tests([t for m in modules for t in MODULES[m]])
    context = multiprocessing.get_context("fork")
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="dynprobe-mutate-") as scratch,
        context.Pool(args.jobs, initializer=_start_worker, initargs=(scratch,)) as pool,
    ):
        groups = [[m for m in modules if MODULES[m] == tests] for tests in dict.fromkeys(MODULES[m] for m in modules)]
        try:
            baselines = {m: b for found in pool.map(_baselines, groups) for m, b in found.items()}
        except BrokenTests as broken:
            raise SystemExit(str(broken)) from None
        jobs = []
        for found in everything.values():
            for i, mutant in enumerate(found):
                baseline = baselines[mutant.module]
                tests = tests_for(mutant, baseline.by_line)
                jobs.append((mutant, i, baseline.timeout(tests), tests))
        outcomes = []
        with Progress(transient=True) as progress:
            task = progress.add_task("mutants", total=len(jobs))
            for outcome in pool.imap_unordered(_try, jobs, chunksize=4):
                outcomes.append(outcome)
                progress.advance(task)
    return _report(modules, outcomes, time.monotonic() - started, show_all=args.survivors)


def _report(modules: list[str], outcomes: list[tuple[Mutant, str, float]], seconds: float, *, show_all: bool) -> int:
    from rich.console import Console
    from rich.table import Table

    counts: dict[str, Counter[str]] = {m: Counter() for m in modules}
    spent: Counter[str] = Counter()
    survivors: list[Mutant] = []
    for mutant, outcome, took in outcomes:
        spent[mutant.module] += took
        key = (mutant.module, mutant.text, mutant.change)
        if outcome == "survived" and key in EQUIVALENT:
            outcome = "equivalent"
        counts[mutant.module][outcome] += 1
        if outcome == "survived":
            survivors.append(mutant)
    table = Table(title=f"mutation testing: {len(outcomes)} mutants in {seconds:.0f} s")
    for heading in ("module", "mutants", "killed", "timeout", "equivalent", "survived", "score", "test s"):
        table.add_column(heading, justify="left" if heading == "module" else "right")
    below = []
    for module in modules:
        c = counts[module]
        total = sum(c.values())
        scored = total - c["equivalent"]
        score = (c["killed"] + c["timeout"]) / scored if scored else 1.0
        if score < 0.9:
            below.append(module)
        table.add_row(module, str(total), str(c["killed"]), str(c["timeout"]), str(c["equivalent"]),
                      str(c["survived"]), f"{score:.1%}", f"{spent[module]:.0f}")  # fmt: skip
    console = Console(width=None if sys.stdout.isatty() else 160)  # (a file: no column cut short)
    console.print(table)
    for mutant in sorted(survivors, key=lambda m: (m.module, m.line)) if show_all or below else []:
        if show_all or mutant.module in below:
            print(mutant)
    if below:
        console.print(f"below 90% killed: {', '.join(below)}")
    return 1 if below else 0


if __name__ == "__main__":
    sys.exit(main())
