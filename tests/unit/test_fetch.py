"""The trap-mode fetch evaluator (spec/fetch.py) over registers and memory of the test's own:
every fetch form and type, signed widths, strings with and without their NUL, unmapped memory,
and how each value prints."""

from __future__ import annotations

import pytest

from dynprobe.arch.x86_64 import Regs
from dynprobe.arch.x86_64.regs import ARG_REGS, GPR64
from dynprobe.spec.fetch import (
    FAULT,
    MAX_STRING,
    FetchContext,
    ReturnValues,
    StringValue,
    Value,
    evaluate,
    format_value,
    json_value,
)
from dynprobe.spec.model import ArgType, Caller, FetchArg, Latency
from dynprobe.spec.parser import parse_probe

DATA = 0x7F00_0000_1000  # a mapped range of the fake memory
DATA_SIZE = 0x100
STACK = 0x7FFC_0000_0000
SYMBOLS = {"counter": DATA + 0x40}


class FakeMemory:
    """Mapped ranges of bytes; a read that leaves them fails as /proc/PID/mem's does, and every
    read is kept, to check how many bytes a fetch reads."""

    def __init__(self, ranges: dict[int, bytes]) -> None:
        self.ranges = ranges
        self.reads: list[tuple[int, int]] = []

    def _mapped(self, addr: int) -> tuple[int, bytes] | None:
        for start, data in self.ranges.items():
            if start <= addr < start + len(data):
                return start, data
        return None

    def read(self, addr: int, size: int) -> bytes:
        self.reads.append((addr, size))
        found = self._mapped(addr)
        if found is None or addr + size > found[0] + len(found[1]):
            raise OSError(5, "Input/output error")
        return found[1][addr - found[0] : addr - found[0] + size]

    def read_upto(self, addr: int, size: int) -> bytes:
        self.reads.append((addr, size))
        found = self._mapped(addr)
        if found is None:
            return b""
        return found[1][addr - found[0] : addr - found[0] + size]


def registers() -> Regs:
    """Every register a value of its own: a fetch of the wrong one is seen."""
    regs = Regs()
    for i, name in enumerate(GPR64):
        regs[name] = 0x1111_0000_0000_0000 * (i % 15 + 1) + i
    regs.rip = 0x5555_0000_1234
    regs.eflags = 0x246
    regs.rsp = STACK + 0x10
    regs.rdi = DATA
    return regs


def memory() -> FakeMemory:
    data = bytearray(range(DATA_SIZE))
    data[0x40:0x48] = (0x1234_5678_9ABC_DEF0).to_bytes(8, "little")
    data[0x50:0x58] = (DATA + 0x80).to_bytes(8, "little")  # a pointer to the string below
    data[0x80:0x8C] = b"hello\tworld\0"
    data[0xF0:0xF8] = (0xFFFF_FFFF_FFFF_FFFE).to_bytes(8, "little")  # -2
    stack = b"".join((0xAA00 + n).to_bytes(8, "little") for n in range(8))
    return FakeMemory({DATA: bytes(data), STACK + 0x10: stack})


def context(
    *, regs: Regs | None = None, mem: FakeMemory | None = None, returning: ReturnValues | None = None
) -> FetchContext:
    return FetchContext(
        regs=regs if regs is not None else registers(),
        memory=mem if mem is not None else memory(),
        comm=lambda: "worker",
        symbol_address=SYMBOLS.get,
        symbolize=lambda addr: "main+0x4" if addr == 0x5555_0000_1234 else None,
        returning=returning,
    )


def fetch(text: str, ctx: FetchContext | None = None, *, kind: str = "p") -> Value:
    arg = parse_probe(f"{kind} f {text}").args[0]
    return evaluate(arg, ctx if ctx is not None else context())


@pytest.mark.parametrize(
    ("name", "register"),
    [("ax", "rax"), ("bx", "rbx"), ("cx", "rcx"), ("dx", "rdx"), ("si", "rsi"), ("di", "rdi"), ("bp", "rbp"),
     ("sp", "rsp"), ("ip", "rip"), ("flags", "eflags"), ("r8", "r8"), ("r15", "r15"), ("rax", "rax")],
)  # fmt: skip
def test_a_register_by_its_kernel_name(name: str, register: str) -> None:
    regs = registers()
    assert fetch(f"%{name}:x64", context(regs=regs)) == getattr(regs, register)


@pytest.mark.parametrize("index", range(1, 7))
def test_argn_is_the_nth_system_v_argument_register(index: int) -> None:
    regs = registers()
    assert fetch(f"$arg{index}", context(regs=regs)) == int(getattr(regs, ARG_REGS[index - 1]))


@pytest.mark.parametrize("index", range(1, 7))
def test_a_return_probe_s_argn_is_the_entry_s(index: int) -> None:
    entry = ReturnValues(args=(11, 22, 33, 44, 55, 66), caller=0x401000, latency_ns=250)
    assert fetch(f"$arg{index}", context(returning=entry), kind="r") == 11 * index


def test_return_values() -> None:
    regs = registers()
    regs.rax = 0xFFFF_FFFF_FFFF_FFFB
    entry = ReturnValues(args=(0,) * 6, caller=0x401000, latency_ns=250)
    ctx = context(regs=regs, returning=entry)
    assert fetch("$retval", ctx, kind="r") == 0xFFFF_FFFF_FFFF_FFFB
    assert fetch("$retval:s32", ctx, kind="r") == -5
    assert fetch("$latency", ctx, kind="r") == 250


def test_latency_and_caller_outside_a_return_are_faults() -> None:
    for what in (Latency(), Caller()):
        assert evaluate(FetchArg("x", what, ArgType("u", 64), "x"), context()) is FAULT
    entry = ReturnValues(args=(0,) * 6, caller=0x401000, latency_ns=250)
    assert evaluate(FetchArg("x", Caller(), ArgType("x", 64), "x"), context(returning=entry)) == 0x401000


def test_stack_fetches() -> None:
    mem = memory()
    ctx = context(mem=mem)
    assert fetch("$stack", ctx) == STACK + 0x10
    assert [fetch(f"$stack{n}", ctx) for n in range(4)] == [0xAA00, 0xAA01, 0xAA02, 0xAA03]
    assert mem.reads[-1] == (STACK + 0x10 + 3 * 8, 8)
    assert fetch("$stack8", ctx) is FAULT  # past the stack's mapped words


@pytest.mark.parametrize(
    ("text", "value", "size"),
    [
        ("+0(%di):u8", 0x00, 1),
        ("+1(%di):u8", 0x01, 1),
        ("+2(%di):u16", 0x0302, 2),
        ("+4(%di):u32", 0x07060504, 4),
        ("+8(%di):u64", 0x0F0E0D0C0B0A0908, 8),
        ("+0x40(%di):x64", 0x1234_5678_9ABC_DEF0, 8),
        ("+0xff(%di):u8", 0xFF, 1),  # the mapping's last byte: a one-byte read reaches it
        ("+0xff(%di):s8", -1, 1),
        ("+0x7f(%di):s8", 0x7F, 1),
        ("+0x80(%di):s8", ord("h"), 1),
        ("+0xf0(%di):s64", -2, 8),
        ("+0xf0(%di):s32", -2, 4),
        ("+0xf0(%di):s16", -2, 2),
        ("+0xf0(%di):u16", 0xFFFE, 2),
        ("+0xf0(%di):x16", 0xFFFE, 2),
        ("-0x10(+0x50(%di)):u8", 0x70, 1),  # through the pointer at +0x50, back 16 bytes
    ],
)
def test_memory_reads_read_the_type_s_width(text: str, value: int, size: int) -> None:
    mem = memory()
    assert fetch(text, context(mem=mem)) == value
    assert mem.reads[-1][1] == size


def test_signed_widths_at_their_edges() -> None:
    regs = registers()
    for bits in (8, 16, 32, 64):
        regs.rax = 1 << (bits - 1)  # the most negative
        assert fetch(f"%ax:s{bits}", context(regs=regs)) == -(1 << (bits - 1))
        regs.rax = (1 << (bits - 1)) - 1  # the most positive
        assert fetch(f"%ax:s{bits}", context(regs=regs)) == (1 << (bits - 1)) - 1
        regs.rax = ((1 << bits) | 5) & ((1 << 64) - 1)  # the bits above are cut
        assert fetch(f"%ax:u{bits}", context(regs=regs)) == 5


def test_a_read_past_the_mapping_is_a_fault() -> None:
    assert fetch("+0xfe(%di):u32") is FAULT  # starts mapped, ends past it
    assert fetch("+0x100(%di):u8") is FAULT
    assert fetch("+0(+0(%di)):u64") is FAULT  # the word at DATA is no mapped address


def test_addresses_above_2_63_and_pointers_with_a_high_top_byte() -> None:
    """A pointer read whole (8 bytes, its top byte too) at the end of its mapping, to an address
    above 2^63."""
    high = 0xFF00_0000_0000_2000
    regs = registers()
    regs.rsi = DATA + DATA_SIZE - 8  # the pointer: the mapping's last 8 bytes
    mem = FakeMemory({DATA: bytes(DATA_SIZE - 8) + (high + 8).to_bytes(8, "little"), high: b"0123456789abcdef"})
    assert fetch("+0(+0(%si)):u8", context(regs=regs, mem=mem)) == ord("8")
    assert fetch("-8(+0(%si)):string", context(regs=regs, mem=mem)) == StringValue("0123456789abcdef", truncated=True)


def test_an_address_wraps_at_64_bits() -> None:
    regs = registers()
    regs.rsi = (1 << 64) - 0x10
    mem = memory()
    mem.ranges[0] = bytes(range(32))
    assert fetch("+0x14(%si):u8", context(regs=regs, mem=mem)) == 4
    assert mem.reads[-1] == (4, 1)


def test_absolute_and_symbol_addresses() -> None:
    assert fetch(f"@{DATA + 0x40:#x}:x64") == 0x1234_5678_9ABC_DEF0
    assert fetch("@counter:x64") == 0x1234_5678_9ABC_DEF0
    assert fetch("@counter+8:u8") == 0x48
    assert fetch("@counter-0x40:u8") == 0
    assert fetch("@no_such_symbol") is FAULT


def test_strings() -> None:
    assert fetch("+0(+0x50(%di)):string") == StringValue("hello\tworld")
    assert fetch("+6(+0x50(%di)):ustring") == StringValue("world")
    assert fetch("$comm") == StringValue("worker")


def test_a_string_cut_by_unmapped_memory_is_truncated() -> None:
    mem = FakeMemory({DATA: b"no end"})
    assert fetch("+3(%di):string", context(mem=mem)) == StringValue("end", truncated=True)


def test_a_string_in_no_mapped_memory_is_a_fault() -> None:
    assert fetch("+0x100(%di):string") is FAULT


def test_a_long_string_stops_at_4096_bytes() -> None:
    """One byte past the longest string is read, to tell a string of exactly 4096 bytes (whole)
    from a longer one (cut)."""
    assert MAX_STRING == 4096
    long = FakeMemory({DATA: b"a" * 5000 + b"\0"})
    assert fetch("+0(%di):string", context(mem=long)) == StringValue("a" * 4096, truncated=True)
    assert long.reads[-1] == (DATA, 4097)
    exactly = FakeMemory({DATA: b"b" * 4096 + b"\0"})
    assert fetch("+0(%di):string", context(mem=exactly)) == StringValue("b" * 4096)
    cut = FakeMemory({DATA: b"c" * 4096})  # then unmapped
    assert fetch("+0(%di):string", context(mem=cut)) == StringValue("c" * 4096, truncated=True)


def test_an_empty_string() -> None:
    assert fetch("+0(%di):string", context(mem=FakeMemory({DATA: b"\0abc"}))) == StringValue("")


def test_invalid_utf8_is_replaced() -> None:
    mem = FakeMemory({DATA: b"ok\xff\xfe!\0"})
    assert fetch("+0(%di):string", context(mem=mem)) == StringValue("ok\ufffd\ufffd!")


@pytest.mark.parametrize(
    ("value", "arg_type", "shown"),
    [
        (FAULT, ArgType("u", 64), "(fault)"),
        (255, ArgType("x", 8), "0xff"),
        (0, ArgType("x", 64), "0x0"),
        (-3, ArgType("s", 32), "-3"),
        (18446744073709551615, ArgType("u", 64), "18446744073709551615"),
        (0x5555_0000_1234, ArgType("symbol"), "main+0x4"),
        (0x1000, ArgType("symbol"), "0x1000"),
        (StringValue('a"b\\c\n\t\r\x01\x1f\x7f '), ArgType("string"), '"a\\"b\\\\c\\n\\t\\r\\x01\\x1f\\x7f "'),
        (StringValue("cut", truncated=True), ArgType("string"), '"cut"...'),
    ],
)
def test_format_value(value: Value, arg_type: ArgType, shown: str) -> None:
    assert format_value(value, arg_type, lambda addr: "main+0x4" if addr == 0x5555_0000_1234 else None) == shown


def test_a_symbol_without_a_symbolizer_prints_in_hex() -> None:
    assert format_value(0x1234, ArgType("symbol")) == "0x1234"


def test_json_values() -> None:
    assert [json_value(FAULT), json_value(StringValue("s", truncated=True)), json_value(-1)] == [None, "s", -1]
