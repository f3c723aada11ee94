"""What the subcommands share: target selection, error printing, signal handling."""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, TextIO

from dynprobe.errors import DynprobeError, ParseError
from dynprobe.output import files
from dynprobe.symbols.demangle import Demangle

if TYPE_CHECKING:
    from dynprobe.core.session import Session


class UsageError(DynprobeError):
    """Wrong command-line use."""


def fail(message: str, code: int = 1) -> int:
    print(f"dynprobe: error: {message}", file=sys.stderr)
    return code


def report_error(exc: DynprobeError) -> int:
    if isinstance(exc, ParseError):
        print(f"dynprobe: error: {exc}", file=sys.stderr)
        for line in exc.caret().splitlines():
            print(f"    {line}", file=sys.stderr)
        return 2
    return fail(str(exc), 2 if isinstance(exc, UsageError) else 1)


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def byte_size(text: str) -> int:
    """An argparse type: a size in bytes, with an optional K, M or G (KiB, MiB, GiB) after it."""
    digits = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = digits[-1:] if digits[-1:] in _SIZE_UNITS else ""
    number = digits[: len(digits) - len(unit)]
    if not number.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or with K, M or G: 64M)")
    return int(number) * _SIZE_UNITS[unit]


def positive_count(text: str) -> int:
    """An argparse type: a whole number, 1 or more."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (1 or more)")
    return int(text)


MIN_INTERVAL = 0.01  # seconds: a shorter one would keep the tracer printing while the program waits
MAX_INTERVAL = 86_400.0


def interval_seconds(text: str) -> float:
    """An argparse type: an interval in seconds, from MIN_INTERVAL to a day."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (e.g. 1 or 0.5)") from None
    if not MIN_INTERVAL <= value <= MAX_INTERVAL:  # also refuses nan
        raise argparse.ArgumentTypeError(f"an interval is {MIN_INTERVAL} to {MAX_INTERVAL:.0f} seconds, not {text!r}")
    return value


def add_demangle_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--demangle", type=Demangle, choices=list(Demangle), default=Demangle.SIMPLE, metavar="{simple,full,no}",
        help="C++ names: simple (ns::Class::method, the default, as uftrace), full (as c++filt), no (symbols)",
    )  # fmt: skip


def add_target_options(parser: argparse.ArgumentParser, *, follow: bool = False) -> None:
    """-p PID, and whether children are followed: `follow` is the default (`record`: as uftrace,
    a program's children and the programs they exec are traced)."""
    parser.add_argument("-p", "--pid", type=int, help="attach to this running process (every thread)")
    if follow:
        parser.add_argument("--no-follow-fork", dest="follow_fork", action="store_false",
                            help="let children created by fork/vfork run untraced (default: traced, "
                            "and the programs they exec)")  # fmt: skip
    else:
        parser.add_argument("--follow-fork", action="store_true",
                            help="trace children created by fork/vfork too (default: they run unprobed)")  # fmt: skip


def add_output_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "-o", "--output", metavar="FILE",
        help=f"write {what} to FILE, created new ('-': the standard output; default: the standard error, "
        "so that nothing reaches the program's own output)",
    )  # fmt: skip


def open_output(path: str | None) -> TextIO:
    """Where a command's results go: the standard error unless `-o FILE` (or `-o -`, the
    standard output) says otherwise. A command dynprobe runs shares its standard output, and a
    table or a line in it would corrupt what the program writes (`gzip -c > out.gz`)."""
    if path is None:
        return sys.stderr
    if path == "-":
        return sys.stdout
    return files.create_text(path)


def close_output(out: TextIO) -> None:
    """Flush (a standard stream) or close (a file) what `open_output` gave; raises OSError."""
    if out in (sys.stdout, sys.stderr):
        out.flush()
    else:
        out.close()


def output_name(path: str | None, default: TextIO = sys.stderr) -> str:
    """What `-o path` names in a message (`default`: the stream without -o)."""
    if path is None:
        return "the standard error" if default is sys.stderr else "the standard output"
    return "the standard output" if path == "-" else path


def exit_code(work: Callable[[], int], output: str | None, default: TextIO = sys.stderr) -> int:
    """`work`'s exit code, or that of the error it raised, told in one line: a pipe closed on
    the output (`| head`) ends the command quietly; another write error names the output (-o
    `output`, else `default`)."""
    try:
        return work()
    except DynprobeError as exc:
        return report_error(exc)
    except BrokenPipeError:
        return 0
    except OSError as exc:
        return report_error(DynprobeError(f"cannot write {output_name(output, default)}: {exc.strerror or exc}"))


def open_session(args: argparse.Namespace, command: list[str]) -> Session:
    """The session -p PID or -- COMMAND names, its warnings printed to stderr as they come."""
    from dynprobe.core.session import attach, print_warning, spawn  # (the engine: not loaded for `list` or --help)

    if args.pid is not None and command:
        raise UsageError("give either -p PID or -- COMMAND, not both")
    if args.pid is None and not command:
        raise UsageError("give a process: -p PID, or -- COMMAND [ARGS...]")
    session = (
        attach(args.pid, follow_fork=args.follow_fork)
        if args.pid is not None
        else spawn(command, follow_fork=args.follow_fork, env=args.environment)
    )
    session.on_warning = print_warning
    return session


def run_target(
    session: Session,
    interval: float | None = None,
    tick: Callable[[], None] | None = None,
    *,
    ready: Callable[[], None],
) -> int | None:
    """Run until the target ends or Ctrl-C / SIGTERM; call `ready` once Ctrl-C is taken as the
    end of the run (what it prints may tell the user to press it), `tick` every `interval` seconds.
    Returns the target's exit status (128+N: killed by signal N), or None when interrupted and
    no status is known (attached: it runs on). A command dynprobe started and that ends soon
    after gives its status; SIGTERM is passed on to it once detached, as strace does (`kill`,
    or a harness that stops dynprobe alone, would leave it running untraced); SIGINT is not: a
    terminal's Ctrl-C reaches it already, and a second one would cut its own shutdown short."""
    interrupted = 0

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal interrupted
        interrupted = signum
        session.interrupt_wait(signum, frame)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    # What the set-up made (probes, sites, symbols: 10^5 objects for 10^4 probes) lives as long
    # as the command: collections while the target runs need not walk it again (~0.2 s).
    gc.freeze()
    try:
        ready()
        while True:
            try:
                status = session.run(timeout=interval)
            except BrokenPipeError:
                return None
            if status is not None or interrupted or not session.processes():
                break
            if tick is not None:
                tick()
    finally:
        # What is left (detach, final counts, a trace's info) is short and must not be cut:
        # another Ctrl-C (often pressed twice) is ignored.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # (the last snapshot is taken as the session ends)
    if status is None and interrupted and session.spawned:
        return _stop_command(session, interrupted)
    return status


def _stop_command(session: Session, signum: int, grace: float = 2.0) -> int | None:
    """Detach, pass SIGTERM on to the command dynprobe started (see run_target); its exit
    status if it ends within `grace` seconds (else it runs on, and we say so)."""
    pid = session.pid
    session.close()
    if signum != signal.SIGINT:
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signum)
        except ProcessLookupError:
            return None
    deadline = time.monotonic() + grace
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return session.exit_status  # reaped by the detach, which kept its status
        if done:
            code = os.waitstatus_to_exitcode(status)  # -N: killed by signal N
            return code if code >= 0 else 128 - code
        if time.monotonic() > deadline:
            why = (
                f"did not end after {signal.Signals(signum).name}"
                if signum != signal.SIGINT
                else "was not sent dynprobe's SIGINT (a terminal's Ctrl-C reaches it itself; SIGTERM is passed on)"
            )
            print(f"dynprobe: pid {pid} {why}; it runs on, detached",
                  file=sys.stderr)  # fmt: skip
            return None
        time.sleep(0.01)
