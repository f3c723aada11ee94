"""`dynprobe trace`: print one ftrace-format line (or JSON line) per probe hit."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import TextIO

from dynprobe.cli.common import add_target_options, interruptible, open_session, report_error
from dynprobe.core.probe import Hit, Probe
from dynprobe.core.session import Session, print_warning
from dynprobe.errors import DynprobeError
from dynprobe.output.ftrace import EventLine, ftrace_line, json_line
from dynprobe.ptrace.process import thread_cpu
from dynprobe.spec.fetch import json_value
from dynprobe.spec.parser import parse_probe

EXAMPLES = """\
examples:
  dynprobe trace 'p:app/add add a=%di b=%si:s32' -- ./app 10
  dynprobe trace 'p libc:malloc size=%di:u64' 'p libc:free ptr=%di' -p 1234
  dynprobe trace 'p /usr/bin/bash:0x5a0d0 cmd=+0(%di):string' --json -o out.jsonl -p $(pgrep -n bash)
  dynprobe trace -f probes.txt -- ./server --port 8080

Probe syntax (as tracefs uprobe_events):
  p[:[GRP/]EVENT] [PATH:]SYMBOL[+OFFS]|PATH:0xFILEOFFSET [NAME=]FETCHARG[:TYPE] ...
  FETCHARG: %REG  @ADDR  @SYM[+|-OFFS]  $stackN  $stack  $argN  $comm  +|-OFFS(FETCHARG)
  TYPE: u8..u64 s8..s64 x8..x64 string ustring symbol
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "trace", help="print an event line per probe hit",
        description="Place probes and print one line per hit, in the ftrace trace format.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("specs", nargs="*", metavar="SPEC", help="probe specifications")
    p.add_argument(
        "-f",
        "--file",
        action="append",
        default=[],
        metavar="SPECFILE",
        help="read probe specifications from a file, one per line ('#' starts a comment)",
    )
    p.add_argument("--json", action="store_true", help="print JSON lines instead of ftrace lines")
    p.add_argument("-o", "--output", metavar="FILE", help="write events to FILE instead of stdout")
    p.add_argument("--trap", action="store_true", help="force trap mode (the only mode so far)")
    p.add_argument("-q", "--quiet", action="store_true", help="no summary on stderr")  # fmt: skip
    add_target_options(p)
    p.set_defaults(run=run)


def read_spec_files(paths: list[str]) -> list[str]:
    specs: list[str] = []
    for path in paths:
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError as exc:
            raise DynprobeError(f"cannot read spec file {path}: {exc.strerror}") from exc
        specs.extend(s for line in lines if (s := line.split("#", 1)[0].strip()))
    return specs


class EventPrinter:
    """The pre-handler of every traced probe: formats the hit and writes a line."""

    def __init__(self, out: TextIO, as_json: bool) -> None:
        self.out = out
        self.as_json = as_json
        self.lines = 0

    def __call__(self, hit: Hit) -> None:
        values = hit.fetch()
        probe = hit.probe
        from dynprobe.spec.fetch import format_value

        formatted = [(a.name, format_value(values[a.name], a.type, hit.context.symbolize)) for a in probe.args]
        event = EventLine(
            hit.comm(), hit.pid, hit.tid, thread_cpu(hit.pid, hit.tid), hit.time, probe.group, probe.event,
            hit.address, formatted, {k: json_value(v) for k, v in values.items()},
        )  # fmt: skip
        self.out.write((json_line(event) if self.as_json else ftrace_line(event)) + "\n")
        self.lines += 1


def print_summary(session: Session, probes: list[Probe]) -> None:
    if not probes:
        return
    width = max(len(p.name) for p in probes)
    print(f"dynprobe: {len(probes)} probe(s)", file=sys.stderr)
    for p in probes:
        paths = ", ".join(f"{k.value} {n}" for k, n in sorted(p.resumes.items(), key=lambda kv: kv[0].value))
        where = f"{p.location.basename}:{p.location.label}"
        print(f"  {p.name:<{width}}  {where:<28} mode={p.mode.value} hits={p.hits} missed={p.nmissed}"
              + (f"  ({paths})" if paths else ""), file=sys.stderr)  # fmt: skip


def run(args: argparse.Namespace, command: list[str]) -> int:
    try:
        specs = [parse_probe(s) for s in list(args.specs) + read_spec_files(args.file)]
        if not specs:
            return report_error(DynprobeError("no probe given: add a SPEC or -f SPECFILE"))
        out: TextIO = open(args.output, "w") if args.output else sys.stdout  # noqa: SIM115
    except DynprobeError as exc:
        return report_error(exc)
    except OSError as exc:
        return report_error(DynprobeError(f"cannot write {args.output}: {exc.strerror}"))
    printer = EventPrinter(out, args.json)
    status: int | None = None
    try:
        with open_session(args, command) as session:
            session.on_warning = print_warning
            probes = [session.probe(spec, pre=printer) for spec in specs]
            with interruptible(session):
                try:
                    status = session.run()
                except BrokenPipeError:
                    status = None
            session.close()
            if not args.quiet:
                print_summary(session, probes)
    except DynprobeError as exc:
        return report_error(exc)
    finally:
        if out is not sys.stdout:
            out.close()
        else:
            with contextlib.suppress(BrokenPipeError):
                out.flush()
    if args.pid is not None:
        return 0
    return status if status is not None else 130
