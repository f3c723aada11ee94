"""Where a function's indirect jumps may land (issue 26): the switch tables GCC and Clang emit,
decoded from the function's instructions and the module's bytes, as objtool finds the kernel's.

Position-independent code (shared objects, PIE) dispatches through a table of 32-bit offsets
from the table, bounded by a compare before it:

    cmp   eI, N            ; ja default    (N + 1 entries; jae: N; a movzx from 8 bits: 256)
    lea   rT, [rip+TABLE]
    movsxd rA, dword [rT + rI*4]
    add   rA, rT
    jmp   rA               ; (notrack jmp under CET)

and code built without -fPIC through one of absolute addresses: `jmp [rI*8 + TABLE]`, or a
`mov rA, [rI*8 + TABLE]` then `jmp rA`; an entry at a constant place (`movsxd rA, [rip+TABLE]`)
is a table of one. A table of offsets whose index nothing bounds (glibc's string functions: the index is a bit scan
plus or minus an offset, or a sum) is bounded by what it holds, where the caller says what is
code (`is_code`) and the table's first entry is known: the offsets are from the table's own
`lea`, and the load adds no displacement to it (GCC's switch on cases from -2 loads
`[rT + rI*4 + 8]`: its first entries are before where the load begins). Every entry of a table
lands in the module's code, and the index never goes below 0, so the entries read from the
first while each lands in code hold the whole table, and perhaps what follows it (more targets:
refusals, never fewer); a first entry that does not, or MAX_ENTRIES that all do, is
`UNBOUNDED`, as is a table of addresses nothing bounds. Any other
indirect jump goes through a value made elsewhere (a tail call through a pointer, a computed
goto's table of label addresses, a method): it lands only where the module takes an address
(its relocations, its RIP-relative `lea`s), which the caller knows: `THROUGH_POINTER`.

The instructions that run into the jump are walked back (`_Code.before`): the one before it, or,
after a `jmp` or a `ret`, the branches to the code, each way a few places deep. Where code is
also a branch's target and the code before runs into it, only the way before is walked: a
compiler puts the table's `lea` and the compare that bounds the index on the dispatch's own way
(no control-flow graph proves it). Pure: decoded instructions and a reader of the module's
bytes in, the targets out.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import iced_x86 as iced

from dynprobe.frozen import frozen

if TYPE_CHECKING:  # the enum types exist in the stubs only; at run time the values are ints
    from iced_x86._iced_x86_py import Register as RegisterT

MAX_ENTRIES = 4096  # a table's entries read at most (a bound above it: unbounded)
LOOK_BACK = 64  # instructions looked at before a jump for the table's parts and its bound
MERGES, MERGE_WAYS = 3, 8  # places where branches meet walked through (each up to this many branches)

_R = iced.Register
_C = iced.Code
_FULL = iced.RegisterExt.full_register
_WRITES = (iced.OpAccess.WRITE, iced.OpAccess.READ_WRITE, iced.OpAccess.COND_WRITE, iced.OpAccess.READ_COND_WRITE)
_INFO = iced.InstructionInfoFactory()
_NO_FALL_THROUGH = (iced.FlowControl.UNCONDITIONAL_BRANCH, iced.FlowControl.INDIRECT_BRANCH, iced.FlowControl.RETURN,
                    iced.FlowControl.INTERRUPT, iced.FlowControl.EXCEPTION)  # fmt: skip
_CALLER_SAVED = frozenset((_R.RAX, _R.RCX, _R.RDX, _R.RSI, _R.RDI, _R.R8, _R.R9, _R.R10, _R.R11))
# a compare's unsigned jumps to the default (ja, jae) or to the dispatch (jbe, jb): entries past N
_BOUNDS = {
    iced.Mnemonic.JA: 1, iced.Mnemonic.JBE: 1, iced.Mnemonic.JAE: 0, iced.Mnemonic.JB: 0,
}  # fmt: skip
_IMMEDIATES = (iced.OpKind.IMMEDIATE8, iced.OpKind.IMMEDIATE32, iced.OpKind.IMMEDIATE8TO32, iced.OpKind.IMMEDIATE8TO64,
               iced.OpKind.IMMEDIATE32TO64)  # fmt: skip
_FROM_BYTE = (_C.MOVZX_R32_RM8, _C.MOVZX_R64_RM8)
_BIT_SCANS = (iced.Mnemonic.BSF, iced.Mnemonic.BSR, iced.Mnemonic.TZCNT, iced.Mnemonic.LZCNT)
_COPIES = (
    _C.MOV_R32_RM32, _C.MOV_RM32_R32, _C.MOV_R64_RM64, _C.MOV_RM64_R64, _C.MOVZX_R32_RM8, _C.MOVZX_R32_RM16,
    _C.MOVZX_R64_RM8, _C.MOVZX_R64_RM16,
)  # fmt: skip


class Landing(enum.Enum):
    UNBOUNDED = "a switch table whose size the code does not bound"
    THROUGH_POINTER = "a value made elsewhere: where the module takes an address"


Reader = Callable[[int, int], bytes | None]  # (address, size) -> the module's bytes there, or None
IsCode = Callable[[int], bool]  # an address -> whether the module's code is there


def landing(
    insns: Sequence[iced.Instruction], at: int, read: Reader, *, is_code: IsCode | None = None
) -> frozenset[int] | Landing:
    """Where the indirect jump `insns[at]` (of a whole function's `insns`) may land: a decoded
    table's targets, or a `Landing`. The jump's register is followed back through copies and
    the pointer guard's mangling (`ror`, `xor` of the same register) to what made it: a load (a
    table's or a pointer's), a call's result, the caller's argument or a `lea` of one label;
    where code is reached by several branches, along each (MERGES deep at most), the targets
    of all of them. Made any other way, nothing says where it lands: `UNBOUNDED`. `is_code`:
    tables nothing bounds are read as far as they land in code (without: `UNBOUNDED`)."""
    code = _Code(insns, is_code)
    jump = insns[at]
    if jump.op0_kind == iced.OpKind.MEMORY:
        return code.loaded(at, jump, read)
    return _follow(code, _FULL(jump.op0_register), at, read, MERGES)


def _follow(code: _Code, register: RegisterT, before: int, read: Reader, merges: int) -> frozenset[int] | Landing:
    """Where the value of `register` at `insns[before]` may jump to (see `landing`)."""
    for _ in range(LOOK_BACK):
        found = code.definition(before, register)
        if isinstance(found, _Merge):
            ways = [_follow(code, register, source, read, merges - 1) for source in found.sources] if merges else []
            if not ways or Landing.UNBOUNDED in ways:
                return Landing.UNBOUNDED
            tables = [way for way in ways if isinstance(way, frozenset)]  # (pointers: the module's count)
            return frozenset().union(*tables) if tables else Landing.THROUGH_POINTER
        if not isinstance(found, tuple):
            return Landing.THROUGH_POINTER if found is _From.CALLER else Landing.UNBOUNDED
        before, insn = found
        if insn.flow_control in (iced.FlowControl.CALL, iced.FlowControl.INDIRECT_CALL):
            return Landing.THROUGH_POINTER  # (a function that returns a pointer)
        kinds = (insn.op0_kind, insn.op1_kind) if insn.op_count == 2 else ()
        if insn.mnemonic == iced.Mnemonic.MOV and kinds == (iced.OpKind.REGISTER, iced.OpKind.REGISTER):
            register = _FULL(insn.op1_register)
        elif insn.mnemonic == iced.Mnemonic.MOV and kinds == (iced.OpKind.REGISTER, iced.OpKind.MEMORY):
            return code.loaded(before, insn, read)
        elif insn.mnemonic == iced.Mnemonic.ADD and kinds == (iced.OpKind.REGISTER, iced.OpKind.REGISTER):
            return code.relative(before, (insn.op0_register, insn.op1_register), read)
        elif insn.code == _C.LEA_R64_M and insn.memory_index_scale == 1 and not insn.memory_displacement \
                and _R.NONE not in (insn.memory_base, insn.memory_index):  # fmt: skip
            return code.relative(before, (insn.memory_base, insn.memory_index), read)
        elif insn.code == _C.LEA_R64_M and insn.memory_base == _R.RIP:
            return frozenset((int(insn.memory_displacement),))
        elif insn.mnemonic not in (iced.Mnemonic.ROR, iced.Mnemonic.ROL, iced.Mnemonic.XOR) \
                or kinds[1:] == (iced.OpKind.REGISTER,):  # fmt: skip
            return Landing.UNBOUNDED
        # (else PTR_DEMANGLE: the same register, turned and xored with the guard: on to what made it)
    return Landing.UNBOUNDED


class _From(enum.Enum):
    CALLER = "the function's entry: the value it was called with"


@frozen
class _Merge:
    """Code that several branches (and nothing before it) run into: their indices."""

    sources: tuple[int, ...]


class _Code:
    """One function's instructions, walked back from one along the way the code runs into it."""

    def __init__(self, insns: Sequence[iced.Instruction], is_code: IsCode | None) -> None:
        self.insns = insns
        self.is_code = is_code
        self._sources: dict[int, list[int]] | None = None  # an address -> the direct branches to it

    def _branches_to(self, at: int) -> list[int]:
        if self._sources is None:
            self._sources = {}
            for k, insn in enumerate(self.insns):
                if insn.op0_kind in (iced.OpKind.NEAR_BRANCH32, iced.OpKind.NEAR_BRANCH64, iced.OpKind.NEAR_BRANCH16):
                    self._sources.setdefault(int(insn.near_branch_target), []).append(k)
        return self._sources.get(int(self.insns[at].ip), [])

    def before(self, at: int) -> Iterator[int | _From | _Merge]:
        """The instructions that run before `insns[at]`, latest first (LOOK_BACK at most): the
        one before it, or, after a `jmp` or a `ret`, the one branch to it; then `_From.CALLER` at
        the function's entry, or a `_Merge` of the branches to code several reach (and nothing
        before it runs into: the walk ends there; up to MERGES of them, else it just ends)."""
        for _ in range(LOOK_BACK):
            if self._falls_into(at):
                at -= 1
            else:
                sources = self._branches_to(at)
                if at == 0 and not sources:
                    yield _From.CALLER
                    return
                if len(sources) != 1:
                    if 1 < len(sources) <= MERGE_WAYS:
                        yield _Merge(tuple(sources))
                    return
                (at,) = sources
            yield at

    def _falls_into(self, at: int) -> bool:
        """Whether the code before `insns[at]` runs on into it: not after a `jmp` or a `ret`, nor
        after the padding (nops, int3s) that follows one; nops from the function's entry do."""
        prev = at - 1
        while prev >= 0 and self.insns[prev].mnemonic in (iced.Mnemonic.NOP, iced.Mnemonic.INT3):
            prev -= 1
        if prev < 0:
            return at > 0
        return self.insns[prev].flow_control not in _NO_FALL_THROUGH

    def definition(self, before: int, register: RegisterT) -> tuple[int, iced.Instruction] | _From | _Merge | None:
        """The last instruction before `insns[before]` that writes `register` (a call writes the
        registers a callee may change); `_From.CALLER` if none does since the function's entry,
        a `_Merge` if the walk comes to code several branches reach; None if it ends first."""
        for at in self.before(before):
            if isinstance(at, _From | _Merge):
                return at
            insn = self.insns[at]
            if _writes(insn, register) or (insn.flow_control in (iced.FlowControl.CALL, iced.FlowControl.INDIRECT_CALL)
                                           and register in _CALLER_SAVED):  # fmt: skip
                return at, insn
        return None

    def loaded(self, at: int, insn: iced.Instruction, read: Reader) -> frozenset[int] | Landing:
        """Where a jump through the memory operand of `insns[at]` lands: a table of absolute
        addresses (`[rI*8 + TABLE]`, code built without -fPIC), or any pointer: the module's
        relocations say where those are (or, in a file not position-independent, their bytes)."""
        if insn.memory_base == _R.NONE and insn.memory_index != _R.NONE and insn.memory_index_scale == 8:
            return self.table(at, read, table=insn.memory_displacement, origin=None, index=insn.memory_index)
        return Landing.THROUGH_POINTER

    def relative(self, add_at: int, added: tuple[RegisterT, RegisterT], read: Reader) -> frozenset[int] | Landing:
        """`add rA, rB` (or `lea rC, [rA + rB]`) before a jump: a table of 32-bit offsets
        (`movsxd rA, [rT + rI*4]`, rT a `lea [rip+TABLE]`), added to rB (a `lea [rip+ORIGIN]`:
        the table itself, or a label)."""
        first, second = added
        for offsets, origin in ((first, second), (second, first)):
            load = self.definition(add_at, _FULL(offsets))
            if not isinstance(load, tuple) or load[1].code != _C.MOVSXD_R64_RM32:
                continue
            load_at, movsxd = load
            start = self.rip_address(add_at, origin)
            if movsxd.memory_base == _R.RIP and start is not None:  # (one entry, at a constant place)
                return self.table(load_at, read, table=int(movsxd.memory_displacement), origin=start, index=None)
            table = self.rip_address(load_at, movsxd.memory_base)
            if table is None or start is None or movsxd.memory_index == _R.NONE or movsxd.memory_index_scale != 4:
                return Landing.UNBOUNDED
            # Its first entry is where the `lea` points when the offsets are from the table and the
            # load adds nothing to it: only then do the entries from there hold every case (the
            # index, not below 0) for a table nothing bounds (GCC's `movsxd rA, [rT + rI*4 + 8]`
            # of cases from -2: the first two entries are before the displacement)
            first = table if start == table and not movsxd.memory_displacement else None
            table = (table + movsxd.memory_displacement) & ((1 << 64) - 1)
            return self.table(load_at, read, table=table, origin=start, index=movsxd.memory_index, first=first)
        return Landing.UNBOUNDED

    def rip_address(self, before: int, register: RegisterT) -> int | None:
        """The address a `lea register, [rip+X]` last put in `register` before `insns[before]`."""
        if register == _R.NONE:
            return None
        found = self.definition(before, _FULL(register))
        if not isinstance(found, tuple) or found[1].code != _C.LEA_R64_M or found[1].memory_base != _R.RIP:
            return None
        return int(found[1].memory_displacement)

    def table(self, load_at: int, read: Reader, *, table: int, origin: int | None,
              index: RegisterT | None, first: int | None = None) -> frozenset[int] | Landing:  # fmt: skip
        """The targets of the table at `table` indexed by `index` (None: its first entry only) at
        `insns[load_at]`: 32-bit offsets from `origin`, or (None) 64-bit addresses. `first`:
        where its first entry is known to be (`held` reads one nothing bounds from there)."""
        width = 8 if origin is None else 4
        entries = 1 if index is None else self.bound(load_at, _FULL(index))
        if entries is None:
            if first is None or origin is None or self.is_code is None:
                return Landing.UNBOUNDED
            return self.held(read, self.is_code, table=first, origin=origin)
        if not 0 < entries <= MAX_ENTRIES:
            return Landing.UNBOUNDED
        data = read(table, width * entries)
        if data is None or len(data) != width * entries:
            return Landing.UNBOUNDED
        if origin is None:
            return frozenset(struct.unpack(f"<{entries}Q", data))
        return frozenset(origin + offset for offset in struct.unpack(f"<{entries}i", data))

    @staticmethod
    def held(read: Reader, is_code: IsCode, *, table: int, origin: int) -> frozenset[int] | Landing:
        """The targets of a table of offsets nothing bounds, by what it holds: its entries from
        the first (at `table`) while each lands in code (see the module's docstring)."""
        width = 4
        targets: set[int] = set()
        for k in range(MAX_ENTRIES):
            data = read(table + width * k, width)
            if data is None or len(data) != width:
                break
            target = origin + int.from_bytes(data, "little", signed=True)
            if not is_code(target):
                break
            targets.add(target)
        else:
            return Landing.UNBOUNDED
        return frozenset(targets) if targets else Landing.UNBOUNDED

    def bound(self, load_at: int, index: RegisterT) -> int | None:
        """How many entries the index may select: from the compare (and unsigned jump) that bounds
        it before `insns[load_at]`, or that bounds a register it was copied from (`mov eI, eJ`,
        before or after the compare) or the memory it was loaded from; a `movzx` from 8 bits
        bounds it to 256, a bit scan to the register's width. None when nothing does."""
        names = {_FULL(index)}
        narrowest: int | None = None
        compared: dict[RegisterT, int | None] = {}  # registers compared after the copies met: their bounds
        loaded_from: tuple[RegisterT, RegisterT, int, int] | None = None  # the memory the index was loaded from
        for i in self.before(load_at):
            if not isinstance(i, int):
                break
            insn = self.insns[i]
            if insn.mnemonic == iced.Mnemonic.CMP and insn.op1_kind in _IMMEDIATES:
                bound = self._compare_bound(i, load_at)
                if insn.op0_kind == iced.OpKind.MEMORY:
                    if _memory(insn) == loaded_from:
                        return _narrower(bound, narrowest)
                elif _FULL(insn.op0_register) in names:
                    return _narrower(bound, narrowest)
                else:
                    compared.setdefault(_FULL(insn.op0_register), bound)
            elif loaded_from is not None and (_writes(insn, loaded_from[0]) or _writes(insn, loaded_from[1])):
                break  # (the memory compared before is another)
            elif written := [name for name in names if _writes(insn, name)]:
                names.difference_update(written)  # (before this, the register held something else)
                if insn.mnemonic in _BIT_SCANS:  # (0 to the width: lzcnt and tzcnt of 0)
                    return _narrower((64 if iced.RegisterExt.is_gpr64(insn.op0_register) else 32) + 1, narrowest)
                if insn.code in _FROM_BYTE:
                    narrowest = _narrower(256, narrowest)
                if insn.code not in _COPIES:
                    break  # (made otherwise: bounded by nothing found before)
                if insn.op1_kind == iced.OpKind.MEMORY:
                    loaded_from = _memory(insn)
                elif _FULL(insn.op1_register) in compared:
                    return _narrower(compared[_FULL(insn.op1_register)], narrowest)
                else:
                    names.add(_FULL(insn.op1_register))
            else:
                for changed in [r for r in compared if _writes(insn, r)]:
                    del compared[changed]  # (its value at the compare was made here)
        return narrowest

    def _compare_bound(self, at: int, load_at: int) -> int | None:
        """The entries the compare `insns[at]` allows, by the unsigned jump after it."""
        jump = next((j for j in self.insns[at:load_at] if j.flow_control == iced.FlowControl.CONDITIONAL_BRANCH), None)
        if jump is None or jump.mnemonic not in _BOUNDS:
            return None
        return int(self.insns[at].immediate(1)) + _BOUNDS[jump.mnemonic]


def _memory(insn: iced.Instruction) -> tuple[RegisterT, RegisterT, int, int]:
    """The memory operand of `insn`: base, index, scale, displacement."""
    return insn.memory_base, insn.memory_index, insn.memory_index_scale, insn.memory_displacement


def _writes(insn: iced.Instruction, register: RegisterT) -> bool:
    return any(
        _FULL(used.register) == register and used.access in _WRITES for used in _INFO.info(insn).used_registers()
    )


def _narrower(bound: int | None, other: int | None) -> int | None:
    return other if bound is None else bound if other is None else min(bound, other)
