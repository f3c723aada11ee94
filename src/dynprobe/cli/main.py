"""`dynprobe` entry point: parse the subcommand and hand over."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any, NoReturn, cast

from dynprobe import __version__

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
def _one_blas_thread() -> Iterator[None]:
    """numpy's OpenBLAS starts a thread per CPU, spinning, when it loads; dynprobe does no linear
    algebra. One thread is asked for only while the commands' modules (and numpy) load: the
    programs dynprobe starts get the environment it was given."""
    if "OPENBLAS_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        del os.environ["OPENBLAS_NUM_THREADS"]


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
    with _one_blas_thread():
        parser = build_parser(own[0] if own else None)
    args = parser.parse_args(own)
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


if __name__ == "__main__":
    sys.exit(main())
