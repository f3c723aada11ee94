"""dynprobe benchmark harness (`make bench`): the seed's loop of N calls of an empty -O0 function,
timed by the program itself, untraced and under each probe mechanism, in one run; plus attach time
for many probes. Prints a table and writes bench/results/latest.json.

Ratios are only meaningful within one run: this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.markup import escape
from rich.table import Table

import dynprobe
from dynprobe.symbols.elf import load_elf

HERE = Path(__file__).parent
BUILD = HERE / "build"
RESULTS = HERE / "results"
TRACEFS = Path("/sys/kernel/tracing")
GROUP = "dynprobe_bench"
T = TypeVar("T")


def compile_c(source: Path, output: Path, *flags: str) -> str:
    BUILD.mkdir(exist_ok=True)
    if not output.exists() or output.stat().st_mtime < source.stat().st_mtime:
        subprocess.run(["gcc", *flags, "-o", str(output), str(source)], check=True)
    return str(output)


def seed_binary() -> str:
    return compile_c(HERE / "targets" / "seed.c", BUILD / "seed", "-O0", "-pthread")


def run_seed(argv: list[str]) -> int:
    """Elapsed microseconds the program reports."""
    return int(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)


def traced_seed(
    argv: list[str], spec: str, pin: bool = True, optimize: bool = False, ring: int | None = None,
    upcalls: bool = False, **kw: Any,
) -> tuple[int, dict[str, Any]]:  # fmt: skip
    """Run the seed under one probe (a trap probe unless `optimize`; Python handlers by upcalls
    if `upcalls`); `kw` goes to session.probe."""
    with tempfile.TemporaryFile("w+") as out:
        with dynprobe.spawn(argv, stdout=out.fileno()) as session:
            session.pin_tracer = pin
            session.optimize = optimize or upcalls
            session.upcalls = upcalls
            if ring:
                session.ring_bytes = ring
            probe = session.probe(spec, **kw)
            status = session.run()
            stops = session.stats["stops"]
            session.close()
        out.seek(0)
        elapsed = int(out.read())
    assert status == 0
    info = {"hits": probe.hits, "stops": stops, "resumes": {k.value: v for k, v in probe.resumes.items()}}
    if optimize:
        info.update(mode=probe.mode.value, lost=probe.lost, missed=probe.nmissed)
        if probe.mode.value == "optimized":
            info["resumes"] = {"jump": probe.hits}
    return elapsed, info


REPEAT = 3  # rows of nanoseconds: the median of this many runs (a run now and then meets a busy moment)


def median_run(run: Callable[[], T], elapsed: Callable[[T], int]) -> T:
    """The result of REPEAT runs of `run` whose `elapsed` time is the median."""
    return sorted((run() for _ in range(REPEAT)), key=elapsed)[REPEAT // 2]


def append_line(path: Path, line: str) -> None:
    """Append to a tracefs file (Python's "a" mode seeks to the end, which tracefs refuses)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


@contextlib.contextmanager
def kernel_uprobe(path: str, offset: int, kind: str = "p") -> Iterator[None]:
    """A kernel uprobe (`kind` "r": uretprobe) on path:offset, enabled in our own tracing
    instance; removed afterwards."""
    instance = TRACEFS / "instances" / GROUP
    event = f"{GROUP}/seed_test"
    append_line(TRACEFS / "uprobe_events", f"{kind}:{event} {path}:{offset:#x}")
    try:
        instance.mkdir(exist_ok=True)
        (instance / "events" / GROUP / "seed_test" / "enable").write_text("1\n")
        try:
            yield
        finally:
            (instance / "events" / GROUP / "seed_test" / "enable").write_text("0\n")
    finally:
        with contextlib.suppress(OSError):
            instance.rmdir()
        append_line(TRACEFS / "uprobe_events", f"-:{event}")


def python_floor(seed: str, calls: int) -> int:
    """The least any CPython tracer can spend per boosted hit: dynprobe places the probe, then a
    bare loop does only waitpid, GETREGS, SETREGS, CONT and the wake-up placement (no dispatch,
    no handlers). It reaches into the session's internals on purpose: it is a measuring stick."""
    from dynprobe.ptrace import syscalls as sc
    from dynprobe.ptrace.procfs import thread_cpu

    with tempfile.TemporaryFile("w+") as out:
        with dynprobe.spawn([seed, str(calls), "boost"], stdout=out.fileno()) as session:
            session.probe("test_boost")
            proc = session._runtime.processes.by_pid[session.pid]
            site = next(s for s in proc.sites.values() if s.probes)
            assert site.slot is not None
            tid, allowed = session.pid, os.sched_getaffinity(0)
            home = thread_cpu(tid, tid)  # the CPU session.run() would choose: CPUs of a VM differ
            home = home if home in allowed else min(allowed)
            os.sched_setaffinity(0, {home})
            session._runtime.processes.started = True
            mask = os.sched_getaffinity(tid)
            sc.cont(tid)
            try:
                while True:
                    _, status = os.waitpid(tid, sc.WALL)
                    if os.WIFEXITED(status):
                        break
                    regs = sc.get_regs(tid)
                    other = proc.sites.get(regs.rip - 1)
                    if status != (signal.SIGTRAP << 8 | 0x7F) or other is None:
                        sc.cont(tid)
                        continue
                    if other is not site:  # the loader's hook at start-up
                        session._runtime.traps.hit(proc, tid, other, regs)
                        continue
                    regs.rip = site.slot
                    sc.set_regs(tid, regs)
                    os.sched_setaffinity(tid, {home})
                    sc.cont(tid)
                    os.sched_setaffinity(tid, mask)
            finally:
                os.sched_setaffinity(0, allowed)
                session._runtime.processes.clear()
        out.seek(0)
        return int(out.read())


class BpftraceMissing(Exception):
    """bpftrace is not installed or cannot run here: its rows are left out, with this reason."""


def bpftrace_run(argv: list[str], function: str, action: str) -> int:
    """Elapsed microseconds the program reports when run under bpftrace with a uprobe on
    `function` of argv[0] doing `action` (bpftrace counts in the kernel, BPF maps)."""
    if shutil.which("bpftrace") is None:
        raise BpftraceMissing("bpftrace is not installed (make bench installs it where apt can)")
    result = subprocess.run(
        ["bpftrace", "-e", f"uprobe:{argv[0]}:{function} {{ {action} }}", "-c", " ".join(argv)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    elapsed = next((line for line in result.stdout.splitlines() if line.strip().isdigit()), None)
    if result.returncode != 0 or elapsed is None:
        raise BpftraceMissing(f"bpftrace failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return int(elapsed)


def tracefs_problem() -> str | None:
    if not (TRACEFS / "uprobe_events").exists():
        return "tracefs is not mounted (mount -t tracefs nodev /sys/kernel/tracing)"
    if not os.access(TRACEFS / "uprobe_events", os.W_OK):
        return "no write access to uprobe_events (needs root)"
    return None


def many_functions_binary(count: int) -> str:
    source = BUILD / f"many{count}.c"
    BUILD.mkdir(exist_ok=True)
    if not source.exists():
        body = "".join(f"__attribute__((noinline)) int f{i}(int x) {{ return x * {i % 7 + 1} + {i}; }}\n"
                       for i in range(count))  # fmt: skip
        calls = "".join(f"    s += f{i}(s);\n" for i in range(count))
        source.write_text(f"{body}int main(void) {{\n    int s = 1;\n{calls}    return s == 42;\n}}\n")
    return compile_c(source, BUILD / f"many{count}", "-O1")


def attach_many(count: int, optimize: bool) -> dict[str, float]:
    """Probes on every function of a generated program, in-process: placing them in one batch
    (which optimizes them at its end, with `optimize`), running."""
    binary = many_functions_binary(count)
    specs = [f"f{i}" for i in range(count)]
    t0 = time.perf_counter()
    with open(os.devnull, "w") as devnull, dynprobe.spawn([binary], stdout=devnull.fileno()) as session:
        session.optimize = optimize
        t1 = time.perf_counter()
        probes = session.probes_from(specs)
        t2 = time.perf_counter()
        optimized = sum(p.mode.value == "optimized" for p in probes)
        in_use = session.slot_bytes_in_use()
        session.run()
        t3 = time.perf_counter()
    assert all(p.hits == 1 for p in probes)
    return {"probes": count, "optimized": optimized, "spawn_s": t1 - t0, "attach_s": t2 - t1,
            "run_s": t3 - t2, "total_s": t3 - t0, "exec_bytes_per_probe": in_use / count}  # fmt: skip


def program_attach(count: int = 20) -> dict[str, float]:
    """Seconds to compile a `count`-probe program (a body each, keyed maps) and place it in a
    spawned process (its probes take their jumps as the run starts); the median of REPEAT."""
    binary = many_functions_binary(count)
    text = " ".join(f"uprobe:{binary}:f{i} {{ @c[func] = count(); @s[tid] = sum(arg0); @h = hist(arg0); }}"
                    for i in range(count))  # fmt: skip
    runs = []
    for _ in range(REPEAT):
        with open(os.devnull, "w") as devnull, dynprobe.spawn([binary], stdout=devnull.fileno()) as session:
            t0 = time.perf_counter()
            program = session.program(text)
            runs.append(time.perf_counter() - t0)
            session.run()
        assert dict(program.entries("c")) == {(f"f{i}",): 1 for i in range(count)}
    return {"probes": count, "attach_s": sorted(runs)[REPEAT // 2]}


def function_tracing(calls: int) -> dict[str, Any]:
    """The seed loop traced whole (main and test: entry and exit of every call) by `dynprobe
    record` and by `uftrace record` (a -pg build, and dynamic patching `-P .` of a -mnop-mcount
    build), each run timing itself; then `dynprobe report` of the trace (events per second)."""
    source = HERE / "targets" / "seed.c"
    plain = seed_binary()
    results: dict[str, Any] = {"calls": calls, "untraced_us": run_seed([plain, str(calls)]), "runs": REPEAT}
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "dynprobe.data")
        cmd = [sys.executable, "-m", "dynprobe.cli.main", "record", "-o", trace, "--ring-size", str(1 << 26), "--"]

        def record() -> int:
            shutil.rmtree(trace, ignore_errors=True)
            return int(subprocess.run([*cmd, plain, str(calls)], capture_output=True, text=True, check=True).stdout)

        results["dynprobe_us"] = median_run(record, int)
        results["dynprobe_lost"] = json.loads(Path(trace, "info.json").read_text())["lost"]
        for command in ("report", "replay"):  # each a whole `dynprobe` process, start-up included
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "dynprobe.cli.main", command, trace], stdout=subprocess.DEVNULL,
                           check=True)  # fmt: skip
            results[f"{command}_events_per_s"] = 2 * calls / (time.perf_counter() - t0)
        # An argument and the return value recorded (uftrace's -A, -R): two data records a call,
        # twice the records: a ring that holds them all
        values = ["-A", "test@arg1", "-R", "test@retval"]
        cmd[cmd.index("--ring-size") + 1] = str(1 << 28)
        cmd[-1:-1] = values
        results["dynprobe_values_us"] = median_run(record, int)
        results["dynprobe_values_lost"] = json.loads(Path(trace, "info.json").read_text())["lost"]
        uftrace = shutil.which("uftrace")
        if uftrace is None:
            results["uftrace"] = "not installed"
            return results
        pg = compile_c(source, BUILD / "seed-pg", "-O0", "-pg")
        builds = {
            "uftrace_pg_us": (pg, []),
            "uftrace_pg_values_us": (pg, values),
            "uftrace_dynamic_us": (
                compile_c(source, BUILD / "seed-nop", "-O0", "-pg", "-mfentry", "-mnop-mcount", "-fno-PIE", "-no-pie"),
                ["-P", "."],
            ),
        }
        for key, (binary, extra) in builds.items():
            data = os.path.join(tmp, key)

            def uftrace_record(data: str = data, extra: list[str] = extra, binary: str = binary) -> int:
                shutil.rmtree(data, ignore_errors=True)
                done = subprocess.run(  # in tmp: a -pg program writes gmon.out where it runs
                    [uftrace, "record", "-d", data, *extra, binary, str(calls)],
                    cwd=tmp, capture_output=True, text=True, check=True,
                )  # fmt: skip
                return int(done.stdout.split()[-1])

            results[key] = median_run(uftrace_record, int)
    return results


def deep_tracing(calls: int) -> dict[int, float]:
    """ns per traced call (`dynprobe record -P rec`) of a recursion 1, 10, 100 and 1,000 deep."""
    binary = compile_c(HERE / "targets" / "deep.c", BUILD / "deep", "-O1")
    costs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for depth in (1, 10, 100, 1000):
            argv = [binary, str(depth), str(calls // (depth + 1))]
            untraced = run_seed(argv)
            cmd = [sys.executable, "-m", "dynprobe.cli.main", "record", "-o", os.path.join(tmp, "t"), "-P", "rec",
                   "--ring-size", str(1 << 26), "--"]  # fmt: skip
            traced = int(subprocess.run([*cmd, *argv], capture_output=True, text=True, check=True).stdout)
            costs[depth] = (traced - untraced) * 1000 / (calls // (depth + 1) * (depth + 1))
    return costs


def tracer_attach(count: int) -> dict[str, float]:
    """`session.function_tracer` over every function of a generated program: attach time."""
    binary = many_functions_binary(count)
    with open(os.devnull, "w") as devnull, dynprobe.spawn([binary], stdout=devnull.fileno()) as session:
        t0 = time.perf_counter()
        tracer = session.function_tracer()
        tracer.start()
        elapsed = time.perf_counter() - t0
        session.run()
        calls = tracer.calls
    return {"functions": count, "patched": tracer.patched, "attach_s": elapsed, "calls": calls}


def count_cli(count: int) -> float:
    """Wall time of `dynprobe count -f SPECFILE -- PROGRAM` with one probe per function: start,
    attach, optimize, run, print the counts (the issue's 10,000-probe target)."""
    binary = many_functions_binary(count)
    specs = BUILD / f"many{count}.specs"
    specs.write_text("".join(f"p f{i}\n" for i in range(count)))
    t0 = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "dynprobe.cli.main", "count", "-o", "-", "-f", str(specs), "--",
                             binary], capture_output=True, text=True)  # fmt: skip
    elapsed = time.perf_counter() - t0
    assert result.returncode == 0 and result.stdout.count(" 1\n") == count, result.stderr[-500:]
    return elapsed


def startup() -> dict[str, float]:
    """Wall seconds, the median of REPEAT runs, of what a user's first commands cost before any
    tracing: `dynprobe --version`, and a whole `count` of one libc probe over /bin/true."""
    commands = {"version_s": ["--version"], "count_true_s": ["count", "-o", "/dev/null", "p libc:malloc", "--",
                                                             "/bin/true"]}  # fmt: skip
    times: dict[str, float] = {}
    for name, argv in commands.items():
        runs = []
        for _ in range(REPEAT):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "dynprobe.cli.main", *argv], capture_output=True, check=True)
            runs.append(time.perf_counter() - t0)
        times[name] = sorted(runs)[len(runs) // 2]
    return times


def post_processing(statements: int) -> dict[str, Any]:
    """The same call tree (targets/tree.c, ~23 events a statement) recorded by `dynprobe record`
    and `uftrace record` (a -pg build), then read back by each tool's replay, report, Chrome JSON
    and folded stacks: per command, the median wall and CPU seconds of REPEAT whole runs (start-up
    included), and the peak RSS."""
    source = HERE / "targets" / "tree.c"
    plain = compile_c(source, BUILD / "tree", "-O0")
    results: dict[str, Any] = {"statements": statements}
    uftrace = shutil.which("uftrace")
    with tempfile.TemporaryDirectory() as tmp:
        ours = os.path.join(tmp, "dynprobe.data")
        subprocess.run([sys.executable, "-m", "dynprobe.cli.main", "record", "-o", ours, "--ring-size", str(1 << 26),
                        "--", plain, str(statements)], capture_output=True, check=True)  # fmt: skip
        results["events"] = 2 * json.loads(Path(ours, "info.json").read_text())["calls"]
        dp = [sys.executable, "-m", "dynprobe.cli.main"]
        commands: dict[str, tuple[list[str], str | None]] = {
            "replay": ([*dp, "replay", ours], None), "report": ([*dp, "report", ours], None),
            "chrome": ([*dp, "dump", "--chrome", ours], None), "flame": ([*dp, "dump", "--flame", ours], None),
            "perfetto": ([*dp, "dump", "--perfetto", ours], None),
        }  # fmt: skip
        if uftrace is not None:
            theirs = os.path.join(tmp, "uftrace.data")
            pg = compile_c(source, BUILD / "tree-pg", "-O0", "-pg")
            subprocess.run([uftrace, "record", "-d", theirs, pg, str(statements)], cwd=tmp, capture_output=True,
                           check=True)  # fmt: skip
            for name, argv in {"replay": ["replay"], "report": ["report"], "chrome": ["dump", "--chrome"],
                               "flame": ["dump", "--flame-graph"]}.items():  # fmt: skip
                commands[f"uftrace_{name}"] = ([uftrace, *argv, "-d", theirs], tmp)
        else:
            results["uftrace"] = "not installed"
        peak, peak_file = compile_c(HERE / "targets" / "peak.c", BUILD / "peak"), os.path.join(tmp, "peak")
        for name, (argv, cwd) in commands.items():
            runs = []
            for _ in range(REPEAT):
                t0 = time.perf_counter()
                child = subprocess.Popen([peak, peak_file, *argv], cwd=cwd, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)  # fmt: skip
                _, status, usage = os.wait4(child.pid, 0)
                assert os.waitstatus_to_exitcode(status) == 0, argv
                peak_mb = int(Path(peak_file).read_text()) / 1024
                runs.append((time.perf_counter() - t0, usage.ru_utime + usage.ru_stime, peak_mb))
            wall, cpu, most = (sorted(r[i] for r in runs)[len(runs) // 2] for i in range(3))
            results[name] = {"wall_s": wall, "cpu_s": cpu, "peak_mb": most}
    return results


def cli_seed(seed: str, calls: int, command: list[str]) -> int:
    """Elapsed microseconds the seed reports when run under `dynprobe COMMAND... -- seed calls`
    (its line is the first line of stdout: the command's results go to stderr, or to -o)."""
    with tempfile.TemporaryDirectory() as tmp:
        events = Path(tmp) / "events.txt"  # (created by dynprobe: it writes only files it creates)
        output = ["-o", str(events)] if command[0] == "trace" else []
        argv = [sys.executable, "-m", "dynprobe.cli.main", *command, *output, "--", seed, str(calls)]
        result = subprocess.run(argv, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-500:]
        assert not output or len(events.read_text().splitlines()) == calls, "trace printed a line per hit"
    return int(result.stdout.split("\n", 1)[0])


def unwind_tables() -> dict[str, float]:
    """Seconds to compile the unwind rows of libc and of the system's python3, and to read them
    from the cache by build-id (each in a process of its own): the stack walker's tables."""
    code = ("import sys, time; from dynprobe.symbols.elf import load_elf; image = load_elf(sys.argv[1]); "
            "t = time.perf_counter(); image.unwind_table; print(time.perf_counter() - t)")  # fmt: skip
    files = {"libc": "/lib/x86_64-linux-gnu/libc.so.6", "python3": os.path.realpath("/usr/bin/python3")}
    seconds = {}
    with tempfile.TemporaryDirectory() as cache:
        for name, path in files.items():
            if not os.path.exists(path):
                continue
            for how, env in ((name, {"DYNPROBE_CACHE": "0"}), (f"{name}_cached", {"XDG_CACHE_HOME": cache})):
                runs = [subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, check=True,
                                       env={**os.environ, **env}) for _ in range(REPEAT + 1)][1:]  # fmt: skip
                seconds[how] = sorted(float(run.stdout) for run in runs)[REPEAT // 2]
    return seconds


JUMP_LIBRARIES = {
    "libc": "/lib/x86_64-linux-gnu/libc.so.6", "libstdc++": "/usr/lib/x86_64-linux-gnu/libstdc++.so.6",
    "libpython3.11": "/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0",
    "libsqlite3": "/usr/lib/x86_64-linux-gnu/libsqlite3.so.0", "liblzma": "/usr/lib/x86_64-linux-gnu/liblzma.so.5",
    "python3": "/usr/bin/python3",
}  # fmt: skip


def jump_coverage() -> dict[str, dict[str, Any]]:
    """Per library: its functions (one per address), how many could take a jump at their entry,
    and the others by reason (`dynprobe list`'s JUMP column, summed)."""
    from dynprobe.errors import OptimizeRefusal
    from dynprobe.symbols.elf import ElfImage

    out: dict[str, dict[str, Any]] = {}
    for name, path in JUMP_LIBRARIES.items():
        if not os.path.exists(path):
            out[name] = {"missing": path}
            continue
        image = ElfImage(os.path.realpath(path))
        functions = {f.addr: f for f in image.functions if f.size}
        refused = Counter(
            plan.name
            for f in functions.values()
            if isinstance(plan := image.jump_plan(f.addr, f.size, f.addr), OptimizeRefusal)
        )
        out[name] = {"functions": len(functions), "jump": len(functions) - sum(refused.values()), "refused": refused}
    return out


HOT_SQL = (
    "create table t(a integer, b text);"
    " with recursive c(x) as (select 1 union all select x+1 from c where x < 20000)"
    " insert into t select x, printf('v%d', x*7919 % 1000) from c;"
    " create index ti on t(b); select b, count(*), sum(a) from t group by b order by b limit 3;"
)
HOT_WORKLOADS = {  # a workload, and the modules whose every function is counted in it
    "python3 json.dumps": (["/usr/bin/python3.11", "-c", "import json; json.dumps(list(range(200000)) + "
                            "[{'a': str(i)} for i in range(50000)])"], ["libc", "/usr/bin/python3.11"]),
    "sort": (["sort", "{input}", "-o", "/dev/null"], ["libc"]),
    "gzip": (["gzip", "-c", "{input}"], ["libc"]),
    "sqlite3": (["sqlite3", ":memory:", HOT_SQL], ["libc", "/usr/lib/x86_64-linux-gnu/libsqlite3.so.0"]),
}  # fmt: skip


def hot_functions(most: int = 30) -> dict[str, dict[str, Any]]:
    """Per workload (python3's json.dumps, sort and gzip of 3 MB of text, a sqlite3 workload): its
    `most` most-called functions (every
    function of the modules named counted, each an optimized count probe or a trap), and those
    of them that stay traps, with why."""
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        text = Path(scratch) / "input.txt"
        text.write_text("".join(f"line {i * 7919 % 1000003} {'x' * (i % 41)}\n" for i in range(100_000)))
        for name, (argv, modules) in HOT_WORKLOADS.items():
            argv = [a.replace("{input}", str(text)) for a in argv]
            missing = [m for m in (argv[0], *modules) if m.startswith("/") and not os.path.exists(m)]
            if shutil.which(argv[0]) is None or missing:
                out[name] = {"missing": ", ".join(missing) or argv[0]}
                continue
            with dynprobe.spawn(argv, stdout=subprocess.DEVNULL) as session:
                probes = [p for m in modules for p in session.probes_from(session.expand(f"p {m}:*"), action="count")]
                session.run(timeout=600)
                top = sorted(probes, key=lambda p: p.hits, reverse=True)[:most]
                out[name] = {"top": [p.name.split("/", 1)[1] for p in top],
                             "traps": {p.name.split("/", 1)[1]: str(p.trap_reason) for p in top  # type: ignore[attr-defined]
                                       if p.mode != dynprobe.ProbeMode.OPTIMIZED}}  # fmt: skip
    return out


def timestamp_cost() -> tuple[float, float]:
    """ns per rdtscp and per rdtsc here: the floor of a record's cost (its time stamp)."""
    binary = compile_c(HERE / "targets" / "tsc.c", BUILD / "tsc", "-O2")
    rdtscp, rdtsc = subprocess.run([binary], capture_output=True, text=True, check=True).stdout.split()
    return float(rdtscp), float(rdtsc)


def events_binary() -> str:
    return compile_c(HERE / "targets" / "events.c", BUILD / "events", "-O2")


def drain_rate(n: int, rate: int, ring: int = 1 << 26, where: str | None = None) -> dict[str, Any]:
    """The consumer draining records to a file (in `where`, default the temp directory): `n`
    events at `rate` per second (0: as fast as the target can), recorded with a timestamp and 2
    arguments."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("wb", dir=where) as sink:
        with dynprobe.spawn([events_binary(), str(n), str(rate)], stdout=out.fileno()) as session:
            session.ring_bytes = ring
            probe = session.probe("p:b/ev event i=%di t=%si", action="record")
            session.write_raw(sink, decode=False)
            status = session.run()
            session.close()
            written = sink.tell()
        out.seek(0)
        elapsed_us = int(out.read())
    assert status == 0
    drained = session.records_drained
    assert drained + probe.lost == n, (drained, probe.lost, n)
    return {"events": n, "rate": rate, "ring": ring, "where": where or tempfile.gettempdir(),
            "elapsed_s": elapsed_us / 1e6, "lost": probe.lost, "drained": drained,
            "bytes_written": written, "drained_per_s": drained / (elapsed_us / 1e6)}  # fmt: skip


def peak_rss(argv: list[str]) -> float:
    """MiB: the peak RSS of a whole `dynprobe ...` run, measured by a small launcher
    (targets/peak.c)."""
    peak = compile_c(HERE / "targets" / "peak.c", BUILD / "peak")
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "peak")
        subprocess.run([peak, result, sys.executable, "-m", "dynprobe.cli.main", *argv], cwd=tmp,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)  # fmt: skip
        return int(Path(result).read_text()) / 1024


def memory(events: int, calls: int) -> dict[str, float]:
    """Peak RSS (MiB) of `trace` printing `events` events (its default 1 MiB ring) and of
    `record` of the seed's `calls` calls (its default 32 MiB ring): memory follows the rings, not
    the trace; and of `trace` of no event, what the interpreter and its libraries take."""
    binary = events_binary()
    trace = ["trace", "-o", "/dev/null", "p:b/ev event i=%di t=%si"]
    return {
        "trace_none_mb": peak_rss([*trace, "--", binary, "0"]),
        "trace_events": events,
        "trace_mb": peak_rss([*trace, "--", binary, str(events)]),
        "record_calls": calls,
        "record_mb": peak_rss(["record", "-o", "t.data", "--", seed_binary(), str(calls)]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    args = parser.parse_args()
    scale = 0.1 if args.quick else 1.0
    # (the upcall rows' runs as long as the kernel uprobe's: a few tens of ms would meet one busy moment of
    # the host or none, and the median of three such runs is that moment's as often as not)
    n_trap, n_step, n_free, n_kernel, n_opt, n_rec, n_async, n_ret, n_stack, n_upcall = (
        int(x * scale) for x in (20_000, 10_000, 2_000, 200_000, 20_000_000, 2_000_000, 1_000_000, 5_000_000,
                                 5_000_000, 100_000)
    )  # fmt: skip
    seed = seed_binary()
    image = load_elf(seed)
    test_offset = image.vaddr_to_offset(image.by_name["test"].addr)
    assert test_offset is not None
    console = Console(stderr=True)
    rows: list[dict[str, Any]] = []

    def add(name: str, calls: int, elapsed_us: int, **extra: Any) -> None:
        row = {"name": name, "calls": calls, "elapsed_us": elapsed_us, "us_per_call": elapsed_us / calls}
        rows.append({**row, **extra})
        console.log(escape(f"{name}: {elapsed_us / calls:.3f} us/call"))

    add("untraced", n_opt, median_run(lambda: run_seed([seed, str(n_opt)]), int))
    baseline = rows[0]["us_per_call"]
    optimized: list[tuple[str, int, str, dict[str, Any]]] = [  # (row, calls, spec, session.probe keywords)
        ("optimized: count", n_opt, "test", {"action": "count"}),
        # A ring that holds every record: the cost of writing them, not of dropping them.
        ("optimized: record (tsc + 2 registers)", n_rec, "p test a=%di b=%si", {"ring": 1 << 26, "action": "record"}),
        ("optimized: record + async Python callback", n_async, "p test a=%di b=%si",
         {"ring": 1 << 26, "on_event": lambda event: None}),
        ("optimized return: latency recorded (entry + return)", n_rec, "r test ns=$latency:u64",
         {"ring": 1 << 26, "action": "record"}),
        ("optimized return: latency histogram (dynprobe latency)", n_ret, "r test ns=$latency:u64",
         {"action": "hist", "value": "ns"}),
        ("optimized return: count (no time stamps)", n_ret, "r test", {"action": "count"}),
        ("optimized: count by stack (6 frames: test, calls, main, libc's two, _start)", n_stack, "test",
         {"action": "count", "by": "stack"}),
        ("optimized: count by stack, 3 frames (max_frames=3: test, calls, main)", n_stack, "test",
         {"action": "count", "by": "stack", "max_frames": 3}),
    ]  # fmt: skip
    for name, calls, spec, kw in optimized:
        elapsed, info = median_run(lambda: traced_seed([seed, str(calls)], spec, optimize=True, **kw),  # noqa: B023
                                   lambda r: r[0])  # fmt: skip
        add(name, calls, elapsed, **info, runs=REPEAT)
    # libc's memcpy (mempcpy's branch into it taken along) and malloc, each untraced then counted
    libcalls = compile_c(HERE / "targets" / "libcalls.c", BUILD / "libcalls", "-O2")
    for function, what in (("memcpy", "memcpy"), ("malloc", "malloc + free")):
        argv = [libcalls, str(n_rec), function]
        add(f"untraced: libc {what}", n_rec, median_run(functools.partial(run_seed, argv), int))
        traced = functools.partial(traced_seed, argv, f"libc:{function}", optimize=True, action="count")
        elapsed, info = median_run(traced, lambda r: r[0])
        add(f"optimized: count on libc {function}", n_rec, elapsed, **info, runs=REPEAT)
    # 16 frames through -O2 code without frame pointers: the same calls untraced, then counted by stack
    deep = compile_c(HERE / "targets" / "deep.c", BUILD / "deep-O2-nofp", "-O2", "-fomit-frame-pointer")
    deep_argv = [deep, "10", str(n_stack // 16)]
    add("untraced: 16-frame stacks (leaf at depth 10, -O2, no frame pointers)", n_stack // 16,
        median_run(lambda: run_seed(deep_argv), int))  # fmt: skip
    elapsed, info = median_run(
        lambda: traced_seed(deep_argv, f"{deep}:leaf", optimize=True, action="count", by="stack"), lambda r: r[0]
    )
    add("optimized: count by stack (16 frames, -O2, no frame pointers)", n_stack // 16, elapsed, **info, runs=REPEAT)

    def trap_row(name: str, calls: int, argv_tail: list[str], spec: str, **kw: Any) -> None:
        elapsed, info = median_run(lambda: traced_seed([seed, str(calls), *argv_tail], spec, **kw), lambda r: r[0])
        add(name, calls, elapsed, **info, runs=REPEAT)

    trap_row("trap return: Python entry + return handlers", n_step, [], "r test",
             on_entry=lambda hit: None, on_return=lambda hit: None)  # fmt: skip
    trap_row("upcall return: Python entry + return handlers (no stop)", n_upcall, [], "r test",
             on_entry=lambda hit: None, on_return=lambda hit: None, upcalls=True)  # fmt: skip
    trap_row("upcall return: a Python return handler alone (one upcall)", n_upcall, [], "r test",
             on_return=lambda hit: None, upcalls=True)  # fmt: skip
    trap_row("trap, push rbp (a lasting trap: from its slot)", n_trap, [], "test")
    trap_row("trap, emulated (mov rbp,rsp)", n_trap, [], "test+1")
    trap_row("trap, boosted (mov eax,[rip+x])", n_trap, ["boost"], "test_boost")
    trap_row("trap, post-handler (single-step)", n_step, ["boost"], "test_boost", post=lambda hit: None)
    trap_row("upcall, post-handler (no stop, no step)", n_upcall, ["boost"], "test_boost", post=lambda hit: None,
             upcalls=True)  # fmt: skip
    trap_row("trap, push rbp + empty Python pre-handler", n_trap, [], "test", pre=lambda hit: None)
    trap_row("upcall, push rbp + empty Python pre-handler (no stop)", n_upcall, [], "test", pre=lambda hit: None,
             upcalls=True)  # fmt: skip
    # 4 threads making a quarter of the calls each, at once: the time of a call of all of them
    elapsed, info = median_run(
        lambda: traced_seed([seed, str(n_upcall // 4), "plain", "4"], "test", pre=lambda hit: None, upcalls=True),
        lambda r: r[0],
    )
    add("upcall, the same, 4 threads at once", n_upcall // 4 * 4, elapsed, **info, runs=REPEAT)
    add("floor: bare CPython ptrace loop, boosted, placed", n_trap, median_run(lambda: python_floor(seed, n_trap), int))
    trap_row("trap, push rbp, tracer not pinned (cross-CPU)", n_free, [], "test", pin=False)
    # What a user runs: a trap probe counted, and the same probe printing a line per hit
    clis = {"count --trap": ["count", "--trap", "p test"], "trace --trap -o FILE": ["trace", "--trap", "p test"]}
    for name, command in clis.items():
        elapsed = median_run(lambda: cli_seed(seed, n_trap, command), int)  # noqa: B023
        add(f"trap, `dynprobe {name}` (CLI)", n_trap, elapsed, runs=REPEAT)
    # bpftrace programs compiled into the target (`dynprobe run`), and bpftrace's own below
    program = "@c[arg0 & 7] = count(); @s = sum(arg0);"
    run_command = ["run", "-e", f"uprobe:{seed}:test {{ {program} }}"]
    elapsed = median_run(lambda: cli_seed(seed, n_kernel, run_command), int)
    add(f"`dynprobe run` {program}", n_kernel, elapsed, runs=REPEAT)
    programs = {  # (the language's targets: keyed counts, and the latency idiom, entry and return)
        "@[tid] = count()": f"uprobe:{seed}:test {{ @[tid] = count(); }}",
        "@[arg0 % 1024] = count()": f"uprobe:{seed}:test {{ @[arg0 % 1024] = count(); }}",
        "latency: @start[tid] = nsecs; @ns = hist(nsecs - @start[tid]); delete(@start[tid])":
            f"uprobe:{seed}:test {{ @start[tid] = nsecs; }} uretprobe:{seed}:test /@start[tid]/"
            " { @ns = hist(nsecs - @start[tid]); delete(@start[tid]); }",
    }  # fmt: skip
    for name, text in programs.items():
        elapsed = median_run(lambda: cli_seed(seed, n_rec, ["run", "-e", text]), int)  # noqa: B023
        add(f"`dynprobe run` {name}", n_rec, elapsed, runs=REPEAT)
    problem = tracefs_problem()
    if problem is None:
        try:
            with kernel_uprobe(seed, test_offset):
                add("kernel uprobe (tracefs)", n_kernel, median_run(lambda: run_seed([seed, str(n_kernel)]), int))
            with kernel_uprobe(seed, test_offset, "r"):
                add("kernel uretprobe (tracefs)", n_kernel, median_run(lambda: run_seed([seed, str(n_kernel)]), int))
        except OSError as exc:
            problem = f"tracefs refused the uprobe: {exc}"
    if problem:
        rows.append({"name": "kernel uprobe (tracefs)", "unavailable": problem})
        console.log(f"kernel uprobe: unavailable: {problem}")
    bpftrace_rows = {  # bpftrace's count and count by ustack (frame pointers, in the kernel) on the same site
        "bpftrace: uprobe count()": (seed, "test", "@ = count();"),
        "bpftrace: uprobe @[ustack] = count()": (seed, "test", "@[ustack] = count();"),
        "bpftrace: @[ustack] = count(), 16-frame stacks": (deep, "leaf", "@[ustack] = count();"),
        f"bpftrace: {program}": (seed, "test", program),
    }
    for name, (binary, function, action) in bpftrace_rows.items():
        calls = n_kernel if binary == seed else n_stack // 16
        argv = [binary, str(calls)] if binary == seed else [*deep_argv[:2], str(calls)]
        try:
            add(name, calls, median_run(lambda: bpftrace_run(argv, function, action), int))  # noqa: B023
        except BpftraceMissing as exc:
            rows.append({"name": name, "unavailable": str(exc)})
            console.log(f"{name}: unavailable: {exc}")
    kernel_cost = {
        r["name"]: r["us_per_call"] - baseline for r in rows if r["name"].startswith("kernel") and "us_per_call" in r
    }

    def kernel_for(name: str) -> float | None:
        """Return probes compare with the kernel's uretprobe, the rest with its uprobe."""
        return kernel_cost.get("kernel uretprobe (tracefs)" if "return" in name else "kernel uprobe (tracefs)")

    attach = attach_many(1000, optimize=False)
    console.log(f"1000 trap probes: attach {attach['attach_s']:.2f} s")
    n_many = 2000 if args.quick else 10_000
    many = attach_many(n_many, optimize=True)
    console.log(f"{n_many} optimized probes: placed and optimized in {many['attach_s']:.2f} s")
    cli_s = count_cli(n_many)
    console.log(f"dynprobe count -f ({n_many} probes), whole run: {cli_s:.2f} s")
    tracing = function_tracing(int(2_000_000 * scale))
    deep = deep_tracing(int(2_000_000 * scale))
    console.log(f"function tracing: {tracing}")
    tracer_10k = tracer_attach(n_many)
    console.log(f"function tracer attach: {tracer_10k}")
    drains = [
        drain_rate(int(10_000_000 * scale), 10_000_000, where="/dev/shm"),  # a file in memory (tmpfs)
        drain_rate(int(10_000_000 * scale), 10_000_000),  # a file on the disk-backed temp directory
        drain_rate(int(50_000_000 * scale), 0, where="/dev/shm"),
    ]
    for d in drains:
        console.log(f"drain: {d}")
    rdtscp_ns, rdtsc_ns = timestamp_cost()
    started = startup()
    console.log(f"start-up: {started}")
    unwinding = unwind_tables()
    console.log(f"unwind tables compiled: {unwinding}")
    jumps = jump_coverage()
    program_placed = program_attach()
    console.log(f"a program of 20 probes placed: {program_placed}")
    hot = hot_functions()
    console.log(f"hot functions: {hot}")
    console.log(f"functions taking a jump: {jumps}")
    reading = post_processing(int(175_000 * scale))
    console.log(f"post-processing: {reading}")
    peaks = memory(int(4_000_000 * scale), int(10_000_000 * scale))
    console.log(f"memory: {peaks}")

    table = Table(title="dynprobe probes: the seed loop (N calls of an empty -O0 function)")
    for col in ("mechanism", "calls", "us/call", "ns/hit over untraced", "vs kernel u(ret)probe", "stops/hit", "path"):
        table.add_column(col, justify="right" if col not in ("mechanism", "path") else "left")
    for row in rows:
        if "unavailable" in row:
            table.add_row(escape(row["name"]), "-", "-", "-", "-", "-", escape(row["unavailable"]))
            continue
        per_hit = row["us_per_call"] - baseline
        row["us_per_hit"] = per_hit if row["name"] != "untraced" else 0.0
        kernel = kernel_for(row["name"])
        ratio = f"{per_hit / kernel:.3g}x" if kernel and row["name"] != "untraced" else "-"
        stops = f"{row['stops'] / row['calls']:.2f}" if "stops" in row else "-"
        path = ", ".join(row.get("resumes", {})) or "-"
        if row.get("lost"):
            path += f" (lost {row['lost']:,})"
        table.add_row(escape(row["name"]), f"{row['calls']:,}", f"{row['us_per_call']:.4f}",
                      f"{row['us_per_hit'] * 1000:,.1f}", ratio, stops, path)  # fmt: skip
    out = Console(width=150)
    out.print(table)
    out.print(f"attach {attach['probes']} trap probes (one per function of a generated program): "
              f"{attach['attach_s']:.3f} s; spawn {attach['spawn_s']:.3f} s; run {attach['run_s']:.3f} s")  # fmt: skip
    out.print(f"{many['probes']} probes placed in one batch and optimized at its end: {many['attach_s']:.2f} s "
              f"({many['optimized']} optimized), run {many['run_s']:.2f} s; "
              f"{many['exec_bytes_per_probe']:.0f} executable bytes per probe (trap slot + detour)")  # fmt: skip
    out.print(f"`dynprobe count -f` with {many['probes']} probes, start to printed counts: {cli_s:.2f} s")
    per_call = {
        k: (v - tracing["untraced_us"]) * 1000 / tracing["calls"] for k, v in tracing.items() if k.endswith("_us")
    }
    costs = ", ".join(f"{k.removesuffix('_us')} {v:.0f}" for k, v in per_call.items() if k != "untraced_us")
    out.print(f"function tracing, the seed loop traced whole, ns per traced call (entry + exit): {costs}; "
              f"{tracing['dynprobe_lost']:,} lost ({tracing['dynprobe_values_lost']:,} with values); "
              "`dynprobe report` reads "
              f"{tracing['report_events_per_s'] / 1e6:.2f} M events/s, `dynprobe replay` "
              f"{tracing['replay_events_per_s'] / 1e6:.2f} M events/s")  # fmt: skip
    out.print("function tracing at depth (recursion N deep), ns per traced call: "
              + ", ".join(f"{depth} deep {ns:.0f}" for depth, ns in deep.items()))  # fmt: skip
    out.print(f"function tracer over {tracer_10k['functions']} functions: {tracer_10k['patched']} patched "
              f"in {tracer_10k['attach_s']:.2f} s")  # fmt: skip
    out.print(f"a time stamp costs {rdtscp_ns:.1f} ns (rdtscp, with the CPU) or {rdtsc_ns:.1f} ns (rdtsc) here")
    out.print(f"start-up: `dynprobe --version` {started['version_s'] * 1000:.0f} ms, `dynprobe count 'p libc:malloc' "
              f"-- /bin/true` {started['count_true_s'] * 1000:.0f} ms")  # fmt: skip
    out.print("unwind tables (the stack walker's rows), compiled or read from the cache: "
              + ", ".join(f"{name} {unwinding[name]:.3f} s or {unwinding[name + '_cached']:.3f} s"
                          for name in unwinding if not name.endswith("_cached")))  # fmt: skip
    shown = []
    for name in ("replay", "report", "chrome", "flame", "perfetto"):
        ours, theirs = reading[name], reading.get(f"uftrace_{name}")
        versus = f" vs uftrace {theirs['cpu_s']:.2f} s, {theirs['peak_mb']:.0f} MB" if theirs else ""
        shown.append(f"{name} {ours['cpu_s']:.2f} s, {ours['peak_mb']:.0f} MB{versus}")
    jump_table = Table(title="functions whose entry takes a jump (the others stay traps), by library")
    for col in ("library", "functions", "take a jump", "%", "refused"):
        jump_table.add_column(col, justify="left" if col in ("library", "refused") else "right")
    for name, counts in jumps.items():
        if "missing" in counts:
            jump_table.add_row(name, "-", "-", "-", f"not installed: {counts['missing']}")
            continue
        share = 100 * counts["jump"] / max(1, counts["functions"])
        reasons = ", ".join(f"{reason} {n}" for reason, n in counts["refused"].most_common()) or "-"
        jump_table.add_row(name, f"{counts['functions']:,}", f"{counts['jump']:,}", f"{share:.2f}", reasons)
    out.print(jump_table)
    out.print(f"a `dynprobe run` program of {program_placed['probes']} probes compiled and placed: "
              f"{program_placed['attach_s']:.2f} s")  # fmt: skip
    for name, found in hot.items():
        if "missing" in found:
            out.print(f"{name}: not installed ({found['missing']})")
            continue
        traps = ", ".join(f"{f} ({why})" for f, why in found["traps"].items()) or "none"
        out.print(f"{name}: of its {len(found['top'])} most-called functions, traps: {traps}")
    out.print(f"peak RSS: `trace` of {peaks['trace_events'] / 1e6:.0f} M events {peaks['trace_mb']:.0f} MB (1 MiB "
              f"ring; {peaks['trace_none_mb']:.0f} MB for none), `record` of {peaks['record_calls'] / 1e6:.0f} M calls "
              f"{peaks['record_mb']:.0f} MB (32 MiB ring)")  # fmt: skip
    out.print(f"reading a {reading['events'] / 1e6:.1f} M-event call graph back (CPU seconds, peak RSS, start-up "
              f"included): {'; '.join(shown)}")  # fmt: skip
    for d in drains:
        pace = f"paced at {d['rate'] / 1e6:.0f} M/s" if d["rate"] else "as fast as the target can"
        out.print(f"consumer drain to a file in {d['where']}, {d['events']:,} events {pace}: "
                  f"{d['drained_per_s'] / 1e6:.1f} M events/s drained, {d['lost']:,} lost")  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    result = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": sys.version.split()[0]},
        "command": "make bench" + (" (--quick)" if args.quick else ""),
        "seed": rows,
        "attach": attach,
        "attach_optimized": many,
        "count_cli_s": cli_s,
        "function_tracing": tracing,
        "function_tracing_at_depth_ns": deep,
        "tracer_attach": tracer_10k,
        "drain": drains,
        "timestamp_ns": {"rdtscp": rdtscp_ns, "rdtsc": rdtsc_ns},
        "startup_s": started,
        "unwind_tables_s": unwinding,
        "jump_coverage": jumps,
        "program_attach": program_placed,
        "hot_functions": hot,
        "post_processing": reading,
        "memory_mb": peaks,
    }
    (RESULTS / "latest.json").write_text(json.dumps(result, indent=2) + "\n")
    out.print(f"written {RESULTS / 'latest.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
