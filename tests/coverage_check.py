"""`make coverage`'s verdict: line and branch coverage of the combined data (every process the
suite started), per module and in total; fails when branch coverage is below the floor.

    python -m tests.coverage_check [--branches PERCENT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import coverage
from rich.console import Console
from rich.table import Table

BRANCH_FLOOR = 92.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--branches", type=float, default=BRANCH_FLOOR, help="the least branch coverage, in percent")
    args = parser.parse_args()
    cov = coverage.Coverage()
    cov.load()
    report = Path(cov.config.data_file).with_name("report.json")
    cov.json_report(outfile=str(report))
    files = json.loads(report.read_text())["files"]
    table = Table(title="coverage: every process the suite started")
    for heading in ("module", "lines", "missed", "branches", "missed", "lines %", "branches %"):
        table.add_column(heading, justify="left" if heading == "module" else "right")
    totals = [0, 0, 0, 0]  # statements, missed, branches, branches missed
    for path, measured in sorted(files.items()):
        summary = measured["summary"]
        row = [summary["num_statements"], summary["missing_lines"], summary["num_branches"]]
        row.append(summary["num_branches"] - summary["covered_branches"])
        totals = [t + n for t, n in zip(totals, row, strict=True)]
        table.add_row(path.split("src/", 1)[-1], *map(str, row), _percent(row[0], row[1]), _percent(row[2], row[3]))
    table.add_row("total", *map(str, totals), _percent(totals[0], totals[1]), _percent(totals[2], totals[3]))
    console = Console(width=None if sys.stdout.isatty() else 160)  # (a file: no column cut short)
    console.print(table)
    branch_share = 100.0 * (totals[2] - totals[3]) / totals[2] if totals[2] else 100.0
    if branch_share < args.branches:
        console.print(f"branch coverage {branch_share:.1f}% is below {args.branches:.1f}%")
        return 1
    return 0


def _percent(total: int, missed: int) -> str:
    return f"{100.0 * (total - missed) / total:.1f}" if total else "-"


if __name__ == "__main__":
    sys.exit(main())
