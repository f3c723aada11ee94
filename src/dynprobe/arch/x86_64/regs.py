"""The x86-64 register set as the kernel's `struct user_regs_struct` (PTRACE_GETREGS layout).

Pure data: the ptrace layer fills it, handlers and the emulator read and change it.
"""

from __future__ import annotations

import ctypes

REG_NAMES: tuple[str, ...] = (
    "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8",
    "rax", "rcx", "rdx", "rsi", "rdi", "orig_rax", "rip", "cs", "eflags", "rsp",
    "ss", "fs_base", "gs_base", "ds", "es", "fs", "gs",
)  # fmt: skip

# System V AMD64 integer argument registers, in order.
ARG_REGS: tuple[str, ...] = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")

# The kernel's pt_regs spellings used by uprobe_events (%ax, %sp, %ip, ...).
KERNEL_ALIASES: dict[str, str] = {
    "ax": "rax", "bx": "rbx", "cx": "rcx", "dx": "rdx", "si": "rsi", "di": "rdi",
    "bp": "rbp", "sp": "rsp", "ip": "rip", "flags": "eflags", "rflags": "eflags",
    "orig_ax": "orig_rax",
}  # fmt: skip

GPR64: tuple[str, ...] = (
    "rax", "rcx", "rdx", "rbx", "rsp", "rbp", "rsi", "rdi",
    "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15",
)  # fmt: skip

FLAG_CF = 1 << 0
FLAG_PF = 1 << 2
FLAG_ZF = 1 << 6
FLAG_SF = 1 << 7
FLAG_TF = 1 << 8
FLAG_OF = 1 << 11
MASK64 = (1 << 64) - 1


def canonical_name(name: str) -> str | None:
    """`rax`, `ax`, `%ax`, `RAX` -> `rax`; None for a name that is not a register."""
    n = name.lower().lstrip("%")
    n = KERNEL_ALIASES.get(n, n)
    return n if n in REG_NAMES else None


class Regs(ctypes.Structure):
    """Registers of one stopped thread. Read and write by attribute or by name (`regs["rax"]`)."""

    _fields_ = [(name, ctypes.c_uint64) for name in REG_NAMES]

    def __getitem__(self, name: str) -> int:
        reg = canonical_name(name)
        if reg is None:
            raise KeyError(f"unknown register {name!r}")
        return int(getattr(self, reg))

    def __setitem__(self, name: str, value: int) -> None:
        reg = canonical_name(name)
        if reg is None:
            raise KeyError(f"unknown register {name!r}")
        setattr(self, reg, value & MASK64)

    def arg(self, index: int) -> int:
        """The `index`-th integer argument (1-based, System V ABI) at a function's entry."""
        if not 1 <= index <= len(ARG_REGS):
            raise IndexError(f"argument {index} is not passed in a register (1..{len(ARG_REGS)})")
        return int(getattr(self, ARG_REGS[index - 1]))

    def copy(self) -> Regs:
        clone = Regs()
        ctypes.pointer(clone)[0] = self
        return clone

    def as_dict(self) -> dict[str, int]:
        return {name: int(getattr(self, name)) for name in REG_NAMES}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Regs) and bytes(self) == bytes(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return "Regs(" + ", ".join(f"{n}={getattr(self, n):#x}" for n in ("rip", "rsp", "rax", "rdi")) + ", ...)"
