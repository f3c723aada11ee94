"""`dynprobe latency`: a log2 histogram of each function's latency, aggregated in the target
(like bcc's funclatency): a return probe per function whose return code buckets `$latency`."""

from __future__ import annotations

import argparse
import dataclasses
import re

from dynprobe.cli.common import UsageError, add_target_options, report_error
from dynprobe.cli.hist import print_histograms
from dynprobe.cli.probes import ProbeRequest, Tally, add_aggregate_options, run_aggregating
from dynprobe.errors import DynprobeError
from dynprobe.ringbuf.layout import SHADOW_CAPACITY
from dynprobe.spec.parser import parse_probe
from dynprobe.symbols.resolve import is_pattern

EXAMPLES = """\
examples:
  dynprobe latency compress -- ./app input.txt            one function of the program
  dynprobe latency libc:malloc libc:free -i 5 -p 1234      every 5 seconds and at the end
  dynprobe latency /usr/lib/libz.so.1:deflate --maxactive 64 -- ./app
"""


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "latency", help="log2 histogram of function latencies",
        description="A log2 histogram of each function's latency (entry to return, in nanoseconds), "
        "aggregated in the target by return probes.",
        epilog=EXAMPLES,
    )  # fmt: skip
    p.add_argument("functions", nargs="+", metavar="FUNC", help="SYMBOL or PATH:SYMBOL (a function's entry)")
    add_aggregate_options(p, "histograms")
    p.add_argument("--maxactive", type=int, metavar="N",
                   help="pending calls per thread and function (default max(10, 2 x CPUs))")  # fmt: skip
    p.add_argument("--trap", "--no-optimize", dest="trap", action="store_true",
                   help="keep the entries trap probes (no jump optimization), for comparisons")  # fmt: skip
    p.add_argument(
        "--stats",
        action="store_true",
        help="at the end, per function: hits, missed, lost and its mode (optimized or trap, and why)",
    )
    add_target_options(p)
    p.set_defaults(run=run)


def _event_name(function: str) -> str:
    name = re.sub(r"\W", "_", function.rsplit(":", 1)[-1])
    return ("f_" + name if name[:1].isdigit() else name)[:64] or "function"


def request_for(args: argparse.Namespace) -> ProbeRequest:
    if args.maxactive is not None and not 1 <= args.maxactive <= SHADOW_CAPACITY:
        raise UsageError(f"--maxactive {args.maxactive} is out of range (1..{SHADOW_CAPACITY})")
    maxactive = str(args.maxactive) if args.maxactive is not None else ""
    specs = []
    for function in args.functions:
        if function.split(None, 1)[0][:1] in ("p", "r") and " " in function:
            raise UsageError(f"give a function, not a probe spec: {function!r}")
        spec = parse_probe(f"r{maxactive}:latency/{_event_name(function)} {function} ns=$latency:u64")
        # a pattern's functions are named each by its own (r_strlen), not after the pattern
        specs.append(dataclasses.replace(spec, event=None) if is_pattern(function) else spec)
    return ProbeRequest(specs, None, args.trap, None)


def _heading(t: Tally) -> str:
    missed = f", {t.missed} missed" if t.missed else ""
    tick = t.probe.clock_tick_ns
    # On a CPU whose counter moves in steps (AMD's Zen: every 10 ns), a call may end in the
    # tick it began in: say how long a tick is, once per histogram that has such calls.
    clock = f" (a tick of the clock: {tick:.3g} ns)" if tick and t.histogram[0] else ""
    return f"@latency_ns[{t.probe.location.label}]: {sum(t.histogram)} calls{missed}{clock}"


def run(args: argparse.Namespace, command: list[str]) -> int:
    try:
        request = request_for(args)
    except DynprobeError as exc:
        return report_error(exc)
    return run_aggregating(
        args, command, request,
        lambda session, spec: session.probe(spec, action="hist", value="ns"),
        lambda shown, out: print_histograms(shown, out, _heading, "(no returns)"),
        "--maxactive {}",
    )  # fmt: skip
