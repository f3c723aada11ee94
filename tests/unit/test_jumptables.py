"""Where indirect jumps land (arch/x86_64/jumptables.py) and the rules can_optimize builds on it
(switch tables, jumps through pointers, tiny functions' padding), as byte tables: code encoded
here, a table's bytes given, the targets and refusals checked."""

from __future__ import annotations

import struct

import iced_x86 as iced
import pytest

from dynprobe.arch.x86_64.decode import iter_instructions
from dynprobe.arch.x86_64.jumptables import Landing, landing
from dynprobe.arch.x86_64.optimize import OptimizePlan, can_optimize
from dynprobe.errors import OptimizeRefusal

C, R = iced.Code, iced.Register
Memory = iced.MemoryOperand
reg_reg, reg_mem, reg_imm = (
    iced.Instruction.create_reg_reg,
    iced.Instruction.create_reg_mem,
    iced.Instruction.create_reg_i32,
)
mem_imm, one_reg, one_mem = iced.Instruction.create_mem_i32, iced.Instruction.create_reg, iced.Instruction.create_mem
branch = iced.Instruction.create_branch
F = 0x1000  # the function
TABLE = 0x3000  # its table
LABEL = 0x1040  # a label the vfprintf form adds its offsets to


def encode(*insns: iced.Instruction, at: int = F) -> bytes:
    out = b""
    for insn in insns:
        encoder = iced.Encoder(64)
        encoder.encode(insn, at + len(out))
        out += encoder.take_buffer()
    return out


def decoded(code: bytes) -> list[iced.Instruction]:
    return list(iter_instructions(code, F))


def reader(memory: dict[int, bytes]):  # type: ignore[no-untyped-def]
    def read(addr: int, size: int) -> bytes | None:
        for start, data in memory.items():
            if start <= addr and addr + size <= start + len(data):
                return data[addr - start : addr - start + size]
        return None

    return read


def offsets(*targets: int, origin: int = TABLE) -> bytes:
    return b"".join(struct.pack("<i", t - origin) for t in targets)


CASES = [0x1100, 0x1120, 0x1140, 0x1160, 0x1180, 0x11A0]
CMP5_JA = (reg_imm(C.CMP_RM32_IMM8, R.EDI, 5), branch(C.JA_REL32_64, 0x1200))
GCC_DISPATCH = (
    reg_mem(C.LEA_R64_M, R.RDX, Memory(R.RIP, displ=TABLE)),
    reg_reg(C.MOV_R32_RM32, R.EDI, R.EDI),
    reg_mem(C.MOVSXD_R64_RM32, R.RAX, Memory(R.RDX, R.RDI, 4)),
    reg_reg(C.ADD_R64_RM64, R.RAX, R.RDX),
    one_reg(C.JMP_RM64, R.RAX),
)  # fmt: skip


def test_gcc_s_relative_table_bounded_by_its_compare() -> None:
    insns = decoded(encode(*CMP5_JA, *GCC_DISPATCH))
    memory = {TABLE: offsets(*CASES) + offsets(0x9999)}  # (an entry past the bound: not a target)
    assert landing(insns, len(insns) - 1, reader(memory)) == frozenset(CASES)


@pytest.mark.parametrize(
    ("bound", "entries"),
    [
        ((reg_imm(C.CMP_RM32_IMM8, R.EDI, 5), branch(C.JAE_REL32_64, 0x1200)), 5),
        ((reg_imm(C.CMP_RM32_IMM8, R.EDI, 5), branch(C.JBE_REL32_64, 0x1200)), 6),
        # the index copied from the compared register after the compare, and before it
        ((reg_imm(C.CMP_RM32_IMM8, R.ESI, 3), branch(C.JA_REL32_64, 0x1200),
          reg_reg(C.MOV_R32_RM32, R.EDI, R.ESI)), 4),
        ((reg_reg(C.MOV_R32_RM32, R.EDI, R.ESI), reg_imm(C.CMP_RM32_IMM8, R.ESI, 3),
          branch(C.JA_REL32_64, 0x1200)), 4),
        # compared in memory, then loaded from there
        ((mem_imm(C.CMP_RM32_IMM8, Memory(R.RBX, displ=8), 2), branch(C.JA_REL32_64, 0x1200),
          reg_mem(C.MOV_R32_RM32, R.EDI, Memory(R.RBX, displ=8))), 3),
        # a byte: 256 entries at most
        ((reg_mem(C.MOVZX_R32_RM8, R.EDI, Memory(R.RSI)),), 256),
    ],
)  # fmt: skip
def test_what_bounds_a_table(bound: tuple[iced.Instruction, ...], entries: int) -> None:
    insns = decoded(encode(*bound, *GCC_DISPATCH))
    targets = [0x1100 + 4 * i for i in range(entries + 1)]
    found = landing(insns, len(insns) - 1, reader({TABLE: offsets(*targets)}))
    assert found == frozenset(targets[:entries])


def test_a_table_not_bounded_or_not_readable() -> None:
    unbounded = decoded(encode(*GCC_DISPATCH))
    assert landing(unbounded, len(unbounded) - 1, reader({TABLE: offsets(*CASES)})) is Landing.UNBOUNDED
    bounded = decoded(encode(*CMP5_JA, *GCC_DISPATCH))
    assert landing(bounded, len(bounded) - 1, reader({TABLE: offsets(*CASES[:3])})) is Landing.UNBOUNDED
    # the index changed after its compare: the compare says nothing of it
    changed = decoded(encode(*CMP5_JA, reg_imm(C.ADD_RM32_IMM8, R.EDI, 9), *GCC_DISPATCH))
    assert landing(changed, len(changed) - 1, reader({TABLE: offsets(*CASES)})) is Landing.UNBOUNDED


def test_offsets_added_to_a_label_and_lea_as_the_add() -> None:
    """glibc's printf: offsets from a label, not from the table; a `lea rcx, [r11 + rcx]` adds."""
    vfprintf = decoded(encode(
        *CMP5_JA, reg_mem(C.LEA_R64_M, R.RSI, Memory(R.RIP, displ=TABLE)),
        reg_mem(C.MOVSXD_R64_RM32, R.RAX, Memory(R.RSI, R.RDI, 4)),
        reg_mem(C.LEA_R64_M, R.RSI, Memory(R.RIP, displ=LABEL)),
        reg_reg(C.ADD_R64_RM64, R.RAX, R.RSI), one_reg(C.JMP_RM64, R.RAX),
    ))  # fmt: skip
    memory = reader({TABLE: offsets(*CASES, origin=LABEL)})
    assert landing(vfprintf, len(vfprintf) - 1, memory) == frozenset(CASES)
    strcpy = decoded(encode(
        reg_reg(C.BSF_R64_RM64, R.RDI, R.RCX), reg_mem(C.LEA_R64_M, R.R11, Memory(R.RIP, displ=TABLE)),
        reg_mem(C.MOVSXD_R64_RM32, R.RCX, Memory(R.R11, R.RDI, 4)),
        reg_mem(C.LEA_R64_M, R.RCX, Memory(R.R11, R.RCX, 1)), one_reg(C.JMP_RM64, R.RCX),
    ))  # fmt: skip
    targets = [0x1100 + i for i in range(65)]
    assert landing(strcpy, len(strcpy) - 1, reader({TABLE: offsets(*targets, 0x9999)})) == frozenset(targets)


def test_a_table_of_addresses_in_code_built_without_pic() -> None:
    direct = decoded(encode(*CMP5_JA, one_mem(C.JMP_RM64, Memory(R.NONE, R.RDI, 8, displ=TABLE))))
    via = decoded(encode(*CMP5_JA, reg_mem(C.MOV_R64_RM64, R.RAX, Memory(R.NONE, R.RDI, 8, displ=TABLE)),
                         one_reg(C.JMP_RM64, R.RAX)))  # fmt: skip
    memory = reader({TABLE: b"".join(struct.pack("<Q", t) for t in CASES)})
    assert landing(direct, len(direct) - 1, memory) == landing(via, len(via) - 1, memory) == frozenset(CASES)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ((reg_mem(C.MOV_R64_RM64, R.RAX, Memory(R.RDI, displ=8)), one_reg(C.JMP_RM64, R.RAX)),
         Landing.THROUGH_POINTER),  # a method
        ((reg_mem(C.MOV_R64_RM64, R.RAX, Memory(R.RDI, displ=8)), reg_imm(C.ROR_RM64_IMM8, R.RAX, 0x11),
          reg_mem(C.XOR_R64_RM64, R.RAX, Memory(R.NONE, displ=0x30, seg=R.FS)), one_reg(C.JMP_RM64, R.RAX)),
         Landing.THROUGH_POINTER),  # glibc's PTR_DEMANGLE
        ((reg_reg(C.MOV_R64_RM64, R.RAX, R.RSI), one_reg(C.POP_R64, R.RBX),
          one_reg(C.JMP_RM64, R.RAX)), Landing.THROUGH_POINTER),  # the caller's argument
        ((branch(C.CALL_REL32_64, 0x2000), one_reg(C.JMP_RM64, R.RAX)),
         Landing.THROUGH_POINTER),  # a function's result
        ((one_mem(C.JMP_RM64, Memory(R.RDI, displ=0x18)),), Landing.THROUGH_POINTER),
        ((reg_mem(C.LEA_R64_M, R.RAX, Memory(R.RIP, displ=LABEL)), one_reg(C.JMP_RM64, R.RAX)),
         frozenset({LABEL})),
        ((reg_reg(C.XOR_R32_RM32, R.EAX, R.EAX), one_reg(C.JMP_RM64, R.RAX)), Landing.UNBOUNDED),
        # made where two ways meet after a jmp: nothing says which
        ((branch(C.JMP_REL32_64, 0x2000), one_reg(C.JMP_RM64, R.RAX)), Landing.UNBOUNDED),
    ],
)  # fmt: skip
def test_jumps_through_what_is_made_elsewhere(code: tuple[iced.Instruction, ...], expected: object) -> None:
    insns = decoded(encode(*code))
    assert landing(insns, len(insns) - 1, reader({})) == expected


def test_one_branch_into_code_after_a_ret_is_followed() -> None:
    """After a `ret` and its padding, the code one branch reaches is walked from the branch."""
    # mov rax,[rdi+10h]; jne +4 (to the jmp); ret; nop dword [rax]; jmp rax
    insns = decoded(bytes.fromhex("488b4710" + "7504" + "c3" + "0f1f00" + "ffe0"))
    assert insns[1].near_branch_target == insns[-1].ip
    assert landing(insns, len(insns) - 1, reader({})) is Landing.THROUGH_POINTER


# --- can_optimize with them -------------------------------------------------------------------------
PROLOGUE = (one_reg(C.PUSH_R64, R.RBP), reg_reg(C.MOV_R64_RM64, R.RBP, R.RSP))


def test_a_switch_is_refused_only_when_a_case_lands_in_the_region() -> None:
    code = encode(*PROLOGUE, *CMP5_JA, *GCC_DISPATCH)
    fine = reader({TABLE: offsets(*CASES)})
    plan = can_optimize(code, F, F, read=fine)
    assert isinstance(plan, OptimizePlan) and plan.length == 1 + 3 + 3  # push, mov, cmp
    into = reader({TABLE: offsets(*CASES[:5], F + 4)})
    assert can_optimize(code, F, F, read=into) == OptimizeRefusal.JUMP_INTO_REGION
    assert can_optimize(code, F, F) == OptimizeRefusal.INDIRECT_JUMP  # (no reader: nothing is known)
    unbounded = encode(*PROLOGUE, reg_reg(C.XOR_R32_RM32, R.EDI, R.EDI), *GCC_DISPATCH[:1],
                       reg_imm(C.ADD_RM32_IMM8, R.EDI, 1), *GCC_DISPATCH[1:])  # fmt: skip
    assert can_optimize(unbounded, F, F, read=fine) == OptimizeRefusal.INDIRECT_JUMP


def test_a_tail_call_through_a_pointer_is_refused_only_where_the_module_takes_an_address() -> None:
    code = encode(*PROLOGUE, one_reg(C.POP_R64, R.RBP), one_mem(C.JMP_RM64, Memory(R.RDI, displ=8)))
    assert isinstance(can_optimize(code, F, F, read=reader({})), OptimizePlan)
    taken = frozenset({F + 1})  # (the `mov` after the push: its address is in a relocation)
    assert can_optimize(code, F, F, read=reader({}), module_targets=taken) == OptimizeRefusal.JUMP_INTO_REGION


NOPS = bytes.fromhex("662e0f1f840000000000") + bytes.fromhex("6690")  # (nopw cs:[rax+rax], xchg ax,ax)


@pytest.mark.parametrize(
    ("code", "padding", "expected"),
    [
        ("c3", NOPS, 1),  # ret
        ("31c0c3", NOPS, 3),  # xor eax,eax; ret
        ("f3c3", b"\xcc" * 14, 2),  # rep ret, int3 padding
        ("ff6738", NOPS[:10], 3),  # jmp [rdi+38h]: sqlite3OsAccess
        ("ebfe", NOPS, 2),  # jmp short (to itself)
        ("c3", NOPS[:3], OptimizeRefusal.TOO_SHORT),  # the next function starts 4 bytes on
        ("c3", b"\x90\x90\x55\x48", OptimizeRefusal.TOO_SHORT),  # not padding
        ("55", NOPS, OptimizeRefusal.TOO_SHORT),  # push rbp: it runs on into the padding
    ],
)  # fmt: skip
def test_a_tiny_function_s_jump_covers_its_padding(code: str, padding: bytes, expected: OptimizeRefusal | int) -> None:
    plan = can_optimize(bytes.fromhex(code), F, F, padding=padding, read=reader({}))
    if isinstance(expected, OptimizeRefusal):
        assert plan == expected
        return
    assert isinstance(plan, OptimizePlan) and plan.length == expected and plan.overwritten == 5
    assert plan.resume_at == F + expected


def test_a_tiny_function_s_padding_reached_by_a_branch_is_refused() -> None:
    assert can_optimize(b"\xc3", F, F, padding=NOPS, module_targets=frozenset({F + 3})) == (
        OptimizeRefusal.JUMP_INTO_REGION
    )
    assert can_optimize(b"\xc3", F, F, padding=NOPS, other_probes=frozenset({F + 2})) == OptimizeRefusal.REGION_OVERLAP


def landed(*code: iced.Instruction, memory: dict[int, bytes] | None = None) -> frozenset[int] | Landing:
    insns = decoded(encode(*code))
    return landing(insns, len(insns) - 1, reader(memory or {}))


def test_a_table_of_4096_entries_is_read_and_a_larger_one_is_not() -> None:
    targets = [0x1100 + i for i in range(4097)]
    memory = {TABLE: offsets(*targets)}
    most = landed(reg_imm(C.CMP_RM32_IMM32, R.EDI, 4095), branch(C.JA_REL32_64, 0x1200), *GCC_DISPATCH, memory=memory)
    assert most == frozenset(targets[:4096])
    more = landed(reg_imm(C.CMP_RM32_IMM32, R.EDI, 4096), branch(C.JA_REL32_64, 0x1200), *GCC_DISPATCH, memory=memory)
    assert more is Landing.UNBOUNDED


@pytest.mark.parametrize(
    ("fillers", "expected"),
    [(63, Landing.THROUGH_POINTER), (64, Landing.UNBOUNDED)],  # (LOOK_BACK: 64)
)
def test_how_far_back_a_jump_s_register_is_looked_for(fillers: int, expected: Landing) -> None:
    code = [reg_mem(C.MOV_R64_RM64, R.RAX, Memory(R.RDI, displ=8)), *[reg_imm(C.ADD_RM32_IMM8, R.ECX, 1)] * fillers]
    assert landed(*code, one_reg(C.JMP_RM64, R.RAX)) is expected


@pytest.mark.parametrize(
    "code",
    [
        (reg_mem(C.MOV_R64_RM64, R.RAX, Memory(R.RDI)), reg_imm(C.ADD_RM64_IMM8, R.RAX, 8)),  # (an add of a number)
        (reg_mem(C.LEA_R64_M, R.RAX, Memory(R.RDI, displ=8)),),  # (a lea of no label)
        (reg_mem(C.LEA_R64_M, R.RDX, Memory(R.RIP, displ=TABLE)), reg_mem(C.MOVSXD_R64_RM32, R.RAX, Memory(R.RDX)),
         reg_reg(C.ADD_R64_RM64, R.RAX, R.RDX)),  # (offsets read with no index)
        (*CMP5_JA, reg_mem(C.MOVSXD_R64_RM32, R.RAX, Memory(R.RDX, R.RDI, 4)),
         reg_reg(C.ADD_R64_RM64, R.RAX, R.RDX)),  # (a table whose address is not found)
        (*CMP5_JA, reg_mem(C.LEA_R64_M, R.RDX, Memory(R.RIP, displ=TABLE)),
         reg_mem(C.MOVSXD_R64_RM32, R.RAX, Memory(R.RDX, R.RDI, 4)), reg_reg(C.MOV_R64_RM64, R.RDX, R.RSI),
         reg_reg(C.ADD_R64_RM64, R.RAX, R.RDX)),  # (offsets added to what is not a label)
        (*CMP5_JA, reg_mem(C.LEA_R64_M, R.RDX, Memory(R.RIP, displ=TABLE)), reg_reg(C.MOV_R64_RM64, R.RAX, R.RDI),
         reg_reg(C.ADD_R64_RM64, R.RAX, R.RDX)),  # (an add of no table's offset)
    ],
)  # fmt: skip
def test_what_nothing_says_where_it_lands(code: tuple[iced.Instruction, ...]) -> None:
    assert landed(*code, one_reg(C.JMP_RM64, R.RAX), memory={TABLE: offsets(*CASES)}) is Landing.UNBOUNDED


def test_a_call_changes_only_what_a_callee_may() -> None:
    label = reg_mem(C.LEA_R64_M, R.RBX, Memory(R.RIP, displ=LABEL))
    assert landed(label, branch(C.CALL_REL32_64, 0x2000), one_reg(C.JMP_RM64, R.RBX)) == frozenset({LABEL})
    assert landed(reg_mem(C.LEA_R64_M, R.RAX, Memory(R.RIP, displ=LABEL)), branch(C.CALL_REL32_64, 0x2000),
                  one_reg(C.JMP_RM64, R.RAX)) is Landing.THROUGH_POINTER  # fmt: skip
    assert (
        landed(one_mem(C.JMP_RM64, Memory(R.NONE, displ=0x3000))) is Landing.THROUGH_POINTER
    )  # (a pointer at an address)


def test_nops_before_a_jump_from_the_entry_or_after_a_ret() -> None:
    """Nops at the entry run into the jump (the register is the caller's); after a `ret` and
    its padding, code no branch reaches says nothing."""
    nop = bytes.fromhex("90")
    at_entry = decoded(nop * 2 + bytes.fromhex("ffe0"))
    assert landing(at_entry, 2, reader({})) is Landing.THROUGH_POINTER
    after_ret = decoded(bytes.fromhex("488b4708" + "c3" + "cc" + "90" + "ffe0"))
    assert landing(after_ret, len(after_ret) - 1, reader({})) is Landing.UNBOUNDED


def test_a_negative_displacement_from_the_table_s_register() -> None:
    code = (*CMP5_JA, reg_mem(C.LEA_R64_M, R.RDX, Memory(R.RIP, displ=TABLE + 8)),
            reg_mem(C.MOVSXD_R64_RM32, R.RAX, Memory(R.RDX, R.RDI, 4, displ=-8)),
            reg_reg(C.ADD_R64_RM64, R.RAX, R.RDX))  # fmt: skip
    assert landed(*code, one_reg(C.JMP_RM64, R.RAX), memory={TABLE: offsets(*CASES, origin=TABLE + 8)}) == frozenset(
        CASES
    )


@pytest.mark.parametrize(
    ("bound", "entries"),
    [
        ((reg_imm(C.CMP_RM32_IMM8, R.EDI, 0), branch(C.JA_REL32_64, 0x1200)), 1),
        ((reg_imm(C.CMP_RM32_IMM8, R.EDI, 0), branch(C.JAE_REL32_64, 0x1200)), None),  # (none selectable)
        ((reg_imm(C.CMP_RM32_IMM8, R.EDI, 5), branch(C.JB_REL32_64, 0x1200)), 5),
        ((reg_imm(C.CMP_RM32_IMM32, R.ESI, 300), branch(C.JA_REL32_64, 0x1200),
          reg_reg(C.MOVZX_R32_RM8, R.EDI, R.SIL)), 256),  # (a byte's 256 below the compare's 301)
        ((reg_reg(C.BSF_R32_RM32, R.EDI, R.ECX),), 33),
        # what the compare bounds is not the index
        ((mem_imm(C.CMP_RM32_IMM8, Memory(R.RBX, displ=16), 2), branch(C.JA_REL32_64, 0x1200),
          reg_mem(C.MOV_R32_RM32, R.EDI, Memory(R.RBX, displ=8))), None),
        ((mem_imm(C.CMP_RM32_IMM8, Memory(R.RBX, displ=8), 2), branch(C.JA_REL32_64, 0x1200),
          reg_imm(C.ADD_RM64_IMM8, R.RBX, 8), reg_mem(C.MOV_R32_RM32, R.EDI, Memory(R.RBX, displ=8))), None),
        ((reg_reg(C.MOV_R32_RM32, R.EDI, R.ESI), reg_imm(C.ADD_RM32_IMM8, R.ESI, 5),
          reg_imm(C.CMP_RM32_IMM8, R.ESI, 3), branch(C.JA_REL32_64, 0x1200)), None),
        ((reg_imm(C.CMP_RM32_IMM8, R.EDI, 2), branch(C.JA_REL32_64, 0x1200),
          reg_mem(C.MOV_R32_RM32, R.EDI, Memory(R.RBX, displ=8))), None),
        ((reg_imm(C.CMP_RM32_IMM8, R.EDI, 2), branch(C.JA_REL32_64, 0x1200), reg_reg(C.MOV_R32_RM32, R.EDI, R.ESI)),
         None),
        ((reg_imm(C.CMP_RM32_IMM8, R.ESI, 3), branch(C.JA_REL32_64, 0x1200), reg_reg(C.ADD_R32_RM32, R.EDI, R.ESI)),
         None),
        ((mem_imm(C.CMP_RM32_IMM8, Memory(R.RBX, R.RCX, 4), 2), branch(C.JA_REL32_64, 0x1200),
          reg_imm(C.ADD_RM64_IMM8, R.RCX, 1), reg_mem(C.MOV_R32_RM32, R.EDI, Memory(R.RBX, R.RCX, 4))), None),
        ((mem_imm(C.CMP_RM32_IMM8, Memory(R.RBX, R.RCX, 4), 2), branch(C.JA_REL32_64, 0x1200),
          reg_mem(C.MOV_R32_RM32, R.EDI, Memory(R.RBX, R.RCX, 4))), 3),
        ((reg_imm(C.CMP_RM32_IMM8, R.EDI, 5), branch(C.JG_REL32_64, 0x1200)), None),  # (signed: not a bound)
        ((reg_imm(C.CMP_RM32_IMM8, R.EDI, 5),), None),  # (no jump after the compare)
    ],
)  # fmt: skip
def test_what_bounds_a_table_and_what_does_not(bound: tuple[iced.Instruction, ...], entries: int | None) -> None:
    targets = [0x1100 + i for i in range(400)]
    found = landed(*bound, *GCC_DISPATCH, memory={TABLE: offsets(*targets)})
    assert found == (Landing.UNBOUNDED if entries is None else frozenset(targets[:entries]))


def test_cases_at_the_site_or_past_the_region_are_fine() -> None:
    code = encode(*PROLOGUE, *CMP5_JA, *GCC_DISPATCH)
    plan = can_optimize(code, F, F, read=reader({TABLE: offsets(F, F + 7, *CASES[2:])}))  # (push, mov, cmp: 7)
    assert isinstance(plan, OptimizePlan) and plan.resume_at == F + 7


@pytest.mark.parametrize(
    ("padding", "expected"),
    [
        (b"\x90" * 4, 1),  # exactly the bytes the jump needs
        (b"\x90" * 4 + b"\x55", 1),  # then code: the jump stops before it
        (b"\x90" * 3 + b"\x55", OptimizeRefusal.TOO_SHORT),
    ],
)
def test_padding_exactly_long_enough(padding: bytes, expected: OptimizeRefusal | int) -> None:
    plan = can_optimize(b"\xc3", F, F, padding=padding, read=reader({}))
    assert plan == expected if isinstance(expected, OptimizeRefusal) else isinstance(plan, OptimizePlan)


@pytest.mark.parametrize(
    ("second", "expected"),
    [
        ("488b4610", Landing.THROUGH_POINTER),  # mov rax,[rsi+10h]: pointers both ways
        ("31c09090", Landing.UNBOUNDED),  # xor eax,eax: nothing says where one way lands
        ("90909090", Landing.UNBOUNDED),  # (a way no code runs into: nothing says)
    ],
)
def test_code_several_branches_reach_is_walked_along_each(second: str, expected: Landing) -> None:
    """mov rax,[rdi+8]; jmp L; (second way) jmp L; L: jmp rax"""
    code = bytes.fromhex("488b4708" + "eb06" + second + "eb00" + "ffe0")
    insns = decoded(code)
    assert len([i for i in insns if i.near_branch_target == insns[-1].ip]) == 2
    assert landing(insns, len(insns) - 1, reader({})) is expected


def test_a_label_one_way_and_a_pointer_the_other() -> None:
    """The label's address is a target; the pointer's are the module's to count."""
    label = encode(reg_mem(C.LEA_R64_M, R.RAX, Memory(R.RIP, displ=LABEL)), at=F + 6)
    code = bytes.fromhex("488b4708" + "eb09") + label + bytes.fromhex("eb00" + "ffe0")
    insns = decoded(code)
    assert landing(insns, len(insns) - 1, reader({})) == frozenset({LABEL})


def test_a_loop_through_the_code_branches_meet_at_ends() -> None:
    """mov rax,[rdi+8]; jmp L; (loop:) dec ecx; jmp L; L: test ecx,ecx; jne loop; jmp rax: the
    walk meets L again on the loop's way, and stops, MERGES deep (nothing said: UNBOUNDED)."""
    code = bytes.fromhex("488b4708" + "eb04" + "ffc9" + "eb00" + "85c9" + "75f8" + "ffe0")
    insns = decoded(code)
    assert insns[5].near_branch_target == insns[2].ip and insns[1].near_branch_target == insns[4].ip
    assert landing(insns, len(insns) - 1, reader({})) is Landing.UNBOUNDED


# --- tables nothing bounds, read by what they hold -------------------------------------------------------
def in_code(addr: int) -> bool:
    return F <= addr < F + 0x1000  # (the module's code: 0x1000-0x2000)


def held(*code: iced.Instruction, memory: dict[int, bytes]) -> frozenset[int] | Landing:
    insns = decoded(encode(*code))
    return landing(insns, len(insns) - 1, reader(memory), is_code=in_code)


def test_a_table_nothing_bounds_is_read_while_its_entries_land_in_code() -> None:
    """glibc's string functions index their tables by a bit scan plus or minus an offset: the
    table's entries from the first while each lands in the module's code (a case split off to
    another function too), the first that does not ends it; none that does, or MAX_ENTRIES
    (4096) that all do, and nothing says where it lands."""
    cold = 0x1F00  # (a case GCC put in a .cold part elsewhere in the code)
    memory = {TABLE: offsets(*CASES, cold, 0x9000, *CASES)}
    assert held(*GCC_DISPATCH, memory=memory) == frozenset([*CASES, cold])
    assert held(*GCC_DISPATCH, memory={TABLE: offsets(0x9000, *CASES)}) is Landing.UNBOUNDED
    assert held(*GCC_DISPATCH, memory={}) is Landing.UNBOUNDED
    assert held(*GCC_DISPATCH, memory={TABLE: offsets(*CASES[:2])}) == frozenset(CASES[:2])  # (the end of the data)
    most = [0x1000 + i for i in range(4095)]
    assert held(*GCC_DISPATCH, memory={TABLE: offsets(*most, 0x9000)}) == frozenset(most)
    assert held(*GCC_DISPATCH, memory={TABLE: offsets(*most, 0x1000)}) is Landing.UNBOUNDED
    # a table of addresses (code built without -fPIC): no `lea` says where it begins
    absolute = (one_mem(C.JMP_RM64, Memory(R.NONE, R.RDI, 8, displ=TABLE)),)
    assert held(*absolute, memory={TABLE: struct.pack("<3Q", *CASES[:2], 0x9000)}) is Landing.UNBOUNDED


def test_a_table_nothing_bounds_is_read_only_from_where_it_begins() -> None:
    """GCC's switch on cases from -2 with no default loads `[rT + rI*4 + 8]` (rT the table's
    `lea`): its first two entries are before where the load begins, so nothing says where the
    table's entries end below: unbounded (a case there could land in the region). The same
    with the offsets from a label other than the table (the load's base no proof of a start)."""
    biased = (*GCC_DISPATCH[:2], reg_mem(C.MOVSXD_R64_RM32, R.RAX, Memory(R.RDX, R.RDI, 4, displ=8)),
              *GCC_DISPATCH[3:])  # fmt: skip
    memory = {TABLE: offsets(F + 2, F + 3, *CASES, 0x9000)}
    assert held(*biased, memory=memory) is Landing.UNBOUNDED
    label = (reg_mem(C.LEA_R64_M, R.RCX, Memory(R.RIP, displ=LABEL)), *GCC_DISPATCH[:3],
             reg_reg(C.ADD_R64_RM64, R.RAX, R.RCX), one_reg(C.JMP_RM64, R.RAX))  # fmt: skip
    assert held(*label, memory={TABLE: offsets(*CASES, 0x9000, origin=LABEL)}) is Landing.UNBOUNDED
    assert held(*GCC_DISPATCH, memory={TABLE: offsets(*CASES, 0x9000)}) == frozenset(CASES)


def test_an_entry_at_a_constant_place_is_a_table_of_one() -> None:
    """`movsxd rax, [rip+TABLE]; lea rsi, [rip+TABLE]; add rax, rsi; jmp rax` (glibc's
    __res_context_query): the one entry's target."""
    code = (
        reg_mem(C.MOVSXD_R64_RM32, R.RAX, Memory(R.RIP, displ=TABLE + 8)),
        reg_mem(C.LEA_R64_M, R.RSI, Memory(R.RIP, displ=TABLE)),
        reg_reg(C.ADD_R64_RM64, R.RAX, R.RSI),
        one_reg(C.JMP_RM64, R.RAX),
    )  # fmt: skip
    assert landed(*code, memory={TABLE + 8: offsets(CASES[3])}) == frozenset([CASES[3]])
    assert landed(*code, memory={}) is Landing.UNBOUNDED


def test_a_case_of_a_table_nothing_bounds_landing_in_the_region_refuses_it() -> None:
    code = encode(*PROLOGUE, *GCC_DISPATCH)
    fine = {TABLE: offsets(*CASES, 0x9000)}
    plan = can_optimize(code, F, F, read=reader(fine), is_code=in_code)
    assert isinstance(plan, OptimizePlan)
    into = reader({TABLE: offsets(*CASES, F + 4, 0x9000)})
    assert can_optimize(code, F, F, read=into, is_code=in_code) == OptimizeRefusal.JUMP_INTO_REGION
    assert can_optimize(code, F, F, read=reader(fine)) == OptimizeRefusal.INDIRECT_JUMP  # (what is code: not said)
