"""`dynprobe record` (the function tracer into a trace directory) and `live` (record, then replay);
the commands that read a trace back are cli/reading.py's."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import tempfile
from typing import TYPE_CHECKING

from dynprobe.cli.common import (
    add_demangle_option,
    add_output_option,
    add_target_options,
    byte_size,
    open_session,
    report_error,
    run_target,
)
from dynprobe.cli.probes import PROGRESS_FROM, RING_WAS_FULL, add_ring_options, note_rings, progress_bar, set_ring_mode
from dynprobe.cli.reading import DEFAULT_DIR, add_filter_options, call_filter, parse_time, show_trace, threshold
from dynprobe.core.ftrace import ValueRequest
from dynprobe.errors import DynprobeError, OptimizeRefusal, Refusal, SessionError
from dynprobe.output import callgraph, files
from dynprobe.output.callfilter import CallFilter
from dynprobe.spec.argspec import AUTO_VALUES, ArgSpecError, parse_values
from dynprobe.symbols.elf import load_elf
from dynprobe.symbols.patterns import MatchKind, NamePattern
from dynprobe.tracefile import EVENTS, INFO, create_trace_directory, remove_trace_directory, write_info

if TYPE_CHECKING:
    from dynprobe.core.ftrace import FunctionTracer
    from dynprobe.core.session import Session

RECORD_EXAMPLES = """\
examples:
  dynprobe record -- ./app input.txt                 every function of ./app, into dynprobe.data/
  dynprobe record -F parse -N 'debug_.*' -o parse.data -- ./app     parse's calls, all under them
  dynprobe record --lib libz -P 'deflate.*@libz' -P main -p 1234    only these patched; Ctrl-C stops
  dynprobe record -A 'parse@arg1/s,arg2' -R parse@retval -a -- ./app   values, as uftrace: parse("x", 2) = 0;
  dynprobe record --flight-recorder --ring-size 4M -p 1234    the newest calls: Ctrl-C, or kill -USR2 DYNPROBE_PID
  dynprobe record --flight-recorder --threshold 100ms -p 1234   and what led up to each call of 100 ms or more
then: dynprobe replay | report | dump --perfetto or --chrome (Perfetto UI) | dump --flame (flamegraph.pl)
"""
LIVE_EXAMPLES = """\
examples:
  dynprobe live -- ./app input.txt                   the call graph on the standard error
  dynprobe live -F parse -D 3 --threshold 10us -o calls.txt -- ./app
  dynprobe live -d app.data -- ./app                 and keep the trace for report, dump
"""


def _add_record_options(p: argparse.ArgumentParser, *, live: bool) -> None:
    if live:
        p.add_argument("-d", "--data", metavar="DIR",
                       help="keep the trace in DIR (default: a temporary directory, removed after)")  # fmt: skip
        add_output_option(p, "the call graph")
    else:
        p.add_argument("-o", "-d", "--output", "--data", dest="data", default=DEFAULT_DIR, metavar="DIR",
                       help=f"the trace directory (default {DEFAULT_DIR})")  # fmt: skip
    p.add_argument("-P", "--patch", action="append", default=[], metavar="FUNC",
                   help="patch only the functions FUNC names (all if none): the others run untouched")  # fmt: skip
    p.add_argument("-U", "--unpatch", action="append", default=[], metavar="FUNC",
                   help="do not patch the functions FUNC names")  # fmt: skip
    add_filter_options(p)
    p.add_argument("--no-libcall", dest="libcall", action="store_false",
                   help="leave out the program's calls to library functions (shown by default, as uftrace shows "
                   "them: `malloc();` where the program calls it)")  # fmt: skip
    p.add_argument(
        "--nest-libcall",
        action="store_true",
        help="also the calls its libraries make to library functions (operator new() { malloc(); })",
    )
    p.add_argument(
        "--lib",
        action="append",
        default=[],
        metavar="NAME",
        help="trace this library's functions too (libz, /path/lib.so)",
    )
    p.add_argument("--ring-size", type=byte_size, default=1 << 25, metavar="BYTES",
                   help="per-thread ring buffer size, a power of two (default 32M)")  # fmt: skip
    add_ring_options(p)
    p.add_argument("--threshold", type=parse_time, default=0, metavar="TIME",
                   help="leave out calls shorter than TIME (10us, 1ms): not recorded at all; with "
                   "--flight-recorder, every call is kept and one that lasts TIME or more takes a snapshot: "
                   "what led up to it is written at once")  # fmt: skip
    p.add_argument("-A", "--argument", dest="arguments", action="append", default=[], metavar="FUNC@ARGS",
                   help="record FUNC's arguments, as uftrace: arg1,arg2/s,fparg1 (formats d i u x o c s f, "
                   "a size in bits: arg1/x32; a place: arg1%%r12, arg7%%stack+1)")  # fmt: skip
    p.add_argument("-R", "--retval", dest="retvals", action="append", default=[], metavar="FUNC@retval",
                   help="record FUNC's return value (retval, retval/s, retval/x32, retval/f)")  # fmt: skip
    p.add_argument("-a", "--auto-args", action="store_true",
                   help="record the arguments and return values of known library functions (malloc, "
                   "strcmp, printf, ...)")  # fmt: skip
    add_target_options(p, follow=True)
    p.set_defaults(time_range=None)  # (-r is a reader's)


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "record", help="trace every function's entry and exit into a trace directory",
        description="The function tracer: entries and exits of the functions of the program (and the "
        "named libraries), recorded in the target and written to a trace directory.",
        epilog=RECORD_EXAMPLES,
    )  # fmt: skip
    _add_record_options(p, live=False)
    p.set_defaults(run=run_record)
    live = sub.add_parser(
        "live", help="record and replay in one go",
        description="Record (as `record`) into a temporary directory, then replay it: the call graph on "
        "the standard error (or -o FILE), apart from the program's own output.",
        epilog=LIVE_EXAMPLES,
    )  # fmt: skip
    _add_record_options(live, live=True)
    add_demangle_option(live)
    live.set_defaults(run=run_live)


def _why(reason: str) -> str:
    """A reason code of Tracing.not_patched, explained."""
    for codes in (Refusal, OptimizeRefusal):
        if reason in codes.__members__:
            return f"{codes[reason].value} [{reason}]"
    return reason


FEW_FUNCTIONS = 10
_RUNTIME = ("libc.so", "libm.so", "libpthread.so", "libdl.so", "librt.so", "libgcc_s.so", "libstdc++.so", "ld-linux")


def _hint_libraries(exe: str) -> None:
    """A program whose code is in its libraries (a Python built with --enable-shared): say which."""
    if sum(1 for f in load_elf(exe).functions if f.size) >= FEW_FUNCTIONS:
        return
    needed = [name.split(".so")[0] for name in load_elf(exe).needed if not name.startswith(_RUNTIME)]
    if needed:
        libs = " ".join(f"--lib {name}" for name in needed)
        print(f"dynprobe: {os.path.basename(exe)} has few functions of its own; its code may be in the "
              f"libraries it loads: {libs}", file=sys.stderr)  # fmt: skip


def _note_libraries_not_loaded(session: Session, tracer: FunctionTracer) -> None:
    """Libraries whose functions wait for the loader to map them, which the program does not
    load at start: traced only if it loads them later (dlopen). Say so, rather than record
    nothing without a word (`--lib libz` for a program that does not use it)."""
    proc = session.process(session.pid)
    waiting = tracer.unmapped.get(session.pid, set())
    if proc is None or not waiting:
        return
    at_start = {os.path.realpath(path) for path in proc.libraries().values()}
    for path in sorted({f.path for f in tracer.functions if f.id in waiting}):
        if os.path.realpath(path) not in at_start:
            print(f"dynprobe: {os.path.basename(path)} is not a library {os.path.basename(proc.exe)} loads at start: "
                  "its functions are traced if the program loads it later (dlopen)", file=sys.stderr)  # fmt: skip


def _function_table(session: Session, tracer: FunctionTracer, filters: CallFilter) -> dict[str, object]:
    """The trace's functions (by id) and their files, the ids -F and -N name and the values
    functions record: they grow when a followed process execs another program."""
    functions = session.traced_functions
    table: list[list[object]] = [[f.name, os.path.basename(f.path), f.vaddr, f.size, f.plt] for f in functions]
    return {
        "functions": table,
        "modules": [
            {"path": path, "build_id": load_elf(path).build_id} for path in sorted({f.path for f in functions})
        ],
        "filters": filters.to_info(table) if filters else None,
        "captures": {
            str(fid): [[v.text for v in c.arguments], [v.text for v in c.retval]] for fid, c in tracer.captures.items()
        },
    }


def _value_requests(args: argparse.Namespace, kind: MatchKind) -> list[ValueRequest]:
    """-a's table, then -A and -R: 'FUNC@VALUES', VALUES comma-separated (a MODULE among them
    qualifies FUNC, as uftrace's -A malloc@libc,arg1)."""
    requests = []
    if args.auto_args:
        for name, texts in AUTO_VALUES.items():
            for text, retval in zip(texts, (False, True), strict=True):
                if text:
                    requests.append(ValueRequest(NamePattern(name), tuple(parse_values(text, retval=retval)), True))
    for given, retval in [(a, False) for a in args.arguments] + [(r, True) for r in args.retvals]:
        func, at, rest = given.partition("@")
        if not at or not func:
            option = "-R" if retval else "-A"
            raise ArgSpecError(f"{option} {given!r}: give FUNC@{'retval' if retval else 'arg1,arg2/s'}")
        items = [item.strip() for item in rest.split(",")]
        modules = [item for item in items if item and not re.match(r"(fp)?arg[0-9]|retval", item)]
        values = parse_values(",".join(i for i in items if i not in modules), retval=retval)
        patterns = [NamePattern(f"{func}@{module}", kind) for module in modules] or [NamePattern(func, kind)]
        requests += [ValueRequest(pattern, tuple(values)) for pattern in patterns]
    return requests


def run_record(args: argparse.Namespace, command: list[str]) -> int:
    out = args.data
    status: int | None = None
    try:
        filters = call_filter(args)
        kind = MatchKind(args.match)
        patch = tuple(NamePattern(t, kind) for t in args.patch)
        unpatch = tuple(NamePattern(t, kind) for t in args.unpatch)
        requests = _value_requests(args, kind)
        create_trace_directory(out)  # before the target is touched: a bad -o is said at once
    except DynprobeError as exc:
        return report_error(exc)
    # Under -F (or a depth trigger), depth counts from the nearest -F call (or the trigger's),
    # which only a reader knows; without, the target leaves out what is deeper (it counts its
    # traced calls).
    depth = args.depth if filters.depth_from_outermost else None
    # A flight recorder's threshold keeps every call and takes a snapshot at a long one.
    threshold_ns, snapshot_over_ns = (0, args.threshold) if args.flight_recorder else (args.threshold, 0)
    try:
        with open_session(args, command) as session:
            session.ring_bytes = args.ring_size
            set_ring_mode(session, lossy=args.lossy, flight_recorder=args.flight_recorder)
            tracer = session.function_tracer(
                patch, unpatch, args.lib, graph=True, depth=depth, threshold_ns=threshold_ns,
                library_calls=args.libcall or args.nest_libcall, nested_calls=args.nest_libcall,
                snapshot_over_ns=snapshot_over_ns,
            )  # fmt: skip
            tracer.record_values(requests)
            info = {
                "command": command or [f"(pid {session.pid})"],
                "pid": session.pid, "record_size": session.layout.record_size, "complete": False,
                "threshold_ns": threshold_ns, "depth": depth, **_function_table(session, tracer, filters),
                "clock": session.clock(), "flight_recorder": args.flight_recorder, "snapshot_over_ns": snapshot_over_ns,
            }  # fmt: skip
            with files.create_binary(os.path.join(out, EVENTS)) as events:
                session.write_raw(events, decode=False)
                write_info(out, info)
                if len(tracer.functions) < PROGRESS_FROM or not sys.stderr.isatty():
                    tracer.start()
                else:
                    with progress_bar() as bar:
                        task = bar.add_task("patching functions", total=len(tracer.functions))
                        tracer.start(lambda n: bar.advance(task, n))
                refused = tracer.not_patched.copy()
                pending = refused.pop("NOT_MAPPED", 0)  # patched when the loader maps their library
                reasons = ", ".join(f"{r} {n}" for r, n in refused.most_common())
                left = sum(refused.values())
                skipped = f"; not patched: {left} ({reasons})" if left else ""
                nops = f" ({tracer.nop_entries} at their patchable NOP entry)" if tracer.nop_entries else ""
                later = f", {pending} more once their library is mapped" if pending else ""
                functions = f"{tracer.patched} function{'' if tracer.patched == 1 else 's'}"
                if not tracer.patched and not pending:
                    why = _why(refused.most_common(1)[0][0])
                    raise SessionError(f"no function could be patched ({reasons}): {why}")

                def ready() -> None:
                    print(f"dynprobe: tracing {functions}{nops}{later}{skipped}", file=sys.stderr)
                    _note_libraries_not_loaded(session, tracer)
                    if not args.lib and not args.patch and program is not None:
                        _hint_libraries(program)

                main = session.process(session.pid)
                program = os.path.realpath(main.exe) if main is not None else None
                status = run_target(session, ready=ready)
                session.close()  # counts after the detach: an attached program ran on until then
                calls, missed, lost = tracer.calls, tracer.missed, tracer.lost
                failure = session.output_failure
                if failure is None:
                    try:
                        events.flush()
                    except OSError as exc:
                        failure = exc.strerror or str(exc)
            inherited = {str(tid): [began, calls] for tid, (began, calls) in tracer.inherited.items()}
            info.update(complete=True, threads=session.thread_names(), calls=calls, missed=missed, lost=lost,
                        overwritten=session.records_overwritten, clock=session.clock(),
                        inherited=inherited)  # fmt: skip
            info.update(_function_table(session, tracer, filters))
            if failure is not None:
                return _stopped_writing(out, info, failure, session.records_drained, session.records_discarded)
            write_info(out, info)
            dropped = f" ({lost} records lost: {RING_WAS_FULL}; a larger --ring-size keeps them)"
            dropped = dropped if lost else ""
            what = f"{calls} call{'' if calls == 1 else 's'} recorded"
            if threshold_ns:
                what = f"{calls} calls traced, those of {callgraph.duration(threshold_ns).strip()} or more recorded"
            if args.flight_recorder:
                kept = session.records_drained
                what = f"{calls} call{'' if calls == 1 else 's'} traced, the newest {kept} records kept"
                if snapshot_over_ns:
                    asked = session.snapshots_asked
                    over = callgraph.duration(snapshot_over_ns).strip()
                    what += f" ({asked} call{'' if asked == 1 else 's'} of {over} or more took a snapshot)"
            where = "" if getattr(args, "temporary", False) else f" in {out}"
            print(f"dynprobe: {what}{where}{dropped}", file=sys.stderr)
            note_rings(session)
            _name_refused(tracer, program)
    except OSError as exc:  # closing the events file (its last bytes) on a full disk
        return report_error(DynprobeError(f"cannot write {os.path.join(out, EVENTS)}: {exc.strerror or exc}"))
    except DynprobeError as exc:
        _remove_if_empty(out)
        return report_error(exc)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM while probes were placed
        _remove_if_empty(out)
        raise
    if args.pid is not None:
        return 0
    return status if status is not None else 130


MAX_NAMED = 20


def _name_refused(tracer: FunctionTracer, program: str | None) -> None:
    """The program's own functions that could not be patched, by name and why: absent from the
    call graph, they should not be a mystery (a library's are counted in the first line)."""
    own = sorted(
        {
            (func.name, reason)
            for reason, funcs in tracer.refused.items()
            for func in funcs
            if os.path.realpath(func.path) == program
        }
    )  # fmt: skip (a name once, whatever the processes)
    if own:
        named = ", ".join(f"{name} ({reason})" for name, reason in own[:MAX_NAMED])
        more = f" and {len(own) - MAX_NAMED} more" if len(own) > MAX_NAMED else ""
        print(f"dynprobe: not traced, of {os.path.basename(program or '')}'s functions: {named}{more}", file=sys.stderr)


def _remove_if_empty(out: str) -> None:
    """The trace directory goes when nothing was recorded in it."""
    written = os.path.join(out, EVENTS)
    if not os.path.exists(written) or not os.path.getsize(written):
        with contextlib.suppress(OSError):
            remove_trace_directory(out)


def _stopped_writing(out: str, info: dict[str, object], failure: str, written: int, dropped: int) -> int:
    """The trace could not be written on (a full disk): recording stopped, the program let go;
    what was written is readable up to where it stops."""
    info["stopped"] = failure
    with contextlib.suppress(OSError):  # (then the trace reads as one cut short)
        write_info(out, info)
    print(f"dynprobe: error: cannot write {os.path.join(out, EVENTS)}: {failure}: recording stopped, the "
          f"program let go; {written} records written (readable up to there), {dropped} drained after it dropped",
          file=sys.stderr)  # fmt: skip
    return 1


def run_live(args: argparse.Namespace, command: list[str]) -> int:
    with contextlib.ExitStack() as stack:
        args.temporary = args.data is None
        if args.temporary:
            args.data = os.path.join(stack.enter_context(tempfile.TemporaryDirectory(prefix="dynprobe-live-")), "trace")
        status = run_record(args, command)
        if os.path.exists(os.path.join(args.data, INFO)):
            signal.signal(signal.SIGINT, signal.default_int_handler)  # the replay may be stopped
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            reading = argparse.Namespace(directory=args.data, demangle=args.demangle, tid=[], output=args.output)
            # (the recording's own filters are in its info.json: the replay applies them)
            replayed = show_trace(reading, [], lambda t, out, f: callgraph.replay(t, out, threshold(t, reading), f),
                             default=sys.stderr, filters=CallFilter())  # fmt: skip
            return status or replayed
        return status
