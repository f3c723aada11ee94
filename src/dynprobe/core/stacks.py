"""Call stacks of a traced thread, walked by the tracer over the target's memory (`hit.stack()`).

Each frame's caller is found with the rows compiled from its module's unwind tables
(arch/x86_64/unwind.py), with frame pointers where its module has none (JIT code, a file without
unwind tables: the stack is then marked as possibly cut). A return address dynprobe replaced
(return probes, the function tracer) is given as the caller it stands for. The walk ends at the
outermost frame (its return address is undefined), at `max_frames`, or where a caller cannot be
read or is not code; every read is bounded (the target's stack is untrusted).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from dynprobe.arch.x86_64 import Regs
from dynprobe.arch.x86_64.unwind import RSP, BpRule, Frame, Kind, Row, step
from dynprobe.errors import SymbolError
from dynprobe.frozen import frozen
from dynprobe.symbols.demangle import display
from dynprobe.symbols.elf import ElfImage, load_elf
from dynprobe.symbols.maps import Mapping, mapping_at

MAX_FRAMES = 127  # as bpftrace's ustack (perf_event_max_stack)
_PAGE = 4096
_MAX_PAGES = 1024  # of stack read in one walk (4 MiB: a deeper stack is cut there)


@frozen
class StackFrame:
    """One frame: its address, and the module and function it is in when they are known."""

    address: int
    module: str | None = None  # the file's path
    symbol: str | None = None  # as the file names it (mangled); an inlined function's as DWARF names it
    offset: int = 0  # from the symbol's start
    named_at: int | None = None  # the link-time address it is named by (a return address: the call's)
    inlined: bool = False  # a function inlined there (DWARF's): no frame of its own on the stack
    call_site: str | None = None  # `file:line` where the function inlined in it was called, if one is

    @property
    def function(self) -> str | None:
        """The symbol as people read it (C++ names demangled, without their parameters)."""
        return display(self.symbol) if self.symbol is not None else None

    @property
    def line(self) -> str | None:
        """`file:line` of its code (of the call, for a return address; where the function
        inlined in it was called, if one is), when DWARF says."""
        if self.call_site is not None or self.module is None or self.named_at is None:
            return self.call_site
        from dynprobe.symbols.lines import source_line  # (pyelftools' DWARF: loaded for stacks only)

        return source_line(self.module, self.named_at)

    def __str__(self) -> str:
        where = f" ({os.path.basename(self.module)})" if self.module else ""
        if self.symbol is None:
            return f"{self.address:#x}{where}"
        line = self.line
        at = f" at {line}" if line is not None else ""
        how = " [inlined]" if self.inlined else f"+{self.offset:#x}" if self.offset else ""
        return f"{self.function}{how}{where}{at}"


@frozen
class Stack(Sequence[StackFrame]):
    """The frames of a thread at a hit, innermost first. `cut`: the walk may have missed the
    outermost frames (it stopped at `max_frames`, at memory it could not read, or went by frame
    pointers, which code built without them does not keep)."""

    frames: tuple[StackFrame, ...]
    cut: bool

    @overload
    def __getitem__(self, index: int) -> StackFrame: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[StackFrame]: ...
    def __getitem__(self, index: int | slice) -> StackFrame | Sequence[StackFrame]:
        return self.frames[index]

    def __len__(self) -> int:
        return len(self.frames)

    def __iter__(self) -> Iterator[StackFrame]:
        return iter(self.frames)

    def __str__(self) -> str:
        return "\n".join([*(str(f) for f in self.frames), *(["..."] if self.cut else [])])


class _StackMemory:
    """The target's memory a walk reads, a page at a time, at most _MAX_PAGES of it."""

    def __init__(self, read: Callable[[int, int], bytes]) -> None:
        self._read = read
        self._pages: dict[int, bytes] = {}

    def u64(self, addr: int) -> int:
        page, within = addr & ~(_PAGE - 1), addr & (_PAGE - 1)
        if within > _PAGE - 8:
            return int.from_bytes(self._bytes(page)[within:] + self._bytes(page + _PAGE)[: within - (_PAGE - 8)],
                                  "little")  # fmt: skip
        return int.from_bytes(self._bytes(page)[within : within + 8], "little")

    def _bytes(self, page: int) -> bytes:
        data = self._pages.get(page)
        if data is None:
            if len(self._pages) >= _MAX_PAGES or not 0 < page < 1 << 47:
                raise OSError("outside the stack a walk reads")
            data = self._pages[page] = self._read(page, _PAGE)
        return data


@dataclass
class _Module:
    """A mapping a stack walk passes through, and its file (None: none to read)."""

    mapping: Mapping
    image: ElfImage | None


def walk(
    regs: Regs,
    maps: list[Mapping],
    read: Callable[[int, int], bytes],
    *,
    real_return: Callable[[int], int],
    max_frames: int = MAX_FRAMES,
    at_entry: bool = False,
) -> Stack:
    """The stack of a thread whose registers are `regs` (its rip: the innermost frame, a
    function's first instruction if `at_entry`: its return address is at rsp even where no row
    says so), in a process with these maps and memory (`read(addr, size)`, OSError where
    unmapped). `real_return(address)`: the return address a replaced one stands for (itself
    otherwise)."""
    memory = _StackMemory(read)
    modules: dict[int, _Module | None] = {}
    frame: Frame | None = Frame(int(regs.rip), int(regs.rsp), int(regs.rbp), exact=True)
    frames: list[StackFrame] = []
    cut = False
    walked = 0
    while frame is not None:
        module = _module_at(maps, frame.pc, modules)
        if module is None:
            cut = cut or bool(frames)  # (a return address into no code: the walk went wrong)
            break
        row = _row(module, frame.lookup)
        if row is None and at_entry and not frames:
            row = Row(Kind.CFA, RSP, 8, BpRule.SAME, 0)
        frames += _frames(module, frame.pc, exact=frame.exact)
        walked += 1
        if walked >= max_frames:
            cut = True
            break
        caller = step(frame, row, memory.u64)
        if caller is None:
            cut = cut or row is None or row.kind != Kind.END
            break
        if row is None or row.kind == Kind.NONE:
            cut = True  # (by frame pointers: a frame without one is skipped unseen)
        if not caller.exact and caller.sp <= frame.sp:
            cut = True  # (the stack grows down: a caller's frame is above its callee's)
            break
        frame = caller._replace(pc=real_return(caller.pc)) if caller.pc else None
    return Stack(tuple(frames), cut)


def _module_at(maps: list[Mapping], pc: int, modules: dict[int, _Module | None]) -> _Module | None:
    """The executable mapping holding `pc` (None: none does) and the ELF file it maps, if any."""
    mapping = mapping_at(maps, pc)
    if mapping is None or not mapping.executable:
        return None
    if mapping.start not in modules:
        modules[mapping.start] = _module_of(mapping)
    return modules[mapping.start]


def _module_of(mapping: Mapping) -> _Module:
    image = None
    if mapping.path.startswith("/"):
        try:
            image = load_elf(mapping.path)
        except SymbolError:
            image = None
    return _Module(mapping, image)


def _vaddr(module: _Module, pc: int) -> int | None:
    if module.image is None:
        return None
    return module.image.offset_to_vaddr(pc - module.mapping.start + module.mapping.offset)


def _row(module: _Module, pc: int) -> Row | None:
    vaddr = _vaddr(module, pc)
    return module.image.unwind_table.find(vaddr) if module.image is not None and vaddr is not None else None


def _frames(module: _Module, pc: int, *, exact: bool) -> list[StackFrame]:
    """The frame at `pc`, after the frames of the functions DWARF says are inlined there
    (innermost first, as gdb shows them)."""
    frame = _frame(module, pc, exact=exact)
    if frame.module is None or frame.named_at is None:
        return [frame]
    from dynprobe.symbols.lines import inlined_at

    chain = inlined_at(frame.module, frame.named_at)
    if not chain:
        return [frame]
    inlined = [
        StackFrame(pc, frame.module, name, 0, frame.named_at, inlined=True,
                   call_site=chain[k + 1][1] if k + 1 < len(chain) else None)
        for k, (name, _) in reversed(list(enumerate(chain)))
    ]  # fmt: skip
    return [*inlined, dataclasses.replace(frame, call_site=chain[0][1])]


def _frame(module: _Module, pc: int, *, exact: bool) -> StackFrame:
    """The frame at `pc`, named by the function of its lookup address (a return address: the
    call before it, which may be its function's last instruction; but a signal's trampoline
    at its own address, the return address the handler got)."""
    path = module.mapping.path or None
    named_at = pc if exact else pc - 1
    row = _row(module, named_at)
    if row is not None and row.kind == Kind.SIGNAL:
        named_at = pc
    vaddr = _vaddr(module, named_at)
    func = module.image.function_at(vaddr) if module.image is not None and vaddr is not None else None
    if func is None or vaddr is None:
        return StackFrame(pc, path)
    return StackFrame(pc, path, func.name, vaddr + pc - named_at - func.addr, vaddr)


def named(frames: Sequence[tuple[int, bool, Mapping | None]], cut: bool, maps: list[Mapping]) -> Stack:
    """A stack the target's walker stored, as frames (address, whether the thread was there
    rather than a return address, the mapping it was in if known), named by their mapping or
    else by the process's `maps`."""
    modules: dict[int, _Module | None] = {}
    out = []
    for pc, exact, mapping in frames:
        module = _module_of(mapping) if mapping is not None else _module_at(maps, pc, modules)
        out += _frames(module, pc, exact=exact) if module is not None else [StackFrame(pc)]
    return Stack(tuple(out), cut)
