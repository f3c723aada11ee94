"""can_optimize reasons and region relocation, as byte tables (docs/architecture.md §5, hazards 12-15)."""

from __future__ import annotations

import pytest

from dynprobe.arch.x86_64 import decode_one
from dynprobe.arch.x86_64.optimize import (
    OptimizePlan,
    branches_in,
    can_optimize,
    plt_slot,
    relocate_region,
    short_jump,
)  # fmt: skip
from dynprobe.arch.x86_64.relocate import retarget
from dynprobe.errors import OptimizeRefusal

F = 0x401000  # function start
HIGH = 0x7F3A_9C41_2000  # where shared libraries run: far above 4 GiB

# name -> (function bytes, site offset, other probe offsets, expected reason or region length)
TABLE: dict[str, tuple[str, int, tuple[int, ...], OptimizeRefusal | int]] = {
    "prologue push/mov/sub": ("554889e54883ec10" + "90c9c3", 0, (), 1 + 3 + 4),
    "endbr64 + push": ("f30f1efa55" + "4889e5c9c3", 0, (), 4 + 1),
    "probe after endbr64": ("f30f1efa554889e5" + "c9c3", 4, (), 1 + 3 + 1),
    "one-byte ret function": ("c3", 0, (), OptimizeRefusal.TOO_SHORT),
    "rep ret too short": ("f3c3", 0, (), OptimizeRefusal.TOO_SHORT),
    "ret inside the region": ("31c0c3" + "90909090", 0, (), OptimizeRefusal.UNRELOCATABLE_INSN),
    "ret ends the region (5-byte leaf)": ("8d443f01" + "c3", 0, (), 4 + 1),
    "ret imm16 ends the region": ("31c0" + "c20800", 0, (), 2 + 3),
    "far ret ends the region": ("31c0" + "9090cb", 0, (), OptimizeRefusal.UNRELOCATABLE_INSN),
    "jmp back into entry+2": ("554889e5" + "90" * 4 + "ebf8" + "c3", 0, (), OptimizeRefusal.JUMP_INTO_REGION),
    "jcc into entry+1 (loop head)": ("4883ef01" + "75fb" + "c3" + "90" * 4, 0, (), OptimizeRefusal.JUMP_INTO_REGION),
    "jump to the site itself is fine": ("4883ef014883c701" + "75f6" + "c3", 0, (), 4 + 4),
    "indirect jmp rax (tail call)": ("554889e5" + "90" * 4 + "ffe0", 0, (), OptimizeRefusal.INDIRECT_JUMP),
    "jump table jmp [rax*8+x]": ("554889e5" + "90" * 4 + "ff24c500104000" + "c3", 0, (), OptimizeRefusal.INDIRECT_JUMP),
    "far indirect jmp [rax]": ("554889e5" + "90" * 4 + "ff28", 0, (), OptimizeRefusal.INDIRECT_JUMP),
    "bytes the decoder stops at": ("554889e5" + "0f", 0, (), OptimizeRefusal.UNDECODABLE),
    "nothing decodable": ("0f" * 6, 0, (), OptimizeRefusal.UNDECODABLE),
    "site inside an instruction": ("554889e5" + "c9c3" + "90" * 4, 2, (), OptimizeRefusal.UNDECODABLE),
    "call alone is the region": ("e8000000005d" + "c3", 0, (), 5),
    "call ends the region": ("55e800000000" + "5dc3", 0, (), 1 + 5),
    "call through register inside the region": ("ffd0" + "909090c3", 0, (), OptimizeRefusal.UNRELOCATABLE_INSN),
    "call through register ends the region": ("554889e5" + "ffd0" + "c3", 0, (), 4 + 2),
    "-pg: call [rip+mcount@GOT] ends the region": ("554889e5" + "ff15bc2d0000" + "5dc3", 0, (), 4 + 6),
    "syscall in the region": ("0f05" + "909090c3", 0, (), OptimizeRefusal.UNRELOCATABLE_INSN),
    "another probe inside": ("554889e5" + "4883ec10c9c3", 0, (1,), OptimizeRefusal.REGION_OVERLAP),
    "another probe right after is fine": ("554889e54883ec10c9c3", 0, (8,), 8),
    "rip-relative load": ("488b0510000000" + "c3", 0, (), 7),
    # PLT stubs: a jump through one pointer (a GOT slot), never into a function, ends the region
    "lazy .plt: jmp [rip+x]; push 3; jmp PLT0": ("ff25e22f0000" + "6803000000" + "e9c0ffffff", 0, (), 6),
    ".plt.sec after endbr64: bnd jmp [rip+x]": ("f30f1efa" + "f2ff25d52f0000" + "0f1f440000", 4, (), 7),
    ".plt.got: jmp [rip+x]; xchg ax,ax": ("ff25da2f0000" + "6690", 0, (), 6),
    "jmp [rip+x] inside the region": ("ff25da2f0000" + "90" * 4, 0, (), 6),
    "jmp [rip+x] before more of the region": ("31c0" + "ff25da2f0000" + "90", 0, (), 2 + 6),
}


@pytest.mark.parametrize(("name", "case"), TABLE.items(), ids=list(TABLE))
def test_can_optimize(name: str, case: tuple[str, int, tuple[int, ...], OptimizeRefusal | int]) -> None:
    code, site, others, expected = case
    result = can_optimize(bytes.fromhex(code), F, F + site, other_probes=frozenset(F + o for o in others))
    if isinstance(expected, OptimizeRefusal):
        assert result == expected
    else:
        assert isinstance(result, OptimizePlan), result
        assert result.length == expected and result.resume_at == F + site + expected


def test_branches_in() -> None:
    # jne +2; call +0x10; jmp -4; jmp rax (no target); ret
    code = bytes.fromhex("7502" + "e810000000" + "ebfc" + "ffe0" + "c3")
    assert branches_in(code, F) == [(F, F + 2 + 2), (F + 2, F + 7 + 0x10), (F + 7, F + 9 - 4)]


SOURCE = F - 0x40  # where a branch of another function is

# a branch at SOURCE aimed at the region's second instruction (F + 3), the bytes from its start
# no other code runs -> its re-aimed form's length, or None (it cannot be taken along)
TAKE_ALONG: dict[str, tuple[str, int, int | None]] = {
    "jmp rel8, padding after it (glibc's mempcpy)": ("eb41", 5, 5),
    "jmp rel8, no room after it": ("eb41", 2, None),
    "jmp rel32": ("e93e000000", 5, 5),
    "jcc rel32": ("0f843d000000", 6, 6),
    "call rel32": ("e83e000000", 5, 5),
    "jcc rel8: its rel32 form would run into the next instruction": ("7441", 2, None),
    "bnd jmp rel32": ("f2e93d000000", 6, 6),
}  # fmt: skip


@pytest.mark.parametrize("name", list(TAKE_ALONG))
def test_branches_into_the_region_are_taken_along_where_they_can_be_re_aimed(name: str) -> None:
    """memcpy's entry (mov rax, rdi; cmp rdx, 0x20): another function's branch lands on its
    second instruction, inside the jump. Taken along where it can be re-aimed in place (the
    plan's `moved`), refused otherwise, and refused when nothing says which branches land
    there or something else may (a taken address)."""
    code = bytes.fromhex("4889f8" + "4883fa20" + "c3")
    hexed, room, length = TAKE_ALONG[name]
    branch = decode_one(bytes.fromhex(hexed), SOURCE)
    assert branch is not None and int(branch.near_branch_target) == F + 3

    def plan(found: list[tuple[object, int]] | None) -> object:
        return can_optimize(code, F, F, module_targets={F + 3}, branches_to=lambda at: found if at == F + 3 else None)

    result = plan([(branch, room)])
    if length is None:
        assert result == OptimizeRefusal.JUMP_INTO_REGION
    else:
        assert isinstance(result, OptimizePlan) and result.moved == (branch,) and result.length == 7
        aimed = retarget(branch, F + 0x10000)
        assert aimed is not None and len(aimed) == length
        again = decode_one(aimed, SOURCE)
        assert again is not None and int(again.near_branch_target) == F + 0x10000 and again.mnemonic == branch.mnemonic
        assert retarget(branch, HIGH) is None  # (out of a rel32's reach)
    assert plan(None) == plan([]) == OptimizeRefusal.JUMP_INTO_REGION
    assert can_optimize(code, F, F, module_targets={F + 3}) == OptimizeRefusal.JUMP_INTO_REGION


def test_a_branch_inside_the_region_is_not_taken_along() -> None:
    """A loop back into the jump's own bytes from within them cannot be re-aimed in place."""
    code = bytes.fromhex("4883ef01" + "75fb" + "c3" + "90" * 4)  # dec rdi at +0..4; jne +1 at +4
    jne = decode_one(bytes.fromhex("75fb"), F + 4)
    assert jne is not None and int(jne.near_branch_target) == F + 1
    found = [(jne, 8)]
    assert can_optimize(code, F, F, branches_to=lambda at: found) == OptimizeRefusal.JUMP_INTO_REGION


@pytest.mark.parametrize("bias", [None, 0x5555_5555_4000, HIGH - 0x1000], ids=["default", "PIE", "library"])
@pytest.mark.parametrize("inside", [1, 2, 7])
def test_a_module_target_inside_the_region_at_any_load_bias(bias: int | None, inside: int) -> None:
    """Another function of the module jumps (at link-time addresses, `bias` below where they
    run; none: the same) to the region's first, second or last inner byte: refused. A target
    at the site itself or past the region is fine, and so is one at where site+2 runs (a
    link-time address is no run-time one)."""
    code = bytes.fromhex("554889e5" + "4883ec10" + "c9c3")
    link = 0x1000 if bias is not None else F
    site = link + (bias or 0)

    def plan(targets: set[int]) -> object:
        if bias is None:
            return can_optimize(code, site, site, module_targets=targets)
        return can_optimize(code, site, site, module_targets=targets, bias=bias)

    assert plan({link + inside}) == OptimizeRefusal.JUMP_INTO_REGION
    assert isinstance(plan({link, link + 8}), OptimizePlan)
    if bias:
        assert isinstance(plan({link + 2 + bias}), OptimizePlan)


def test_empty_or_unknown_function() -> None:
    assert can_optimize(b"", F, F) == OptimizeRefusal.FUNCTION_UNKNOWN


def test_relocated_region_jumps_back_and_keeps_rip_relative_targets() -> None:
    plan = can_optimize(bytes.fromhex("488b0510000000c3"), F, F)
    assert isinstance(plan, OptimizePlan)
    detour = F + 0x100000
    code = relocate_region(plan, detour)
    assert code is not None
    load = decode_one(code, detour)
    assert load is not None and load.ip_rel_memory_address == F + 7 + 0x10
    back = decode_one(code[load.len :], detour + load.len)
    assert back is not None and back.near_branch_target == F + 7


@pytest.mark.parametrize("code", ["488b0510000000c3", "554889e5" + "ff15bc2d0000" + "5dc3"], ids=["load", "final call"])
def test_rip_relative_out_of_reach_cannot_be_relocated(code: str) -> None:
    plan = can_optimize(bytes.fromhex(code), F, F)
    assert isinstance(plan, OptimizePlan)
    assert relocate_region(plan, F + (1 << 33)) is None


@pytest.mark.parametrize("func", [F, HIGH], ids=["below 4 GiB", "above 4 GiB"])
def test_final_call_becomes_push_return_address_and_jmp(func: int) -> None:
    """The return address is pushed whole: its low dword, then its high one."""
    code = bytes.fromhex("55e810000000" + "5dc3")
    plan = can_optimize(code, func, func)
    assert isinstance(plan, OptimizePlan)
    detour = func + 0x2000
    out = relocate_region(plan, detour)
    assert out is not None
    assert out[:1] == b"\x55"  # push rbp, as is
    lea = decode_one(out[1:], detour + 1)
    assert lea is not None and str(lea) == "lea rsp,[rsp-8]"
    ret = func + 6
    assert out[6:13] == b"\xc7\x04\x24" + (ret & 0xFFFF_FFFF).to_bytes(4, "little")
    assert out[13:21] == b"\xc7\x44\x24\x04" + (ret >> 32).to_bytes(4, "little")
    jmp = decode_one(out[21:], detour + 21)
    assert jmp is not None and jmp.near_branch_target == func + 6 + 0x10  # the callee; it returns to func+6
    assert len(out) == 26  # nothing after the jmp: the callee returns to the original code


@pytest.mark.parametrize(
    ("call", "jump"),
    [("ff15bc2d0000", "jmp qword ptr [403DC6h]"), ("ffd0", "jmp rax"), ("ff1424", "jmp qword ptr [rsp+8]"),
     ("ff542408", "jmp qword ptr [rsp+10h]")],
    ids=["rip-relative (-pg's mcount)", "register", "[rsp]", "[rsp+8]"],
)  # fmt: skip
def test_final_indirect_call_becomes_push_return_address_and_jmp_through_its_operand(call: str, jump: str) -> None:
    """The jmp reads the same target: RIP-relative re-encoded for the detour, a stack operand
    8 bytes further up (the return address is pushed first)."""
    code = bytes.fromhex("554889e5" + call + "5dc3")
    plan = can_optimize(code, F, F)
    assert isinstance(plan, OptimizePlan)
    detour = F + 0x2000
    out = relocate_region(plan, detour)
    assert out is not None
    ret = F + 4 + len(call) // 2
    assert out[4 + 5 : 4 + 20] == b"\xc7\x04\x24" + ret.to_bytes(4, "little") + b"\xc7\x44\x24\x04" + bytes(4)
    jmp = decode_one(out[24:], detour + 24)
    assert jmp is not None and str(jmp) == jump and 24 + jmp.len == len(out)


@pytest.mark.parametrize(
    ("code", "slot"),
    [
        ("ff25e22f0000" + "6803000000" + "e9c0ffffff", F + 6 + 0x2FE2),  # lazy .plt
        ("f30f1efa" + "f2ff25d52f0000" + "0f1f440000", F + 11 + 0x2FD5),  # .plt.sec (IBT)
        ("ff25da2f0000" + "6690", F + 6 + 0x2FDA),  # .plt.got
        ("ff35e22f0000" + "f2ff25e32f0000", None),  # PLT0: pushes first
        ("f30f1efa" + "6800000000" + "f2e9e1ffffff", None),  # an IBT .plt entry (lazy): pushes
        ("ff24c500104000", None),  # through a table: no stub
        ("f30f1efa" + "90", None),  # no jump at all
    ],
)
def test_plt_slot(code: str, slot: int | None) -> None:
    assert plt_slot(bytes.fromhex(code), F) == slot


def test_a_plt_stub_s_jump_is_relocated_through_the_same_slot() -> None:
    plan = can_optimize(bytes.fromhex("f30f1efa" + "f2ff25d52f0000" + "0f1f440000"), F, F + 4)
    assert isinstance(plan, OptimizePlan)
    detour = F + 0x100000
    code = relocate_region(plan, detour)
    assert code is not None
    jump = decode_one(code, detour)
    assert jump is not None and jump.is_jmp_near_indirect and jump.ip_rel_memory_address == F + 11 + 0x2FD5


def test_a_branch_just_outside_the_region_is_taken_along() -> None:
    """Re-aimed branches may end where the region starts, or start where it ends; one whose new
    bytes would reach into the region is refused."""
    code = bytes.fromhex("4889f8" + "4883fa20" + "e9f7ffffff" + "c3")  # the jmp at F + 7 lands on F + 3
    after = decode_one(bytes.fromhex("e9f7ffffff"), F + 7)
    before = decode_one(bytes.fromhex("e9fe000000"), F - 5)  # (landing nowhere near: its length counts)
    overlapping = decode_one(bytes.fromhex("e9fe000000"), F - 4)
    assert after is not None and before is not None and overlapping is not None

    def plan(found: list[tuple[object, int]]) -> object:
        return can_optimize(code, F, F, branches_to=lambda at: found)

    result = plan([(after, 5), (before, 5)])
    assert isinstance(result, OptimizePlan) and result.moved == (after, before)
    assert plan([(overlapping, 5), (after, 5)]) == OptimizeRefusal.JUMP_INTO_REGION


def test_a_branch_of_the_function_the_module_s_scan_missed_refuses_the_site() -> None:
    """The function's own `jmp F+3` must be among the branches taken along: were only another
    function's branch there given, the function's own would be left to land inside the jump."""
    code = bytes.fromhex("4889f8" + "4883fa20" + "e9f7ffffff" + "c3")  # the jmp at F + 7 lands on F + 3
    elsewhere = decode_one(bytes.fromhex("e9fe000000"), F - 5)
    assert elsewhere is not None
    assert can_optimize(code, F, F, branches_to=lambda at: [(elsewhere, 5)]) == OptimizeRefusal.JUMP_INTO_REGION


def test_retarget_reach_and_kinds() -> None:
    """A jmp rel8 becomes 5 bytes, whose reach counts from its end; an indirect jump, a `loop`
    and a `jrcxz` are not re-aimed."""
    short = decode_one(bytes.fromhex("eb41"), HIGH)
    assert short is not None
    assert retarget(short, HIGH + 5 + (1 << 31) - 1) is not None and retarget(short, HIGH + 5 + (1 << 31)) is None
    assert retarget(short, HIGH + 5 - (1 << 31)) is not None and retarget(short, HIGH + 4 - (1 << 31)) is None
    for hexed in ("ff2500000000", "e2fe", "e3fe"):  # jmp [rip+0]; loop; jrcxz
        other = decode_one(bytes.fromhex(hexed), F)
        assert other is not None and retarget(other, F + 0x100) is None, hexed
    assert short_jump(bytes.fromhex("eb41"), F) == 2
    assert short_jump(bytes.fromhex("e93e000000"), F) is None and short_jump(b"\x0f", F) is None


def test_a_branch_into_an_instruction_or_a_prefixed_one_is_not_taken_along() -> None:
    """A branch that lands inside one of the region's instructions (after a prefix, say) has no
    copy to land on; a rel32 branch with a redundant prefix would be re-encoded shorter, leaving
    a byte that runs (or moving a call's return address): both refused."""
    code = bytes.fromhex("4889f8" + "4883fa20" + "c3")
    into = decode_one(bytes.fromhex("e93f000000"), SOURCE)  # lands on F + 4, inside the cmp
    assert into is not None and int(into.near_branch_target) == F + 4
    found = [(into, 5)]
    assert can_optimize(code, F, F, module_targets={F + 4}, branches_to=lambda at: found) == (
        OptimizeRefusal.JUMP_INTO_REGION
    )
    for hexed in ("40e83d000000", "48e93d000000"):  # (rex) call, (rex.w) jmp: 6 bytes, 5 re-encoded
        prefixed = decode_one(bytes.fromhex(hexed), SOURCE)
        assert prefixed is not None and int(prefixed.near_branch_target) == F + 3 and prefixed.len == 6
        assert retarget(prefixed, F + 0x100) is None, hexed
