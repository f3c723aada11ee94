"""`dynprobe` entry point: parse the subcommand and hand over."""

from __future__ import annotations

import argparse
import sys

from dynprobe import __version__
from dynprobe.cli import count, hist, latency, record, trace
from dynprobe.cli import list as list_cmd
from dynprobe.cli.common import split_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dynprobe",
        description="Dynamic probes for user-space x86-64 processes (kprobes/uprobes without the kernel).",
        epilog="Run 'dynprobe COMMAND --help' for examples.",
    )
    parser.add_argument("--version", action="version", version=f"dynprobe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    trace.add_parser(sub)
    count.add_parser(sub)
    hist.add_parser(sub)
    latency.add_parser(sub)
    list_cmd.add_parser(sub)
    record.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    own, command = split_command(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args = parser.parse_args(own)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        result: int = args.run(args, command)
    except KeyboardInterrupt:  # a Ctrl-C once the target was let go (a detach is never cut short)
        return 130
    return result


if __name__ == "__main__":
    sys.exit(main())
