"""What of a bpftrace program runs where (lang/target.py): each refusal at its span, before
anything is placed; the tracer's blocks (lang/tracer.py) and its printf, as C's."""

from __future__ import annotations

import re
import time

import pytest

from dynprobe.errors import ProgramError
from dynprobe.lang.check import check_program
from dynprobe.lang.maps import lay_out
from dynprobe.lang.output import c_format
from dynprobe.lang.parser import parse_program
from dynprobe.lang.target import PrintfArg, check_runnable, printf_records, tracer_maps
from dynprobe.lang.tracer import TracerBlock, TracerMaps
from dynprobe.ringbuf import layout as L


def runnable(source: str) -> None:
    check_runnable(check_program(parse_program(source), source), source)


@pytest.mark.parametrize(
    "source",
    [
        "uprobe:libc:malloc /arg0 > 16 && tid != 0/ { $x = arg0; @s[tid, cpu] = sum($x); @h = hist(arg0);"
        " @l = lhist(arg0, 0, 100, 10); @n++; @m[arg0] = max(nsecs); if (@n > 3) { delete(@m[arg0]); } exit(); }",
        "uretprobe:libc:malloc { @r = retval; @t = elapsed; @v = *(uint32 *)retval; @c = retval ? 1 : 2; }",
        'uprobe:libc:strlen { printf("%d %s %s\\n", arg0 + 1, comm, str(arg0, 4)); if (arg0) { printf("x\\n"); } }',
        "uprobe:libc:strlen /@s[ustack(5)]/ { @s[ustack(5)] = count(); }",
        "uprobe:libc:str* /@c[comm, probe] < 5/ { @c[comm, probe] = count(); @f[func, str(arg0)] = max(arg0); }"
        ' uprobe:libc:write { @w[str(arg1, arg2)] = count(); printf("%s\\n", str(arg1, arg2 - 1)); }'
        " uretprobe:libc:strlen { @r[ustack] = count(); print(@r); print(@r, 3); clear(@r); zero(@w); }",
        "uprobe:libc:open { @f[tid] = str(arg0); @g[tid, 1] = str(arg0, arg1); }"
        ' uretprobe:libc:open { printf("%s %s %d\\n", @f[tid], @g[tid, 1], retval); delete(@f[tid]); }'
        ' END { printf("%s\\n", @f[1]); @h = "x"; }',
        'uprobe:libc:malloc { @who[tid] = comm; @f = func; @p[arg0] = probe; zero(@f); time("%H\\n"); time(); }'
        ' uretprobe:libc:malloc { printf("%s %s %s\\n", @who[tid], @f, @p[1]); delete(@who[tid]); }'
        ' END { printf("%s\\n", @f); }',
        'BEGIN { printf("hi %d %s\\n", -3, "there"); time("%H\\n"); } interval:s:1 { print(@c); clear(@c); '
        "zero(@d); } END { print(@c, 2); exit(); } uprobe:libc:free { @c[arg0] = count(); @d = sum(arg0); }",
        'BEGIN { @start = nsecs; $x = 3; @v[1, "a"] = $x * 2; @h = hist($x); } interval:ms:10 { @ticks++; '
        'if (@ticks >= 3 && @c[1] > 0) { exit(); } } END { delete(@v[1, "a"]); printf("%d %d\\n", elapsed, '
        "(int8)@ticks); } uprobe:libc:free { @c[arg0] = count(); }",
    ],
)  # fmt: skip
def test_what_runs(source: str) -> None:
    runnable(source)


@pytest.mark.parametrize(
    ("source", "says", "at"),
    [
        ('uprobe:libc:malloc { printf("%s\\n", ustack); }', "a stack value", "ustack"),
        ('uprobe:libc:malloc { printf("' + "%s" * 60 + '", ' + ", ".join(["str(arg0)"] * 60) + "); }",
         "a printf() of 4088 bytes of values (a record holds 4080)", "printf"),
        ('uprobe:libc:malloc { @["x"] = count(); }', "a map key that is not an integer, str(), comm, func", '"x"'),
        ("uprobe:libc:malloc { @m = comm; } uretprobe:libc:malloc { @m = func; }",
         "@m holding func here and comm elsewhere", "func"),
        ("uprobe:libc:malloc { @m[1] = str(arg0); @m[2] = probe; }", "@m holding probe here and str() elsewhere",
         "probe"),
        ('uprobe:libc:malloc { @m = comm; @n = @m; }', "a value of @n that is not a str(), comm, func or probe",
         "@m"),
        ("uprobe:libc:malloc { @m[comm] = count(); } uprobe:libc:free { @m[str(arg0)] = count(); }",
         "@m keyed by string here and by comm elsewhere", "@m[str"),
        ("uprobe:libc:malloc { @s = str(arg0); @t[@s] = 1; }", "a map key that is not an integer, str()", "@s"),
        ("uprobe:libc:malloc { $s = str(arg0); }", "a string value", "str(arg0)"),
        ("uprobe:libc:malloc, BEGIN { @x = 1; }", "a probe block is either uprobes and uretprobes", "uprobe"),
        ("BEGIN /1/ { exit(); }", "a predicate is for uprobes", "1"),
        ("BEGIN { @x = pid; }", "pid in BEGIN, END and interval probes (dynprobe runs them in the tracer): it "
         "belongs to a thread", "pid"),
        ("interval:s:1 { @x++; } uprobe:libc:malloc { @y = @x; }", "@x is written in BEGIN, END and interval probes "
         "(dynprobe runs them in the tracer) and used by probe bodies", "@x"),
        ("END { @v = *(uint32 *)0; }", "reading memory in BEGIN, END and interval probes", "*("),
        ("END { delete(@c[1]); } uprobe:libc:free { @c[arg0] = count(); }", "delete() of a map probe bodies write",
         "@c[1]"),
        ("BEGIN { @s[str(0)] = 1; }", "str() in BEGIN, END and interval probes", "str("),
        ("uprobe:libc:malloc { @m[" + ", ".join(["1"] * 17) + "] = 1; }", "keys of more than 16 words", "@m"),
        ("uprobe:libc:malloc { @m[str(arg0), str(arg1), 1] = 1; }", "keys of more than 16 words", "@m"),
        ("uprobe:libc:malloc { @m[ustack, arg0] = count(); }", "ustack among a map's keys", "@m"),
        ("uprobe:libc:malloc { @m[ustack(3)] = count(); @n[ustack] = count(); }", "ustack of different depths",
         "uprobe"),
        ("uprobe:libc:malloc { " + "".join(f"$v{i} = {i}; " for i in range(65)) + "}",
         "more than 64 scratch variables", "$v64"),
        ("uprobe:libc:malloc { @x = " + "(1 + " * 48 + "1" + ")" * 48 + "; }", "an expression nested this deep",
         "1"),
    ],
)  # fmt: skip
def test_what_cannot_run_is_refused_at_its_span(source: str, says: str, at: str) -> None:
    with pytest.raises(ProgramError) as caught:
        runnable(source)
    assert says in caught.value.message, caught.value.message
    start, end = caught.value.span
    assert source[start:end].startswith(at), source[start:end]


@pytest.mark.parametrize(
    ("fmt", "values", "expected"),
    [
        ("%d %i|%5d|%-4d|", [-1, (1 << 64) - 1, 42, 7], "-1 -1|   42|7   |"),
        ("%u %x %X %o", [-1, 255, 255, 8], f"{(1 << 64) - 1} ff FF 10"),
        ("%ld %llu %lx %hhd", [5, 6, 7, 8], "5 6 7 8"),
        ("%s|%10s|%c|%p|100%%", ["ab", "cd", 65, 4096], "ab|        cd|A|0x1000|100%"),
        ("no conversions\\n", [], "no conversions\\n"),
        ("%q %5|%d", [3], "%q %5|3"),  # (what is no conversion stays as it is)
    ],
)  # fmt: skip
def test_printf_formats_as_c_does(fmt: str, values: list[int | str], expected: str) -> None:
    assert c_format(fmt, values) == expected


def tracer_block(source: str, *, read_map: object = None, done: list[object] | None = None,
                 start_ns: int = 0) -> TracerBlock:  # fmt: skip
    """The first block of `source`, a BEGIN, END or interval one, ready to run over its own
    maps; what it prints and clears goes to `done`."""
    checked = check_program(parse_program(source), source)
    check_runnable(checked, source)
    tracer = TracerMaps(tracer_maps(checked), lay_out(checked).tables)
    log = done if done is not None else []
    return TracerBlock(checked.program.probes[0], checked, tracer, read_map=read_map or (lambda name, keys: 0),
                       print_map=lambda name, top: f"<{name} {top}>", clear=lambda name, keep: log.append((name, keep)),
                       write=log.append, start_ns=start_ns)  # type: ignore[arg-type]  # fmt: skip


def test_a_map_the_tracer_holds_takes_no_room_in_the_target() -> None:
    """A keyed map only an interval body writes lives in the tracer: its table in the region
    the target maps is one slot; the same map written by a probe body has them all."""
    sizes = {}
    for source in ("interval:ms:10 { @ticks++; @h[@ticks % 3] = hist(@ticks); }",
                   "uprobe:libc:free { @h[arg0 % 3] = hist(arg0); }"):  # fmt: skip
        checked = check_program(parse_program(source), source)
        check_runnable(checked, source)
        sizes[source.split()[0]] = lay_out(checked, slots=1024).tables["h"].slots
    assert sizes == {"interval:ms:10": 1, "uprobe:libc:free": 1024}


def test_a_tracer_block_prints_clears_zeroes_and_exits() -> None:
    """Its statements in order, each through the callback it names; a target's map read for
    the keys the block works out; exit() is said by run()."""
    source = ('END { $k = 1; printf("%d %d %s\\n", @c[$k], -@c[$k + 1], "x"); print(@c); print(@c, 2);'
              ' clear(@c); zero(@d); time("at\\n"); exit(); }'
              " uprobe:libc:free { @c[arg0] = count(); @d = sum(arg0); }")  # fmt: skip
    done: list[object] = []

    def value(name: str, keys: tuple[int, ...]) -> int:
        assert name == "c"
        return {(1,): 5, (2,): 7}[keys]

    assert tracer_block(source, read_map=value, done=done).run() is True
    assert done == ["5 -7 x\n", "<c 0>", "<c 2>", ("c", False), ("d", True), "at\n"]
    assert tracer_block("END { zero(@d); } uprobe:libc:free { @d = sum(arg0); }", done=done).run() is False


def test_a_tracer_block_keeps_its_maps() -> None:
    """Maps a BEGIN, END or interval body writes live in the tracer, across runs of the block:
    assignments, steps, aggregations, deletes, clear and zero, with the target's arithmetic."""
    block = tracer_block('interval:s:1 { @ticks++; $t = @ticks; @sq[$t] = $t * $t; @h = hist($t); @s = stats($t);'
                         ' @m["min"] = min(-$t); if (@ticks == 2) { delete(@sq[1]); @w = (uint8)(@ticks - 3); }'
                         ' if (@ticks == 3) { exit(); } }')  # fmt: skip
    assert [block.run() for _ in range(3)] == [False, False, True]
    tracer = block.tracer
    assert dict(tracer.entries("ticks")) == {(): 3} and dict(tracer.entries("w")) == {(): 255}
    assert dict(tracer.entries("sq")) == {(2,): 4, (3,): 9}
    assert dict(tracer.entries("h")) == {(): {1: 1, 2: 2}}
    assert dict(tracer.entries("s")) == {(): (3, 6)} and dict(tracer.entries("m")) == {("min",): -3}
    tracer.clear("sq", keep_keys=True)
    assert dict(tracer.entries("sq")) == {(2,): 0, (3,): 0}
    tracer.clear("sq", keep_keys=False)
    assert tracer.entries("sq") == []


def test_printf_records_are_laid_out_and_numbered_in_order() -> None:
    """A record: the printf's number, then 8 bytes an integer, a string field a str() (its
    length the most it copies: 63 bytes, or what str()'s literal says), nothing for comm; the
    same call twice is one record; BEGIN's printf() is the tracer's, not a record."""
    source = (
        'BEGIN { printf("b\\n"); } uprobe:libc:strlen { printf("%s %d %s\\n", comm, arg0, str(arg0)); '
        'if (arg0) { printf("%s\\n", str(arg0, 4)); printf("x\\n"); } } uretprobe:libc:strlen { printf("x\\n"); }'
    )
    checked = check_program(parse_program(source), source)
    records = sorted(printf_records(checked).values(), key=lambda r: r.number)
    assert [(r.number, r.fmt, r.size) for r in records] == [
        (0, "%s %d %s\n", 8 + 8 + L.STRING_FIELD),
        (1, "%s\n", 8 + L.STRING_FIELD),
        (2, "x\n", 8),
    ]
    assert records[0].args == (PrintfArg("comm", 8), PrintfArg("int", 8), PrintfArg("str", 16, 63))
    assert records[1].args == (PrintfArg("str", 8, 4),)
    both = check_program(parse_program('u:libc:strlen { printf("%s %s %d", func, probe, 1); }'), "")
    assert next(iter(printf_records(both).values())).args == (PrintfArg("func", 8), PrintfArg("probe", 8),
                                                              PrintfArg("int", 8))  # fmt: skip
    # a map of comm's value: its word; time(fmt): its number alone, bpftrace's format by default
    named = 'u:libc:strlen { @c = comm; printf("%s %d\\n", @c, 2); time("%M\\n"); time(); }'
    records = sorted(printf_records(check_program(parse_program(named), "")).values(), key=lambda r: r.number)
    assert records[0].args == (PrintfArg("comm word", 8), PrintfArg("int", 16))
    assert [(r.fmt, r.time, r.size) for r in records[1:]] == [("%M\n", True, 8), ("%H:%M:%S\n", True, 8)]


def test_a_tracer_block_s_strings_clock_and_prints() -> None:
    """Maps of strings (a missing entry: empty), `elapsed` from the block's start and `nsecs`
    on the same clock, `time()` in its default format, `print(@m)` of a whole map."""
    done: list[object] = []
    start = time.monotonic_ns()
    block = tracer_block('END { @s[1] = "hello"; @t = @s[1]; @e = elapsed; @n = nsecs; printf("<%s|%s>\\n", @s[1],'
                         " @s[2]); time(); print(@s); }", done=done, start_ns=start)  # fmt: skip
    assert block.run() is False
    after = time.monotonic_ns()
    tracer = block.tracer
    assert dict(tracer.entries("s")) == {(1,): "hello"} and dict(tracer.entries("t")) == {(): "hello"}
    ((_, elapsed),) = tracer.entries("e")
    ((_, now),) = tracer.entries("n")
    assert isinstance(elapsed, int) and isinstance(now, int) and start <= now <= after and 0 <= elapsed <= after - start
    assert done[0] == "<hello|>\n" and re.fullmatch(r"\d\d:\d\d:\d\d\n", str(done[1])) and done[2] == "<s 0>"
