"""`dynprobe run`: a program in bpftrace's language against one process (and its children with
--follow-fork): its uprobe and uretprobe bodies compiled into the target, BEGIN, END and
interval bodies run here, and at the end every map printed as bpftrace prints it."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
import time
from typing import TYPE_CHECKING, TextIO

from dynprobe.cli.common import (
    UsageError,
    add_output_option,
    add_target_options,
    close_output,
    exit_code,
    open_output,
    open_session,
    report_error,
    run_target,
)
from dynprobe.errors import DynprobeError, ProgramError, SymbolError
from dynprobe.lang.check import check_program
from dynprobe.lang.maps import DEFAULT_SLOTS
from dynprobe.lang.parser import PROBE_KINDS, parse_program
from dynprobe.lang.target import check_runnable
from dynprobe.spec.model import split_location
from dynprobe.symbols.elf import load_elf
from dynprobe.symbols.resolve import find_file, functions_matching

if TYPE_CHECKING:
    from dynprobe.core.programs import PlacedProgram

EXAMPLES = """\
examples:
  dynprobe run -e 'uprobe:libc:malloc { @bytes[tid] = sum(arg0); @sizes = hist(arg0); }' -- ./app
  dynprobe run -e 'uprobe:libc:read /arg2 > 4096/ { @big = count(); }' -p 1234
  dynprobe run -e 'uprobe:libc:open { printf("%s opens %s\\n", comm, str(arg0)); }' -- ./app
  dynprobe run -l 'uprobe:libc:mall*'                  the probes a pattern names (bpftrace -l)
  dynprobe run --dry-run -e 'uprobe:libc:malloc { @[tid] = count(); }' -- ./app
                                                       each probe placed: its mode and its site's code size
  dynprobe run latency.bt -c ./app     (latency.bt: uprobe:./app:parse { @start[tid] = nsecs; }
                                         uretprobe:./app:parse /@start[tid]/ {
                                           @ns = hist(nsecs - @start[tid]); delete(@start[tid]); })
"""
_POLL = 0.02  # seconds between looks at whether a probe called exit() (bpftrace stops at once)


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "run", help="run a program in bpftrace's language",
        description="Run a program in bpftrace's language (its uprobes, uretprobes, maps, BEGIN, END and "
                    "intervals) against a process: probe bodies are compiled into the target, no stop per hit; "
                    "what their printf()s print goes through the rings. Maps are printed at the end as bpftrace "
                    "prints them.",
        epilog=EXAMPLES,
    )  # fmt: skip
    p.add_argument("script", nargs="?", metavar="FILE", help="the program, in a file")
    p.add_argument("-e", dest="program", metavar="PROGRAM", help="the program, given here")
    p.add_argument("-c", dest="command", metavar="CMD", help="run CMD (split as a shell would) and trace it")
    p.add_argument("--dry-run", action="store_true",
                   help="compile the program and place its probes, say each one's mode and its site's code size, run "
                        "nothing (a command started runs to its entry point, its libraries mapped, and is killed "
                        "there)")  # fmt: skip
    p.add_argument("-l", dest="listing", metavar="PATTERN",
                   help="list the probes PATTERN names ('uprobe:libc:mal*'), as bpftrace -l; run nothing")  # fmt: skip
    add_output_option(p, "what the program prints")
    add_target_options(p)
    p.set_defaults(run=run)


def _source(args: argparse.Namespace) -> tuple[str, str]:
    """The program's text and the name its errors give it."""
    if args.program is None and args.script is None:
        raise UsageError("give the program: -e 'PROGRAM' or a FILE")
    if args.program is not None and args.script is not None:
        raise UsageError(f"give the program once: -e 'PROGRAM' or a FILE, not both (a command to run goes after --: "
                         f"-- {args.script})")  # fmt: skip
    if args.program is not None:
        return args.program, "stdin"
    try:
        with open(args.script, encoding="utf-8") as file:
            return file.read(1 << 20), args.script
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {args.script}: {getattr(exc, 'strerror', None) or exc}") from None


def _list(pattern: str) -> int:
    """`-l`: the probes an attach point with globs names, a line each, sorted, as bpftrace -l
    lists them (one function per address: the name `run` would probe it by)."""
    kind, _, where = pattern.partition(":")
    module, sep, glob = split_location(where)
    if kind not in PROBE_KINDS or not sep or not module:
        raise UsageError(f"-l takes uprobe:FILE:FUNCTION or uretprobe:FILE:FUNCTION, with globs in FUNCTION (a "
                         f"library by name: uprobe:libc:mal*), not {pattern!r}")  # fmt: skip
    image = load_elf(find_file(module))
    found = sorted({f.name for f in functions_matching(image, glob or "*")})
    if not found:
        raise SymbolError(f"no function of {image.path} matches {glob!r}")
    with contextlib.suppress(BrokenPipeError):
        print("".join(f"{PROBE_KINDS[kind]}:{image.path}:{name}\n" for name in found), end="")
    return 0


def run(args: argparse.Namespace, command: list[str]) -> int:
    if args.listing is not None:
        if args.program is not None or args.script is not None or command or args.command is not None:
            print("dynprobe: -l lists probes and runs nothing: give no program and no command with it",
                  file=sys.stderr)  # fmt: skip
            return 2
        try:
            return _list(args.listing)
        except DynprobeError as exc:
            return report_error(exc)
    try:
        source, filename = _source(args)
        if args.command is not None:
            if command:
                raise UsageError("give either -c CMD or -- COMMAND, not both")
            command = shlex.split(args.command)
    except (DynprobeError, ValueError) as exc:
        print(f"dynprobe: {exc}", file=sys.stderr)
        return 2
    try:  # (before any process is started or stopped)
        check_runnable(check_program(parse_program(source, filename), source, filename), source, filename)
    except ProgramError as exc:
        print(exc.render(), file=sys.stderr)
        return 1

    if args.dry_run:
        return exit_code(lambda: _dry_run(args, command, source, filename), args.output)

    def work() -> int:
        out = open_output(args.output)
        with open_session(args, command) as session:
            program = session.program(source, filename)
            program.write = lambda text: _write(out, text)
            _write(out, _attaching(program))
            program.run_blocks("BEGIN")
            intervals = program.intervals()
            due = [time.monotonic() + seconds for seconds, _ in intervals]

            def tick() -> None:
                now = time.monotonic()
                for i, (seconds, block) in enumerate(intervals):
                    if now >= due[i]:
                        due[i] += seconds
                        if block.run():
                            program.exited = True
                if program.called_exit():
                    signal.raise_signal(signal.SIGTERM)  # (run_target's way out: detach, end the command)

            status = None
            if not program.exited:
                period = min([_POLL, *(seconds for seconds, _ in intervals)])
                status = run_target(session, period, tick, ready=lambda: None)
            session.drain()  # (what the probes printed comes before what END prints)
            program.run_blocks("END")
            session.close()
            _write(out, "\n\n" + program.format_maps())
            for name, dropped in program.dropped().items():
                print(f"dynprobe: @{name} was full: {dropped} updates dropped (it took {len(program.entries(name))} "
                      f"keys; a map holds {DEFAULT_SLOTS} at most)", file=sys.stderr)  # fmt: skip
            for probe in program.probes:
                if probe.nmissed or probe.lost:
                    print(f"dynprobe: {probe.name}: {probe.nmissed} hits did not run the body (a signal handler's "
                          f"hit inside it, or a site left a trap), {probe.lost} printf() records lost (a full ring)",
                          file=sys.stderr)  # fmt: skip
            close_output(out)
        if args.pid is not None or program.called_exit():
            return 0
        return status if status is not None else 130

    return exit_code(work, args.output)


def _dry_run(args: argparse.Namespace, command: list[str], source: str, filename: str) -> int:
    """--dry-run: the program placed, each probe's mode (optimized, with its site's code size; a
    trap, and why) said, nothing run; a process attached to is let go as it was, a command
    started is killed at its entry point (run there so that its libraries are mapped)."""
    from dynprobe.core.probe import ProbeMode

    out = open_output(args.output)
    with open_session(args, command) as session:
        program = session.program(source, filename)
        main = session.process(session.pid)
        image = load_elf(main.exe) if args.pid is None and main is not None else None
        start = image.vaddr_to_offset(image.entry) if image is not None else None
        if image is not None and start is not None:
            entry = session.probe(f"{image.path}:{start:#x}", pre=lambda hit: session.stop())
            session.run(timeout=60)
            entry.remove()
        session.optimize_now()
        _write(out, _attaching(program))
        for probe in program.probes:
            site = main.sites.get(probe.sites[main.pid]) if main is not None and main.pid in probe.sites else None
            if site is None:  # (why it was refused, where its module was mapped, if it was)
                how = "not placed: its module is not mapped (loaded later, by dlopen?)"
                how = how if probe.not_placed is None else f"refused: {probe.not_placed}"
            elif probe.mode == ProbeMode.OPTIMIZED:
                how = "optimized" + (f", {site.detour[1]} bytes of code at its site" if site.detour else "")
            else:
                why = probe.trap_reason
                how = probe.mode.value + (f" ({why.name})" if why is not None else "")
            _write(out, f"{program.probe_name(probe)}: {how}\n")
        if args.pid is None:
            with contextlib.suppress(ProcessLookupError):  # (ended before its entry point: a static program)
                os.kill(session.pid, signal.SIGKILL)
            session.run(timeout=60)  # (its end reaped)
    close_output(out)
    return 0


def _attaching(program: PlacedProgram) -> str:
    """bpftrace's first line: its count takes in the probes the tracer runs (BEGIN, END, intervals)."""
    in_tracer = [p for b in program.checked.program.probes for p in b.attach_points
                 if p.kind not in ("uprobe", "uretprobe")]  # fmt: skip
    count = len(program.probes) + len(in_tracer)
    return f"Attaching {count} probe{'s' if count != 1 else ''}...\n"


def _write(out: TextIO, text: str) -> None:
    out.write(text)
    out.flush()
