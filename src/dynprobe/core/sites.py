"""What can be told about a probe site from the file alone: instruction boundaries, the first
instruction's resume plan, default event names. Cached per function: attaching thousands of probes
decodes each function once."""

from __future__ import annotations

import weakref

import iced_x86 as iced

from dynprobe.arch.x86_64 import INT3, ResumePlan, decode_one, instruction_starts, plan_resume
from dynprobe.errors import Refusal
from dynprobe.symbols.elf import ElfImage, load_elf
from dynprobe.symbols.resolve import Location


def check_location(location: Location) -> Refusal | None:
    """Whether a location can take a trap probe, judged from the file alone."""
    image = load_elf(location.path)
    func = location.function
    if func is None or func.size == 0:
        func = image.function_at(location.vaddr)
    if func is None:
        return Refusal.UNKNOWN_FUNCTION
    at_entry = location.vaddr == func.addr  # an instruction starts there: no need to decode up to it
    if not at_entry and location.vaddr not in _starts(image, func.addr, func.size):
        return Refusal.NOT_INSN_BOUNDARY
    decoded = first_instruction(location)
    return decoded if isinstance(decoded, Refusal) else None


def first_instruction(location: Location) -> tuple[iced.Instruction, ResumePlan] | Refusal:
    """The instruction at the location, as the file has it (decoded at its link-time address),
    and how a trap there resumes; or why no trap probe can be there. Decoded once for all the
    processes that map the file (and for both the check and the site)."""
    image = load_elf(location.path)
    known = _DECODED.setdefault(image, {})
    decoded = known.get(location.vaddr)
    if decoded is None:
        decoded = known[location.vaddr] = _decode_site(image, location.vaddr)
    return decoded


_DECODED: weakref.WeakKeyDictionary[ElfImage, dict[int, tuple[iced.Instruction, ResumePlan] | Refusal]] = (
    weakref.WeakKeyDictionary()
)


def _decode_site(image: ElfImage, vaddr: int) -> tuple[iced.Instruction, ResumePlan] | Refusal:
    insn = decode_one(image.code(vaddr, 15), vaddr)
    if insn is None:
        return Refusal.UNDECODABLE
    if insn.mnemonic == 0 or image.code(vaddr, 1) == bytes([INT3]):
        return Refusal.FOREIGN_INT3
    plan = plan_resume(insn)
    return plan if isinstance(plan, Refusal) else (insn, plan)


# Per image, as _DECODED: a file rewritten in place is another image (load_elf), and what an
# image evicted from load_elf's cache knew goes with it.
_STARTS: weakref.WeakKeyDictionary[ElfImage, dict[tuple[int, int], frozenset[int]]] = weakref.WeakKeyDictionary()


def _starts(image: ElfImage, addr: int, size: int) -> frozenset[int]:
    known = _STARTS.setdefault(image, {})
    starts = known.get((addr, size))
    if starts is None:
        starts = known[addr, size] = frozenset(instruction_starts(image.code(addr, size), addr))
    return starts


def default_event_name(location: Location, is_return: bool = False) -> str:
    """tracefs-like default event names: p_main, p_main_4, p_libc_so_6_0x1139, r_main."""
    kind = "r" if is_return else "p"
    if location.label.startswith("0x"):
        raw = f"{kind}_{location.basename}_{location.label}"
    else:
        raw = f"{kind}_" + location.label.replace("+0x", "_").replace("+", "_")
    return identifier(raw)


def identifier(text: str) -> str:
    """`text` as (part of) an event name: letters, digits and '_', at most 64 of them."""
    return "".join(c if c.isalnum() or c == "_" else "_" for c in text)[:64]
