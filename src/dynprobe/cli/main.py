"""`dynprobe` entry point: parse the subcommand and hand over."""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType
from typing import Any, NoReturn, cast

from dynprobe import __version__
from dynprobe.cli import count, hist, latency, record, trace
from dynprobe.cli import list as list_cmd
from dynprobe.cli.common import split_command


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, as every other error (argparse prints the usage first); the
    examples of a command's epilog printed as written."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dynprobe",
        description="Dynamic probes for user-space x86-64 processes (kprobes/uprobes without the kernel).",
        epilog="Run 'dynprobe COMMAND --help' for examples.",
    )
    parser.add_argument("--version", action="version", version=f"dynprobe {__version__}")
    # (the subcommands' parsers are _Parser too: argparse makes them of the parent's class)
    sub = cast("argparse._SubParsersAction[argparse.ArgumentParser]",
               parser.add_subparsers(dest="command", metavar="COMMAND"))  # fmt: skip
    trace.add_parser(sub)
    count.add_parser(sub)
    hist.add_parser(sub)
    latency.add_parser(sub)
    list_cmd.add_parser(sub)
    record.add_parsers(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM before the target runs (while probes are placed, say): it unwinds as a Ctrl-C
    does, so the session detaches (or kills the command it started and never ran) instead of
    dying with its work in the target (run_target handles SIGTERM from there on)."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    own, command = split_command(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
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
