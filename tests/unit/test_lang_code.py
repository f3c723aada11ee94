"""bpftrace's language compiled into a detour (arch/x86_64/codegen/lang.py), run natively in
this process: each probe body's maps, as the tracer reads them (lang/maps.py), against the
values the same operations give in Python, with bpftrace's semantics."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator

import iced_x86 as iced
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynprobe.actions.model import ActionKind, Program
from dynprobe.arch.x86_64.codegen.clock import read_tsc_code
from dynprobe.arch.x86_64.codegen.detours import build_detour
from dynprobe.arch.x86_64.cpu import has_rdpid
from dynprobe.arch.x86_64.decode import iter_instructions
from dynprobe.errors import OptimizeRefusal
from dynprobe.lang import maps, output
from dynprobe.lang.check import check_program
from dynprobe.lang.maps import Clock, LangBody, Region, key_hash, lay_out
from dynprobe.lang.parser import parse_program
from dynprobe.lang.target import PRINTF_NUMBER, check_runnable, printf_records, thread_keyed_maps, tracer_maps
from dynprobe.lang.tracer import TracerBlock, TracerMaps
from dynprobe.ringbuf import layout as L
from tests.unit.native import NativeArea, field
from tests.unit.test_codegen import LAYOUT, plan

MASK = (1 << 64) - 1
NS_AS_TICKS = Clock(1 << 32, 0, 0)


class Compiled:
    """A one-probe program's body placed in a detour's actions, with its region of maps."""

    def __init__(self, area: NativeArea, source: str, *, slots: int = 64, clock: Clock = NS_AS_TICKS,
                 probe_index: int = 0) -> None:  # fmt: skip
        program = parse_program(source)
        checked = check_program(program, source)
        self.region: Region = lay_out(checked, slots=slots)
        self.memory = np.zeros(self.region.size // 8, dtype=np.uint64)
        self.region.initialize(self.memory)
        self.area = area
        body = LangBody(program.probes[0], checked, self.memory.ctypes.data, self.region.tables, clock,
                        printf_records(checked))  # fmt: skip
        self.program = Program(probe_index, ActionKind.COUNT, lang=body)

        def actions(base: int) -> bytes:
            detour = build_detour(plan(), [self.program], LAYOUT, base, function_entry=True)
            assert not isinstance(detour, OptimizeRefusal), detour
            area.add_fixups(detour.fixups)
            return detour.code[: detour.action_bytes] + b"\xc3"

        self.actions = area.place(actions)

    def __call__(self, *args: int) -> None:
        self.area.call_at(self.actions, *(a & MASK for a in args))

    def entries(self, name: str) -> dict[tuple[int, ...], object]:
        table = self.region.tables[name]
        return dict(maps.entries(self.memory.tobytes(), table))

    def value(self, name: str) -> object:
        return self.entries(name).get((), None)

    def dropped(self, name: str) -> int:
        return maps.dropped(self.memory.tobytes(), self.region.tables[name])


@pytest.fixture
def area() -> Iterator[NativeArea]:
    made = NativeArea(LAYOUT)
    yield made
    made.close()


def test_counts_and_sums_by_key(area: NativeArea) -> None:
    code = Compiled(
        area, "uprobe:/bin/x:f { @c[arg0] = count(); @s[arg0 % 3, arg1 + 1] = sum(arg1 * 2); @n = count(); }"
    )
    calls = [(1, 10), (2, 20), (1, 30), (5, -4), (4, 10), (1, 10)]
    for a, b in calls:
        code(a, b)
    assert code.entries("c") == {(1,): 3, (2,): 1, (5,): 1, (4,): 1}
    sums: dict[tuple[int, ...], int] = {}
    for a, b in calls:
        sums[(a % 3, b + 1)] = sums.get((a % 3, b + 1), 0) + 2 * b
    assert code.entries("s") == sums
    assert code.value("n") == len(calls)
    assert area.counter(0, L.HITS) == len(calls) and area.counter(0, L.MISSED) == 0


def test_min_max_avg_stats(area: NativeArea) -> None:
    code = Compiled(area, "u:/bin/x:f { @lo = min(arg0); @hi = max(arg0); @a[arg1] = avg(arg0); @st = stats(arg0); }")
    values = [5, -7, 12, 0, 3]
    for v in values:
        code(v, 1)
    assert (code.value("lo"), code.value("hi")) == (-7, 12)
    assert code.entries("a") == {(1,): (5, sum(values))}
    assert code.value("st") == (5, sum(values))


def test_hist_and_lhist_buckets(area: NativeArea) -> None:
    code = Compiled(area, "u:/bin/x:f { @h = hist(arg0); @l = lhist(arg0, 0, 100, 10); }")
    values = [-3, 0, 1, 2, 3, 4, 1000, (1 << 63) - 1, 99, 100, 250, 15]
    for v in values:
        code(v)
    hist: dict[int, int] = {}
    lhist: dict[int, int] = {}
    for v in values:
        bucket = -1 if v < 0 else v.bit_length()
        hist[bucket] = hist.get(bucket, 0) + 1
        step = -1 if v < 0 else min(v, 100) // 10
        lhist[step] = lhist.get(step, 0) + 1
    assert code.value("h") == hist
    assert code.value("l") == lhist


@pytest.mark.parametrize(
    ("expr", "args", "expected"),
    [
        ("arg0 + arg1 * 3", (4, 5), 19),
        ("arg0 - arg1", (4, 5), -1),
        ("arg0 / arg1", (-7, 2), ((-7 & MASK) // 2)),  # unsigned, as bpftrace divides
        ("arg0 % arg1", (-7, 2), 1),
        ("arg0 / arg1", (7, 0), 0),  # by zero: 0, as BPF
        ("arg0 % arg1", (7, 0), 7),
        ("arg0 >> 1", (-7, 0), (-7 & MASK) >> 1),  # logical, signed or not
        ("(uint64)arg0 >> 60", (-1, 0), 15),
        ("arg0 << arg1", (3, 4), 48),
        ("arg0 & 12 | arg1 ^ 1", (13, 6), (13 & 12) | (6 ^ 1)),
        ("arg0 > 5", (-1, 0), 0),  # both signed (a literal is)
        ("(uint64)arg0 > (uint64)5", (-1, 0), 1),
        ("arg0 > (uint64)5", (-1, 0), 1),  # one unsigned: unsigned, as bpftrace compares
        ("arg0 <= arg1", (3, 3), 1),
        ("arg0 == 3 && arg1 != 3", (3, 4), 1),
        ("arg0 == 3 && arg1 != 3", (3, 3), 0),
        ("arg0 || arg1", (0, 0), 0),
        ("arg0 || arg1", (0, 9), 1),
        ("arg0 && arg1", (0, 5), 0),  # (the right side is not looked at)
        ("arg0 || arg1", (0x100, 0), 1),
        ("arg0 && arg1", (0x100, 0x200), 1),
        ("!arg0", (0, 0), 1),
        ("!arg0", (5, 0), 0),
        ("-arg0", (5, 0), -5),
        ("~arg0", (5, 0), ~5),
        ("arg0 ? arg1 : 7", (1, 9), 9),
        ("arg0 ? arg1 : 7", (0, 9), 7),
        ("(int8)arg0", (0x1FF, 0), -1),
        ("(uint8)arg0", (0x1FF, 0), 0xFF),
        ("(int32)arg0", (0x80000000, 0), -(1 << 31)),
        ("(uint16)arg0", (-1, 0), 0xFFFF),
    ],
)  # fmt: skip
def test_arithmetic_as_bpftrace_does_it(area: NativeArea, expr: str, args: tuple[int, int], expected: int) -> None:
    code = Compiled(area, f"u:/bin/x:f {{ @r = {expr}; }}")
    code(*args)
    assert code.value("r") == expected


def test_a_predicate_that_is_a_plain_value(area: NativeArea) -> None:
    code = Compiled(area, "u:/bin/x:f /arg1/ { @n = count(); }")
    for a, b in ((1, 0), (0, 2), (5, 0), (0, 0x100)):
        code(a, b)
    assert code.value("n") == 2


def test_scratch_variables_conditions_and_steps(area: NativeArea) -> None:
    code = Compiled(
        area,
        "u:/bin/x:f /arg0 != 99/ { $x = arg0 * 2; $x += 1; if ($x > 10) { @big++; @last = $x; } else { @small += $x; }"
        " @steps[arg0] = @steps[arg0] + 1; ++@pre; @post = @pre++; $y = 3; $y <<= 2; @y = $y; }",
    )  # fmt: skip
    for a in (1, 7, 2, 99, 9):
        code(a)
    # x: 3, 15, 5, 19 (99 filtered out)
    assert code.value("big") == 2 and code.value("last") == 19 and code.value("small") == 8
    assert code.entries("steps") == {(1,): 1, (7,): 1, (2,): 1, (9,): 1}
    assert code.value("pre") == 8 and code.value("post") == 7 and code.value("y") == 12
    assert area.counter(0, L.HITS) == 5


def test_reads_of_memory_and_a_fault_gives_zero(area: NativeArea) -> None:
    words = (ctypes.c_uint32 * 2)(0xFFFFFFFE, 7)
    code = Compiled(area, "u:/bin/x:f { @u = *(uint32 *)arg0; @s = *(int32 *)arg0; @w = *(uint32 *)(arg0 + 4);"
                          " @q = *arg1; }")  # fmt: skip
    code(ctypes.addressof(words), area.guarded(b"") + 16)
    assert (code.value("u"), code.value("s"), code.value("w"), code.value("q")) == (0xFFFFFFFE, -2, 7, 0)


def test_delete_and_exit(area: NativeArea) -> None:
    code = Compiled(area, "u:/bin/x:f { @c[arg0] = count(); @m[arg0] = min(arg1); if (arg1 == 0) { delete(@c[arg0]);"
                          " delete(@m[arg0]); } if (arg1 == 42) { exit(); } }")  # fmt: skip
    code(1, 5)
    code(2, 6)
    code(1, 0)
    assert code.entries("c") == {(2,): 1} and code.entries("m") == {(2,): 6}
    code(1, 9)  # afresh after the delete
    assert code.entries("c") == {(1,): 1, (2,): 1} and code.entries("m") == {(1,): 9, (2,): 6}
    assert code.memory[0] == 0
    code(3, 42)
    assert code.memory[0] == 1


def test_clear_and_zero_in_a_probe_body(area: NativeArea) -> None:
    """clear(@m) hides every entry and starts its values afresh; zero(@m) keeps the entries, their
    values back to their start (min's at the far end, a hist's every bucket); other maps untouched."""
    code = Compiled(area, "u:/bin/x:f { @c[arg0] = count(); @m[arg0] = min(arg0); @h[arg0 % 2] = hist(arg0); @n++;"
                          " if (arg1 == 1) { clear(@c); clear(@h); }"
                          " if (arg1 == 2) { zero(@m); zero(@h); } }")  # fmt: skip
    for key in (1, 2, 3):
        code(key, 0)
    code(4, 1)  # its updates, then the clear
    assert code.entries("c") == {} and code.entries("h") == {}
    assert code.entries("m") == {(1,): 1, (2,): 2, (3,): 3, (4,): 4} and code.value("n") == 4
    code(2, 0)
    code(5, 2)  # its updates, then the zeroing: min's words at its start
    assert code.entries("c") == {(2,): 1, (5,): 1} and code.entries("h") == {(0,): {}, (1,): {}}
    assert code.entries("m") == {(k,): (1 << 63) - 1 for k in (1, 2, 3, 4, 5)}
    code(3, 0)
    assert code.entries("m")[(3,)] == 3 and code.entries("h") == {(0,): {}, (1,): {2: 1}} and code.value("n") == 7


def test_a_full_map_drops_and_counts_updates(area: NativeArea) -> None:
    code = Compiled(area, "u:/bin/x:f { @c[arg0] = count(); @n = count(); }", slots=4)
    for key in range(10):
        code(key)
    code(0)
    assert sum(code.entries("c").values()) + code.dropped("c") == 11  # type: ignore[arg-type]
    assert len(code.entries("c")) == 4 and code.dropped("c") == 6 and code.value("n") == 11
    table = code.region.tables["c"]  # (the dropped updates went to the sink: its count, no keys)
    sink = table.sink // 8
    assert code.memory[sink : sink + table.slot_bytes // 8].tolist() == [0, 1, 0, 6]


def test_keys_are_found_by_their_hash() -> None:
    """The tracer and the generated code agree on each key's hash (never 0: a free slot's)."""
    assert key_hash(()) & 1 and key_hash((0,)) & 1
    assert len({key_hash((k,)) for k in range(10_000)}) == 10_000
    assert key_hash((1, 2)) != key_hash((2, 1))


def test_a_signal_handler_hitting_a_probe_in_a_body_skips_it(area: NativeArea) -> None:
    code = Compiled(area, "u:/bin/x:f { @n = count(); }")
    area.set_word(L.LANG_BUSY, 1)
    code(0)
    area.set_word(L.LANG_BUSY, 0)
    code(0)
    assert code.value("n") == 1 and area.counter(0, L.MISSED) == 1 and area.counter(0, L.HITS) == 2


def test_threads_updating_at_once_lose_nothing(area: NativeArea) -> None:
    """Two threads (each with its area, as in a target) counting, summing and taking the max into
    the same entries many times over: every update is there."""
    source = "u:/bin/x:f { @c[arg0 & 3] = count(); @s = sum(arg0); @m = max(arg0); @h = hist(arg0); }"
    code = Compiled(area, source)
    other = NativeArea(LAYOUT)
    try:
        body = code.program
        detour = build_detour(plan(), [body], LAYOUT, other.base + other.used, function_entry=True)
        assert not isinstance(detour, OptimizeRefusal)
        elsewhere = other.place(detour.code[: detour.action_bytes] + b"\xc3")
        calls = 1_000_000

        def loop(on: NativeArea, actions: int) -> int:  # u64 f(n, arg): call actions(arg) n times
            return on.place(
                bytes.fromhex("53" "4154" "4889fb" "4989f4")  # push rbx; push r12; mov rbx, rdi; mov r12, rsi
                + bytes.fromhex("4c89e7" "48b8") + actions.to_bytes(8, "little")  # again: mov rdi, r12; mov rax, ..
                + bytes.fromhex("ffd0" "48ffcb" "75ec")  # call rax; dec rbx; jnz again
                + bytes.fromhex("415c" "5b" "c3")  # pop r12; pop rbx; ret
            )  # fmt: skip

        mine, theirs = loop(area, code.actions), loop(other, elsewhere)
        together = threading.Barrier(2)

        def run(on: NativeArea, at: int, arg: int) -> None:
            together.wait()
            on.call_at(at, calls, arg)

        thread = threading.Thread(target=run, args=(other, theirs, 6))
        thread.start()
        run(area, mine, 5)
        thread.join()
    finally:
        other.close()
    assert code.entries("c") == {(1,): calls, (2,): calls}
    assert code.value("s") == 11 * calls and code.value("m") == 6
    assert code.value("h") == {3: 2 * calls}


def test_every_update_of_a_map_word_is_atomic(area: NativeArea) -> None:
    """Read-modify-writes of a slot (rdi) or of a dropped counter carry a lock prefix: no update
    is lost to another thread's between its read and its write (the test above may not see two
    threads meet on a busy machine: this one sees the instructions)."""
    body = ("@c[arg0] = count(); @s = sum(arg0); @a = avg(arg0); @lo = min(arg0); @hi = max(arg0); @h = hist(arg0);"
            " @l = lhist(arg0, 0, 10, 1); @n++; @v += 2;")  # fmt: skip
    code = Compiled(area, f"u:/bin/x:f {{ {body} }}")
    detour = build_detour(plan(), [code.program], LAYOUT, 0x10000, function_entry=True)
    assert not isinstance(detour, OptimizeRefusal)
    updating = (iced.Mnemonic.ADD, iced.Mnemonic.INC, iced.Mnemonic.XADD, iced.Mnemonic.CMPXCHG)
    writes = [
        insn
        for insn in iced.Decoder(64, detour.code[: detour.action_bytes], ip=0x10000)
        if insn.op_count and insn.op0_kind == iced.OpKind.MEMORY and insn.mnemonic in updating
        and insn.memory_base in (iced.Register.RDI, iced.Register.RAX)
    ]  # fmt: skip
    assert len(writes) >= 12 and all(insn.has_lock_prefix for insn in writes)


ORACLE = [
    "$a = -7; $b = 2; @div = $a / $b; @mod = $a % $b; @sar = $a >> 1; @shl = $b << 3; @neg = -$a; @not = ~$b;"
    " @lnot = !$a;",
    "$a = -1; $z = (uint64)5; @gt = $a > $z; @gts = $a > 5; @c8 = (int8)300; @u8 = (uint8)$a;"
    " @c32 = (int32)0x80000000;",
    "$i = 3; @h = hist($i); @h = hist(0); @h = hist(-5); @h = hist(1 << 20); @l = lhist(15, 0, 100, 10);"
    " @l = lhist(200, 0, 100, 10); @l = lhist(-1, 0, 100, 10);",
    "@s = stats(10); @s = stats(-4); @a = avg(7); @a = avg(8); @m = min(-3); @m = min(4); @x = max(9); @x = max(-9);",
    "@k[1, 2] = count(); @k[1, 2] = count(); @k[3, 4] = count(); @u[5] = sum(5); @u[5] = sum(-8); @u[6] = sum(1);",
    "$x = 10; $x *= 3; $x -= 4; @x = $x; @t = $x > 20 ? 1 : 2; @y++; @y++; @z[7] = 1; @z[7] += 5; @w = @z[7] * 2;",
    "@q = 1 && 0; @r = 0 || 5; @e = (3 == 3) + (3 != 3); if (@r) { @then = 1; } else { @else = 1; }",
]


@pytest.mark.skipif(shutil.which("bpftrace") is None, reason="bpftrace is not installed (make toolchains installs it)")
@pytest.mark.parametrize("statements", ORACLE, ids=[s[:40] for s in ORACLE])
def test_maps_are_bpftraces(area: NativeArea, statements: str) -> None:
    """The same statements run by bpftrace (in BEGIN) and compiled here (a uprobe's body, one
    hit): the maps print the same."""
    run = subprocess.run(["bpftrace", "-e", f"BEGIN {{ {statements} exit(); }}"], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    if run.returncode != 0:
        pytest.skip(f"bpftrace cannot run a BEGIN probe here: {run.stderr.strip().splitlines()[-1:]}")
    code = Compiled(area, f"u:/bin/x:f {{ {statements} }}")
    code()
    ours = "".join(
        output.format_map(name, table.kind, list(code.entries(name).items()), lhist=table.lhist)  # type: ignore[arg-type]
        for name, table in sorted(code.region.tables.items())
    )
    assert "Attaching 1 probe...\n\n\n" + ours == run.stdout


def in_tracer(statements: str) -> dict[str, dict[tuple[output.Key, ...], output.Value]]:
    """The maps `statements` leave, run in BEGIN by the tracer (lang/tracer.py)."""
    source = f"BEGIN {{ {statements} }}"
    checked = check_program(parse_program(source), source)
    check_runnable(checked, source)
    tables = lay_out(checked).tables
    tracer = TracerMaps(tracer_maps(checked), tables)
    block = TracerBlock(checked.program.probes[0], checked, tracer, read_map=lambda name, keys: 0,
                        print_map=lambda name, top: "", clear=lambda name, keep: None, write=lambda text: None,
                        start_ns=0)  # fmt: skip
    assert block.run() is False
    return {name: dict(tracer.entries(name)) for name in tables}


EDGE_STATEMENTS = [
    "$a = 7; $z = 0; @d = $a / $z; @m = $a % $z; @lt = $a < $a; @le = $a <= $a; @ge = $a >= $a; @gt = $a > $a;"
    " @eq = $a == $a; @ne = $a != $a; @sl = -$a < $a; @sg = -$a >= $a;",
    "$n = -5; @k[$n] = count(); @k[$n * 2] = count(); @j[$n] = sum($n); @c64 = (int64)$n; @u64 = (uint64)$n;"
    " @c = (int32)$n; @u = (uint16)$n; @b = (int8)(200 + $n);",
    "@l = lhist(100, 0, 100, 10); @l = lhist(99, 0, 100, 10); @l = lhist(0, 0, 100, 10); @l = lhist(-1, 0, 100, 10);"
    " @l = lhist(101, 0, 100, 10); @m = lhist(55, 10, 100, 10); @m = lhist(10, 10, 100, 10);",
    "@t = 10; @t += -3; @t -= 20; @t *= -2; @t /= 3; @t %= 7; @lo = min(5); @lo = min(5); @lo = min(-9);"
    " @hi = max(-9); @hi = max(-9); @hi = max(3); @e = min(-9); @f = max(3);",
    "$v = 1; $v += 2; $v <<= 3; $v -= 30; @v = $v; $w = -4; $w >>= 1; @w = $w; $s = -9; $s /= 2; @s = $s;"
    " $p = 6; $p %= 4; $p |= 8; $p &= 12; $p ^= 5; @p = $p; @q = $p++; @r = ++$p; @o = $p--; @x = --$p;",
    "if (0) { $v = 5; } @v = $v; @a = avg(5); @a = avg(7); @r = @a; @m[1] = 4; @n = @m[2]; @c = (int8)100;"
    " @d = (int16)40000; @e = (int32)3000000000;",
]


@pytest.mark.parametrize("statements", ORACLE + EDGE_STATEMENTS, ids=[s[:40] for s in ORACLE + EDGE_STATEMENTS])
def test_the_tracer_runs_a_body_as_the_target_does(area: NativeArea, statements: str) -> None:
    """The same statements in BEGIN (lang/tracer.py's interpreter, in the tracer) and compiled
    (a uprobe's body, one hit): the same maps, entry for entry."""
    code = Compiled(area, f"u:/bin/x:f {{ {statements} }}")
    code()
    assert in_tracer(statements) == {name: code.entries(name) for name in code.region.tables}


EDGES = [0, 1, 2, 3, 7, 63, 64, 65, 100, 255, 256, 65535, 1 << 31, (1 << 63) - 1, -1, -2, -7, -(1 << 63)]
OPERATORS = ["+", "-", "*", "/", "%", "&", "|", "^", "<<", ">>", "==", "!=", "<", "<=", ">", ">=", "&&", "||"]
CASTS = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]


def _expressions() -> st.SearchStrategy[str]:
    leaves = st.sampled_from(["$a", "$b", "$u", *map(str, EDGES[:12])])
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.tuples(inner, st.sampled_from(OPERATORS), inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
            st.tuples(st.sampled_from(["-", "~", "!"]), inner).map(lambda t: f"{t[0]}({t[1]})"),
            st.tuples(st.sampled_from(CASTS), inner).map(lambda t: f"({t[0]})({t[1]})"),
            st.tuples(inner, inner, inner).map(lambda t: f"({t[0]} ? {t[1]} : {t[2]})"),
        ),
        max_leaves=6,
    )


@settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(_expressions(), st.sampled_from(EDGES), st.sampled_from(EDGES), st.sampled_from(EDGES))
def test_the_tracer_s_arithmetic_is_the_target_s(area: NativeArea, expr: str, a: int, b: int, u: int) -> None:
    """Any expression over signed and unsigned variables and literals, with every operator and
    cast, kept, aggregated and counted by key: the tracer's maps are the compiled code's."""
    statements = (f"$a = {a}; $b = {b}; $u = (uint64){u}; $x = {expr}; @r = $x; @n = -$x; @h = hist($x);"
                  f" @l = lhist($x, 0, 100, 10); @lo = min($x); @hi = max($x); @s = stats($x); @k[$x] = count();"
                  f" @t += $x; @t -= 3; @t *= 5; @t /= 3; @t %= 1000; @t <<= 2; @t >>= 1; @t &= 0xff; @t |= 0x100;"
                  f" @t ^= 3; @i++; ++@i; @i--; @v = $x > 0 ? @i++ : --@i; $y = $x; $y += 9; $y *= $b;"
                  " @y = $y;")  # fmt: skip
    code = Compiled(area, f"u:/bin/x:f {{ {statements} }}")
    code()
    assert in_tracer(statements) == {name: code.entries(name) for name in code.region.tables}


def test_builtins_tid_pid_cpu_and_the_clock(area: NativeArea) -> None:
    """tid and pid from the thread area, cpu the thread's, nsecs the time-stamp counter as the
    clock turns it into ns (here ns = ticks, plus the offset), elapsed since the clock's start."""
    area.set_word(L.TID, 4321)
    area.set_word(L.TGID, 99)
    clock = Clock(1 << 32, 10**15, 10**16)
    code = Compiled(area, "u:/bin/x:f { @t = tid; @p = pid; @c = cpu; @n = nsecs; @e = elapsed; }", clock=clock)
    before = area.call(read_tsc_code())
    code()
    after = area.call(read_tsc_code())
    assert (code.value("t"), code.value("p")) == (4321, 99)
    assert 0 <= code.value("c") < (os.cpu_count() or 1)  # type: ignore[operator]
    now, since = code.value("n"), code.value("e")
    assert isinstance(now, int) and isinstance(since, int)
    assert before <= now - 10**15 <= after and before <= since + 10**16 - 10**15 <= after and since + 10**16 >= now


def test_retval_is_the_returned_rax(area: NativeArea) -> None:
    code = Compiled(area, "ur:/bin/x:f { @r = retval; @neg = retval < 0; }")
    returning = area.place(  # rax = -77, then the body
        bytes.fromhex("48c7c0b3ffffff")  # mov rax, -77
        + bytes.fromhex("49bb") + code.actions.to_bytes(8, "little") + bytes.fromhex("41ffe3")  # mov r11, ..; jmp r11
    )  # fmt: skip
    area.call_at(returning)
    assert (code.value("r"), code.value("neg")) == (-77, 1)


def test_steps_and_compound_assignments(area: NativeArea) -> None:
    code = Compiled(
        area,
        "u:/bin/x:f { $x = arg0; $x++; $y = $x--; $z = ++$x; $w = --$x; @x = $x; @y = $y; @z = $z; @w = $w;"
        " @m = arg0; @m -= 3; @k = arg0; @k *= 3; @k %= 4; @q = arg0; @q /= 2; @u = 5; @u--; @v = 5; @old = @v--;"
        " @new = --@v; @s[1] = 7; @s[1] -= 10; $d = 20; $d -= arg0; $d *= 2; @d = $d; @sh = 3; @sh <<= 2;"
        " @p = (uint8 *)arg0; }",
    )  # fmt: skip
    code(9)
    # x: 9, 10, (y 10) 9, (z 10) 10, (w 9) 9
    assert [code.value(n) for n in "xyzw"] == [9, 10, 10, 9]
    assert (code.value("m"), code.value("k"), code.value("q")) == (6, 27 % 4, 4)
    assert (code.value("u"), code.value("old"), code.value("new"), code.value("v")) == (4, 5, 3, 3)
    assert code.entries("s") == {(1,): -3} and code.value("d") == 22
    assert (code.value("sh"), code.value("p")) == (12, 9)


def claimed(code: Compiled, name: str) -> int:
    """Slots of the map taken (a hash in their first word), entries or not."""
    table = code.region.tables[name]
    step = table.slot_bytes // 8
    first = table.offset // 8
    return sum(1 for slot in range(table.slots) if code.memory[first + slot * step])


def test_keys_have_the_tracers_hash_and_slot(area: NativeArea) -> None:
    """An entry sits in the slot its keys' hash names (the tracer finds it there), the hash in
    its first word, the keys after it in order."""
    code = Compiled(area, "u:/bin/x:f { @c[arg0, arg1] = count(); }", slots=64)
    code(3, 70000)
    table = code.region.tables["c"]
    home = table.home(key_hash((3, 70000)))
    at = (table.offset + home * table.slot_bytes) // 8
    assert code.memory[at : at + 5].tolist() == [key_hash((3, 70000)), 1, 3, 70000, 1]


def test_keys_that_share_a_home_slot_each_keep_their_entry(area: NativeArea) -> None:
    """Keys whose hashes name the same slot take the next ones; each is read back as its own,
    and a key looked up that is in none of the slots looked at reads 0."""
    table_slots = 4
    code = Compiled(area, "u:/bin/x:f { @v[arg0] = arg1; @r[arg0] = @v[arg0 + arg2]; }", slots=table_slots)
    home = code.region.tables["v"].home
    keys = [k for k in range(1000) if home(key_hash((k,))) == home(key_hash((0,)))][:3]
    for i, key in enumerate(keys):
        code(key, 100 + i, 0)
    code(keys[0], 100, 5000)  # (@v[keys[0] + 5000]: none)
    assert code.entries("v") == {(k,): 100 + i for i, k in enumerate(keys)} and claimed(code, "v") == 3
    assert code.entries("r") == {(keys[0],): 0, **{(k,): 100 + i for i, k in enumerate(keys) if i}}
    code(7777, 1, 0)  # (the table full: a key in none of its slots is looked for in all of them)
    code(keys[1], 5, 9999)
    assert code.entries("r")[(keys[1],)] == 0 and claimed(code, "v") == table_slots


def test_delete_starts_every_value_word_afresh(area: NativeArea) -> None:
    code = Compiled(area, "u:/bin/x:f { if (arg1) { delete(@a[arg0]); delete(@h[arg0]); } else { @a[arg0] = avg(arg2);"
                          " @h[arg0] = hist(arg2); } }")  # fmt: skip
    code(1, 0, 10)
    code(1, 0, 1 << 60)
    code(1, 1, 0)
    code(1, 0, 4)
    code(2, 1, 0)  # (a key never set: nothing to delete, no slot taken)
    assert code.entries("a") == {(1,): (1, 4)} and code.entries("h") == {(1,): {3: 1}}
    assert claimed(code, "a") == claimed(code, "h") == 1


def test_lhist_from_a_minimum_above_zero(area: NativeArea) -> None:
    code = Compiled(area, "u:/bin/x:f { @l = lhist(arg0, 10, 50, 10); }")
    for v in (5, 10, 15, 49, 50, 200):
        code(v)
    assert code.value("l") == {-1: 1, 0: 2, 3: 1, 4: 2}


@pytest.mark.parametrize(
    ("read", "expected"),
    [("*(uint8 *)arg0", 0xF0), ("*(int8 *)arg0", -16), ("*(uint16 *)arg0", 0xFEF0), ("*(int16 *)arg0", -272),
     ("*(uint32 *)arg0", 0xFDFCFEF0), ("*(int32 *)arg0", 0xFDFCFEF0 - (1 << 32)), ("*arg0", 0x7FFEFDFCFDFCFEF0),
     ("(int16)arg1", -2), ("(uint32)arg1", 0xFFFFFFFE), ("(int32)(arg1 >> 32)", -1)],
)  # fmt: skip
def test_reads_and_casts_of_every_width(area: NativeArea, read: str, expected: int) -> None:
    word = ctypes.c_uint64(0x7FFEFDFCFDFCFEF0)
    code = Compiled(area, f"u:/bin/x:f {{ @r = {read}; }}")
    code(ctypes.addressof(word), -2)
    assert code.value("r") == expected


def test_the_body_holds_the_thread_busy_while_it_runs(area: NativeArea) -> None:
    """While a body runs, LANG_BUSY is 1 (a signal handler's probe would skip its body); after, 0."""
    code = Compiled(area, "u:/bin/x:f { @busy = *(uint64 *)arg0; }")
    code(area.mem.ctypes.data + L.LANG_BUSY)
    assert code.value("busy") == 1 and area.word(L.LANG_BUSY) == 0


def test_deep_expressions_and_many_variables_stay_in_their_words(area: NativeArea) -> None:
    """An expression nested 40 deep (each right operand deeper) and 40 scratch variables: right
    values, and nothing of the thread area's header below the temporaries written."""
    nested = "arg0"
    for i in range(40):
        nested = f"({i} - {nested})" if i % 2 else f"(arg1 + {nested})"
    variables = " ".join(f"$v{i} = arg0 + {i};" for i in range(40))
    total = " + ".join(f"$v{i}" for i in range(40))
    code = Compiled(area, f"u:/bin/x:f {{ {variables} @n = {nested}; @t = {total}; }}")
    before = area.mem[: L.LANG_TEMPS].copy()
    code(3, 10)
    value = 3
    for i in range(40):
        value = i - value if i % 2 else 10 + value
    assert code.value("n") == value and code.value("t") == sum(3 + i for i in range(40))
    assert (area.mem[: L.LANG_TEMPS] == before).all()


@pytest.mark.parametrize("rdpid", [True, False])
def test_cpu_is_the_threads(area: NativeArea, rdpid: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the thread is held to, by rdpid or (where the CPU has none) rdtscp."""
    if rdpid and not has_rdpid():
        pytest.skip("this CPU has no rdpid (the other case runs)")
    monkeypatch.setattr("dynprobe.arch.x86_64.codegen.lang.has_rdpid", lambda: rdpid)
    cpu = max(os.sched_getaffinity(0))
    code = Compiled(area, "u:/bin/x:f { @c = cpu; }")
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        code()
    finally:
        os.sched_setaffinity(0, old)
    assert code.value("c") == cpu


def test_clear_hides_the_entries_and_zero_restarts_the_values(area: NativeArea) -> None:
    """What `clear(@m)` and `zero(@m)` in the tracer do to a region: min starts over at its far end."""
    code = Compiled(area, "u:/bin/x:f { @c[arg0] = count(); @m[arg0] = min(arg1); }")
    code(1, 5)
    code(2, 7)
    code.region.tables["c"].clear(code.memory, keep_keys=True)
    code.region.tables["m"].clear(code.memory, keep_keys=False)
    assert code.entries("c") == {(1,): 0, (2,): 0} and code.entries("m") == {}
    code(1, 9)
    assert code.entries("c") == {(1,): 1, (2,): 0} and code.entries("m") == {(1,): 9}


def test_printf_writes_a_record_of_its_values(area: NativeArea) -> None:
    """Each printf() a record: its number, each integer (worked out as anywhere), each str()
    copied (a length, a flag, the bytes: at most its length; unreadable: none), comm nothing
    (the tracer's)."""
    text = ctypes.create_string_buffer(b"hello, world")
    code = Compiled(area, 'u:/bin/x:f { printf("%d %s %s\\n", arg0 * 2, str(arg1), comm); '
                          'if (arg0 > 2) { printf("[%s] %u\\n", str(arg1, 5), -arg0); } }')  # fmt: skip
    for n in (1, 3):
        code(n, ctypes.addressof(text))
    code(4, 0)
    records = area.records()
    assert [field(r, L.RECORD_PROBE, 2) for r in records] == [0] * 5
    payload = [r[L.RECORD_HEADER :] for r in records]
    assert [field(p, 0) for p in payload] == [0, 0, 1, 0, 1]
    first = [p for p in payload if field(p, 0) == 0]
    assert [field(p, PRINTF_NUMBER) for p in first] == [2, 6, 8]
    strings = [(field(p, 16, 2), field(p, 18, 2), p[20 : 20 + field(p, 16, 2)]) for p in first]
    assert strings == [(12, 0, b"hello, world"), (12, 0, b"hello, world"), (0, 0, b"")]
    second = [p for p in payload if field(p, 0) == 1]
    assert [(field(p, 8, 2), field(p, 10, 2), p[12 : 12 + field(p, 8, 2)]) for p in second] == [
        (5, 1, b"hello"),
        (0, 0, b""),
    ]
    assert [field(p, 8 + L.STRING_FIELD) for p in second] == [(-3) & MASK, (-4) & MASK]
    assert area.counter(0, L.HITS) == 3 and area.counter(0, L.MISSED) == 0


def test_nothing_is_printed_once_the_program_called_exit(area: NativeArea) -> None:
    """After exit() (the region's first word set), printf(), print() and time() write no
    record, as bpftrace prints nothing after its exit; maps still count until the tracer sees
    it."""
    code = Compiled(area, 'u:/bin/x:f { printf("%d\\n", arg0); time(); print(@n); @n = count(); '
                          "if (arg0 == 2) { exit(); } }")  # fmt: skip
    for n in (1, 2, 3, 4):
        code(n)
    payload = [r[L.RECORD_HEADER :] for r in area.records()]
    assert [field(p, 0) for p in payload] == [0, 1, 2, 0, 1, 2]  # (the printf's, time()'s and print()'s numbers)
    assert [field(p, PRINTF_NUMBER) for p in payload if field(p, 0) == 0] == [1, 2]
    assert code.value("n") == 4 and int(code.memory[0]) == 1


def test_a_printf_larger_than_the_record_size_is_refused() -> None:
    source = 'u:/bin/x:f { printf("%s %s\\n", str(arg0), str(arg1)); }'
    checked = check_program(parse_program(source), source)
    region = lay_out(checked)
    body = LangBody(checked.program.probes[0], checked, 0x10000, region.tables, NS_AS_TICKS, printf_records(checked))
    detour = build_detour(plan(), [Program(0, ActionKind.COUNT, lang=body)], LAYOUT, 0x400000, function_entry=True)
    assert detour == OptimizeRefusal.RECORD_TOO_LARGE


def test_maps_keyed_by_strings(area: NativeArea) -> None:
    """str() keys: the bytes up to the NUL (at most str()'s length), NUL-padded words hashed
    as the tracer hashes them; an unreadable pointer an empty string, as bpftrace's."""
    words = [ctypes.create_string_buffer(w) for w in (b"alpha", b"beta", b"alpha", b"al", b"x" * 80)]
    code = Compiled(area, "u:/bin/x:f { @c[str(arg0)] = count(); @s[str(arg0, 2), arg1] = sum(arg1); }")
    for i, word in enumerate(words):
        code(ctypes.addressof(word), i)
    code(0, 9)
    assert code.entries("c") == {("alpha",): 2, ("beta",): 1, ("al",): 1, ("x" * 63,): 1, ("",): 1}
    assert code.entries("s") == {("al", 0): 0, ("be", 1): 1, ("al", 2): 2, ("al", 3): 3, ("xx", 4): 4, ("", 9): 9}
    table = code.region.tables["c"]
    key = b"beta".ljust(64, b"\0")
    hashed = key_hash([int.from_bytes(key[i : i + 8], "little") for i in range(0, 64, 8)])
    slots = [k for k in range(table.slots) if int(code.memory[(table.offset + k * table.slot_bytes) // 8]) == hashed]
    assert len(slots) == 1 and (slots[0] - table.home(hashed)) % table.slots < maps.PROBES


def test_maps_of_strings(area: NativeArea) -> None:
    """@m[k] = str(p[, n]): the bytes in the entry's value words (a later one replaces them); a
    printf() of such a value copies them into its record, an entry that is not there an empty
    string; delete() empties it."""
    words = [ctypes.create_string_buffer(w) for w in (b"alpha", b"beta", b"x" * 80)]
    code = Compiled(area, 'u:/bin/x:f { if (arg1 == 9) { delete(@s[arg0]); } else { @s[arg0] = str(arg1);'
                          ' @t = str(arg1, 3); } printf("<%s>\\n", @s[arg0]); }')  # fmt: skip
    for key, word in ((1, words[0]), (2, words[1]), (1, words[2])):
        code(key, ctypes.addressof(word))
    code(2, 9)
    code(3, 0)  # (unreadable: an empty string)
    assert code.entries("s") == {(1,): "x" * 63, (3,): ""} and code.entries("t") == {(): ""}
    texts = [p[12 : 12 + field(p, 8, 2)] for p in (r[L.RECORD_HEADER :] for r in area.records())]
    assert texts == [b"alpha", b"beta", b"x" * 63, b"", b""]


def test_a_stack_key_is_the_slot_the_probe_counted_the_hit_in(area: NativeArea) -> None:
    """@[ustack]: the probe counts the hit by its stack before the body (its slot's address in
    STACK_SLOT, 0 when the table is full); the body keys by that address."""
    code = Compiled(area, "u:/bin/x:f { @[ustack] = count(); @n[ustack] = sum(arg0); }")
    for slot, times in ((0x7000_1000, 2), (0x7000_2000, 1), (0, 1)):
        area.set_word(L.STACK_SLOT, slot)
        for _ in range(times):
            code(5)
    assert code.entries("") == {(0x7000_1000,): 2, (0x7000_2000,): 1, (0,): 1}
    assert code.entries("n") == {(0x7000_1000,): 10, (0x7000_2000,): 5, (0,): 5}


def test_comm_func_and_probe_keys_are_the_thread_and_the_probe(area: NativeArea) -> None:
    """comm keys by the thread (pid << 32 | tid), func and probe by the probe's index plus 1
    (0 names nothing): words the tracer names; so are maps of them."""
    code = Compiled(area, "u:/bin/x:f { @[comm, func] = count(); @p[probe, arg0] = sum(arg0); @who[arg0] = comm;"
                          " @f = func; }", probe_index=3)  # fmt: skip
    area.set_word(L.TGID, 99)
    for tid in (4321, 4321, 4322):
        area.set_word(L.TID, tid)
        code(7)
    assert code.entries("") == {(99 << 32 | 4321, 4): 2, (99 << 32 | 4322, 4): 1}
    assert code.entries("p") == {(4, 7): 21}
    assert code.entries("who") == {(7,): 99 << 32 | 4322} and code.entries("f") == {(): 4}


def test_a_str_length_worked_out_at_the_hit(area: NativeArea) -> None:
    """str(ptr, n) with n an expression: at most n bytes (n taken unsigned, at most 63), in a
    key and in a printf, with the temporaries of both operands kept apart."""
    text, long = ctypes.create_string_buffer(b"hello, world"), ctypes.create_string_buffer(b"x" * 80)
    code = Compiled(area, 'u:/bin/x:f { @k[str(arg0 + (arg1 - arg1), arg1 + 1), arg1] = count(); '
                          '@j[arg1, str(arg0, 3)] = count(); '
                          'printf("%s|\\n", str(arg0 + (arg1 - arg1), arg1 * 2)); }')  # fmt: skip
    for n in (0, 1, 2, 40, -1):
        code(ctypes.addressof(text), n)
    code(ctypes.addressof(long), 100)
    assert code.entries("k") == {("h", 0): 1, ("he", 1): 1, ("hel", 2): 1, ("hello, world", 40): 1,
                                 ("", -1): 1, ("x" * 63, 100): 1}  # fmt: skip
    assert code.entries("j") == {(0, "hel"): 1, (1, "hel"): 1, (2, "hel"): 1, (40, "hel"): 1, (-1, "hel"): 1,
                                 (100, "xxx"): 1}  # fmt: skip
    payload = [r[L.RECORD_HEADER :] for r in area.records()]
    strings = [(field(p, 8, 2), field(p, 10, 2), p[12 : 12 + field(p, 8, 2)]) for p in payload]
    assert strings == [(0, 1, b""), (2, 1, b"he"), (4, 1, b"hell"), (12, 0, b"hello, world"),
                       (12, 0, b"hello, world"), (63, 1, b"x" * 63)]  # fmt: skip


def test_print_writes_a_record_of_its_number_alone(area: NativeArea) -> None:
    """print(@m[, N]) in a probe: a record of its number (the tracer prints the map)."""
    code = Compiled(area, 'u:/bin/x:f { @c = count(); if (arg0) { print(@c, 2); } printf("%d\\n", arg0); }',
                    probe_index=2)  # fmt: skip
    for n in (1, 0):
        code(n)
    records = area.records()
    assert [field(r, L.RECORD_PROBE, 2) for r in records] == [2, 2, 2]
    assert [field(r[L.RECORD_HEADER :], 0) for r in records] == [0, 1, 1]
    assert [p.prints for p in code.program.lang.printfs.values()] == [("c", 2), None]


def test_a_map_keyed_by_the_thread_is_updated_without_a_lock(area: NativeArea) -> None:
    """Where every update keys a map by `tid`, an entry has one writer: its count, sum, hist,
    step and `+=` are plain instructions (a locked one costs several ns here); elsewhere they
    stay locked. The counts are the same either way."""
    source = ("u:/bin/x:f { @t[tid, arg0] = count(); @s[arg0, tid] = sum(arg0); @h[tid] = hist(arg0); @n[tid]++;"
              " @p[tid] += 2; @shared[arg0] = count(); @mixed[tid] = count(); @mixed[arg0] = count(); }")  # fmt: skip
    checked = check_program(parse_program(source), source)
    assert thread_keyed_maps(checked) == {"t", "s", "h", "n", "p"}
    tables = lay_out(checked).tables
    assert {name for name, table in tables.items() if table.one_writer} == {"t", "s", "h", "n", "p"}
    code = Compiled(area, source)
    area.set_word(L.TID, 77)
    for arg in (1, 1, 2):
        code(arg)
    assert code.entries("t") == {(77, 1): 2, (77, 2): 1} and code.entries("s") == {(1, 77): 2, (2, 77): 2}
    assert code.entries("n") == {(77,): 3} and code.entries("p") == {(77,): 6}
    assert code.entries("shared") == {(1,): 2, (2,): 1} and code.entries("mixed") == {(77,): 3, (1,): 2, (2,): 1}

    def locked(text: str) -> int:  # (the locked instructions of a body: its map's claim, its drop count, its update)
        checked = check_program(parse_program(text), text)
        region = lay_out(checked)
        body = LangBody(
            checked.program.probes[0], checked, 0x10000, region.tables, NS_AS_TICKS, printf_records(checked)
        )
        built = build_detour(
            plan(), [Program(0, ActionKind.COUNT, lang=body)], LAYOUT, 0x7000_0000, function_entry=True
        )
        assert not isinstance(built, OptimizeRefusal)
        return sum(i.has_lock_prefix for i in iter_instructions(built.code[: built.action_bytes], 0x7000_0000))

    assert locked("u:/bin/x:f { @t[arg0] = count(); }") == locked("u:/bin/x:f { @t[tid] = count(); }") + 1
