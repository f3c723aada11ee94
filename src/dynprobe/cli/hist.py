"""`dynprobe hist`: a log2 histogram of one fetched value per probe hit, aggregated in the target."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TextIO

from dynprobe.actions.filter import parse_value
from dynprobe.cli.common import add_target_options, report_error
from dynprobe.cli.probes import (
    Shown,
    Tally,
    add_aggregate_options,
    add_probe_options,
    check_request,
    run_aggregating,
    write_report,
)
from dynprobe.errors import DynprobeError
from dynprobe.output.hist import Histogram, zero_label

EXAMPLES = """\
examples:
  dynprobe hist 'p libc:malloc' --value %di -- ./app                 malloc sizes
  dynprobe hist 'p:io/rd read_block n=%si:u32' --value n -i 5 -p 1234
  dynprobe hist 'p libc:write fd=%di len=%dx' --value len --filter 'fd == 1' -- ./app
"""


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "hist", help="log2 histogram of a fetched value",
        description="A log2 histogram of one fetch argument per hit, aggregated in the target.",
        epilog=EXAMPLES,
    )  # fmt: skip
    add_probe_options(p)
    p.add_argument("--value", required=True, metavar="FETCHARG",
                   help="what to count: a fetch argument's name, or a fetch argument (%%di, +8(%%si):u32)")  # fmt: skip
    add_aggregate_options(p, "histograms")
    add_target_options(p)
    p.set_defaults(run=run)


def print_histograms(shown: Shown, out: TextIO, heading: Callable[[Tally], str], empty: str = "(no hits)") -> None:
    """Each probe's histogram under its `heading`, after the title (the time, every -i seconds)."""
    lines = [shown.title] if shown.title else []
    for t in shown.tallies:
        lines += [heading(t), str(Histogram(t.histogram, zero_label(t.probe.value))) or f"  {empty}", ""]
    if (line := shown.left_out_line()) is not None:
        lines.append(line.strip())
    write_report(out, lines)


def run(args: argparse.Namespace, command: list[str]) -> int:
    try:
        request = check_request(args)
        for spec in request.specs:
            parse_value(args.value, spec.args)
    except DynprobeError as exc:
        return report_error(exc)
    return run_aggregating(
        args, command, request,
        lambda session, spec: session.probe(spec, action="hist", value=args.value, filter=request.filter),
        lambda shown, out: print_histograms(shown, out, lambda t: f"@{t.probe.name}[{args.value}]:"),
    )  # fmt: skip
