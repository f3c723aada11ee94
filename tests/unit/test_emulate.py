"""The emulator (arch/x86_64/emulate.py) instruction by instruction: every register and flag it
changes, what it reads and writes, the counter branches, what it refuses, and the prepared fast
paths against the general one."""

from __future__ import annotations

import pytest

from dynprobe.arch.x86_64 import Regs, decode_one, emulate, prepare
from dynprobe.arch.x86_64.emulate import EmulationFault, can_emulate
from dynprobe.arch.x86_64.operands import effective_address

SITE = 0x401000
STACK = 0x7FFF_0000
TARGET = SITE + 2 + 0x10  # where a rel8 +0x10 branch at SITE goes
ZF = 0x40


class Memory:
    """Bytes at addresses; a read returns exactly what was asked or fails."""

    def __init__(self, words: dict[int, int] | None = None) -> None:
        self.data: dict[int, int] = {}
        for addr, word in (words or {}).items():
            for i, byte in enumerate(word.to_bytes(8, "little")):
                self.data[addr + i] = byte

    def read(self, addr: int, size: int) -> bytes:
        if any(addr + i not in self.data for i in range(size)):
            raise OSError(14, "bad address")
        return bytes(self.data[addr + i] for i in range(size))


def regs(**values: int) -> Regs:
    r = Regs()
    r.rsp = STACK
    r.eflags = 0x202
    for name, value in values.items():
        r[name] = value
    r.rip = SITE
    return r


def run(code: str, r: Regs, mem: Memory | None = None, *, prepared: bool = False) -> list[tuple[int, bytes]]:
    insn = decode_one(bytes.fromhex(code), SITE)
    assert insn is not None
    if prepared:
        emulator = prepare(insn)
        assert emulator is not None
        return emulator(r, (mem or Memory()).read)
    return emulate(insn, r, (mem or Memory()).read)


@pytest.mark.parametrize(
    ("code", "pushed"),
    [("6a05", 5), ("6aff", (1 << 64) - 1), ("6878563412", 0x12345678), ("68f0ffffff", (1 << 64) - 0x10)],
    ids=["push 5", "push -1", "push imm32", "push -16"],
)
def test_push_immediate(code: str, pushed: int) -> None:
    r = regs()
    assert run(code, r) == [(STACK - 8, pushed.to_bytes(8, "little"))]
    assert (r.rsp, r.rip) == (STACK - 8, SITE + len(code) // 2)


@pytest.mark.parametrize("prepared", [False, True])
def test_push_and_pop_a_register(prepared: bool) -> None:
    for code in ("53", "55"):  # push rbx, push rbp
        r = regs(rbx=0x1122_3344_5566_7788, rbp=0x1122_3344_5566_7788)
        assert run(code, r, prepared=prepared) == [(STACK - 8, (0x1122_3344_5566_7788).to_bytes(8, "little"))]
        assert (r.rsp, r.rip) == (STACK - 8, SITE + 1)
    r = regs(rsp=0)  # the stack pointer wraps
    run("53", r, prepared=prepared)
    assert r.rsp == (1 << 64) - 8
    r = regs()
    assert run("58", r, Memory({STACK: 0xABCD})) == []
    assert (r.rax, r.rsp, r.rip) == (0xABCD, STACK + 8, SITE + 1)


def test_pushf_clears_rf_vm_and_tf_in_the_image() -> None:
    r = regs(eflags=0x202 | 0x100 | 1 << 16 | 1 << 17 | 0x1)
    assert run("9c", r) == [(STACK - 8, (0x203).to_bytes(8, "little"))]
    assert (r.rsp, r.rip) == (STACK - 8, SITE + 1)
    assert run("9c", regs(eflags=0x202 | 0x100))[0][1] == (0x202).to_bytes(8, "little")


def test_popf_takes_the_flags_user_space_may_set() -> None:
    r = regs(eflags=0x202)
    run("9d", r, Memory({STACK: 0x3000 | 0x1 | ZF | 1 << 21}))  # IOPL (kept), CF, ZF, ID
    assert (r.eflags, r.rsp, r.rip) == (0x202 | 0x1 | ZF | 1 << 21, STACK + 8, SITE + 1)
    r = regs(eflags=0x202)
    run("9d", r, Memory({STACK: 0x3000 | 0x1 | ZF}))
    assert r.eflags == 0x202 | 0x1 | ZF


@pytest.mark.parametrize("prepared", [False, True])
def test_ret_and_ret_imm16(prepared: bool) -> None:
    r = regs()
    run("c3", r, Memory({STACK: 0x400123}), prepared=prepared)
    assert (r.rip, r.rsp) == (0x400123, STACK + 8)
    r = regs()
    run("c21000", r, Memory({STACK: 0x400123}), prepared=prepared)
    assert (r.rip, r.rsp) == (0x400123, STACK + 8 + 0x10)


@pytest.mark.parametrize("prepared", [False, True])
def test_nops_only_advance(prepared: bool) -> None:
    for code in ("90", "f30f1efa", "0f1f440000", "f390"):
        r = regs()
        before = r.copy()
        assert run(code, r, prepared=prepared) == []
        before.rip = SITE + len(code) // 2
        assert r == before


def test_mov_and_lea_advance() -> None:
    r = regs(rdi=7)
    run("4889f8", r)  # mov rax, rdi
    assert (r.rax, r.rip) == (7, SITE + 3)
    r = regs(rdi=7)
    run("8d4701", r)  # lea eax, [rdi+1]
    assert (r.rax, r.rip) == (8, SITE + 3)


def test_call_through_a_register_and_memory() -> None:
    r = regs(rax=0x7000)
    assert run("ffd0", r) == [(STACK - 8, (SITE + 2).to_bytes(8, "little"))]
    assert (r.rip, r.rsp) == (0x7000, STACK - 8)
    r = regs(rax=0x5000)
    run("ff10", r, Memory({0x5000: 0x7100}))  # call [rax]
    assert r.rip == 0x7100


def test_push_rsp_pushes_its_old_value() -> None:
    r = regs()
    assert run("54", r) == [(STACK - 8, STACK.to_bytes(8, "little"))]


def test_pop_rsp_loads_after_the_increment() -> None:
    r = regs()
    run("5c", r, Memory({STACK: 0x12345678}))
    assert r.rsp == 0x12345678 and r.rip == SITE + 1


def test_call_rel32_pushes_the_return_address() -> None:
    r = regs()
    writes = run("e810000000", r)
    assert r.rip == SITE + 5 + 0x10
    assert writes == [(STACK - 8, (SITE + 5).to_bytes(8, "little"))]


def test_jcc_taken_and_not() -> None:
    r = regs(eflags=0x202 | ZF)
    run("7405", r)
    assert r.rip == SITE + 2 + 5
    r = regs()
    run("7405", r)
    assert r.rip == SITE + 2
    r = regs(eflags=0x202 | 0x80)  # jl: SF != OF
    run("7c10", r)
    assert r.rip == SITE + 2 + 0x10


def test_mov_zero_extends_32_bits_and_merges_8() -> None:
    r = regs(rax=0xFFFFFFFFFFFFFFFF, rdi=0xAAAAAAAA12345678)
    run("89f8", r)
    assert r.rax == 0x12345678
    r = regs(rax=0x1111111111111111, rbx=0x22)
    run("88d8", r)  # mov al, bl
    assert r.rax == 0x1111111111111122


def test_lea_rip_relative() -> None:
    r = regs()
    run("488d3d00010000", r)
    assert r.rdi == SITE + 7 + 0x100


def test_jmp_through_a_plt_slot() -> None:
    r = regs()
    run("ff2510000000", r, Memory({SITE + 6 + 0x10: 0x7F0000001000}))
    assert r.rip == 0x7F0000001000


# (code, rcx, eflags) -> (rcx after, taken)
COUNTER_BRANCHES = [
    ("e210", 2, 0, 1, True),  # loop
    ("e210", 1, 0, 0, False),
    ("e210", 0, 0, (1 << 64) - 1, True),  # wraps
    ("e210", 1 << 32, 0, (1 << 32) - 1, True),
    ("67e210", (5 << 32) | 1, 0, 0, False),  # loop with ecx: the upper half is not the counter, and is cleared
    ("67e210", 5 << 32, 0, (1 << 32) - 1, True),
    ("e110", 2, ZF, 1, True),  # loope
    ("e110", 2, 0, 1, False),
    ("e110", 1, ZF, 0, False),
    ("67e110", (1 << 32) | 2, ZF, 1, True),
    ("e010", 2, 0, 1, True),  # loopne
    ("e010", 2, ZF, 1, False),
    ("67e010", (1 << 32) | 2, ZF, 1, False),
    ("e310", 0, 0, 0, True),  # jrcxz
    ("e310", 1 << 32, 0, 1 << 32, False),
    ("67e310", 1 << 32, 0, 1 << 32, True),  # jecxz
    ("67e310", 1, 0, 1, False),
    # the counter's top bit is the counter's: rcx's bit 63, ecx's bit 31
    ("e110", (1 << 63) | 2, ZF, (1 << 63) | 1, True),
    ("67e110", 0x8000_0002, ZF, 0x8000_0001, True),
    ("e010", (1 << 63) | 2, 0, (1 << 63) | 1, True),
    ("67e010", 0x8000_0002, 0, 0x8000_0001, True),
    ("e310", 1 << 63, 0, 1 << 63, False),
    ("67e310", 0x8000_0000, 0, 0x8000_0000, False),
]


@pytest.mark.parametrize(("code", "rcx", "flags", "after", "taken"), COUNTER_BRANCHES)
def test_counter_branches(code: str, rcx: int, flags: int, after: int, taken: bool) -> None:
    r = regs(rcx=rcx, eflags=0x202 | flags)
    run(code, r)
    length = len(code) // 2
    assert r.rcx == after
    assert r.rip == (SITE + length + 0x10 if taken else SITE + length)
    assert r.eflags == 0x202 | flags  # no flag changes


@pytest.mark.parametrize(
    ("code", "emulated"),
    [
        ("53", True), ("58", True), ("6653", False), ("6658", False),  # push/pop 16-bit
        ("ff30", False), ("8f00", False),  # push/pop memory
        ("ff25e22f0000", True), ("ff28", False),  # jmp [rip+x]; jmp far [rax]
        ("c7f800000000", False),  # xbegin: a conditional branch, not a jcc
        ("8d4701", True), ("488d4701", True), ("668d4701", False),  # lea r32, r64, r16
        ("488918", False), ("488b18", False),  # mov [rax], rbx; mov rbx, [rax]
        ("cb", False), ("ca0800", False),  # far returns
    ],
)  # fmt: skip
def test_what_is_emulated(code: str, emulated: bool) -> None:
    insn = decode_one(bytes.fromhex(code), SITE)
    assert insn is not None
    assert can_emulate(insn) is emulated
    assert (prepare(insn) is not None) is emulated
    if not emulated:
        with pytest.raises(EmulationFault):
            emulate(insn, regs(rax=STACK), Memory({STACK: 0}).read)


def test_a_short_or_failed_read_is_a_fault_before_any_change() -> None:
    insn = decode_one(bytes.fromhex("c3"), SITE)
    assert insn is not None
    for read in (lambda addr, size: b"\x00" * 7, Memory().read):
        r = regs()
        with pytest.raises(EmulationFault):
            emulate(insn, r, read)
        assert r == regs()


def test_lea_ignores_a_segment_prefix() -> None:
    r = regs(rdi=0x1000, fs_base=0x7F00_0000_0000)
    run("64488d07", r)  # lea rax, fs:[rdi]
    assert r.rax == 0x1000


def test_an_instruction_taken_as_checked_but_not_emulated_is_a_fault() -> None:
    insn = decode_one(bytes.fromhex("4883c001"), SITE)  # add rax, 1
    assert insn is not None
    with pytest.raises(EmulationFault):
        emulate(insn, regs(), Memory().read, checked=True)


@pytest.mark.parametrize(
    ("code", "address"),
    [
        ("64488b042528000000", 0x7F00_0000_0028),  # mov rax, fs:[0x28]: no base, fs
        ("65488b07", 0x1000 + 0x5000_0000),  # mov rax, gs:[rdi]
        ("488b0425f0ff0000", 0xFFF0),  # mov rax, [0xfff0]: no base, no segment
    ],
)
def test_an_operand_s_address_counts_its_segment_base(code: str, address: int) -> None:
    insn = decode_one(bytes.fromhex(code), SITE)
    assert insn is not None
    r = regs(rdi=0x1000, fs_base=0x7F00_0000_0000, gs_base=0x5000_0000)
    assert effective_address(insn, r) == address
    assert effective_address(insn, r, with_segment=False) == address - {0x64: r.fs_base, 0x65: r.gs_base}.get(
        int(code[:2], 16), 0
    )


def test_registers_by_name_and_arguments_by_number() -> None:
    r = regs(rdi=7, r9=9)
    r["%si"] = -1  # (the kernel's names too)
    assert (r["rdi"], r["rsi"], r.arg(1), r.arg(6)) == (7, (1 << 64) - 1, 7, 9)
    with pytest.raises(KeyError, match="unknown register 'xmm0'"):
        r["xmm0"]
    with pytest.raises(KeyError, match="unknown register 'bogus'"):
        r["bogus"] = 1
    for index in (0, 7):
        with pytest.raises(IndexError, match=f"argument {index} is not passed in a register"):
            r.arg(index)
