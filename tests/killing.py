"""Killing dynprobe at random moments while it traces a hot program: the program must run on,
with its own results, whatever the mechanism and whenever the kill (during the attach, the
optimization, the steady state or the detach). Used by tests/integration/test_killed_tracer.py
and, for many more runs, by `make stress-kill`:

    python -m tests.killing [--runs N] [--mode MODE ...] [--seed S] [--loaded]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from tests.conftest import DYNPROBE, build_target

THREADS = 4
SECONDS = 1.6  # the program's run; kills land in its first KILL_WITHIN seconds
KILL_WITHIN = 1.1

# How each mode traces: a CLI command (the program's pid appended with -p), or a script of the
# Python API (its pid formatted in), for what the CLI does not do (Python handlers).
_API = "import dynprobe, sys; s = dynprobe.attach({pid}); {probes}; print('placed', flush=True); s.run()"
MODES: dict[str, list[str]] = {
    "trap count": [*DYNPROBE, "count", "--trap", "p work"],
    "trap record": [*DYNPROBE, "trace", "--trap", "p work i=%di", "-o", "{out}/events.txt"],
    "trap Python handler": [
        sys.executable,
        "-c",
        _API.format(pid="{pid}", probes="s.upcalls = False; s.probe('work', pre=lambda h: None)"),
    ],
    "upcall Python handler": [
        sys.executable,
        "-c",
        _API.format(pid="{pid}", probes="s.upcalls = True; s.probe('work', pre=lambda h: None)"),
    ],
    "upcall return handlers": [
        sys.executable,
        "-c",
        _API.format(
            pid="{pid}",
            probes="s.upcalls = True; s.retprobe('work', entry=lambda h: None, handler=lambda h: None)",
        ),
    ],
    "upcall return handler alone": [
        sys.executable,
        "-c",
        _API.format(pid="{pid}", probes="s.upcalls = True; s.retprobe('work', handler=lambda h: None)"),
    ],
    "trap post-handler": [
        sys.executable,
        "-c",
        _API.format(pid="{pid}", probes="s.upcalls = False; s.probe('leaf', post=lambda h: None)"),
    ],
    "optimized count": [*DYNPROBE, "count", "p work"],
    "branches taken along": [*DYNPROBE, "count", "p libc:memcpy", "p libc:mempcpy"],
    "optimized record": [*DYNPROBE, "trace", "p work i=%di", "-o", "{out}/events.txt"],
    "stacks counted in the target": [*DYNPROBE, "trace", "--stack", "p work i=%di", "-o", "{out}/events.txt"],
    "return probe": [*DYNPROBE, "latency", "work"],
    "trap return probe": [*DYNPROBE, "latency", "--trap", "work"],
    "function tracer": [*DYNPROBE, "record", "-o", "{out}/trace.data"],
}


@dataclass
class Outcome:
    mode: str
    delay: float
    detaching: bool
    survived: bool
    why: str


def hot_program() -> str:
    return build_target("hot", flags=("-O1", "-pthread"))


def kill_once(mode: str, rng: random.Random, hot: str) -> Outcome:
    """Start the hot program, trace it in `mode`, SIGKILL dynprobe a random time later (a
    quarter of the time shortly after a SIGINT, during its detach); the program must end as it
    would have."""
    delay = rng.uniform(0.0, KILL_WITHIN)
    detaching = rng.random() < 0.25
    out = tempfile.mkdtemp(prefix="dynprobe-kill-")
    program = subprocess.Popen([hot, str(THREADS), str(SECONDS)], stdout=subprocess.PIPE, text=True)
    tracer = None
    try:
        assert program.stdout is not None
        program.stdout.readline()  # "ready": its threads start
        argv = [a.format(pid=program.pid, out=out) for a in MODES[mode]]
        if argv[0] != sys.executable or argv[1] != "-c":
            argv += ["-p", str(program.pid)]
        tracer = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        if detaching:
            tracer.send_signal(signal.SIGINT)
            time.sleep(rng.uniform(0.0, 0.05))
        tracer.kill()
        said = tracer.communicate(timeout=30)[1]
        result, _ = program.communicate(timeout=60)
        ok = program.returncode == 0 and result.startswith("ok ")
        why = (
            "" if ok else f"exit {program.returncode}: {result.strip()[-200:]!r}; dynprobe said {said.strip()[-400:]!r}"
        )
        return Outcome(mode, delay, detaching, ok, why)
    finally:
        for proc in (tracer, program):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(out, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100, help="runs per mode (default 100)")
    parser.add_argument("--mode", action="append", choices=list(MODES), help="only these modes (repeatable)")
    parser.add_argument("--seed", type=int, default=int(time.time()), help="random seed (printed, to replay a run)")
    parser.add_argument("--loaded", action="store_true", help="with a CPU hog on every CPU, as on a busy machine")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    hot = hot_program()
    load = " under a CPU hog per CPU" if args.loaded else ""
    print(f"seed {args.seed}; {args.runs} runs per mode; the program: {THREADS} threads, {SECONDS} s{load}", flush=True)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)] if (
        args.loaded
    ) else []  # fmt: skip
    failed = 0
    try:
        for mode in args.mode or list(MODES):
            outcomes = [kill_once(mode, rng, hot) for _ in range(args.runs)]
            bad = [o for o in outcomes if not o.survived]
            failed += len(bad)
            print(f"{mode:<22} {len(outcomes) - len(bad):>4} of {len(outcomes)} survived", flush=True)
            for o in bad:
                print(f"    killed at {o.delay:.3f} s{' (detaching)' if o.detaching else ''}: {o.why}", flush=True)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", os.getcwd())
    sys.exit(main())
