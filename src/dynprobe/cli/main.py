"""`dynprobe` entry point: parse the subcommand and hand over."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any, NoReturn, cast

from dynprobe import __version__
from dynprobe.gcpause import gc_paused

# The module of each command (its parser, and what runs it). Only the module of the command
# asked for is imported: `list` and `--version` never load the tracing engine.
COMMANDS = {
    "trace": "trace", "count": "count", "stacks": "count", "hist": "hist", "latency": "latency", "list": "list",
    "record": "record", "live": "record", "run": "run",
    **dict.fromkeys(("replay", "report", "graph", "dump"), "reading"),
}  # fmt: skip


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, as every other error (argparse prints the usage first); the
    examples of a command's epilog printed as written."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser(first: str | None = None) -> argparse.ArgumentParser:
    """The parser for arguments starting with `first`: a command's name, its module's commands
    alone; an option of dynprobe's own (--version), none; help, or a word no command has (its
    error lists them), every command's."""
    parser = _Parser(
        prog="dynprobe",
        description="Dynamic probes for user-space x86-64 processes (kprobes/uprobes without the kernel).",
        epilog="Run 'dynprobe COMMAND --help' for examples.",
    )
    parser.add_argument("--version", action="version", version=f"dynprobe {__version__}")
    # (the subcommands' parsers are _Parser too: argparse makes them of the parent's class)
    sub = cast("argparse._SubParsersAction[argparse.ArgumentParser]",
               parser.add_subparsers(dest="command", metavar="COMMAND"))  # fmt: skip
    if first in COMMANDS:
        modules = [COMMANDS[first]]
    elif first is not None and first.startswith("-") and first not in ("-h", "--help"):
        modules = []
    else:
        modules = list(dict.fromkeys(COMMANDS.values()))
    for module in modules:
        importlib.import_module(f"dynprobe.cli.{module}").add_parsers(sub)
    return parser


@contextlib.contextmanager
def _one_blas_thread() -> Iterator[dict[str, str]]:
    """numpy's OpenBLAS starts a thread per CPU, spinning, when it loads; dynprobe does no linear
    algebra, and numpy loads at its first use (dynprobe/deferred.py), which may come at any time.
    One thread is asked for while a command runs; yields the environment dynprobe was given, the
    one the programs it starts get."""
    given = dict(os.environ)
    if "OPENBLAS_NUM_THREADS" in given:
        yield given
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        yield given
    finally:
        os.environ.pop("OPENBLAS_NUM_THREADS", None)


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split at the first '--': (dynprobe's arguments, the command to run)."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


class Terminated(KeyboardInterrupt):
    """SIGTERM before the target runs (while probes are placed, say): it unwinds as a Ctrl-C
    does, so the session detaches (or kills the command it started and never ran) instead of
    dying with its work in the target (run_target handles SIGTERM from there on)."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    own, command = split_command(list(sys.argv[1:] if argv is None else argv))
    with _one_blas_thread() as environment:
        return _main(own, command, environment)


def _main(own: list[str], command: list[str], environment: dict[str, str]) -> int:
    with gc_paused():  # (the commands' modules make objects by the ten thousand, none of them garbage)
        parser = build_parser(own[0] if own else None)
    args = parser.parse_args(own)
    gc.freeze()  # (what they made lives as long as the command: later collections pass it by)
    args.environment = environment
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    try:
        result: int = args.run(args, command)
    except Terminated:
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:  # a Ctrl-C once the target was let go (a detach is never cut short)
        return 130
    return result


def command() -> NoReturn:
    """The `dynprobe` command: `main()`, then out without the interpreter's teardown, which
    frees every object of every module (a few milliseconds of a short command's). Everything
    that matters was done by then: sessions closed, outputs closed or flushed (the standard
    streams here; a flush that fails exits 120, as Python's own does); a thread still running,
    which a command never leaves, gets the usual exit instead."""
    status = main()
    if threading.active_count() > 1:
        sys.exit(status)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:
        status = 120
    os._exit(status)


if __name__ == "__main__":
    command()
