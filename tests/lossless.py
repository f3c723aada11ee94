"""`make lossless`: the bursts that lost records at the defaults, run again and again with a CPU hog
on every CPU (a busy machine: the reader may not get a CPU when a ring fills). At the defaults a
writer waits for the reader, so every run must lose nothing:

- `trace` of malloc and free around 200,000 pairs (400,000 events into a 1 MiB ring);
- `record` of a 2 M-call tree (32 MiB rings);
- `record` of 10 M calls of the seed function (20 M records).

    python -m tests.lossless [--runs 20] [--unloaded]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DYNPROBE = [sys.executable, "-m", "dynprobe.cli.main"]


def build(name: str, sources: list[Path], flags: list[str], build_dir: Path) -> str:
    out = build_dir / name
    subprocess.run(["gcc", *flags, "-o", str(out), *map(str, sources)], check=True)
    return str(out)


def trace_malloc_free(program: str, scratch: Path) -> tuple[int, int]:
    """(events written, events lost) of `trace` at the defaults."""
    out = scratch / "events.txt"
    r = subprocess.run([*DYNPROBE, "trace", "--stats", "-o", str(out), "p libc:malloc size=%di:u64",
                        "p libc:free ptr=%di", "--", program, "malloc", "1", "200000"],
                       capture_output=True, text=True, check=True)  # fmt: skip
    lost = sum(int(n) for n in re.findall(r" lost=(\d+) ", r.stderr))
    with open(out) as f:
        return sum(1 for _ in f), lost


def record(argv: list[str], scratch: Path) -> tuple[int, int]:
    """(records written, records lost) of `record` at the defaults."""
    data = scratch / "trace.data"
    subprocess.run([*DYNPROBE, "record", "-o", str(data), "--", *argv], capture_output=True, check=True)
    info = json.loads((data / "info.json").read_text())
    shutil.rmtree(data)
    return 2 * int(info["calls"]), int(info["lost"]) + int(info["missed"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--unloaded", action="store_true", help="without the CPU hogs")
    args = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory(prefix="dynprobe-lossless-") as tmp:
        scratch = Path(tmp)
        opt = build("opt", [ROOT / "tests/targets/opt.c", ROOT / "tests/targets/opt_asm.S"], ["-O1", "-pthread"],
                    scratch)  # fmt: skip
        tree = build("tree", [ROOT / "bench/targets/tree.c"], ["-O0"], scratch)
        seed = build("seed", [ROOT / "bench/targets/seed.c"], ["-O0", "-pthread"], scratch)
        cases: dict[str, tuple[Callable[[], tuple[int, int]], int]] = {
            "trace malloc+free, 200k pairs": (lambda: trace_malloc_free(opt, scratch), 400_000),
            "record tree, 2 M calls": (lambda: record([tree, "190000"], scratch), 0),
            "record seed, 10 M calls": (lambda: record([seed, "10000000"], scratch), 20_000_000),
        }
        hogs = [] if args.unloaded else [
            subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)
        ]  # fmt: skip
        failed = 0
        table = Table(title=f"{args.runs} runs a case{'' if args.unloaded else ', a CPU hog per CPU'}")
        for column in ("case", "run", "events", "lost", "seconds"):
            table.add_column(column, justify="left" if column == "case" else "right")
        try:
            for run in range(1, args.runs + 1):
                for name, (case, least) in cases.items():
                    started = time.monotonic()
                    events, lost = case()
                    seconds = time.monotonic() - started
                    bad = lost > 0 or events < least
                    failed += bad
                    table.add_row(name, str(run), f"{events:,}", f"[red]{lost:,}[/]" if bad else "0", f"{seconds:.1f}")
                    console.log(f"run {run}: {name}: {events:,} events, {lost:,} lost, {seconds:.1f} s")
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        console.print(table)
        console.print(f"{failed} of {args.runs * len(cases)} runs lost events" if failed else "nothing lost")
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
