"""Smoke tests of every CLI command and of the bad-input promises (one line, non-zero, target unharmed)."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import pty
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dynprobe.core.returns import default_maxactive
from dynprobe.symbols.ifunc import is_fragment
from tests.conftest import DYNPROBE, build_target
from tests.integration.helpers import held_by_other_tracer


def dp(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DYNPROBE, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def sigs() -> str:
    return build_target("sigs", flags=("-O1",))


def test_trace_prints_ftrace_lines_and_summary(wordcount: str) -> None:
    r = dp("trace", "p:demo/add add_word w=+0(%di):string len=%si:s32", "--", wordcount, "a b a")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "demo/add" in line and ": (0x" in line]
    assert len(lines) == 3
    assert lines[0].split()[0] == f"wordcount-{lines[0].split('-')[1].split()[0]}"
    assert lines[0].endswith('w="a" len=1') and lines[1].endswith('w="b" len=1')
    assert "demo/add" in r.stderr and "hits=3" in r.stderr
    assert r.stdout == "2 distinct words\n"  # the target's own output, alone (events on stderr)


def test_trace_json_to_file_and_spec_file(wordcount: str, tmp_path: Path) -> None:
    specs = tmp_path / "specs.txt"
    specs.write_text("# comment\np:t/h hash\n\np:t/a add_word n=%si:u32  # trailing comment\n")
    out = tmp_path / "events.jsonl"
    r = dp("trace", "--json", "-o", str(out), "-f", str(specs), "--", wordcount, "x y")
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in out.read_text().splitlines()]
    assert [e["event"] for e in events] == ["a", "h", "a", "h"]  # add_word calls hash
    assert [e["args"] for e in events if e["event"] == "a"] == [{"n": 1}, {"n": 1}]
    assert all(e["comm"] == "wordcount" and e["pid"] == e["tid"] for e in events)


def test_exit_status_is_the_commands(sigs: str) -> None:
    r = dp("trace", "probed", "--", sigs, "exit", "7")
    assert r.returncode == 7 and "usr1=50" in r.stdout and "hits=50" in r.stderr
    r = dp("trace", "probed", "--", sigs, "kill", str(int(signal.SIGTERM)))
    assert r.returncode == 128 + signal.SIGTERM
    assert "usr1=50" in r.stdout


def test_the_command_gets_the_environment_dynprobe_was_given() -> None:
    """dynprobe asks numpy's OpenBLAS for one thread while it loads, and takes that back: the
    program it starts sees the environment as given (one variable added to see it pass)."""
    env = {**os.environ, "DYNPROBE_SEEN": "yes"}
    env.pop("OPENBLAS_NUM_THREADS", None)
    r = subprocess.run([*DYNPROBE, "count", "p libc:malloc", "--", "/usr/bin/env"], capture_output=True, text=True,
                       timeout=60, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "DYNPROBE_SEEN=yes" in r.stdout.splitlines() and "OPENBLAS_NUM_THREADS" not in r.stdout


def test_list_binary_and_pid(wordcount: str) -> None:
    r = dp("list", wordcount)
    assert r.returncode == 0
    names = {line.split()[-1] for line in r.stdout.splitlines()[1:]}
    assert {"main", "hash", "add_word"} <= names
    nm = subprocess.run(["nm", "--defined-only", wordcount], capture_output=True, text=True).stdout
    nm_funcs = {line.split()[2] for line in nm.splitlines() if line.split()[1] in "tT"}
    assert names <= nm_funcs  # every listed function is a function symbol nm knows
    r = dp("list", wordcount, "add_*")
    assert [line.split()[-1] for line in r.stdout.splitlines()[1:]] == ["add_word"]
    proc = subprocess.Popen(["sleep", "30"])
    try:
        r = dp("list", "-p", str(proc.pid), "nanosleep")
        assert r.returncode == 0 and "libc.so.6" in r.stdout
    finally:
        proc.kill()
        proc.wait()


def help_examples() -> list[tuple[str, str]]:
    """(command, example) for each line of each command's help that shows a dynprobe command,
    without its comment (after two spaces)."""
    commands = re.findall(r"^    ([a-z]+) ", dp("--help").stdout, re.M)
    assert commands == ["trace", "count", "stacks", "hist", "latency", "list", "record", "live", "run", "replay",
                        "report", "graph", "dump"]  # fmt: skip
    found = []
    for command in commands:
        shown = dp(command, "--help")
        assert shown.returncode == 0 and "examples:" in shown.stdout, command
        lines = shown.stdout.split("examples:", 1)[1].splitlines()
        examples = [re.split(r"\s{2,}", line.strip())[0] for line in lines if line.startswith("  dynprobe ")]
        assert len(examples) >= 2, command
        found += [(command, example) for example in examples]
    return found


def test_every_help_example_is_a_valid_command() -> None:
    """Each example in each command's help parses as that command, and its probe specs, filter
    and histogram value are accepted as the command checks them before it touches a process."""
    from dynprobe.actions.filter import parse_value
    from dynprobe.cli.main import build_parser, split_command
    from dynprobe.cli.probes import check_request

    examples = help_examples()
    assert len(examples) >= 30
    for command, example in examples:
        words = shlex.shlex(example.replace("$(pgrep -n bash)", "1234"), posix=True, punctuation_chars="|>")
        words.whitespace_split = True
        argv = list(itertools.takewhile(lambda word: word not in ("|", ">"), words))  # not what a shell does after
        assert argv[:2] == ["dynprobe", command], example
        own, _ = split_command(argv[1:])
        try:
            args = build_parser().parse_args(own)
        except SystemExit:
            pytest.fail(f"not a valid command: {example}")
        if command == "run" and args.program is not None:
            from dynprobe.lang.check import check_program
            from dynprobe.lang.parser import parse_program
            from dynprobe.lang.target import check_runnable

            check_runnable(check_program(parse_program(args.program), args.program), args.program)
        if getattr(args, "specs", None):
            request = check_request(args)
            if command == "hist":
                for spec in request.specs:
                    parse_value(args.value, spec.args)


def test_list_takes_what_specs_take_and_names_aliases_once(wordcount: str) -> None:
    """`list libc`, `list 'libc:mem*'`, `list -p PID 'libc:malloc*'`: a library by the name specs
    give it; malloc once (not __libc_malloc too), under the name programs call."""
    by_name = dp("list", "libc", "malloc*")
    assert by_name.returncode == 0, by_name.stderr
    functions = [line.split()[-1] for line in by_name.stdout.splitlines()[1:]]
    assert "malloc" in functions and "__libc_malloc" not in functions
    addresses = [line.split()[0] for line in by_name.stdout.splitlines()[1:]]
    assert len(addresses) == len(set(addresses))  # one row per address
    assert dp("list", "libc:malloc*").stdout == by_name.stdout
    with subprocess.Popen(["sleep", "30"]) as proc:
        try:
            mapped = dp("list", "-p", str(proc.pid), "libc:malloc*")
        finally:
            proc.kill()
    assert mapped.returncode == 0, mapped.stderr
    assert [line.split()[-1] for line in mapped.stdout.splitlines()[1:]] == functions
    assert {line.split()[2] for line in mapped.stdout.splitlines()[1:]} == {"libc.so.6"}
    r = dp("list", wordcount, "main")
    header, row = r.stdout.splitlines()
    assert header.split() == ["ADDRESS", "SIZE", "MODULE", "TRAP", "JUMP", "FUNCTION"] and row.split()[-1] == "main"


def test_specs_from_stdin_top_and_all(wordcount: str) -> None:
    """`-f -` reads specs from stdin; probes with no hits are left out unless --all; --top N
    keeps the N most hit, and a line says what was left out."""
    specs = "p:wc/add add_word\np:wc/hash hash\np:wc/never libc:abort\n"
    r = subprocess.run([*DYNPROBE, "count", "-o", "-", "-f", "-", "--", wordcount, "a b a"], input=specs,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith("  ")]
    assert rows == [["wc/add", "3"], ["wc/hash", "3"], ["(not", "shown:", "1", "with", "no", "hits", "(--all", "shows",
                                                          "them))"]]  # fmt: skip
    r = subprocess.run([*DYNPROBE, "count", "-o", "-", "--all", "-f", "-", "--", wordcount, "a b a"], input=specs,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert [line.split()[0] for line in r.stdout.splitlines() if line.startswith("  ")] == ["wc/add", "wc/hash",
                                                                                            "wc/never"]  # fmt: skip
    r = dp("count", "-o", "-", "--top", "1", "p:wc/add add_word", "p:wc/main main", "--", wordcount, "a b a")
    assert r.stdout.splitlines()[1:] == ["hits:", f"  {'wc/add'} {3:>12}", "  (not shown: 1 past the top 1)"]


def test_a_missing_function_names_the_library_that_has_it(wordcount: str) -> None:
    r = dp("latency", "malloc", "--", wordcount)
    assert r.returncode == 1 and r.stderr == (
        f"dynprobe: error: no function 'malloc' in {wordcount}; libc.so.6 has it: libc:malloc\n"
    )
    r = dp("latency", "no_such_function", "--", wordcount)
    assert r.returncode == 1 and r.stderr == f"dynprobe: error: no function 'no_such_function' in {wordcount}\n"
    r = dp("count", "p add_wrod", "--", wordcount)  # a slip of the keyboard: the name meant
    assert (
        r.returncode == 1
        and r.stderr == f"dynprobe: error: no function 'add_wrod' in {wordcount}; did you mean add_word?\n"
    )


def test_malformed_spec_prints_a_caret(wordcount: str) -> None:
    r = dp("trace", "p add_word %bogus", "--", wordcount)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "dynprobe: error: BAD_REG_NAME: unknown register: %bogus (column 12)",
        "    p add_word %bogus",
        "               ^",
    ]
    assert r.stdout == ""  # the command never ran


def test_return_probe_events_print_caller_and_function(ret: str) -> None:
    spec = "r:app/add add a=$arg1:s64 ret=$retval:s64 ns=$latency:u64"
    r = dp("trace", "-o", "-", spec, "r fact", "--", ret, "loop", "3")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if "app/add" in line]
    assert len(lines) == 3
    for a, line in enumerate(lines):
        m = re.search(r"app/add: \((0x[0-9a-f]+) <- (0x[0-9a-f]+)\) a=(\d+) ret=(\d+) ns=(\d+)$", line)
        assert m is not None, line
        assert int(m.group(1), 16) != int(m.group(2), 16) and (int(m.group(3)), int(m.group(4))) == (a, a + 1)
    assert "uprobes/r_fact" in r.stderr and "hits=0" in r.stderr


def test_lost_records_are_reported_with_the_remedy(ret: str) -> None:
    """With --lossy, a ring too small for the events (4 KiB: 128 records) loses records: said
    without --stats. Without it, the same ring loses none (the program waits for the reader)."""
    spec = ["--ring-size", "4K", "p:app/add add a=%di", "--", ret, "loop", "100000"]
    r = dp("trace", "-o", "-", "--lossy", *spec)
    assert r.returncode == 0, r.stderr
    lost = int(re.search(r"app/add .* hits=100000 missed=0 lost=(\d+)$", r.stderr, re.M).group(1))  # type: ignore[union-attr]
    assert 0 < lost < 100000 and r.stdout.count("app/add") == 100000 - lost
    assert f"dynprobe: {lost} records lost: a thread's ring was full (--lossy)" in r.stderr
    r = dp("trace", "-o", "-", *spec)
    assert r.returncode == 0, r.stderr
    assert re.search(r"app/add .* hits=100000 missed=0$", r.stderr, re.M) and r.stdout.count("app/add") == 100000
    assert "lost" not in r.stderr
    waited = re.search(r"^dynprobe: the program waited (\d+) times for its events to be read \(a thread's ring was "
                       r"full\): --lossy never waits, a larger --ring-size waits less$", r.stderr, re.M)  # fmt: skip
    assert waited is not None and int(waited.group(1)) > 0


def test_latency_histogram_per_function(ret: str) -> None:
    r = dp("latency", "-o", "-", "--all", "add", "nap", "--stats", "--", ret, "loop", "1000")
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == "500500"
    assert "@latency_ns[nap]: 0 calls" in out
    # Every call is in a row, none in a row of 0 or less. Where the CPU's time-stamp counter
    # moves in steps longer than a reading takes (AMD's Zen: every 10 ns), a call of add (a few
    # ns) may end in the tick it began in: it is counted as "< 1 tick", and the heading says how
    # long a tick is. Elsewhere every call is in a [lo, hi) row.
    rows = [line for line in out if line.startswith(("[", "< 1 tick"))]
    assert sum(int(row.split("|")[0].split()[-1]) for row in rows) == 1000
    assert not any(line.startswith(("(..., 0]", "[0]")) for line in out)
    heading = next(line for line in out if line.startswith("@latency_ns[add]"))
    tick = re.fullmatch(r"@latency_ns\[add\]: 1000 calls( \(a tick of the clock: [0-9.]+ ns\))?", heading)
    assert tick is not None, heading
    assert (tick.group(1) is not None) == any(row.startswith("< 1 tick") for row in rows)
    assert "latency/add" in r.stderr and "mode=optimized" in r.stderr


@pytest.mark.parametrize(
    ("command", "hint"),
    [
        (["trace", "r:t/fact fact"], "a larger MAXACTIVE, as in 'r{}:EVENT ...',"),
        (["latency", "fact"], "--maxactive {}"),
    ],
)
def test_return_probe_that_missed_calls_says_how_to_keep_them(ret: str, command: list[str], hint: str) -> None:
    """fact recursing 5 deeper than the default number of instances: its 5 deepest calls are missed."""
    instances = default_maxactive()
    r = dp(*command, "--", ret, "fact", str(instances + 5))
    assert r.returncode == 0, r.stderr
    name = "t/fact" if command[0] == "trace" else "latency/fact"
    line = (f"dynprobe: {name} missed 5 calls: more than {instances} were pending on a thread (recursion); "
            f"{hint.format(4 * instances)} keeps more")  # fmt: skip
    assert line in r.stderr.splitlines()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["trace", "r add+8"], "a return probe goes on a function's first instruction"),
        (["trace", "p add r=$retval"], "RETVAL_ON_PROBE"),
        (["trace", "r5000 add"], "BAD_MAXACT: maxactive must be a number from 1 to 4096"),
        (["latency", "add", "--maxactive", "0"], "--maxactive 0 is out of range (1..4096)"),
        (["latency", "nosuchfunction"], "no function 'nosuchfunction'"),
    ],
)
def test_bad_return_probe_input_one_line(ret: str, args: list[str], message: str) -> None:
    r = dp(*args, "--", ret, "loop", "3")
    assert r.returncode != 0 and message in r.stderr.splitlines()[0], r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["p no_such_symbol"], "no function 'no_such_symbol'"),
        (["p /no/such/file:f"], "no such file: /no/such/file"),
        (
            ["p libplugin:f"],
            "no such file: libplugin (no library of that name is mapped in the process, needed by the program",
        ),
        (["p add_word+1"], "not on an instruction boundary [NOT_INSN_BOUNDARY]"),
    ],
)
def test_bad_probe_one_line_and_target_not_run(wordcount: str, args: list[str], message: str) -> None:
    r = dp("trace", *args, "--", wordcount)
    assert r.returncode == 1
    assert len(r.stderr.splitlines()) == 1 and message in r.stderr
    assert r.stdout == ""


def test_bad_targets(tmp_path: Path) -> None:
    notelf = tmp_path / "script"
    notelf.write_text("#!/bin/sh\necho hi\n")
    notelf.chmod(0o755)
    r = dp("trace", "main", "--", str(notelf))
    assert r.returncode == 1 and r.stderr.strip() == (
        f"dynprobe: error: {notelf} is a script (/bin/sh), not a program: give dynprobe the program it runs "
        "(a pyenv shim's: `pyenv which python3`)"
    )
    notelf.write_text("echo hi\n")
    r = dp("trace", "main", "--", str(notelf))
    assert r.returncode == 1 and r.stderr.strip() == f"dynprobe: error: {notelf} is not an ELF file"
    elf32 = tmp_path / "elf32"
    data = bytearray(Path(shutil.which("true") or "/bin/true").read_bytes())
    data[4] = 1  # ELFCLASS32
    elf32.write_bytes(bytes(data))
    elf32.chmod(0o755)
    r = dp("trace", "main", "--", str(elf32))
    assert r.returncode == 1 and "32-bit ELF file" in r.stderr and len(r.stderr.splitlines()) == 1
    r = dp("trace", "main", "--", "/no/such/command")
    assert r.returncode == 1 and "no such file" in r.stderr
    r = dp("trace", "main", "-p", str(2**22 + 4321))
    assert r.returncode == 1 and r.stderr.strip().endswith(f"no process with pid {2**22 + 4321}")
    r = dp("trace", "main")
    assert r.returncode == 2 and "give a process" in r.stderr


def test_attach_already_traced_is_one_line(sigs: str) -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        with held_by_other_tracer(sleeper.pid) as holder:
            r = dp("trace", "libc:nanosleep", "-p", str(sleeper.pid))
        assert r.returncode == 1 and len(r.stderr.splitlines()) == 1
        assert f"already traced by pid {holder.pid}" in r.stderr
    finally:
        sleeper.kill()
        sleeper.wait()


def test_ctrl_c_detaches_from_attached_process(spinner: str) -> None:
    target = subprocess.Popen([spinner, "2"], stdout=subprocess.PIPE, text=True)
    assert target.stdout is not None and target.stdout.readline() == "ready\n"
    tracer = subprocess.Popen([*DYNPROBE, "trace", "-o", "-", "p:s/tick tick", "-p", str(target.pid)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert tracer.stdout is not None and "s/tick" in tracer.stdout.readline()
        tracer.send_signal(signal.SIGINT)
        _, err = tracer.communicate(timeout=30)
        assert tracer.returncode == 0 and "s/tick" in err
        target.send_signal(signal.SIGTERM)
        out, _ = target.communicate(timeout=30)
        assert target.returncode == 0 and "ticks=" in out
    finally:
        for p in (tracer, target):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_count_with_stats_and_filter(wordcount: str) -> None:
    r = dp("count", "-o", "-", "p:wc/long add_word n=%si:s32", "p:wc/short add_word n=%si:s32", "--filter", "n > 1",
           "--stats", "--", wordcount, "a bb ccc a")  # fmt: skip
    assert r.returncode == 0, r.stderr
    counts = {line.split()[0]: int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("  ")}
    assert counts == {"wc/long": 2, "wc/short": 2}  # the filter applies to every spec
    assert "mode=optimized" in r.stderr and "lost=0" in r.stderr


def test_count_a_pattern(wordcount: str) -> None:
    """A probe per function a pattern names, each named after it; a pattern naming none says
    so in one line."""
    r = dp("count", "-o", "-", "p:wc/f [ah][da]*", "--", wordcount, "a b a")
    assert r.returncode == 0, r.stderr
    counts = {line.split()[0]: int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("  ")}
    assert counts == {"wc/f_add_word": 3, "wc/f_hash": 3}
    r = dp("count", "p nothing_like_this*", "--", wordcount, "a")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"dynprobe: error: no function of {wordcount} matches 'nothing_like_this*'"
    ]


def test_count_trap_mode_says_why(wordcount: str) -> None:
    r = dp("count", "-o", "-", "--trap", "--stats", "p hash", "--", wordcount, "a b")
    assert r.returncode == 0, r.stderr
    assert "uprobes/p_hash            2" in r.stdout
    assert "mode=trap (DISABLED)" in r.stderr


def test_count_by_stack(wordcount: str) -> None:
    """`--by stack`: each stack after the counts, as bpftrace prints `@[ustack] = count()`,
    named frames a line, the count after, the most hit last; `--max-frames` cuts them."""
    r = dp("count", "-o", "-", "--by", "stack", "p hash", "--", wordcount, "a b a")
    assert r.returncode == 0, r.stderr
    name = os.path.basename(wordcount)
    lines = r.stdout.splitlines()
    lines = lines[lines.index("hits:") :]  # (after the program's own output)
    assert lines[:4] == ["hits:", "  uprobes/p_hash            3", "", "uprobes/p_hash["]
    frames = lines[4 : lines.index("]: 3")]
    assert frames[0].startswith(f"        hash ({name}) at wordcount.c:") and frames[-1].startswith("        _start+")
    assert any(f.startswith("        main+") for f in frames) and lines[-1] == "]: 3"
    four = build_target("stacks_O2-nofp", "stacks.c", flags=("-O2", "-fomit-frame-pointer", "-pthread"))
    r = dp("count", "-o", "-", "--by", "stack", "--top-stacks", "1", "p leaf", "--", four)
    lines = r.stdout.splitlines()
    assert lines[:4] == ["hits:", "  uprobes/p_leaf            4", "", "  (3 more stacks of uprobes/p_leaf, 3 hits, "
                         "not shown: --top-stacks 1)"]  # fmt: skip
    assert lines[4] == "uprobes/p_leaf[" and lines[-1] == "]: 1" and lines.count("uprobes/p_leaf[") == 1
    r = dp("count", "-o", "-", "--by", "stack", "--max-frames", "2", "p hash", "--", wordcount, "a")
    stack = r.stdout.splitlines()
    stack = stack[stack.index("hits:") + 4 :]
    assert (
        r.returncode == 0 and stack[0].startswith(f"        hash ({name}) at ") and stack[2:] == ["        ...", "]: 1"]
    )


def test_stacks_folded() -> None:
    """`dynprobe stacks --folded`: a line a stack, outermost first, for flame graphs."""
    path = build_target("stacks_O2-nofp", "stacks.c", flags=("-O2", "-fomit-frame-pointer", "-pthread"))
    r = dp("stacks", "--folded", "-o", "-", "p leaf", "--", path)
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.splitlines())
    assert len(lines) == 4 and all(line.endswith(";leaf 1") for line in lines), lines
    deep, signal, sorted_, thread = lines
    assert deep.startswith("_start;") and deep.endswith(";main;" + "deep;" * 13 + "leaf 1")
    assert ";main;raise;" in signal and ";__restore_rt;leaf 1" in signal
    assert ";main;sorter;" in sorted_ and sorted_.endswith(";compare;leaf 1")
    assert thread.endswith(";start_thread;worker;leaf 1")
    r = dp("stacks", "-o", "-", "p leaf", "--", path)
    assert r.returncode == 0 and r.stdout.count("uprobes/p_leaf[\n        leaf (stacks_O2-nofp) at stacks.c:10\n") == 4
    r = dp("stacks", "--folded", "--value", "why", "-o", "-", "p leaf why=%di:s32", "--", path)  # summed
    assert r.returncode == 0 and sorted(line.rsplit(" ", 1)[1] for line in r.stdout.splitlines()) == [
        "1",
        "2",
        "3",
        "4",
    ]
    assert next(line for line in r.stdout.splitlines() if ";worker;" in line).endswith(";leaf 2")
    r = dp("stacks", "--top-stacks", "3", "--value", "why", "-o", "-", "p leaf why=%di:s32", "--", path)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and lines[0] == "  (1 more stacks of uprobes/p_leaf, summing 1, not shown: --top-stacks 3)"
    assert [line for line in lines if line.startswith("]: ")] == ["]: 2", "]: 3", "]: 4"]


def test_trace_with_stacks(wordcount: str) -> None:
    """`trace --stack`: each event line followed by its stack, ` => frame` a line (as ftrace
    prints user stacks); in JSON, a "stack" list."""
    name = os.path.basename(wordcount)
    r = dp("trace", "-o", "-", "--stack", "p:wc/h hash", "--", wordcount, "a b")
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if "wc/h" in line or line.startswith(" => ")]
    assert "wc/h: (0x" in lines[0] and lines[1].startswith(f" => hash ({name}) at wordcount.c:")
    assert lines[2].startswith(" => add_word+")
    events = [i for i, line in enumerate(lines) if "wc/h" in line]
    assert len(events) == 2 and lines[events[1] - 1].startswith(" => _start+")
    r = dp("trace", "--json", "-o", "-", "--stack", "--max-frames", "2", "p:wc/h hash", "--", wordcount, "a")
    event = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("{")))
    assert event["stack"][0].startswith(f"hash ({name}) at ") and len(event["stack"]) == 2 and event["stack_cut"]


@pytest.mark.parametrize("command", [["stacks"], ["count", "--by", "stack"], ["trace", "--stack"]])
def test_a_return_probes_stack_begins_where_it_returned_to(command: list[str], wordcount: str,
                                                           tmp_path: Path) -> None:  # fmt: skip
    """As bpftrace's uretprobe ustack: its first frame is the caller, at the return address
    (here in a function inlined into main)."""
    out = tmp_path / "out"
    r = dp(*command, "r add_word", "-o", str(out), "--", wordcount, "a")
    assert r.returncode == 0, r.stderr
    frame_lines = " => " if command == ["trace", "--stack"] else " " * 8  # (trace's event lines may start so)
    frames = [line.strip().removeprefix("=> ") for line in out.read_text().splitlines() if line.startswith(frame_lines)]
    name = os.path.basename(wordcount)
    assert frames[0] == f"count_text [inlined] ({name}) at wordcount.c:29" and frames[1].startswith("main+0x"), frames
    assert frames[-1].startswith("_start+") and not any("add_word" in f for f in frames)


def test_hist_of_a_fetched_value(wordcount: str) -> None:
    r = dp("hist", "-o", "-", "p add_word len=%si:s32", "--value", "len", "--", wordcount, "a bb ccc dddd")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("[")]
    assert [row.split("|")[0].split() for row in rows] == [["[1]", "1"], ["[2,", "4)", "2"], ["[4,", "8)", "1"]]
    # a value read through a pointer that is not one (the length): every read faults, counted apart
    r = dp("hist", "-o", "-", "p add_word n=+0(%si):u64", "--value", "n", "--", wordcount, "a bb ccc dddd")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("@uprobes/p_add_word[n]:\n", 1)[1] == "(fault)                   4\n\n"


def test_trace_filter_keeps_matching_events(wordcount: str) -> None:
    r = dp("trace", "-o", "-", "p:wc/add add_word w=+0(%di):string n=%si:u32", "--filter", "n == 2", "--",
           wordcount, "a bb ccc bb")  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if "wc/add" in line]
    assert [line.split("w=")[1] for line in lines] == ['"bb" n=2', '"bb" n=2']


@pytest.mark.parametrize(
    ("args", "first_line"),
    [
        (["count", "p add_word n=%si", "--filter", "n === 1"], "dynprobe: error: FILTER_SYNTAX:"),
        (["count", "p add_word n=%si", "--filter", "m == 1"], "dynprobe: error: FILTER_UNKNOWN_NAME:"),
        (["hist", "p add_word w=+0(%di):string", "--value", "w"], "dynprobe: error: VALUE_STRING:"),
        (["count", "p add_word", "--ring-size", "5000"], "dynprobe: error: ring size 5000 is not a power of two"),
        (["count", "p add_word", "--ring-size", str(1 << 31)], "dynprobe: error: ring size 2147483648 is out of"),
        (["count", "p add_word", "--ring-size", "2G"], "dynprobe: error: ring size 2147483648 is out of"),
    ],
)
def test_bad_actions_input_one_line_nothing_run(wordcount: str, args: list[str], first_line: str) -> None:
    r = dp(*args, "--", wordcount)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(first_line)
    assert r.stdout == ""  # the command never ran


@pytest.mark.parametrize("options", [[], ["--trap"], ["--stats"]], ids=["default", "trap", "stats"])
def test_a_probe_that_stays_a_trap_says_what_its_hits_cost(options: list[str]) -> None:
    """jump_into's loop jumps back into its first 5 bytes: its probe stays a trap, and without
    --stats (which shows the mode) the summary says that each hit cost a stop; not with --trap,
    which asked for it. call_first takes a jump and is not named."""
    opt = build_target("opt", "opt.c", "opt_asm.S", flags=("-O1", "-pthread"))
    r = dp("count", *options, "jump_into", "call_first", "--", opt, "shapes", "1", "100")
    assert r.returncode == 0, r.stderr
    note = "dynprobe: each hit cost a stop (~10 us) for the probe that stayed a trap: uprobes/p_jump_into"
    note += " (JUMP_INTO_REGION)"
    assert (note in r.stderr.splitlines()) == (options == []), r.stderr
    if options == ["--stats"]:
        assert "mode=trap (JUMP_INTO_REGION)" in r.stderr and "mode=optimized" in r.stderr


def test_a_burst_of_400k_events_is_printed_whole_at_the_defaults(tmp_path: Path) -> None:
    """Issue 25's first case: `trace` of malloc and free around 200,000 pairs, default ring (1 MiB:
    32,768 records), nothing asked for: every hit is printed (the writer waits for the reader
    when its ring is full; in a stress run, with both CPUs kept busy), none lost."""
    opt = build_target("opt", "opt.c", "opt_asm.S", flags=("-O1", "-pthread"))
    out = tmp_path / "events.txt"
    r = dp("trace", "--stats", "-o", str(out), "p libc:malloc size=%di:u64", "p libc:free ptr=%di", "--", opt,
           "malloc", "1", "200000", timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    hits = [int(n) for n in re.findall(r" hits=(\d+) missed=0 lost=0 ", r.stderr)]
    assert len(hits) == 2 and min(hits) >= 200_000, r.stderr
    with open(out) as f:
        assert sum(1 for _ in f) == sum(hits)
    assert "lost" not in r.stderr.replace("lost=0", "")


@pytest.mark.parametrize("mode", [[], ["--trap"]], ids=["optimized", "trap"])
def test_a_flight_recorder_keeps_a_bounded_window_of_threads_that_ended(mode: list[str], tmp_path: Path) -> None:
    """20 threads, each ending after 1,000 hits, rings of 256 records (16 bytes: no fields): what
    ended threads wrote is kept up to 4 rings' worth (their areas go back to the pool as they end: a program that
    makes threads does not make dynprobe's memory grow), events served at stops too; every hit
    is written or counted among those that gave way."""
    opt = build_target("opt", "opt.c", "opt_asm.S", flags=("-O1", "-pthread"))
    out = tmp_path / "events.txt"
    r = dp("trace", *mode, "--flight-recorder", "--ring-size", "4096", "-o", str(out), "p hammer", "--", opt,
           "threads", "20", "1000")  # fmt: skip
    assert r.returncode == 0 and r.stdout == "done 20000\n", r.stderr
    lines = out.read_text().splitlines()
    hits = int(re.search(r"p_hammer .* hits=(\d+)", r.stderr).group(1))  # type: ignore[union-attr]
    gave_way = int(re.search(r"flight recorder: (\d+) older records gave way", r.stderr).group(1))  # type: ignore[union-attr]
    assert hits == 20_000 and 0 < len(lines) <= 4 * 256 and len(lines) + gave_way == hits


def test_a_flight_recorder_writes_the_newest_events_at_sigusr2_and_at_the_end(tmp_path: Path) -> None:
    """`trace --flight-recorder`: nothing is written while the program runs until dynprobe gets
    SIGUSR2, then what the ring holds (256 records at most), in time order; at the end, what came
    since; every hit is written or counted among those that gave way."""
    opt = build_target("opt", "opt.c", "opt_asm.S", flags=("-O1", "-pthread"))
    out = tmp_path / "events.txt"
    argv = [*DYNPROBE, "trace", "--flight-recorder", "--ring-size", "4096", "-o", str(out), "p hammer", "--", opt,
            "forever", "1"]  # fmt: skip
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        try:
            assert proc.stdout.readline() == "ready\n"
            assert out.read_text() == ""  # (hammer is called all the while)
            proc.send_signal(signal.SIGUSR2)
            deadline = time.monotonic() + 30
            while not out.read_text() and time.monotonic() < deadline:
                time.sleep(0.01)
            first = out.read_text().splitlines()
            proc.stdin.close()  # the program ends
            err = proc.stderr.read()
            assert proc.wait(timeout=60) == 0, err
        finally:
            proc.kill()
    lines = out.read_text().splitlines()
    assert 0 < len(first) <= 256 and lines[: len(first)] == first and len(lines) - len(first) <= 256
    stamps = [float(line.split(":")[0].split()[-1]) for line in lines]
    assert stamps == sorted(stamps) and all("uprobes/p_hammer" in line for line in lines)
    hits = int(re.search(r"p_hammer .* hits=(\d+)", err).group(1))  # type: ignore[union-attr]
    gave_way = int(re.search(r"flight recorder: (\d+) older records gave way", err).group(1))  # type: ignore[union-attr]
    assert hits == len(lines) + gave_way and gave_way > 0


def interrupted_when(ready: Callable[[subprocess.Popen[str], list[str]], bool], sig: int, *args: str
                     ) -> tuple[int, str, str]:  # fmt: skip
    """`dynprobe ARGS...` sent `sig` (alone, not its command) once `ready(process, lines of its
    stdout so far)`, asked every 10 ms: (status, stdout, stderr)."""
    with subprocess.Popen([*DYNPROBE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))  # type: ignore[union-attr]
        reader.start()
        try:
            while not ready(proc, list(lines)):
                assert proc.poll() is None, (lines, proc.stderr.read())
                time.sleep(0.01)
            proc.send_signal(sig)
            err = proc.stderr.read()
            proc.wait(timeout=30)
        finally:
            proc.kill()
            reader.join()
    return proc.returncode, "".join(lines), err


def command_runs(name: str) -> Callable[[subprocess.Popen[str], list[str]], bool]:
    """Ready once dynprobe's command runs as `name` (exec'd: the set-up is over)."""

    def ready(proc: subprocess.Popen[str], lines: list[str]) -> bool:
        return any(comm_of(child) == name for child in children_of(proc.pid))

    return ready


def comm_of(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None  # (a child that has just ended)


def children_of(pid: int) -> list[int]:
    try:
        return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    except OSError:
        return []


@pytest.mark.parametrize(
    ("args", "count"),
    [
        (["count", "nap"], r"uprobes/p_nap +(\d+)"),
        (["hist", "p:t/nap nap ms=%di", "--value", "ms"], r"^\[16, 32\) +(\d+)"),  # ms = 20
        (["latency", "nap"], r": (\d+) calls"),
    ],
    ids=["count", "hist", "latency"],
)
def test_interval_prints_as_it_goes_and_at_the_end(ret: str, args: list[str], count: str) -> None:
    """-i SECONDS: a time-stamped block every interval with that interval's calls (nap() sleeps
    20 ms: about 7 calls per 0.15 s, as bcc's funccount and funclatency print them), then the
    total when dynprobe alone gets SIGTERM; the command it started gets it too (as with strace),
    and its status is dynprobe's."""

    def four_intervals(proc: subprocess.Popen[str], lines: list[str]) -> bool:
        return sum(bool(re.match(r"^\d\d:\d\d:\d\d$", line)) for line in lines) >= 4

    options = ["-o", "-", "-i", "0.15"]
    status, out, err = interrupted_when(four_intervals, signal.SIGTERM, *args, *options, "--", ret, "sleep")
    assert status == 128 + signal.SIGTERM, err  # the command's: killed by SIGTERM
    *intervals, total = [int(n) for n in re.findall(count, out, flags=re.M)]
    assert len(re.findall(r"^\d\d:\d\d:\d\d$", out, flags=re.M)) == len(intervals) and "\ntotal:\n" in out
    assert len(intervals) >= 3 and all(n > 0 for n in intervals[1:]), out  # (the first: start-up)
    assert 0 <= total - sum(intervals) <= 20, out  # what came after the last interval (not a sum of sums)
    if args[0] == "latency":  # a 20 ms nap: 16.7 ms or more (a loaded machine may make it longer)
        rows = [line for line in out.splitlines() if line.startswith(("[", "< 1 tick"))]
        assert rows and all(re.match(r"\[(16M|32M|64M|128M|256M), ", row) for row in rows), out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM ignored"])
def test_a_command_that_does_not_end_runs_on_detached(sig: int) -> None:
    """dynprobe alone gets SIGINT (not passed on: a terminal's Ctrl-C would have reached the
    command itself), or SIGTERM, which its command ignores: dynprobe waits a moment, says so, and
    leaves the command running, no longer traced."""
    cmd = ["/bin/sh", "-c", "trap '' TERM; exec sleep 30 >/dev/null 2>&1"]  # (our pipes closed in it)
    status, _, err = interrupted_when(command_runs("sleep"), sig, "count", "libc:nanosleep", "--", *cmd)
    why = "did not end after SIGTERM" if sig == signal.SIGTERM else "was not sent dynprobe's SIGINT"
    m = re.search(rf"dynprobe: pid (\d+) {why}.*; it runs on, detached", err)
    assert status == 130 and m is not None, err
    pid = int(m.group(1))
    try:
        status_text = Path(f"/proc/{pid}/status").read_text()
        assert "TracerPid:\t0\n" in status_text and re.search(r"^State:\t[SR]", status_text, re.M), status_text
    finally:
        os.kill(pid, signal.SIGKILL)


def test_ctrl_c_on_a_terminal_reaches_the_command_once(tmp_path: Path) -> None:
    """Ctrl-C on the terminal dynprobe and its command share: the command gets its SIGINT from
    the terminal, and not a second one from dynprobe (which would cut a graceful shutdown short);
    dynprobe waits for it and exits with its status."""
    source = tmp_path / "graceful.c"
    # SIGINT is taken only inside sigsuspend: `while (!got) pause();` loses a SIGINT that comes
    # between the test and the pause (its handler runs, then pause waits forever), with or
    # without dynprobe; a loaded machine made that happen here about once in a thousand runs.
    source.write_text(
        "#include <signal.h>\n#include <stdio.h>\n#include <unistd.h>\n"
        "static volatile sig_atomic_t got;\nstatic void on_int(int s) { (void)s; got++; }\n"
        "int main(void) { sigset_t block, during; sigemptyset(&block); sigaddset(&block, SIGINT);\n"
        "  sigprocmask(SIG_BLOCK, &block, &during); sigdelset(&during, SIGINT);\n"
        '  signal(SIGINT, on_int); puts("ready"); fflush(stdout);\n'
        "  while (!got) sigsuspend(&during);\n  sigprocmask(SIG_UNBLOCK, &block, 0);\n"
        "  usleep(300000); /* a shutdown a second Ctrl-C would interrupt (and count) */\n"
        '  printf("sigint=%d\\n", got); return 0; }\n'
    )
    binary = tmp_path / "graceful"
    subprocess.run(["gcc", "-O1", "-o", str(binary), str(source)], check=True)
    primary, secondary = pty.openpty()

    def own_terminal() -> None:  # a session of its own, the pty its controlling terminal
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    with subprocess.Popen([*DYNPROBE, "count", "libc:sigsuspend", "--", str(binary)], stdin=secondary,
                          stdout=secondary, stderr=secondary, preexec_fn=own_terminal) as proc:  # fmt: skip
        os.close(secondary)
        shown = b""
        try:
            while b"ready" not in shown:  # (a bounded wait: a failure says what the terminal showed)
                assert select.select([primary], [], [], 60)[0], shown.decode(errors="replace")
                shown += os.read(primary, 4096)
            os.write(primary, b"\x03")  # the terminal sends SIGINT to its foreground process group
            status = proc.wait(timeout=30)
            with contextlib.suppress(OSError):
                while chunk := os.read(primary, 4096):
                    shown += chunk
            assert status == 0, shown.decode(errors="replace")
        finally:
            proc.kill()
            os.close(primary)
    assert b"sigint=1" in shown, shown


@pytest.mark.parametrize("command", ["count", "record"])
def test_a_ring_size_that_is_not_a_size_is_a_usage_error(wordcount: str, command: str) -> None:
    r = dp(command, *(["p add_word"] if command == "count" else []), "--ring-size", "64Q", "--", wordcount)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        f"dynprobe {command}: error: argument --ring-size: '64Q' is not a size (bytes, or with K, M or G: 64M) "
        f"(see 'dynprobe {command} --help')"
    ]


@pytest.mark.parametrize("mode", [[], ["--trap"]], ids=["optimized", "trap"])
def test_symbol_type_after_the_target_ended(wordcount: str, mode: list[str]) -> None:
    """Events are formatted by the consumer, possibly after the target exited: `symbol` values
    still name the function (the maps dynprobe saw last); an address in no file (the word, on
    the stack) or in no mapping (its length) stays a number."""
    r = dp("trace", "-o", "-", *mode, "p add_word ret=+0(%sp):symbol word=%di:symbol len=%si:symbol", "--",
           wordcount, "x yy")  # fmt: skip
    assert r.returncode == 0, r.stderr
    values = [line.split("ret=")[1].split() for line in r.stdout.splitlines() if "ret=" in line]
    assert len(values) == 2 and all(re.fullmatch(r"(main|count_text)\+0x[0-9a-f]+", v[0]) for v in values), values
    assert all(re.fullmatch(r"word=0x7ff[0-9a-f]+", v[1]) for v in values), values
    assert [v[2] for v in values] == ["len=0x1", "len=0x2"]


def test_a_recording_cut_short_replays_what_it_has_and_says_so(spinner: str, tmp_path: Path) -> None:
    """dynprobe SIGKILLed while it records (nothing of it runs after): its trace was never
    closed. replay and report read what reached the disk and say the recording was cut short;
    the program, let go by the guardian, runs on to its own end."""
    trace = tmp_path / "t.data"
    with subprocess.Popen([spinner, "2", "", "30"], stdout=subprocess.PIPE, text=True) as target:
        assert target.stdout is not None and target.stdout.readline() == "ready\n"
        recorder = subprocess.Popen([*DYNPROBE, "record", "-o", str(trace), "-p", str(target.pid)],
                                    stderr=subprocess.PIPE, text=True)  # fmt: skip
        deadline = time.monotonic() + 30
        while not ((trace / "events.raw").exists() and (trace / "events.raw").stat().st_size >= 4096):
            assert recorder.poll() is None and time.monotonic() < deadline, recorder.stderr
            time.sleep(0.01)
        recorder.kill()
        recorder.wait()
        target.terminate()
        assert target.wait(timeout=30) == 0 and target.stdout.read().startswith("ticks=")
    warning = f"dynprobe: warning: {trace} was not closed (the recording was cut short)"
    for command in ("replay", "report"):
        r = dp(command, str(trace))
        assert r.returncode == 0 and r.stderr.splitlines()[0] == warning, r.stderr
        assert "tick" in r.stdout


def test_a_stripped_binary_says_what_can_be_probed(tmp_path: Path) -> None:
    stripped = build_target("wordcount-stripped", "../../examples/wordcount.c", flags=("-O2", "-s"))
    r = dp("list", stripped)
    assert r.returncode == 1 and r.stderr == (
        "dynprobe: error: wordcount-stripped has no function symbols (stripped, no debug file found): "
        "probe the libraries it uses (libc:malloc), or an offset in it (wordcount-stripped:0x1139)\n"
    )
    r = dp("record", "-o", str(tmp_path / "t.data"), "--", stripped, "a b")  # its calls to libraries
    assert r.returncode == 0 and "dynprobe: tracing " in r.stderr, r.stderr
    assert "malloc();" in dp("replay", str(tmp_path / "t.data")).stdout
    r = dp("record", "-o", str(tmp_path / "t2.data"), "--no-libcall", "--", stripped, "a b")
    assert r.returncode != 0 and r.stderr == (
        "dynprobe: error: wordcount-stripped: no function symbols (stripped, no debug file found); "
        "trace the libraries it uses (--lib libc, libraries=[...] in the API), or a build with symbols\n"
    )
    r = dp("record", "-o", str(tmp_path / "t.data"), "--lib", "libc", "-P", "malloc", "--", stripped, "a b")
    assert r.returncode == 0, r.stderr


def test_big_attach_shows_progress_on_the_terminal_only(tmp_path: Path) -> None:
    """With stderr on a terminal, placing and then optimizing many probes show progress bars
    there; the counts on stdout (a pipe here) are plain."""
    n = 300
    source = tmp_path / "many.c"
    body = "".join(f"__attribute__((noinline)) int f{i}(int x) {{ return x * 3 + {i}; }}\n" for i in range(n))
    calls = "".join(f"    s += f{i}(s);\n" for i in range(n))
    source.write_text(f"{body}int main(void) {{\n    int s = 1;\n{calls}    return s == 42;\n}}\n")
    binary = tmp_path / "many"
    subprocess.run(["gcc", "-O1", "-o", str(binary), str(source)], check=True)
    specs = tmp_path / "specs"
    specs.write_text("".join(f"p f{i}\n" for i in range(n)))
    primary, secondary = pty.openpty()
    shown = bytearray()

    def read_terminal() -> None:  # as it comes: a full terminal would block the writer
        with contextlib.suppress(OSError):  # EIO once the other end is closed
            while chunk := os.read(primary, 1 << 16):
                shown.extend(chunk)

    reader = threading.Thread(target=read_terminal)
    reader.start()
    try:
        r = subprocess.run([sys.executable, "-m", "dynprobe", "count", "-o", "-", "-f", str(specs), "--", str(binary)],
                           stdout=subprocess.PIPE, stderr=secondary, text=True, timeout=60)  # fmt: skip
    finally:
        os.close(secondary)
        reader.join(timeout=10)
        os.close(primary)
    assert r.returncode == 0
    assert r.stdout.count(" 1\n") == n and "\x1b" not in r.stdout
    text = shown.decode(errors="replace")
    assert "placing probes" in text and "optimizing" in text and f"{n}/{n}" in text


OUTPUT_COMMANDS = {
    "trace": ["trace", "p emit n=%si:u64"],
    "count": ["count", "emit", "libc:fwrite"],
    "hist": ["hist", "p emit n=%si", "--value", "n"],
    "latency": ["latency", "emit"],
    "record": ["record", "-o", "{dir}/trace.data"],
    "live": ["live"],
}


@pytest.mark.parametrize("command", OUTPUT_COMMANDS, ids=list(OUTPUT_COMMANDS))
def test_results_never_reach_the_programs_output(command: str, tmp_path: Path) -> None:
    """A program that writes binary data on its stdout writes the same bytes under every command
    that runs it; the results are on stderr by default, or in -o FILE (then stderr has only
    dynprobe's summary)."""
    binout = build_target("binout", flags=("-O1",))
    alone = subprocess.run([binout], capture_output=True, check=True).stdout
    assert len(alone) == 64 * 4096
    args = [a.format(dir=tmp_path) for a in OUTPUT_COMMANDS[command]]
    traced = subprocess.run([*DYNPROBE, *args, "--", binout], capture_output=True, timeout=120)
    assert traced.returncode == 0, traced.stderr
    assert traced.stdout == alone
    results = {"trace": b"emit: (0x", "count": b"p_emit", "hist": b"[4K, 8K)", "record": b"recorded in",
               "latency": b"@latency_ns[emit]: 64 calls", "live": b"emit() {"}  # fmt: skip
    assert results[command] in traced.stderr, traced.stderr
    if command != "record":  # (whose -o is its trace directory)
        out = tmp_path / "results.txt"
        to_file = subprocess.run([*DYNPROBE, *args, "-o", str(out), "--", binout], capture_output=True, timeout=120)
        assert to_file.returncode == 0 and to_file.stdout == alone, to_file.stderr
        assert results[command] in out.read_bytes() and results[command] not in to_file.stderr
        assert out.stat().st_mode & 0o777 == 0o600


def test_a_pattern_names_each_function_once_and_apart() -> None:
    """Two static functions of one name are two probes, each named with its offset (a bare name
    would mean one of them: refused, with the offsets); a function with two public names is one
    probe, under the shorter."""
    dupnames = build_target("dupnames", "dupnames_a.c", "dupnames_b.c", "dupnames_main.c", flags=("-O2",))
    r = dp("count", "p helper", "--", dupnames)
    assert r.returncode == 1 and re.fullmatch(
        rf"dynprobe: error: 'helper' names 2 functions in {dupnames} \(static functions of different files\): give "
        rf"one by its offset: {dupnames}:0x[0-9a-f]+, {dupnames}:0x[0-9a-f]+\n", r.stderr), r.stderr  # fmt: skip
    r = dp("count", "-o", "-", "--all", "p:d/h helper*", "p pl*", "--", dupnames)
    assert r.returncode == 0 and r.stdout.splitlines()[0] == "20", r.stderr
    counts = {line.split()[0]: int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("  ")}
    helpers = sorted((n, c) for n, c in counts.items() if n.startswith("d/h_helper_"))
    assert [c for _, c in helpers] == [1, 2] or [c for _, c in helpers] == [2, 1], counts
    assert counts["uprobes/p_plain"] == 1 and not [n for n in counts if "longer_alias" in n], counts


@pytest.mark.parametrize(
    ("name", "fragment"),
    [("strfromd.cold", True), ("f.cold.3", True), ("cold", False), ("str_to_mpn.part.0.constprop.0", False),
     ("coldstart", False), ("x.isra.0", False)],
)  # fmt: skip
def test_cold_fragments_are_not_functions(name: str, fragment: bool) -> None:
    assert is_fragment(name) == fragment


def test_a_probe_on_a_library_never_loaded_says_so(wordcount: str) -> None:
    r = dp("count", "-o", "-", "p libz:deflate", "p libc:malloc", "--", wordcount, "a")
    assert r.returncode == 0, r.stderr
    assert re.search(r"^dynprobe: 1 probe never placed: the program did not load the library: uprobes/p_deflate "
                     r"\(libz\.so[.\d]*\)$", r.stderr, re.M), r.stderr  # fmt: skip


def test_dynprobe_debug_prints_the_engines_decisions(wordcount: str) -> None:
    """README: DYNPROBE_DEBUG=1 says on stderr which sites were queued and optimized, and which
    SIGTRAPs were the target's own (for bug reports); the results are the same."""
    env = dict(os.environ, DYNPROBE_DEBUG="1")
    r = subprocess.run([*DYNPROBE, "count", "p add_word", "--", wordcount, "a b a"],
                       capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert re.search(r"^dynprobe\[\d+\]: site 0x[0-9a-f]+: queued for optimization$", r.stderr, re.M), r.stderr
    assert re.search(r"^dynprobe\[\d+\]: optimized 0x[0-9a-f]+: detour 0x[0-9a-f]+, \d+ bytes$", r.stderr, re.M)
    assert re.search(r"p_add_word +3$", r.stderr, re.M), r.stderr
    signals = build_target("signals", flags=("-O1",))  # its own int3, taken by its SIGTRAP handler
    r = subprocess.run([*DYNPROBE, "count", "p step_me", "--", signals, "own"],
                       capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert r.returncode == 0 and r.stdout == "own_traps=1 sum=11\n", r.stdout + r.stderr
    own = r"^dynprobe\[\d+\]: SIGTRAP of the target's own: tid \d+ rip 0x[0-9a-f]+ rsp 0x[0-9a-f]+ code 0x80"
    own += r" address 0x0$"
    assert re.search(own, r.stderr, re.M), r.stderr


@pytest.mark.parametrize(
    ("argv", "unloaded"),
    [
        (["--version"], ["numpy", "iced_x86", "elftools", "rich", "dynprobe.core.session"]),
        (["list", "--help"], ["dynprobe.core.session", "dynprobe.ringbuf.consumer"]),
        (["count", "--help"], ["dynprobe.tracefile", "dynprobe.output.callgraph"]),
        (["report", "--help"], ["dynprobe.core.session", "elftools", "dynprobe.arch.x86_64.codegen"]),
    ],
    ids=["version", "list", "count", "report"],
)
def test_a_command_imports_only_what_it_needs(argv: list[str], unloaded: list[str]) -> None:
    """Start-up time is import time: a command loads its own module, not every command's."""
    code = (
        "import sys\nfrom dynprobe.cli.main import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in {unloaded!r} if m in sys.modules), file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stderr.splitlines()[-1] == "[]", done.stderr


@pytest.mark.usefixtures("cache_home")
@pytest.mark.parametrize(
    ("options", "spec", "hits"),
    [([], "p work", 4000), ([], "r work", 4000), (["--trap"], "r work", 4000), ([], "p libc:pthread_create", 4)],
)
def test_counting_loads_neither_numpy_nor_pyelftools(options: list[str], spec: str, hits: int) -> None:
    """`count` and `hist` read the target's counters and histograms as plain words: numpy, most
    of a short command's start-up, is not loaded, nor (the files' analysis kept from the first
    run) pyelftools; the counts are exact, four threads ending and folded included."""
    counter = build_target("counter", flags=("-O1", "-pthread"))
    code = (
        "import sys\nfrom dynprobe.cli.main import main\n"
        f"main(['count', *{options!r}, '-o', '-', {spec!r}, '--', {counter!r}, '1000', '4'])\n"
        f"main(['hist', '-o', '-', '--value', '%di', 'p work', '--', {counter!r}, '1000', '4'])\n"
        "print(sorted(m for m in ('numpy', 'elftools') if m in sys.modules), file=sys.stderr)"
    )
    for _ in range(2):  # (the first run works the files out: pyelftools, and numpy with it)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[-1] == "[]", done.stderr
    name = f"uprobes/{spec[0]}_{spec.split()[1].split(':')[-1]}"
    counted = {line.split()[0]: int(line.split()[1]) for line in done.stdout.splitlines() if "  uprobes/" in line}
    assert counted == {name: hits}, done.stdout
    buckets = [int(line.split("|")[0].split()[-1]) for line in done.stdout.splitlines() if line.startswith("[")]
    assert buckets == [4, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4 * (1000 - 512)], done.stdout
