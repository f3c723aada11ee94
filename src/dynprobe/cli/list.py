"""`dynprobe list`: the probe-able functions of a binary or a running process."""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
from collections.abc import Callable

from dynprobe.arch.x86_64 import ResumeKind, decode_one, plan_resume
from dynprobe.arch.x86_64.optimize import OptimizePlan, can_optimize
from dynprobe.cli.common import UsageError, add_demangle_option, report_error
from dynprobe.errors import DynprobeError, Refusal
from dynprobe.symbols.demangle import display, names_of
from dynprobe.symbols.elf import ElfImage, load_elf
from dynprobe.symbols.ifunc import callable_functions
from dynprobe.symbols.maps import read_maps
from dynprobe.symbols.resolve import loaded_in

EXAMPLES = """\
examples:
  dynprobe list ./app                 every function of ./app
  dynprobe list ./app 'parse_*'       those matching a glob
  dynprobe list -p 1234 'malloc*'     functions of a running process and its libraries
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "list", help="list probe-able functions", description="List functions that can be probed.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("binary", nargs="?", help="an ELF file")
    p.add_argument("glob", nargs="?", default="*", help="only functions matching this glob")
    p.add_argument("-p", "--pid", type=int, help="a running process: its executable and libraries")
    add_demangle_option(p)
    p.set_defaults(run=run)


def jump_verdict(image: ElfImage, addr: int, size: int) -> str:
    """Whether the entry could take a 5-byte jump (optimized probe), or why not."""
    plan = can_optimize(image.code(addr, size), addr, addr, module_targets=image.branch_targets())
    return "yes" if isinstance(plan, OptimizePlan) else plan.name


def entry_verdict(image: ElfImage, addr: int) -> str:
    insn = decode_one(image.code(addr, 15), addr)
    if insn is None:
        return f"refused: {Refusal.UNDECODABLE.name}"
    plan = plan_resume(insn)
    if isinstance(plan, Refusal):
        return f"refused: {plan.name}"
    return "emulated" if plan.kind == ResumeKind.EMULATE else "boosted"


def _modules(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(path, load bias) of each module to list."""
    if args.pid is not None:
        if args.binary is not None and args.glob == "*":
            args.glob = args.binary
        maps = read_maps(args.pid)
        if not maps and not os.path.exists(f"/proc/{args.pid}"):
            raise DynprobeError(f"no process with pid {args.pid}")
        seen: dict[str, int] = {}
        for m in maps:
            if m.path.startswith("/") and m.path not in seen and m.offset == 0:
                seen[m.path] = m.start
        out = []
        for path, start in seen.items():
            try:
                image = load_elf(path)
            except DynprobeError:
                continue
            out.append((path, start - image.first_page if image.is_pie else 0))
        return out
    if args.binary is None:
        raise UsageError("give a BINARY or -p PID")
    return [(os.path.realpath(args.binary), 0)]


def _memory(pid: int | None) -> Callable[[int], int | None] | None:
    """8 bytes of process `pid`'s memory at a time (its indirect functions' relocated slots)."""
    if pid is None:
        return None
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None

    def read(addr: int) -> int | None:
        try:
            data = os.pread(fd, 8, addr)
        except OSError:
            return None
        return int.from_bytes(data, "little") if len(data) == 8 else None

    return read


def run(args: argparse.Namespace, command: list[str]) -> int:
    try:
        rows = []
        modules = _modules(args)
        maps = read_maps(args.pid) if args.pid is not None else None
        memory = _memory(args.pid)
        stripped = [p for p, _ in modules if not any(f.size for f in load_elf(p).functions)]
        for path, bias in modules:
            image = load_elf(path)
            for func in callable_functions(image, loaded_in(image, maps, memory)):
                if any(fnmatch.fnmatchcase(n, args.glob) for n in names_of(func.name)):
                    verdicts = (entry_verdict(image, func.addr), jump_verdict(image, func.addr, func.size))
                    name = display(func.name, args.demangle)
                    rows.append((func.addr + bias, func.size, name, os.path.basename(path), *verdicts))
    except DynprobeError as exc:
        return report_error(exc)
    if not rows and len(stripped) == len(modules) == 1:
        name = os.path.basename(stripped[0])
        print(f"dynprobe: {name} has no function symbols (stripped, no debug file found): probe the libraries it uses "
              f"(libc:malloc), or an offset in it ({name}:0x1139)", file=sys.stderr)  # fmt: skip
        return 1
    if not rows:
        print(f"dynprobe: no function matches {args.glob!r}", file=sys.stderr)
        return 1
    name_w = min(max(len(r[2]) for r in rows), 48)
    mod_w = max(len(r[3]) for r in rows)
    print(f"{'ADDRESS':<18} {'SIZE':>7}  {'FUNCTION':<{name_w}}  {'MODULE':<{mod_w}}  {'TRAP':<16}  JUMP")
    try:
        for addr, size, name, module, verdict, jump in rows:
            print(f"{addr:#018x} {size:>7}  {name:<{name_w}}  {module:<{mod_w}}  {verdict:<16}  {jump}")
    except BrokenPipeError:
        pass
    return 0
