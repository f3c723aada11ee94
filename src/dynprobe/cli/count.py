"""`dynprobe count`: hit counts per probe, counted in the target (no stop per hit once optimized),
printed every -i seconds and at the end."""

from __future__ import annotations

import argparse
import sys
import time

from dynprobe.cli.common import add_target_options, open_session, report_error, run_target
from dynprobe.cli.probes import add_probe_options, check_request, place_all, print_stats
from dynprobe.core.probe import Probe
from dynprobe.core.session import print_warning
from dynprobe.errors import DynprobeError

EXAMPLES = """\
examples:
  dynprobe count 'p libc:malloc' 'p libc:free' -- ./app
  dynprobe count -i 1 'p:srv/req handle_request' -p 1234
  dynprobe count 'p libc:write fd=%di' --filter 'fd == 2' --stats -- ./app
  dynprobe count -f all_functions.txt -- ./app      (thousands of probes: one per line)
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "count", help="count probe hits", description="Count hits per probe, in the target.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_probe_options(p, filter_help="count only hits where EXPR holds")
    p.add_argument("-i", "--interval", type=float, metavar="SECONDS", help="also print the counts every SECONDS")
    add_target_options(p)
    p.set_defaults(run=run)


def print_counts(probes: list[Probe], title: str) -> None:
    width = max(len(p.name) for p in probes)
    out = sys.stdout
    print(title, file=out)
    for p in sorted(probes, key=lambda p: -p.hits):
        print(f"  {p.name:<{width}} {p.hits:>12}", file=out)
    out.flush()


def run(args: argparse.Namespace, command: list[str]) -> int:
    if args.interval is not None and args.interval <= 0:
        return report_error(DynprobeError("the interval must be a positive number of seconds"))
    try:
        request = check_request(args)
        with open_session(args, command) as session:
            session.on_warning = print_warning
            probes = place_all(
                session, request, lambda spec: session.probe(spec, action="count", filter=request.filter)
            )

            def tick() -> None:
                print_counts(probes, time.strftime("%H:%M:%S"))

            status = run_target(session, args.interval, tick)
            session.close()
            print_counts(probes, "total:" if args.interval else "hits:")
            if args.stats:
                print_stats(probes, True)
    except DynprobeError as exc:
        return report_error(exc)
    except BrokenPipeError:
        return 0
    if args.pid is not None:
        return 0
    return status if status is not None else 130
