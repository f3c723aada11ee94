"""Instruction decoding with iced-x86: one instruction, or the instruction starts of a function."""

from __future__ import annotations

from collections.abc import Iterator

import iced_x86 as iced

from dynprobe.arch.x86_64.regs import FLAG_CF, FLAG_OF, FLAG_PF, FLAG_SF, FLAG_ZF

Instruction = iced.Instruction
MAX_INSN_LEN = 15
INT3 = 0xCC


def decode_one(code: bytes, ip: int) -> iced.Instruction | None:
    """The instruction at the start of `code` (placed at `ip`), or None if it does not decode."""
    decoder = iced.Decoder(64, code, ip=ip)
    insn = decoder.decode()
    if insn.is_invalid or insn.len > len(code):
        return None
    return insn


def iter_instructions(code: bytes, ip: int) -> Iterator[iced.Instruction]:
    """Linear decode of `code` placed at `ip`; stops at the first undecodable byte."""
    for insn in iced.Decoder(64, code, ip=ip):
        if insn.is_invalid:
            return
        yield insn


def instruction_starts(code: bytes, ip: int) -> list[int]:
    """Addresses of every instruction start when `code` (a whole function) is decoded from `ip`."""
    return [insn.ip for insn in iter_instructions(code, ip)]


def format_insn(insn: iced.Instruction) -> str:
    formatter = iced.Formatter(iced.FormatterSyntax.INTEL)
    return str(formatter.format(insn))


_CC = iced.ConditionCode


def condition_holds(cc: int, eflags: int) -> bool:
    """Whether a jcc/setcc/cmovcc condition code (iced `ConditionCode`) holds under `eflags`."""
    cf = bool(eflags & FLAG_CF)
    zf = bool(eflags & FLAG_ZF)
    sf = bool(eflags & FLAG_SF)
    of = bool(eflags & FLAG_OF)
    pf = bool(eflags & FLAG_PF)
    table = {
        _CC.O: of, _CC.NO: not of, _CC.B: cf, _CC.AE: not cf, _CC.E: zf, _CC.NE: not zf,
        _CC.BE: cf or zf, _CC.A: not (cf or zf), _CC.S: sf, _CC.NS: not sf, _CC.P: pf,
        _CC.NP: not pf, _CC.L: sf != of, _CC.GE: sf == of, _CC.LE: zf or sf != of,
        _CC.G: not zf and sf == of,
    }  # fmt: skip
    return table[cc]  # type: ignore[index]  # iced passes its enums as plain ints
