"""`dynprobe trace`: print one ftrace-format line (or JSON line) per probe hit.

Each probe records its fetch arguments in the target (optimized: no stop per hit) and the
consumer prints the records; `--trap` keeps every probe a trap probe instead."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from typing import TextIO

from dynprobe.cli.common import (
    add_output_option,
    add_target_options,
    close_output,
    open_output,
    open_session,
    output_name,
    report_error,
    run_target,
)
from dynprobe.cli.probes import (
    ProbeRequest,
    add_max_frames_option,
    add_probe_options,
    add_ring_options,
    check_request,
    note_missed_returns,
    note_never_placed,
    note_rings,
    note_traps,
    place_all,
    print_stats,
    say_placed,
)
from dynprobe.core.probe import BatchHandler, EventColumns, Probe
from dynprobe.core.session import Session
from dynprobe.core.stacks import MAX_FRAMES
from dynprobe.errors import DynprobeError
from dynprobe.output.ftrace import ftrace_lines, json_lines

EXAMPLES = """\
examples:
  dynprobe trace 'p:app/add add a=%di b=%si:s32' -- ./app 10
  dynprobe trace 'p libc:malloc size=%di:u64' 'p libc:free ptr=%di' -p 1234
  dynprobe trace 'p /usr/bin/bash:0x5a0d0 cmd=+0(%di):string' --json -o out.jsonl -p $(pgrep -n bash)
  dynprobe trace 'p:app/rd read_block n=%si:u32' --filter 'n > 4096' -- ./app
  dynprobe trace -f probes.txt --stats -- ./server --port 8080
  dynprobe trace --flight-recorder 'p libc:malloc size=%di' -o last.txt -p 1234
                             the newest events only: at the end, and at each kill -USR2 DYNPROBE_PID

Probe syntax (as tracefs uprobe_events; SYMBOL may be a glob: 'p libc:str*'):
  p[:[GRP/]EVENT] [PATH:]SYMBOL[+OFFS]|PATH:0xFILEOFFSET [NAME=]FETCHARG[:TYPE] ...
  r[MAXACTIVE][:[GRP/]EVENT] [PATH:]SYMBOL [NAME=]FETCHARG[:TYPE] ...      (at the return)
  FETCHARG: %REG  @ADDR  @SYM[+|-OFFS]  $stackN  $stack  $argN  $comm  +|-OFFS(FETCHARG)
            $retval  $latency (return probes)
  TYPE: u8..u64 s8..s64 x8..x64 string ustring symbol
Filter: NAME OP NUMBER joined with and/or (OP: == != < <= > >=); NAME is a fetch argument's name.
"""


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "trace", help="print an event line per probe hit",
        description="Place probes and print one line per hit, in the ftrace trace format.",
        epilog=EXAMPLES,
    )  # fmt: skip
    add_probe_options(p)
    p.add_argument("--json", action="store_true", help="print JSON lines instead of ftrace lines")
    p.add_argument("--stack", action="store_true",
                   help="each event followed by its stack (walked in the target), ` => function+0xoff (module)` "
                        "a line, as ftrace prints user stacks")  # fmt: skip
    add_max_frames_option(p, "--stack")
    add_output_option(p, "the events")
    add_ring_options(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no summary on stderr")
    add_target_options(p)
    p.set_defaults(run=run)


class EventPrinter(BatchHandler):
    """The `on_event` handler of every traced probe: one line per event. The consumer thread
    hands it each drain's events (optimized and trap probes alike), formatted a column at a
    time and printed in time order."""

    def __init__(self, out: TextIO, as_json: bool, *, flush: bool = False) -> None:
        self.out = out
        self.flush = flush  # each delivery flushed: a flight recorder's snapshot is in the file once taken
        self.format = json_lines if as_json else ftrace_lines
        self.lines = 0
        self.broken = False
        self.failure: str | None = None  # why the output could not be written (a full disk)
        self.on_failure: Callable[[], object] | None = None

    def on_batches(self, batches: list[EventColumns]) -> None:
        lines = [line for columns in batches for line in self.format(columns)]
        if len(batches) > 1:
            keys = [key for columns in batches for key in zip(columns.time_ns, columns.orders(), strict=True)]
            lines = [lines[i] for i in sorted(range(len(lines)), key=keys.__getitem__)]
        if self.broken or self.failure or not lines:
            return
        try:
            self.out.write("\n".join(lines) + "\n")
            if self.flush:
                self.out.flush()
        except BrokenPipeError:
            self.broken = True  # `| head`: keep tracing quietly until the target ends
        except OSError as exc:
            self.failed(exc)
        self.lines += len(lines)

    def failed(self, exc: OSError) -> None:
        """The output cannot be written: the first failure stops the session (`on_failure`)."""
        if self.failure is None:
            self.failure = exc.strerror or str(exc)
            if self.on_failure is not None:
                self.on_failure()


def trace(session: Session, request: ProbeRequest, printer: EventPrinter, *, stack: bool, max_frames: int
          ) -> list[Probe]:  # fmt: skip
    """Place the probes; with `stack`, each event carries its stack (at most `max_frames`)."""
    by = "stack" if stack else None
    return place_all(session, request, lambda spec: session.probe(
        spec, on_event=printer, filter=request.filter, by=by, max_frames=max_frames))  # fmt: skip


def run(args: argparse.Namespace, command: list[str]) -> int:
    try:
        request = check_request(args)
        if args.max_frames != MAX_FRAMES and not args.stack:
            raise DynprobeError("--max-frames is for --stack")
        out = open_output(args.output)
    except DynprobeError as exc:
        return report_error(exc)
    printer = EventPrinter(out, args.json, flush=request.flight_recorder)
    status: int | None = None
    try:
        with open_session(args, command) as session:
            printer.on_failure = session.request_stop
            probes = trace(session, request, printer, stack=args.stack, max_frames=args.max_frames)
            status = run_target(session, ready=lambda: say_placed(probes, args.pid))
            session.close()
            try:
                out.flush()
            except OSError as exc:
                printer.failed(exc)
            if printer.failure is not None:
                print(f"dynprobe: error: cannot write {output_name(args.output)}: {printer.failure}: tracing "
                      f"stopped, the program let go; {printer.lines} events written", file=sys.stderr)  # fmt: skip
                return 1
            if not args.quiet:
                print_stats(probes, args.stats)
                if not args.stats and not request.trap:
                    note_traps(probes)
                note_missed_returns(probes)
                note_never_placed(probes)
                note_rings(session)
    except DynprobeError as exc:
        return report_error(exc)
    finally:
        with contextlib.suppress(OSError):  # (a failure to write is said above)
            close_output(out)
    if args.pid is not None:
        return 0
    return status if status is not None else 130
