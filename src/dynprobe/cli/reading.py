"""The commands that read a trace directory back: `replay` (the call graph), `report` (time per
function), `graph` (call paths merged), `dump --perfetto | --chrome | --flame`. Apart from
`record`, so that reading a trace never loads the tracing engine; `record` and `live` share its
filter options."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TextIO

from dynprobe.cli.common import UsageError, add_demangle_option, close_output, exit_code, open_output, report_error
from dynprobe.errors import DynprobeError
from dynprobe.output import callgraph, timeline
from dynprobe.output.callfilter import CallFilter, Trigger
from dynprobe.symbols.patterns import MatchKind, NamePattern
from dynprobe.tracefile import EVENTS, TraceFile

DEFAULT_DIR = "dynprobe.data"
READING_EXAMPLES = {
    "replay": """\
examples:
  dynprobe replay                          the call graph of dynprobe.data, with durations
  dynprobe replay parse.data --tid 4242    one thread's
  dynprobe replay -F main -D 2 -N 'log_.*'
                                           main's calls two deep, without log_* and their callees
  dynprobe replay --demangle full | less
  dynprobe replay -f time,tid,elapsed      uftrace's columns: time stamps, time since the first event
  dynprobe replay -f none --no-args        calls alone (to diff two runs)
""",
    "report": """\
examples:
  dynprobe report                          per function: total, self, calls, average
  dynprobe report -s self -t 10us          by self time, counting calls of 10 us or more
  dynprobe report parse.data -o report.txt
""",
    "graph": """\
examples:
  dynprobe graph                           every call path of dynprobe.data, with calls and total time
  dynprobe graph parse -d parse.data       what led to parse, and what parse calls
""",
    "dump": """\
examples:
  dynprobe dump --perfetto -o trace.pftrace  open in ui.perfetto.dev (Perfetto's own format)
  dynprobe dump --chrome -o trace.json     open in ui.perfetto.dev or chrome://tracing
  dynprobe dump --flame | flamegraph.pl > flame.svg
""",
}


def parse_time(text: str) -> int:
    """'10us', '1.5ms', '2s', '500' (ns) -> nanoseconds."""
    for unit, scale in (("ns", 1), ("us", 10**3), ("ms", 10**6), ("s", 10**9)):
        if text.endswith(unit):
            text, factor = text[: -len(unit)], scale
            break
    else:
        factor = 1
    try:
        value = float(text) * factor
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a time: {text!r} (e.g. 500ns, 10us, 1.5ms)") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"a time is 0 or more, finite and under 2^63 ns, not {text!r}")
    return int(value)


def add_filter_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-F", "--filter", action="append", default=[], metavar="FUNC",
                   help="only FUNC's calls and the calls under them (as uftrace's -F)")  # fmt: skip
    p.add_argument("-N", "--notrace", action="append", default=[], metavar="FUNC",
                   help="leave out FUNC's calls and the calls under them")  # fmt: skip
    p.add_argument("-C", "--caller-filter", dest="callers", action="append", default=[], metavar="FUNC",
                   help="only FUNC's calls and the calls that led to them")  # fmt: skip
    p.add_argument("-T", "--trigger", dest="triggers", action="append", default=[], type=_trigger,
                   metavar="FUNC@ACTIONS", help="at FUNC's calls: depth=N (calls under it at most N deep), "
                   "trace_on, trace_off (showing starts, stops), filter, notrace (-F, -N), backtrace (replay shows "
                   "the calls it is under), finish (the trace ends at its first call); with commas")  # fmt: skip
    p.add_argument("--disable", action="store_true", help="show nothing until a trace_on trigger")
    p.add_argument("-D", "--depth", type=int, metavar="N",
                   help="calls at most N deep, counted from the nearest -F call (else the outermost)")  # fmt: skip
    p.add_argument("--match", choices=[k.value for k in MatchKind], default=MatchKind.REGEX.value,
                   help="FUNC is a regular expression found in the name (default, as in uftrace) or a glob of the "
                   "whole name; a name without special characters is that function; FUNC@MODULE: only MODULE's "
                   "functions (alloc.*@libc, main@app)")  # fmt: skip


_ACTIONS = ("trace_on", "traceon", "trace_off", "traceoff", "filter", "notrace", "backtrace", "finish")


def _trigger(text: str) -> tuple[str, list[str]]:
    """'FUNC@ACTION,ACTION' (FUNC may itself name its module: malloc@libc@trace_off)."""
    func, at, actions = text.rpartition("@")
    given = actions.split(",") if at and func else []
    for action in given:
        name, _, value = action.partition("=")
        if not (action in _ACTIONS or (name == "depth" and value.isdigit() and int(value) >= 1)):
            raise argparse.ArgumentTypeError(
                f"not a trigger: {text!r} (FUNC@ACTIONS, the actions among depth=N, trace_on, trace_off, filter, "
                "notrace, backtrace, finish)"
            )
    if not given:
        raise argparse.ArgumentTypeError(f"not a trigger: {text!r} (FUNC@ACTIONS, e.g. parse@depth=2,trace_on)")
    return func, given


def call_filter(args: argparse.Namespace) -> CallFilter:
    """-F, -N, -C, -T, --disable, -D (and a reader's -r) as the readers apply them (a bad pattern
    or depth: a one-line error)."""
    if args.depth is not None and args.depth < 1:
        raise UsageError(f"-D {args.depth}: a depth is 1 or more")
    kind = MatchKind(args.match)
    include, exclude, triggers = list(args.filter), list(args.notrace), []
    for func, actions in args.triggers:
        include += [func] if "filter" in actions else []
        exclude += [func] if "notrace" in actions else []
        depth = next((int(a.partition("=")[2]) for a in actions if a.startswith("depth=")), None)
        on, off = bool({"trace_on", "traceon"} & set(actions)), bool({"trace_off", "traceoff"} & set(actions))
        backtrace, finish = "backtrace" in actions, "finish" in actions
        if depth is not None or on or off or backtrace or finish:
            triggers.append(Trigger(NamePattern(func, kind), depth, on, off, backtrace, finish))
    return CallFilter(
        tuple(NamePattern(t, kind) for t in include), tuple(NamePattern(t, kind) for t in exclude),
        args.depth, tuple(NamePattern(t, kind) for t in args.callers), args.time_range,
        tuple(triggers), args.disable,
    )  # fmt: skip


def _time_range(text: str) -> tuple[int | None, int | None]:
    """'START~STOP' (either may be left out), times since the trace's first event: '10ms~20ms'."""
    start, tilde, stop = text.partition("~")
    if not tilde or not (start or stop):
        raise argparse.ArgumentTypeError(f"not a time range: {text!r} (START~STOP, e.g. 10ms~1.5s, 2s~, ~500us)")
    return (parse_time(start) if start else None, parse_time(stop) if stop else None)


def _add_reading_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE, created new, instead of the standard output")
    p.add_argument("--tid", type=int, action="append", default=[], metavar="TID", help="only this thread (repeatable)")
    p.add_argument("-r", "--time-range", type=_time_range, metavar="START~STOP",
                   help="only what happened from START to STOP after the first event (10ms~1.5s, 2s~)")  # fmt: skip
    add_filter_options(p)
    add_demangle_option(p)


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for name, help_text in (("replay", "print the call graph of a trace"), ("report", "time per function of a trace")):
        q = sub.add_parser(
            name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".",
            epilog=READING_EXAMPLES[name],
        )  # fmt: skip
        q.add_argument("directory", nargs="?", default=DEFAULT_DIR, metavar="DIR")
        if name == "report":
            q.add_argument(
                "-s",
                "--sort",
                choices=callgraph.SORT_KEYS,
                default="total",
                metavar="KEY",
                help=f"sort by a field, largest first, or by name: {', '.join(callgraph.SORT_KEYS)}",
            )
            q.add_argument("-f", "--output-fields", dest="fields", metavar="FIELDS",
                           type=_field_option(callgraph.parse_report_fields), default=callgraph.DEFAULT_REPORT_FIELDS,
                           help=f"the columns, as uftrace's: among {', '.join(callgraph.REPORT_FIELDS)} "
                           "(comma-separated; +FIELD: added to total,self,call)")  # fmt: skip
            q.add_argument("-t", "--threshold", type=parse_time, default=0, metavar="TIME",
                           help="count only calls of TIME or more (10us, 1ms)")  # fmt: skip
        else:
            q.add_argument("-f", "--output-fields", dest="fields", metavar="FIELDS",
                           type=_field_option(callgraph.parse_fields), default=callgraph.DEFAULT_FIELDS,
                           help=f"the columns before each call, as uftrace's: among "
                           f"{', '.join(callgraph.FIELDS)} (comma-separated; +FIELD: added to duration,tid), "
                           "or none")  # fmt: skip
            q.add_argument("--no-args", dest="values", action="store_false",
                           help="leave out the arguments and return values calls recorded (-A, -R)")  # fmt: skip
        _add_reading_options(q)
        q.set_defaults(run=run_replay if name == "replay" else run_report)
    g = sub.add_parser(
        "graph", help="the call graph of a trace, or of one function, as uftrace's graph",
        description="The call paths of every thread merged in one tree, with calls and total time; "
        "with a FUNCTION, the paths that led to it (backtraces) and the tree of its calls.",
        epilog=READING_EXAMPLES["graph"],
    )  # fmt: skip
    g.add_argument("function", nargs="?", metavar="FUNCTION", help="one function's calls (default: the program's)")
    g.add_argument("-d", "--data", dest="directory", default=DEFAULT_DIR, metavar="DIR",
                   help=f"the trace directory (default {DEFAULT_DIR})")  # fmt: skip
    _add_reading_options(g)
    g.set_defaults(run=run_graph)
    d = sub.add_parser(
        "dump", help="convert a trace for other tools", description="Convert a trace directory.",
        epilog=READING_EXAMPLES["dump"],
    )  # fmt: skip
    d.add_argument("directory", nargs="?", default=DEFAULT_DIR, metavar="DIR")
    form = d.add_mutually_exclusive_group(required=True)
    form.add_argument("--perfetto", action="store_true", help="Perfetto's protobuf trace (ui.perfetto.dev): binary, "
                      "so to -o FILE or a pipe")  # fmt: skip
    form.add_argument("--chrome", action="store_true", help="Trace Event JSON (Perfetto UI, chrome://tracing)")
    form.add_argument("--flame", action="store_true", help="folded stacks with self time in ns (flamegraph.pl)")
    _add_reading_options(d)
    d.set_defaults(run=run_dump)


@contextlib.contextmanager
def _trace(args: argparse.Namespace) -> Iterator[TraceFile]:
    trace = TraceFile(args.directory, args.demangle, args.tid)
    if not trace.complete:
        print(f"dynprobe: warning: {args.directory} was not closed (the recording was cut short)", file=sys.stderr)
    yield trace
    if trace.rejected:
        print(f"dynprobe: warning: {trace.rejected} records left out: a function id past the trace's table or a "
              "time outside the recording (written by the traced program itself?)", file=sys.stderr)  # fmt: skip
    if trace.truncated_at is not None:
        print(
            f"dynprobe: warning: {args.directory}/{EVENTS} is truncated: read up to byte {trace.truncated_at}",
            file=sys.stderr,
        )


def threshold(trace: TraceFile, args: argparse.Namespace) -> int:
    """The record's threshold, or a longer one asked for by `report -t`."""
    return max(int(trace.info.get("threshold_ns") or 0), int(getattr(args, "threshold", 0)))


def _field_option(parse: Callable[[str], tuple[str, ...]]) -> Callable[[str], tuple[str, ...]]:
    """An argparse type of a -f option: `parse`'s fields, its error as argparse's."""

    def fields(text: str) -> tuple[str, ...]:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return fields


def run_replay(args: argparse.Namespace, command: list[str]) -> int:
    return show_trace(args, command, lambda t, out, f: callgraph.replay(t, out, threshold(t, args), f, args.fields,
                                                                   args.values))  # fmt: skip


def run_report(args: argparse.Namespace, command: list[str]) -> int:
    return show_trace(args, command, lambda t, out, f: callgraph.report(t, out, args.sort, threshold(t, args), f,
                                                                   args.fields))  # fmt: skip


def run_graph(args: argparse.Namespace, command: list[str]) -> int:
    def show(trace: TraceFile, out: TextIO, filters: CallFilter) -> None:
        if not callgraph.graph(trace, out, args.function, filters) and args.function is not None:
            raise DynprobeError(f"no call of {args.function} in {args.directory}")

    return show_trace(args, command, show)


def run_dump(args: argparse.Namespace, command: list[str]) -> int:
    if args.perfetto:
        return show_trace(args, command, _perfetto)
    return show_trace(args, command, timeline.dump_chrome if args.chrome else callgraph.dump_flame)


def _perfetto(trace: TraceFile, out: TextIO, filters: CallFilter) -> None:
    """Perfetto's trace is bytes: on the output's binary stream, never on a terminal."""
    if out.isatty():
        raise UsageError("dump --perfetto writes a binary trace: give -o FILE (trace.pftrace), or redirect the output")
    out.flush()
    timeline.dump_perfetto(trace, out.buffer, filters)


def show_trace(
    args: argparse.Namespace,
    command: list[str],
    show: Callable[[TraceFile, TextIO, CallFilter], object],
    *,
    default: TextIO = sys.stdout,
    filters: CallFilter | None = None,
) -> int:
    """Read a trace directory and `show` it, filtered by `filters` (default: the command's -F,
    -N, -C, -T, -D, -r), on -o FILE, or `default`: the standard output for `replay`, `report`,
    `graph` and `dump`, which run no program."""
    if command:
        return report_error(UsageError("reading a trace runs no command"))
    output: str | None = args.output

    def read_and_show() -> int:
        with _trace(args) as trace:
            out = default if output is None else open_output(output)
            try:
                show(trace, out, call_filter(args) if filters is None else filters)
            finally:
                close_output(out)
        return 0

    return exit_code(read_and_show, output, default)
