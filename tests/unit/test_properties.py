"""Property tests (hypothesis): the parser and the x86 layer never fail in unplanned ways."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dynprobe.arch.x86_64 import Regs, ResumePlan, decode_one, emulate, out_of_line, plan_resume, prepare
from dynprobe.arch.x86_64.emulate import EmulationFault
from dynprobe.errors import ParseError, Refusal
from dynprobe.spec.parser import parse_spec

SPEC_ALPHABET = st.sampled_from(list("pr:/ %$@+-()=0123456789abcdefxsuitrngkmdl_,.\t"))


@settings(max_examples=500, deadline=None)
@given(st.text(SPEC_ALPHABET, max_size=60))
def test_parser_accepts_or_reports_a_column_inside_the_spec(text: str) -> None:
    try:
        spec = parse_spec(text)
    except ParseError as exc:
        assert 0 <= exc.offset <= len(text) and exc.column == exc.offset + 1
        assert exc.caret().splitlines()[-1].endswith("^")
    else:
        assert spec.kind in ("p", "r") and spec.location


@settings(max_examples=800, deadline=None)
@given(st.binary(min_size=1, max_size=15), st.integers(0x1000, 1 << 46))
def test_any_bytes_get_a_plan_or_a_refusal(code: bytes, ip: int) -> None:
    insn = decode_one(code, ip)
    if insn is None:
        return
    plan = plan_resume(insn)
    assert isinstance(plan, ResumePlan | Refusal)
    if isinstance(plan, ResumePlan) and prepare(insn) is None:
        slot = out_of_line(insn, ip + 0x10000)  # boosted or stepped: it must relocate near the module
        assert slot is not None or insn.is_ip_rel_memory_operand


@settings(max_examples=800, deadline=None)
@given(st.binary(min_size=1, max_size=15), st.lists(st.integers(0, (1 << 64) - 1), min_size=17, max_size=17))
def test_prepared_emulation_matches_generic_emulation(code: bytes, values: list[int]) -> None:
    insn = decode_one(code, 0x401000)
    if insn is None or prepare(insn) is None:
        return
    memory = {values[0] & ~7: values[1]}

    def read(addr: int, size: int) -> bytes:
        if addr not in memory:
            raise OSError(14, "unmapped")
        return memory[addr].to_bytes(8, "little")[:size]

    a, b = Regs(), Regs()
    for i, name in enumerate(("rax", "rcx", "rdx", "rbx", "rbp", "rsi", "rdi", "r8", "r9", "r10", "r11", "r12")):
        a[name] = b[name] = values[i + 2]
    a.rsp = b.rsp = values[0] & ~7
    a.eflags = b.eflags = 0x202 | (values[15] & 0x8D5)
    a.rip = b.rip = 0x401000
    prepared = prepare(insn)
    assert prepared is not None
    try:
        writes_a = prepared(a, read)
    except EmulationFault:
        writes_a = None
    try:
        writes_b = emulate(insn, b, read)
    except EmulationFault:
        writes_b = None
    assert writes_a == writes_b
    if writes_a is not None:
        assert a == b
