"""Jump optimization (optprobes): may a site's first 5 bytes become a `jmp rel32` to a detour?

The rules start from the kernel's (arch/x86/kernel/kprobes/opt.c, can_optimize()), for user
space: the 5 bytes replace whole instructions (the "region"), all of which must run correctly
from the detour; no jump anywhere in the module may land inside the region (it would land in
the middle of our jmp). The kernel refuses a function with any indirect jump; dynprobe reads the
whole module, so (given a reader of its bytes) it decodes a function's switch tables
(arch/x86_64/jumptables.py) and refuses only when a target lands in the region or a table
cannot be bounded; any other indirect jump (a tail call through a pointer) lands only where the
module takes an address, which the caller counts among `module_targets`. A `jmp [rip+x]` (a PLT
stub, a tail call) may end the region; a `ret` can only end the region (a 5-byte leaf function:
`lea eax,[rdi+rdi+1]; ret`); a call can only end it too, and is relocated as "push the original
return address; jmp" (an indirect one as a `jmp` through the same operand), so no return address
ever points into a detour. A function shorter than the jump (`ret`, `xor eax,eax; ret`) may take
it when the bytes after it, up to the next 16-byte boundary, are alignment padding nothing runs
or jumps to (the caller gives them): the jump covers them.

Pure: function bytes + addresses in, a plan or a reason out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Container, Sequence

import iced_x86 as iced

from dynprobe.arch.x86_64.decode import decode_one, iter_instructions
from dynprobe.arch.x86_64.jumptables import IsCode, Landing, Reader, landing
from dynprobe.arch.x86_64.relocate import call_as_jump, jump_to, relocate, retarget
from dynprobe.errors import OptimizeRefusal
from dynprobe.frozen import frozen

JMP_REL32_LEN = 5

_M = iced.Mnemonic
_FC = iced.FlowControl

# Instructions that cannot run from a detour: the kernel would return into it (int, syscall: the
# detour must stay freeable), they trap on purpose, or leave to another code segment. A near `ret`
# runs from a detour as where it was (it reads nothing of where it is), but only as the region's
# last instruction: what follows a `ret` is reached by jumps alone.
_UNRELOCATABLE = {
    _M.RETF, _M.INT, _M.INT1, _M.INT3, _M.INTO, _M.IRET, _M.IRETD, _M.IRETQ, _M.SYSCALL,
    _M.SYSENTER, _M.SYSEXIT, _M.SYSRET, _M.SYSRETQ, _M.UD0, _M.UD1, _M.UD2, _M.HLT, _M.XBEGIN,
}  # fmt: skip


@frozen
class OptimizePlan:
    """The instructions the jump replaces (decoded at their real addresses), and the direct
    branches from elsewhere that land inside them (`moved`), to be aimed at the detour's copy of
    the instruction they land on (relocate.py's `retarget`)."""

    site: int
    region: tuple[iced.Instruction, ...]
    moved: tuple[iced.Instruction, ...] = ()

    @functools.cached_property
    def length(self) -> int:
        return sum(insn.len for insn in self.region)

    @property
    def overwritten(self) -> int:
        """The bytes the jump takes: the region's, and a tiny function's padding after it."""
        return max(self.length, JMP_REL32_LEN)

    @property
    def resume_at(self) -> int:
        return self.site + self.length


def _branch_target(insn: iced.Instruction) -> int | None:
    if insn.op0_kind in (iced.OpKind.NEAR_BRANCH16, iced.OpKind.NEAR_BRANCH32, iced.OpKind.NEAR_BRANCH64):
        return int(insn.near_branch_target)
    return None


def is_pointer_jump(insn: iced.Instruction) -> bool:
    """`jmp [rip+x]`: a jump through one pointer (a PLT stub's, a tail call through the GOT),
    not through a table indexed by a register (a switch), so it never lands inside a function."""
    return (
        insn.is_jmp_near_indirect
        and insn.op0_kind == iced.OpKind.MEMORY
        and insn.memory_base == iced.Register.RIP
        and insn.memory_index == iced.Register.NONE
    )


def plt_slot(code: bytes, start: int) -> int | None:
    """The pointer a PLT stub at `start` jumps through (`jmp [rip+x]`, `bnd jmp [rip+x]`, after
    an `endbr64` or not), or None for code that is no such stub (PLT0, a lazy entry of an IBT
    .plt that pushes its index)."""
    for insn in iter_instructions(code, start):
        if is_pointer_jump(insn):
            return int(insn.ip_rel_memory_address)
        if insn.mnemonic not in (_M.ENDBR64, _M.NOP):
            return None
    return None


def branches_in(code: bytes, start: int) -> list[tuple[int, int]]:
    """(where, where to) of the direct jumps, jccs and calls in `code` (one function, placed at
    `start`)."""
    return [(int(insn.ip), t) for insn in iter_instructions(code, start) if (t := _branch_target(insn)) is not None]


def short_jump(code: bytes, at: int) -> int | None:
    """The length of the `jmp rel8` `code` starts with (at `at`), None if it starts with no such jump."""
    insn = decode_one(code, at)
    return insn.len if insn is not None and insn.code == iced.Code.JMP_REL8_64 else None


def padding_length(code: bytes, at: int) -> int:
    """How many bytes of `code` (at `at`) are whole nops and int3s from its start."""
    covered = 0
    for insn in iter_instructions(code, at):
        if insn.mnemonic not in (_M.NOP, _M.INT3):
            break
        covered += insn.len
    return min(covered, len(code))


def can_optimize(
    code: bytes,
    func_start: int,
    site: int,
    *,
    other_probes: Container[int] = frozenset(),
    module_targets: Container[int] = frozenset(),
    bias: int = 0,
    read: Reader | None = None,
    is_code: IsCode | None = None,
    padding: bytes = b"",
    branches_to: Callable[[int], Sequence[tuple[iced.Instruction, int]] | None] | None = None,
) -> OptimizePlan | OptimizeRefusal:
    """Whether the site at `site`, in the function whose whole code is `code` (at `func_start`),
    can take a 5-byte jump; the plan's instructions are decoded at those addresses (where the
    code runs, to be relocated from there). `other_probes`: other probes' addresses.
    `module_targets`: where the module's other code may land, as link-time addresses (`bias`
    below where they run): its direct branches' targets (glibc's mempcpy jumps to a label inside
    memmove) and the addresses it takes. `read(addr, size)`: the module's bytes at a run-time
    address (its switch tables; None: every indirect jump but a `jmp [rip+x]` is refused);
    `is_code(addr)`: whether a run-time address is the module's code (a table nothing bounds is
    read as far as its entries land there: arch/x86_64/jumptables.py).
    `padding`: the bytes after the function up to the next 16-byte boundary, where no symbol
    starts. `branches_to(addr)`: the direct branches that land at a run-time `addr` of the
    region, each with the bytes from its start no other code runs (its own, and the padding
    after a `jmp`), or None when something else may land there (a taken address): given, such
    branches are taken along (the plan's `moved`) where each can be re-aimed in place."""
    if not code:
        return OptimizeRefusal.FUNCTION_UNKNOWN
    func_end = func_start + len(code)
    insns = list(iter_instructions(code, func_start))
    if not insns or int(insns[-1].next_ip) < func_end:
        return OptimizeRefusal.UNDECODABLE  # data or bytes the decoder rejects inside the function
    starts = {int(i.ip): i for i in insns}
    if site not in starts:
        return OptimizeRefusal.UNDECODABLE
    region: list[iced.Instruction] = []
    addr = site
    while addr < min(
        site + JMP_REL32_LEN, func_end
    ):  # (the instructions cover the function: each next one starts there)
        insn = starts[addr]
        region.append(insn)
        addr += insn.len
    region_end = addr
    if region_end < site + JMP_REL32_LEN:  # a tiny function: the jump would cover its padding too
        if not _covers_padding(region[-1], padding, site + JMP_REL32_LEN - func_end, at=func_end):
            return OptimizeRefusal.TOO_SHORT
        region_end = site + JMP_REL32_LEN
    landed: set[int] = set()  # addresses inside the region direct branches land on
    own: dict[int, set[int]] = {}  # of those, the ones the function's own branches land on: from where
    for i, insn in enumerate(insns):
        if (insn.flow_control == _FC.INDIRECT_BRANCH or insn.is_jmp_near_indirect) and not is_pointer_jump(insn):
            lands = Landing.UNBOUNDED if read is None else landing(insns, i, read, is_code=is_code)
            if lands is Landing.UNBOUNDED:
                return OptimizeRefusal.INDIRECT_JUMP
            if isinstance(lands, frozenset) and any(site < target < region_end for target in lands):
                return OptimizeRefusal.JUMP_INTO_REGION
        target = _branch_target(insn)
        if target is not None and site < target < region_end:
            landed.add(target)
            own.setdefault(target, set()).add(int(insn.ip))
    inside = range(site + 1, region_end)
    landed.update(addr for addr in inside if addr - bias in module_targets)
    if not landed <= {int(insn.ip) for insn in region}:
        return OptimizeRefusal.JUMP_INTO_REGION  # (into an instruction, or the padding a tiny function's jump covers)
    moved = _taken_along(sorted(landed), branches_to, own=own, site=site, region_end=region_end)
    if moved is None:
        return OptimizeRefusal.JUMP_INTO_REGION
    if any(addr in other_probes for addr in inside):
        return OptimizeRefusal.REGION_OVERLAP
    for insn in region:
        if insn.mnemonic in _UNRELOCATABLE or insn.is_call_far or insn.is_jmp_far:
            return OptimizeRefusal.UNRELOCATABLE_INSN
        if insn.mnemonic == _M.RET and insn is not region[-1]:
            return OptimizeRefusal.UNRELOCATABLE_INSN
        if insn.is_call_near_indirect and (insn is not region[-1] or insn.code != iced.Code.CALL_RM64):
            return OptimizeRefusal.UNRELOCATABLE_INSN  # its callee would return into the patched bytes
    # (An indirect jmp allowed, through one pointer, is 6 bytes or more: it ends the region.)
    # A direct call (5 bytes or more) always ends the region, which stops at the first instruction
    # boundary at or past site+5; an indirect one (`call [rip+mcount@GOT]` of -pg code) must end it.
    return OptimizePlan(site, tuple(region), moved)


def _taken_along(
    landed: list[int],
    branches_to: Callable[[int], Sequence[tuple[iced.Instruction, int]] | None] | None,
    *, own: dict[int, set[int]], site: int, region_end: int,
) -> tuple[iced.Instruction, ...] | None:  # fmt: skip
    """The branches that land at the `landed` addresses inside the region, each one that can be
    re-aimed in place (in the bytes no other code runs, outside the region); None if one cannot,
    or something else lands there, or `branches_to` misses one of the function's `own` branches
    there (its module's scan decodes other ranges than the function's: what it misses would
    still land inside the jump)."""
    moved: list[iced.Instruction] = []
    for addr in landed:
        found = branches_to(addr) if branches_to is not None else None
        if not found or not own.get(addr, set()) <= {int(branch.ip) for branch, _ in found}:
            return None
        for branch, room in found:
            start = int(branch.ip)
            again = retarget(branch, addr)  # (its length: where it is aimed makes no difference)
            if again is None or len(again) > room or (start < region_end and start + len(again) > site):
                return None
            moved.append(branch)
    return tuple(moved)


def _covers_padding(last: iced.Instruction, padding: bytes, needed: int, *, at: int) -> bool:
    """Whether a jump may run `needed` bytes past a function whose last instruction is `last`
    into `padding` (at `at`): the function never runs into it (it ends in a `ret` or a jump) and
    those bytes are alignment padding (nops and int3s, whole)."""
    if last.flow_control not in (_FC.RETURN, _FC.UNCONDITIONAL_BRANCH, _FC.INDIRECT_BRANCH) or len(padding) < needed:
        return False
    return padding_length(padding, at) >= needed


def relocate_region(plan: OptimizePlan, at: int) -> bytes | None:
    """The region's instructions re-encoded to run at `at`, then the jump back to `resume_at`.
    A final `call` becomes: push the original return address (flags untouched), jmp the callee.
    None if a RIP-relative operand or a branch cannot reach from `at`."""
    moved = relocate_region_map(plan, at)
    return None if moved is None else moved[0]


def relocate_region_map(plan: OptimizePlan, at: int) -> tuple[bytes, dict[int, int]] | None:
    """`relocate_region`, and where each instruction of the region starts in the copy (original
    address -> address in the copy)."""
    out = b""
    starts: dict[int, int] = {}
    for insn in plan.region:
        here = at + len(out)
        starts[int(insn.ip)] = here
        if insn.is_call_near or insn.is_call_near_indirect:
            ret = int(insn.next_ip)
            out += (
                b"\x48\x8d\x64\x24\xf8"  # lea rsp, [rsp-8]        (lea: no flags)
                + b"\xc7\x04\x24" + (ret & 0xFFFFFFFF).to_bytes(4, "little")  # mov dword [rsp], lo
                + b"\xc7\x44\x24\x04" + (ret >> 32).to_bytes(4, "little")  # mov dword [rsp+4], hi
            )  # fmt: skip
            if insn.is_call_near_indirect:
                jump = relocate(call_as_jump(insn), at + len(out))
                if jump is None:
                    return None
                return out + jump, starts
            out += jump_to(at + len(out), int(insn.near_branch_target))
            return out, starts  # a call ends the region: the callee returns to the original code
        moved = relocate(insn, here)
        if moved is None:
            return None
        out += moved
    return out + jump_to(at + len(out), plan.resume_at), starts
