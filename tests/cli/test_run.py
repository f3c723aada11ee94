"""`dynprobe run`: programs in bpftrace's language against real processes, their maps exact
(and, where bpftrace runs, the same as bpftrace's own)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.cli.test_cli import dp
from tests.conftest import build_target


@pytest.fixture(scope="module")
def counter() -> str:
    return build_target("counter", flags=("-O1", "-pthread"))


def maps_of(stderr: str) -> str:
    """What follows the two empty lines that come before the maps at the end."""
    return stderr.split("\n\n\n", 1)[1] if "\n\n\n" in stderr else ""


def bpftrace(binary: str, program: str, args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """bpftrace's run of `program` against `binary ARGS`, on a copy of `binary` (its kernel
    uprobes patch every process that maps the file: on the original, the int3s would land in
    other tests' targets), its output with the copy's path as the original's; the test skipped,
    with bpftrace's reason, where it cannot run a uprobe."""
    copy = tmp_path / "bpftrace" / os.path.basename(binary)
    copy.parent.mkdir()
    shutil.copy(binary, copy)
    done = subprocess.run(["bpftrace", "-e", program.replace(binary, str(copy)), "-c", f"{copy} {args}"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    done.stdout = done.stdout.replace(str(copy), binary)
    if done.returncode != 0 or "Attaching" not in done.stdout:
        pytest.skip(f"bpftrace cannot run a uprobe here: {done.stderr.strip().splitlines()[-1:]}")
    return done


def test_counts_sums_and_keys_in_the_target(counter: str) -> None:
    program = (f"uprobe:{counter}:work {{ @c = count(); @s = sum(arg0); @by[arg0 % 3] = count(); @t[tid] = count();"
               f" @lo = min(arg0); @hi = max(arg0); }}")  # fmt: skip
    run = dp("run", "-e", program, "--", counter, "1000", "2")
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"total={2 * (999_000 + 1000)}\n"  # (nothing of ours in the program's output)
    assert run.stderr.startswith("Attaching 1 probe...\n")
    lines = maps_of(run.stderr).splitlines()
    assert "@c: 2000" in lines and "@s: 999000" in lines and "@lo: 0" in lines and "@hi: 999" in lines
    by_key = [line for line in lines if line.startswith("@by[")]  # (by value: 1 and 2 tie, in either order)
    assert by_key[-1] == "@by[0]: 668" and sorted(by_key[:2]) == ["@by[1]: 666", "@by[2]: 666"]
    threads = [line for line in lines if line.startswith("@t[")]
    assert len(threads) == 2 and all(line.endswith(": 1000") for line in threads)


def test_return_probes_predicates_and_scratch_variables(counter: str) -> None:
    program = (f"uprobe:{counter}:work /arg0 >= 10/ {{ $x = arg0 * 2; @start[tid] = $x; }}"
               f" uretprobe:{counter}:work /@start[tid]/ {{ @same = count(); @off[retval - @start[tid]] = count();"
               f" delete(@start[tid]); @ret = max(retval); }}")  # fmt: skip
    run = dp("run", "-e", program, "--", counter, "100", "1")
    assert run.returncode == 0, run.stderr
    lines = maps_of(run.stderr).splitlines()
    # work(i) = 2i + 1 (seed 1): each return is its entry's 2i, plus 1
    assert "@same: 90" in lines and "@off[1]: 90" in lines and "@ret: 199" in lines


def test_begin_end_intervals_and_exit(counter: str) -> None:
    program = (f'BEGIN {{ printf("hello %s %d\\n", "there", -3); }} uprobe:{counter}:work /arg0 == 5000/ '
               f'{{ @at = arg0; exit(); }} END {{ printf("bye %d\\n", @at); }}')  # fmt: skip
    run = dp("run", "-e", program, "--", counter, str(10**13), "1", timeout=120)  # (hours of calls: exit() ends it)
    assert run.returncode == 0, run.stderr
    assert run.stderr.startswith("Attaching 3 probes...\nhello there -3\nbye 5000\n")
    assert maps_of(run.stderr) == "@at: 5000\n"
    assert "total=" not in run.stdout  # (ended by the exit(), SIGTERM)


def test_a_program_that_cannot_run_is_refused_before_any_process_starts(tmp_path: Path) -> None:
    started = tmp_path / "started"
    run = dp("run", "-e", 'uprobe:libc:malloc { @s = "x"; }', "--", "touch", str(started))
    assert run.returncode == 1 and run.stdout == "" and not started.exists()
    assert run.stderr.splitlines() == [
        "stdin:1:27-30: ERROR: a value of @s that is not a str(), comm, func or probe (a map of strings takes the bytes"
        " str() reads, or the tracer's names) is not run in the target yet (dynprobe compiles probe bodies: integers,"
        " maps of them and of str(), comm, func and probe)",
        'uprobe:libc:malloc { @s = "x"; }',
        " " * 26 + "~" * 3,
    ]
    bad = dp("run", "-e", "uprobe:libc:malloc { @x = count(; }", "--", "/bin/true")
    assert bad.returncode == 1 and "ERROR: syntax error" in bad.stderr


@pytest.mark.skipif(shutil.which("bpftrace") is None, reason="bpftrace is not installed (make toolchains installs it)")
def test_the_same_maps_as_bpftrace(counter: str, tmp_path: Path) -> None:
    body = "@c = count(); @by[arg0 / 100] = sum(arg0); @h = hist(arg0); @l = lhist(arg0, 0, 1000, 250); @a = avg(arg0);"
    theirs = bpftrace(counter, f"uprobe:{counter}:work /pid == cpid/ {{ {body} }}", "1000 1", tmp_path)
    ours = dp("run", "-e", f"uprobe:{counter}:work {{ {body} }}", "--", counter, "1000", "1")
    assert ours.returncode == 0, ours.stderr
    expected = re.sub(r"^total=.*\n", "", theirs.stdout.split("\n\n\n", 1)[1], flags=re.M)
    assert maps_of(ours.stderr) == expected


def test_clear_and_zero_in_a_probe_body_take_effect_at_once(counter: str) -> None:
    """clear() and zero() in a probe body act before the next hit (bpftrace 0.17 hands them to
    its user space, and the few hits meanwhile land in the old maps: no comparison with it)."""
    body = ("@c[arg0 % 4] = sum(arg0); @s = sum(arg0); @m = max(arg0);"
            " if (arg0 == 500) { clear(@c); zero(@s); zero(@m); }")  # fmt: skip
    ours = dp("run", "-e", f"uprobe:{counter}:work {{ {body} }}", "--", counter, "1000", "1")
    assert ours.returncode == 0, ours.stderr
    sums = {r: sum(range(501, 1000)[(r - 501) % 4 :: 4]) for r in range(4)}  # (what came after the clear)
    keyed = "".join(f"@c[{r}]: {total}\n" for r, total in sorted(sums.items(), key=lambda kv: kv[1]))
    assert maps_of(ours.stderr) == f"{keyed}@m: 999\n@s: {sum(range(501, 1000))}\n"


def test_attached_to_a_running_process_it_ends_at_exit_and_leaves_the_process_running(counter: str) -> None:
    with subprocess.Popen([counter, str(10**13), "1"], stdout=subprocess.DEVNULL) as target:
        try:
            run = dp("run", "-e", f"uprobe:{counter}:work /arg0 % 1000 == 7/ {{ @n++; @last = arg0 % 1000;"
                                  " if (@n == 3) { exit(); } }", "-p", str(target.pid), timeout=120)  # fmt: skip
            assert run.returncode == 0, run.stderr
            # (the tracer sees exit() within a poll, 20 ms: hits meanwhile still count)
            last, count = maps_of(run.stderr).splitlines()
            assert last == "@last: 7" and count.startswith("@n: ") and int(count[4:]) >= 3
            assert target.poll() is None  # (detached: it runs on)
        finally:
            target.kill()


def test_a_dry_run_places_the_probes_says_their_modes_and_runs_nothing(counter: str) -> None:
    """--dry-run: the count bpftrace's first line gives (BEGIN too); each probe's mode (optimized
    with the size of its site's code; a trap and why), nothing run: a command started is killed
    at its entry point (its libraries mapped there: libc's probe placed too), before a line of
    its own; a process attached to runs on untouched."""
    program = (f"uprobe:libc:malloc {{ @c = count(); }} uprobe:{counter}:work {{ @[arg0 % 3] = count(); }}"
               f" uretprobe:{counter}:work {{ @r = hist(retval); }} BEGIN {{ printf(\"hi\\n\"); }}")  # fmt: skip
    run = dp("run", "--dry-run", "-e", program, "-o", "-", "--", counter, "10", "1")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "Attaching 4 probes..." and "total=" not in run.stdout and "hi" not in lines, lines
    expected = [
        "uprobe:/usr/lib/x86_64-linux-gnu/libc.so.6:malloc",
        f"uprobe:{counter}:work",
        f"uretprobe:{counter}:work",
    ]
    assert [line.rsplit(": ", 1)[0] for line in lines[1:]] == expected, lines
    optimized = re.compile(r"optimized, \d+ bytes of code at its site")
    assert all(optimized.fullmatch(line.rsplit(": ", 1)[1]) for line in lines[1:]), lines
    with subprocess.Popen([counter, str(10**13), "1"], stdout=subprocess.DEVNULL) as target:
        try:
            attached = dp("run", "--dry-run", "-e", f"uprobe:{counter}:work {{ @n++; }}", "-o", "-", "-p",
                          str(target.pid))  # fmt: skip
            assert attached.returncode == 0, attached.stderr
            head, placed = attached.stdout.split("\n", 1)
            assert head == "Attaching 1 probe..." and placed.startswith(f"uprobe:{counter}:work: "), attached.stdout
            assert optimized.fullmatch(placed.removeprefix(f"uprobe:{counter}:work: ").rstrip("\n")), attached.stdout
            with open(f"/proc/{target.pid}/status") as status:
                assert "TracerPid:\t0\n" in status.read() and target.poll() is None  # (let go: it runs on)
        finally:
            target.kill()


def test_a_script_file_run_with_c_its_full_map_said_and_end_zeroing(counter: str, tmp_path: Path) -> None:
    """`dynprobe run FILE -c CMD`: a map of more keys than it holds (4096 at most: fewer when a
    key finds no free slot near its hash) keeps those it took and says how many updates it
    dropped; END runs before the maps are printed."""
    script = tmp_path / "keys.bt"
    script.write_text(f"uprobe:{counter}:work {{ @keys[arg0] = count(); @n = count(); }}\nEND {{ zero(@n); }}\n")
    run = dp("run", str(script), "-c", f"{counter} 5000 1")
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"total={5000 * 4999 + 5000}\n"
    lines = maps_of(run.stderr).splitlines()
    kept = len([line for line in lines if line.startswith("@keys[")])
    assert 4000 < kept <= 4096 and "@n: 0" in lines
    assert (
        lines[-1]
        == f"dynprobe: @keys was full: {5000 - kept} updates dropped (it took {kept} keys; a map holds 4096 at most)"
    )


def test_intervals_and_an_exit_before_anything_runs(counter: str) -> None:
    """An interval body runs in the tracer every period (its exit() ends the run at the first);
    a BEGIN that exits ends it before the target runs a call."""
    run = dp("run", "-e", 'interval:ms:50 { printf("tick\\n"); exit(); }', "-c", f"{counter} {10**13} 1",
             timeout=120)  # fmt: skip
    assert (run.returncode, run.stderr) == (0, "Attaching 1 probe...\ntick\n\n\n"), run.stderr
    run = dp("run", "-e", f'BEGIN {{ printf("only\\n"); exit(); }} uprobe:{counter}:work {{ @n = count(); }}',
             "--", counter, str(10**13), "1", timeout=120)  # fmt: skip
    assert (run.returncode, run.stderr) == (0, "Attaching 2 probes...\nonly\n\n\n\n"), run.stderr  # (@n: empty)


def test_maps_the_tracer_writes_count_ticks_and_end_the_run(counter: str) -> None:
    """BEGIN, END and interval bodies write maps of their own (kept in the tracer): an interval
    counts its ticks and exits at the third; END works out of them and of a probe's map."""
    program = ("BEGIN { @start = nsecs; $step = 2; @step = $step; } interval:ms:30 { @ticks++; @every[@ticks % 2] ="
               ' count(); if (@ticks == 3) { printf("tick %d\\n", @ticks); exit(); } }'
               f" uprobe:{counter}:work {{ @calls = count(); }}"
               " END { @took = nsecs > @start; @twice = @ticks * @step; delete(@every[0]); }")  # fmt: skip
    run = dp("run", "-e", program, "--", counter, str(10**13), "1", timeout=120)  # (hours of calls: exit() ends it)
    assert run.returncode == 0, run.stderr
    assert run.stderr.startswith("Attaching 4 probes...\ntick 3\n\n\n"), run.stderr
    lines = maps_of(run.stderr).splitlines()
    assert lines[0].startswith("@calls: ") and int(lines[0][8:]) > 0
    assert lines[1:] == ["@every[1]: 2", f"@start: {lines[2][8:]}", "@step: 2", "@ticks: 3", "@took: 1", "@twice: 6"]


def test_the_maps_of_an_execd_child_merge_with_its_parents() -> None:
    """--follow-fork: a vfork child that execs runs in a region of its own (a fork child shares
    its parent's); the maps printed merge them: counts and sums add, min and max hold, the
    histograms add bucket by bucket, averages are over every value."""
    forks = build_target("forks", flags=("-O1", "-pthread"))
    body = "@c = count(); @s = sum(arg0); @lo = min(arg0); @hi = max(arg0); @a = avg(arg0); @h = hist(arg0);"
    run = dp("run", "--follow-fork", "-e", f"uprobe:{forks}:probed {{ {body} }}", "--", forks, "vfork")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["leaf=6", "child=0"]
    maps = maps_of(run.stderr)
    # the parent: probed(0), probed(100); the child's new image: probed(0), then 0, 1, 2
    for line in ("@a: 17", "@c: 6", "@hi: 100", "@lo: 0", "@s: 103"):
        assert f"\n{line}\n" in f"\n{maps}", maps
    assert re.findall(r"^\[.*?[\])]\s+(\d+) \|", maps, flags=re.M) == ["3", "1", "1", "0", "0", "0", "0", "1"]


def test_a_fork_childs_pid_and_comm_are_its_own() -> None:
    """--follow-fork: in a fork and a vfork child (the vfork child takes thread areas of its
    parent's), pid is the child's, and its comm key names it."""
    forks = build_target("forks", flags=("-O1", "-pthread"))
    program = f"uprobe:{forks}:probed {{ @n[pid] = count(); @t[pid == tid] = count(); @c[comm] = count(); }}"
    for mode, child_calls in (("fork", 5), ("vfork-call", 1)):
        run = dp("run", "--follow-fork", "-e", program, "--", forks, mode)
        assert run.returncode == 0, run.stderr
        lines = maps_of(run.stderr).splitlines()
        assert sorted(line.split(": ")[1] for line in lines if line.startswith("@n[")) == sorted(
            ["2", str(child_calls)]
        )
        assert f"@t[1]: {2 + child_calls}" in lines and f"@c[forks]: {2 + child_calls}" in lines, lines


@pytest.mark.parametrize(("args", "says"), [
    ([], "dynprobe: give the program: -e 'PROGRAM' or a FILE"),
    (["-e", "BEGIN { exit(); }", "./prog"],
     "dynprobe: give the program once: -e 'PROGRAM' or a FILE, not both (a command to run goes after --: -- ./prog)"),
    (["/no/such/file.bt"], "dynprobe: cannot read /no/such/file.bt: No such file or directory"),
    (["-e", "BEGIN { exit(); }", "-c", "/bin/true", "--", "/bin/true"],
     "dynprobe: give either -c CMD or -- COMMAND, not both"),
])  # fmt: skip
def test_what_run_is_given_wrong(args: list[str], says: str) -> None:
    run = dp("run", *args)
    assert (run.returncode, run.stderr, run.stdout) == (2, says + "\n", "")


PRINTF = 'printf("%s|%s|%d|%5d|%x %s\\n", str(arg0), str(arg0, 2), arg1, arg1 * -3, arg1, comm);'


def test_printf_in_a_probe_body_as_bpftrace_prints_it(tmp_path: Path) -> None:
    """Each hit's line, its strings copied in the target (str(p, n): n bytes at most), comm
    the thread's name, in the order of the hits; the same as bpftrace's where it runs."""
    wordcount = build_target("wordcount", "../../examples/wordcount.c", flags=("-O2",))
    program = f"uprobe:{wordcount}:add_word {{ {PRINTF} }}"
    run = dp("run", "-e", program, "--", wordcount, "alpha be gamma")
    assert run.returncode == 0, run.stderr
    printed = "alpha|al|5|  -15|5 wordcount\nbe|be|2|   -6|2 wordcount\ngamma|ga|5|  -15|5 wordcount\n"
    assert run.stderr == "Attaching 1 probe...\n" + printed + "\n\n"
    if shutil.which("bpftrace") is None:
        return
    theirs = bpftrace(wordcount, program, "alpha be gamma", tmp_path)
    # (the program's own line: wherever its buffer went)
    assert theirs.stdout.split("Attaching 1 probe...\n", 1)[1].replace("3 distinct words\n", "") == printed + "\n\n"


def test_printf_from_many_threads_loses_no_line(counter: str) -> None:
    """Two threads' hits, 40,000 lines through the rings: every one printed, each thread's in
    its order, none lost at the defaults (a full ring is waited on)."""
    run = dp("run", "-e", f'uprobe:{counter}:work {{ printf("%d %d\\n", tid, arg0); }}', "--", counter, "20000", "2",
             timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = run.stderr.split("Attaching 1 probe...\n", 1)[1].rstrip("\n").splitlines()
    by_thread: dict[str, list[int]] = {}
    for line in lines:
        tid, value = line.split()
        by_thread.setdefault(tid, []).append(int(value))
    assert len(lines) == 40_000 and sorted(map(len, by_thread.values())) == [20_000, 20_000]
    assert all(values == list(range(20_000)) for values in by_thread.values())
    assert "lost" not in run.stderr


def test_maps_keyed_by_strings_as_bpftrace_prints_them(tmp_path: Path) -> None:
    wordcount = build_target("wordcount", "../../examples/wordcount.c", flags=("-O2",))
    program = f"uprobe:{wordcount}:add_word {{ @[str(arg0)] = count(); @len[str(arg0, 2)] = sum(arg1); }}"
    run = dp("run", "-e", program, "--", wordcount, "alpha be alpha gamma")
    assert run.returncode == 0, run.stderr
    maps = maps_of(run.stderr)
    assert maps.splitlines()[:3] == ["@[be]: 1", "@[gamma]: 1", "@[alpha]: 2"]  # (equal values: in key order)
    assert "@len[be]: 2\n" in maps and "@len[ga]: 5\n" in maps and "@len[al]: 10\n" in maps
    if shutil.which("bpftrace") is None:
        return
    theirs = bpftrace(wordcount, program, "alpha be alpha gamma", tmp_path)
    expected = theirs.stdout.split("\n\n\n", 1)[1]
    assert sorted(maps.splitlines()) == sorted(expected.splitlines()), expected


def test_maps_of_strings_kept_at_entry_printed_at_return(tmp_path: Path) -> None:
    """The opensnoop idiom: a string kept per thread at the entry, printed at the return with
    the return value, then deleted; the last one kept in another map, printed at the end."""
    wordcount = build_target("wordcount", "../../examples/wordcount.c", flags=("-O2",))
    program = (f"uprobe:{wordcount}:add_word {{ @word[tid] = str(arg0); @last = str(arg0, 3); }}"
               f' uretprobe:{wordcount}:add_word {{ printf("%s %d\\n", @word[tid], retval > 0); delete(@word[tid]); }}'
               ' END { printf("last %s\\n", @last); }')  # fmt: skip
    run = dp("run", "-e", program, "--", wordcount, "alpha be gamma")
    assert run.returncode == 0, run.stderr
    assert run.stderr == "Attaching 3 probes...\nalpha 1\nbe 1\ngamma 1\nlast gam\n\n\n@last: gam\n\n", run.stderr
    if shutil.which("bpftrace") is None:
        return
    theirs = bpftrace(wordcount, program, "alpha be gamma", tmp_path)
    assert theirs.stdout.split("Attaching 3 probes...\n", 1)[1].replace("3 distinct words\n", "") == run.stderr[
        len("Attaching 3 probes...\n") :]  # fmt: skip


WALKED = "        "  # how `ustack` and ustack(bpftrace) indent a frame
PERF = "\t"  # how ustack(perf) does


def run_on_stacks(program: str) -> tuple[str, str]:
    """Runs `program`, its {P} the stacks target's path, on that target: the path and the maps."""
    path = build_target("stacks_O0", "stacks.c", flags=("-O0", "-pthread"))
    run = dp("run", "-e", program.replace("{P}", path), "--", path)
    assert run.returncode == 0, run.stderr
    return path, maps_of(run.stderr)


def stack_keyed(maps: str, name: str, *, indent: str) -> list[tuple[str, str]]:
    """The entries of map `name` keyed by a stack: each one's frames (lines of `indent`) and value."""
    return re.findall(rf"^{re.escape(name)}\[\n((?:{indent}.*\n)+)\]: (\d+)$", maps, flags=re.M)


def test_maps_keyed_by_the_stack() -> None:
    """@[ustack]: each hit's stack walked in the target (the probe counts its hits by stack; the
    key is its slot), printed frame by frame as `dynprobe stacks` prints them; ustack(N) at most
    N frames, a uretprobe's from where the return went back to."""
    path, maps = run_on_stacks("uprobe:{P}:leaf { @[ustack] = count(); @n = count(); }"
                               " uretprobe:{P}:leaf { @r[ustack(2)] = count(); }")  # fmt: skip
    name = os.path.basename(path)
    blocks = stack_keyed(maps, "@", indent=WALKED)
    assert len(blocks) == 4 and all(count == "1" for _, count in blocks) and "@n: 4\n" in maps
    assert all(frames.startswith(f"        leaf ({name}) at stacks.c:10\n") for frames, _ in blocks)
    deep = next(frames for frames, _ in blocks if "deep+" in frames)
    assert deep.count("deep+") == 13 and "main+" in deep and not deep.endswith("        ...\n")
    returns = stack_keyed(maps, "@r", indent=WALKED)
    assert len(returns) == 4 and all(frames.count("\n") == 3 for frames, _ in returns)  # (2 frames, then "...")
    assert all("leaf" not in frames.splitlines()[0] for frames, _ in returns)


def test_maps_keyed_by_the_stack_as_perf_prints_it() -> None:
    """ustack(perf) and ustack(perf, N): a frame a line as bpftrace's perf mode prints it,
    `\tADDRESS SYMBOL+OFFSET (MODULE)` (the offset in decimal, the module's path), the frames
    of the walk `ustack` prints (its functions, in its order; a return address a line: not the
    functions DWARF says are inlined there)."""
    path, maps = run_on_stacks("uprobe:{P}:leaf { @[ustack(perf)] = count(); @b[ustack(bpftrace)] = count(); }"
                               " uretprobe:{P}:leaf { @r[ustack(perf, 2)] = count(); }")  # fmt: skip
    perf = stack_keyed(maps, "@", indent=PERF)
    walked = stack_keyed(maps, "@b", indent=WALKED)
    assert len(perf) == len(walked) == 4 and all(count == "1" for _, count in perf)
    frame = re.compile(r"\t([0-9a-f]+) ([\w.]+)\+(\d+) \((/\S+)\)")
    functions = []
    for lines, _ in perf:
        frames = [frame.fullmatch(line) for line in lines.splitlines()]
        assert all(frames) and frames[0] is not None and frames[0].group(2, 3, 4) == ("leaf", "0", path), lines
        functions.append(tuple(f.group(2) for f in frames if f))
    assert sorted(functions) == sorted(tuple(line.split()[0].split("+")[0] for line in frames.splitlines()
                                             if "[inlined]" not in line) for frames, _ in walked)  # fmt: skip
    returns = stack_keyed(maps, "@r", indent=PERF)
    assert len(returns) == 4 and all(frames.count("\n") == 2 and "leaf" not in frames for frames, _ in returns)


def test_ustack_s_arguments_as_bpftrace_takes_them() -> None:
    """A stack mode first, then a number of frames; a mode elsewhere, or after the number, is an
    error, as bpftrace's."""
    for program, error in (
        ("uprobe:libc:malloc { @[ustack(3, perf)] = count(); }",
         "ERROR: ustack() expects a stack mode literal (integer provided)"),
        ("uprobe:libc:malloc { @[ustack(perf, 1, 2)] = count(); }",
         "ERROR: ustack() takes up to 2 arguments (3 provided)"),
        ("uprobe:libc:malloc { @x = perf; }",
         "ERROR: 'perf' is a stack mode: ustack()'s first argument, and nothing else"),
        ("uprobe:libc:malloc { @[ustack(raw)] = count(); }", "ERROR: Unknown identifier: 'raw'"),
    ):  # fmt: skip
        run = dp("run", "-e", program, "--", "/bin/true")
        assert run.returncode != 0 and error in run.stderr, run.stderr


def test_maps_keyed_by_comm_func_and_probe(counter: str, tmp_path: Path) -> None:
    """comm, func and probe as keys: the target keeps a word (the thread, the probe) and the
    tracer names it; the entries of the threads of one name, or of one function, merge."""
    program = (f"uprobe:{counter}:w* {{ @[comm] = count(); @s[comm] = sum(arg0); @m[comm, func] = max(arg0);"
               f" @p[probe] = count(); }} uretprobe:{counter}:work {{ @f[func, retval % 2] = count(); }}")  # fmt: skip
    run = dp("run", "-e", program, "--", counter, "100", "3")
    assert run.returncode == 0, run.stderr
    lines = maps_of(run.stderr).splitlines()
    assert lines == ["@[counter]: 300", "@f[work, 1]: 300", "@m[counter, work]: 99",
                     f"@p[uprobe:{counter}:work]: 300", "@s[counter]: 14850"], lines  # fmt: skip
    if shutil.which("bpftrace") is None:
        return
    theirs = bpftrace(counter, program, "100 3", tmp_path)
    assert theirs.returncode == 0, theirs.stderr
    expected = theirs.stdout.split("\n\n\n", 1)[1].splitlines()  # (0.17 names func by its address: left out)
    assert [line for line in expected if "0x" not in line] == [line for line in lines if line[:3] not in ("@f[", "@m[")]


def test_time_in_a_probe_body_prints_the_hit_s_time(counter: str) -> None:
    """time(fmt) in a probe body: a record in the ring, printed with strftime at the hit's
    time (in its place among the printf()s); time() alone as bpftrace's, %H:%M:%S."""
    before = int(time.time())
    run = dp("run", "-e", f'uprobe:{counter}:work /arg0 < 3/ {{ printf("%d ", arg0); time("%s\\n"); time(); }}',
             "--", counter, "10", "1")  # fmt: skip
    after = int(time.time()) + 1
    assert run.returncode == 0, run.stderr
    lines = run.stderr.split("\n\n\n", 1)[0].splitlines()[1:]
    assert [line.split()[0] for line in lines[::2]] == ["0", "1", "2"], lines
    assert all(before <= int(line.split()[1]) <= after for line in lines[::2]), (before, lines, after)
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d", line) for line in lines[1::2]), lines


def test_listing_probes_as_bpftrace_lists_them(counter: str) -> None:
    """-l PATTERN: the probes it names, a line each, sorted; short forms spelt out; bpftrace's
    own listing names the same functions (of the same file: its path may take another link)."""
    listed = dp("run", "-l", "u:libc:mall*")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines == sorted(lines) and "uprobe:/usr/lib/x86_64-linux-gnu/libc.so.6:malloc" in lines
    assert all(line.startswith("uprobe:/usr/lib/x86_64-linux-gnu/libc.so.6:mall") for line in lines)
    assert dp("run", "-l", f"ur:{counter}:w*").stdout == f"uretprobe:{counter}:work\n"
    for wrong, says in (("kprobe:vfs_read", "-l takes uprobe:FILE:FUNCTION"), ("uprobe:libc:zz*", "no function of"),
                        ("uprobe:/nonexistent:f", "no such file")):  # fmt: skip
        run = dp("run", "-l", wrong)
        assert run.returncode != 0 and says in run.stderr and not run.stdout, run.stderr
    both = dp("run", "-l", "uprobe:libc:malloc", "-e", "BEGIN { exit(); }")
    assert both.returncode == 2 and "-l lists probes and runs nothing" in both.stderr
    if shutil.which("bpftrace") is None:
        return
    theirs = subprocess.run(["bpftrace", "-l", "uprobe:libc:mall*"], capture_output=True, text=True, timeout=60)
    assert theirs.returncode == 0, theirs.stderr
    assert [line.rsplit(":", 1)[1] for line in theirs.stdout.splitlines()] == [line.rsplit(":", 1)[1] for line in lines]


def test_maps_of_comm_func_and_probe(counter: str, tmp_path: Path) -> None:
    """comm, func and probe as a map's values: the target keeps the word the tracer names, as
    for keys; printed in the maps, by printf, and read by END's body."""
    program = (f"uprobe:{counter}:work {{ @who[tid] = comm; @p = probe; @f = func; }}"
               f' uretprobe:{counter}:work {{ @n++; if (@n == 1) {{ printf("%s %s\\n", @who[tid], @p); }} }}'
               ' END { printf("%s\\n", @f); clear(@who); }')  # fmt: skip
    run = dp("run", "-e", program, "--", counter, "10", "1")
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    assert f"counter uprobe:{counter}:work" in lines and "work" in lines, run.stderr
    assert maps_of(run.stderr).splitlines() == ["@f: work", "@n: 10", f"@p: uprobe:{counter}:work", ""]
    if shutil.which("bpftrace") is None:
        return
    plain = f"uprobe:{counter}:work {{ @who = comm; @p = probe; }}"
    theirs = bpftrace(counter, plain, "10 1", tmp_path)
    assert theirs.returncode == 0, theirs.stderr
    ours = dp("run", "-e", plain, "--", counter, "10", "1")
    assert theirs.stdout.split("\n\n\n", 1)[1].splitlines() == maps_of(ours.stderr).splitlines()


def test_str_of_a_length_worked_out_at_the_hit_as_bpftrace_reads_it(counter: str) -> None:
    """write(2) traced as bpftrace's tutorial does: str(arg1, arg2), as many bytes as written
    (not run against bpftrace: its uprobes are system-wide, and its own writes would hit)."""
    program = 'uprobe:libc:write /arg0 == 1/ { printf("%d [%s]\\n", arg2, str(arg1, arg2 - 1)); }'
    run = dp("run", "-e", program, "--", counter, "10", "1")
    assert run.returncode == 0, run.stderr
    assert run.stdout == "total=100\n" and run.stderr.splitlines()[1] == "10 [total=100]"


def test_print_in_a_probe_body_prints_the_map_as_the_tracer_reads_it(counter: str, tmp_path: Path) -> None:
    """print(@m[, N]) in a uprobe: the map as it is when the tracer reads the print's record,
    in order with the printf()s around it (nothing changes the maps after the last call here)."""
    program = (f"uprobe:{counter}:work {{ @c = count(); @k[arg0 % 3] = count(); if (arg0 == 99) {{ print(@c);"
               f' print(@k, 1); printf("after\\n"); }} }}')  # fmt: skip
    run = dp("run", "-e", program, "--", counter, "100", "1")
    assert run.returncode == 0, run.stderr
    printed = run.stderr.split("\n\n\n", 1)[0].splitlines()
    assert printed == ["Attaching 1 probe...", "@c: 100", "@k[0]: 34", "after"], run.stderr
    if shutil.which("bpftrace") is None:
        return
    theirs = bpftrace(counter, program, "100 1", tmp_path)
    assert theirs.returncode == 0, theirs.stderr
    assert [line for line in theirs.stdout.split("\n\n\n", 1)[0].splitlines() if "total" not in line] == printed


def test_printf_of_func_and_probe() -> None:
    """func and probe name the probe that hit (bpftrace's: a wildcard's each function), with
    nothing of them in the record: the tracer knows them."""
    wordcount = build_target("wordcount", "../../examples/wordcount.c", flags=("-O2",))
    program = (f'uprobe:{wordcount}:add_* {{ printf("%s|%s\\n", func, probe); }}'
               f' uretprobe:{wordcount}:hash {{ printf("%s|%s\\n", func, probe); }}')  # fmt: skip
    run = dp("run", "-e", program, "--", wordcount, "a")
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()[1:3]
    assert sorted(lines) == [f"add_word|uprobe:{wordcount}:add_word", f"hash|uretprobe:{wordcount}:hash"]
