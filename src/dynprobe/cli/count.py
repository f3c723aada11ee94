"""`dynprobe count`: hit counts per probe, counted in the target (no stop per hit once optimized),
printed every -i seconds and at the end."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import TextIO

from dynprobe.actions.filter import parse_value
from dynprobe.cli.common import add_output_option, add_target_options, positive_count, report_error
from dynprobe.cli.probes import (
    Shown,
    add_aggregate_options,
    add_max_frames_option,
    add_probe_options,
    check_request,
    run_aggregating,
    write_report,
)
from dynprobe.core.stacks import MAX_FRAMES
from dynprobe.errors import DynprobeError

EXAMPLES = """\
examples:
  dynprobe count 'p libc:malloc' 'p libc:free' -- ./app
  dynprobe count -i 1 'p:srv/req handle_request' -p 1234
  dynprobe count 'p libc:write fd=%di' --filter 'fd == 2' --stats -- ./app
  dynprobe count -f all_functions.txt -- ./app      (thousands of probes: one per line)
  dynprobe count --by stack 'p libc:malloc' -- ./app   (who calls it: each stack, counted)
"""
STACKS_EXAMPLES = """\
examples:
  dynprobe stacks 'p libc:malloc' -- ./app
  dynprobe stacks --folded -o malloc.folded 'p libc:malloc' -p 1234
  flamegraph.pl malloc.folded > malloc.svg       (then: a flame graph of who calls malloc)
  dynprobe stacks --folded --value size 'p libc:malloc size=%di:u64' -- ./app   (bytes, by stack)
"""


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "count", help="count probe hits", description="Count hits per probe, in the target.",
        epilog=EXAMPLES,
    )  # fmt: skip
    add_probe_options(p, filter_help="count only hits where EXPR holds")
    p.add_argument("--by", choices=["stack"],
                   help="also count each probe's hits by stack (walked in the target), printed at the end, "
                        "the most hit last")  # fmt: skip
    add_max_frames_option(p, "--by stack")
    add_top_stacks_option(p, "--by stack")
    add_aggregate_options(p, "counts")
    add_target_options(p)
    p.set_defaults(run=run)
    p = sub.add_parser(
        "stacks", help="count probe hits by stack (folded for flame graphs)",
        description="Count each probe's hits by stack, walked in the target (with the modules' unwind tables; "
                    "frame pointers through code that has none, where a stack may be cut: a last line '...'), "
                    "and print them at the end: as bpftrace prints @[ustack] = count(), or folded. A return "
                    "probe's stack is where the return went back to (as bpftrace's uretprobe ustack).",
        epilog=STACKS_EXAMPLES,
    )  # fmt: skip
    add_probe_options(p, filter_help="count only hits where EXPR holds")
    p.add_argument("--folded", action="store_true",
                   help="one line a stack, its functions outermost first joined by ';', then its count "
                        "(flamegraph.pl's and speedscope's input)")  # fmt: skip
    p.add_argument("--value", metavar="VALUE",
                   help="sum VALUE (a fetch argument's name, or a fetch argument) by stack instead of counting "
                        "hits: bytes allocated by each stack, say")  # fmt: skip
    add_max_frames_option(p)
    add_top_stacks_option(p)
    add_output_option(p, "the stacks")
    add_target_options(p)
    p.set_defaults(run=run_stacks, by="stack", interval=None, top=None, all=True)


def add_top_stacks_option(p: argparse.ArgumentParser, with_option: str | None = None) -> None:
    when = f"with {with_option}: " if with_option else ""
    p.add_argument("--top-stacks", type=positive_count, metavar="N",
                   help=f"{when}print only each probe's N most hit stacks (as bpftrace's print(@, N))")  # fmt: skip


def print_counts(shown: Shown, out: TextIO) -> None:
    """The most hit first, as funccount prints them."""
    width = max((len(t.probe.name) for t in shown.tallies), default=0)
    lines = [shown.title or "hits:"]
    lines += [f"  {t.probe.name:<{width}} {t.hits:>12}" for t in sorted(shown.tallies, key=lambda t: -t.hits)]
    if (line := shown.left_out_line()) is not None:
        lines.append(line)
    write_report(out, lines)


def print_stacks(shown: Shown, out: TextIO, *, after_counts: bool = False, sums: bool = False,
                 top: int | None = None) -> None:  # fmt: skip
    """Each probe's stacks as bpftrace prints `@[ustack] = count()`: a frame a line, the count
    (`sums`: the value's sum) after, the most last (a blank line first, `after_counts`); only the
    `top` most of each probe, if given, after a line saying what is left out."""
    lines: list[str] = []
    for tally in shown.tallies:
        counts = tally.probe.stack_sums if sums else tally.probe.stacks
        ordered = sorted(counts.items(), key=lambda item: item[1])
        if top is not None and len(ordered) > top:
            left = ordered[:-top]
            total = sum(c for _, c in left)
            what = f"summing {total}" if sums else f"{total} hits"
            lines.append(f"  ({len(left)} more stacks of {tally.probe.name}, {what}, not shown: --top-stacks {top})")
            ordered = ordered[-top:]
        for stack, count in ordered:
            lines += [f"{tally.probe.name}[", *(f"        {line}" for line in str(stack).splitlines()), f"]: {count}"]
        if tally.missed:
            lines.append(f"  ({tally.missed} hits of {tally.probe.name} not counted by stack: its table was full)")
    if lines:
        write_report(out, ["", *lines] if after_counts else lines)


def print_folded(shown: Shown, out: TextIO, *, sums: bool = False) -> None:
    """Folded stacks: a line a stack, its functions (or addresses) outermost first joined by
    ';', a space, its count (`sums`: the value's sum); the same call path from different call
    sites adds up."""
    folded: Counter[str] = Counter()
    for tally in shown.tallies:
        for stack, count in (tally.probe.stack_sums if sums else tally.probe.stacks).items():
            folded[";".join(f.function or f"{f.address:#x}" for f in reversed(stack.frames))] += count
    # (a flame graph draws sizes: a sum of 0 or less has none)
    write_report(out, [f"{path} {count}" for path, count in sorted(folded.items()) if count > 0])
    for tally in shown.tallies:  # (not in the folded lines: flamegraph.pl would take it for a stack)
        if tally.missed:
            print(f"dynprobe: {tally.missed} hits of {tally.probe.name} are not in the folded stacks: the table of "
                  "stacks was full", file=sys.stderr)  # fmt: skip


def run_stacks(args: argparse.Namespace, command: list[str]) -> int:
    """`dynprobe stacks`: `count --by stack` printing the stacks alone."""
    try:
        request = check_request(args)
        for spec in request.specs if args.value is not None else ():
            parse_value(args.value, spec.args)  # (before the program is touched)
    except DynprobeError as exc:
        return report_error(exc)
    if args.folded and args.top_stacks is not None:
        return report_error(DynprobeError("--top-stacks is for stacks printed whole, not --folded"))

    def report(shown: Shown, out: TextIO) -> None:
        if args.folded:
            print_folded(shown, out, sums=args.value is not None)
        else:
            print_stacks(shown, out, sums=args.value is not None, top=args.top_stacks)

    return run_aggregating(
        args, command, request,
        lambda session, spec: session.probe(spec, action="count", filter=request.filter, by="stack",
                                            max_frames=args.max_frames, value=args.value),
        report,
    )  # fmt: skip


def run(args: argparse.Namespace, command: list[str]) -> int:
    try:
        request = check_request(args)
    except DynprobeError as exc:
        return report_error(exc)
    if args.by is None and (args.max_frames != MAX_FRAMES or args.top_stacks is not None):
        option = "--max-frames" if args.max_frames != MAX_FRAMES else "--top-stacks"
        return report_error(DynprobeError(f"{option} is for --by stack"))

    def report(shown: Shown, out: TextIO) -> None:
        print_counts(shown, out)
        if args.by == "stack" and shown.title in (None, "total:"):
            print_stacks(shown, out, after_counts=True, top=args.top_stacks)

    return run_aggregating(
        args, command, request,
        lambda session, spec: session.probe(spec, action="count", filter=request.filter, by=args.by,
                                            max_frames=args.max_frames),
        report,
    )  # fmt: skip
