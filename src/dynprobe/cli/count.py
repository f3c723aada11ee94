"""`dynprobe count`: hit counts per probe, counted in the target (no stop per hit once optimized),
printed every -i seconds and at the end."""

from __future__ import annotations

import argparse
from typing import TextIO

from dynprobe.cli.common import add_target_options, report_error
from dynprobe.cli.probes import (
    Shown,
    add_aggregate_options,
    add_probe_options,
    check_request,
    run_aggregating,
    write_report,
)
from dynprobe.errors import DynprobeError

EXAMPLES = """\
examples:
  dynprobe count 'p libc:malloc' 'p libc:free' -- ./app
  dynprobe count -i 1 'p:srv/req handle_request' -p 1234
  dynprobe count 'p libc:write fd=%di' --filter 'fd == 2' --stats -- ./app
  dynprobe count -f all_functions.txt -- ./app      (thousands of probes: one per line)
"""


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "count", help="count probe hits", description="Count hits per probe, in the target.",
        epilog=EXAMPLES,
    )  # fmt: skip
    add_probe_options(p, filter_help="count only hits where EXPR holds")
    add_aggregate_options(p, "counts")
    add_target_options(p)
    p.set_defaults(run=run)


def print_counts(shown: Shown, out: TextIO) -> None:
    """The most hit first, as funccount prints them."""
    width = max((len(t.probe.name) for t in shown.tallies), default=0)
    lines = [shown.title or "hits:"]
    lines += [f"  {t.probe.name:<{width}} {t.hits:>12}" for t in sorted(shown.tallies, key=lambda t: -t.hits)]
    if (line := shown.left_out_line()) is not None:
        lines.append(line)
    write_report(out, lines)


def run(args: argparse.Namespace, command: list[str]) -> int:
    try:
        request = check_request(args)
    except DynprobeError as exc:
        return report_error(exc)
    return run_aggregating(
        args, command, request, lambda session, spec: session.probe(spec, action="count", filter=request.filter),
        print_counts,
    )  # fmt: skip
