"""`dynprobe list`: the probe-able functions of a binary or a running process."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from dynprobe.arch.x86_64 import ResumeKind, decode_one, plan_resume
from dynprobe.arch.x86_64.optimize import OptimizePlan
from dynprobe.cli.common import UsageError, add_demangle_option, report_error
from dynprobe.errors import DynprobeError, Refusal
from dynprobe.spec.model import split_location
from dynprobe.symbols import files
from dynprobe.symbols.demangle import display
from dynprobe.symbols.elf import ElfImage, load_elf
from dynprobe.symbols.maps import Mapping, read_maps
from dynprobe.symbols.resolve import find_file, functions_matching, loaded_in

EXAMPLES = """\
examples:
  dynprobe list ./app                 every function of ./app
  dynprobe list ./app 'parse_*'       those matching a glob (or: './app:parse_*', as specs write it)
  dynprobe list 'libc:mem*'           a library by name, as specs name it
  dynprobe list -p 1234 'malloc*'     functions of a running process and its libraries
  dynprobe list -p 1234 libc: | less  those of one library it has mapped

Aliases (malloc, __libc_malloc) are listed once, under the name programs call.
"""


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "list", help="list probe-able functions", description="List functions that can be probed.",
        epilog=EXAMPLES,
    )  # fmt: skip
    p.add_argument("module", nargs="?", metavar="MODULE[:GLOB]",
                   help="an ELF file, or a library as specs name it (libc); with -p, a lone GLOB")  # fmt: skip
    p.add_argument("glob", nargs="?", metavar="GLOB", help="only functions matching this glob")
    p.add_argument("-p", "--pid", type=int, help="a running process: its executable and libraries")
    add_demangle_option(p)
    p.set_defaults(run=run)


def jump_verdict(image: ElfImage, addr: int, size: int) -> str:
    """Whether the entry could take a 5-byte jump (optimized probe), or why not."""
    plan = image.jump_plan(addr, size, addr)
    return "yes" if isinstance(plan, OptimizePlan) else plan.name


def entry_verdict(image: ElfImage, addr: int) -> str:
    insn = decode_one(image.code(addr, 15), addr)
    if insn is None:
        return f"refused: {Refusal.UNDECODABLE.name}"
    plan = plan_resume(insn)
    if isinstance(plan, Refusal):
        return f"refused: {plan.name}"
    return "emulated" if plan.kind == ResumeKind.EMULATE else "boosted"


def _selection(args: argparse.Namespace) -> tuple[str | None, str]:
    """(the module named, or None for every module of the process; the glob)."""
    first: str | None = args.module
    if first is None:
        if args.pid is None:
            raise UsageError("give a MODULE (a file, or a library: libc) or -p PID")
        return None, "*"
    module, sep, pattern = split_location(first)
    if sep:
        if args.glob is not None:
            raise UsageError(f"give MODULE:GLOB or MODULE GLOB, not both: {first!r} {args.glob!r}")
        return module, pattern or "*"
    if args.pid is not None and args.glob is None:
        return None, first  # list -p PID 'malloc*'
    return first, args.glob or "*"


def _modules(args: argparse.Namespace, module: str | None, maps: list[Mapping] | None) -> list[tuple[str, int]]:
    """(path, load bias) of each module to list."""
    if maps is None:
        return [(find_file(module or ""), 0)]
    if not maps and not os.path.exists(f"/proc/{args.pid}"):
        raise DynprobeError(f"no process with pid {args.pid}")
    wanted = find_file(module, maps) if module is not None else None
    seen: dict[str, int] = {}
    for m in maps:
        first_mapping = m.path.startswith("/") and m.path not in seen and m.offset == 0
        if first_mapping and (wanted is None or files.real_path(m.path) == wanted):
            seen[m.path] = m.start
    if wanted is not None and not seen:
        raise DynprobeError(f"pid {args.pid} has not mapped {wanted}")
    out = []
    for path, start in seen.items():
        try:
            image = load_elf(path)
        except DynprobeError:
            continue
        out.append((path, start - image.first_page if image.is_pie else 0))
    return out


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
        module, glob = _selection(args)
        maps = read_maps(args.pid) if args.pid is not None else None
        modules = _modules(args, module, maps)
        memory = _memory(args.pid)
        stripped = [p for p, _ in modules if not any(f.size for f in load_elf(p).functions)]
        for path, bias in modules:
            image = load_elf(path)
            for func in functions_matching(image, glob, loaded_in(image, maps, memory)):
                verdicts = (entry_verdict(image, func.addr), jump_verdict(image, func.addr, func.size))
                name = display(func.name, args.demangle)
                rows.append((func.addr + bias, func.size, name, os.path.basename(path), *verdicts))
    except DynprobeError as exc:
        return report_error(exc)
    if not rows and len(stripped) == len(modules) == 1:
        name = os.path.basename(stripped[0])
        print(f"dynprobe: error: {name} has no function symbols (stripped, no debug file found): probe the libraries "
              f"it uses (libc:malloc), or an offset in it ({name}:0x1139)", file=sys.stderr)  # fmt: skip
        return 1
    if not rows:
        print(f"dynprobe: error: no function matches {glob!r}", file=sys.stderr)
        return 1
    # The function last: a long C++ name then shifts nothing.
    mod_w = max(len(r[3]) for r in rows)
    jump_w = max(len(r[5]) for r in rows)
    print(f"{'ADDRESS':<18} {'SIZE':>7}  {'MODULE':<{mod_w}}  {'TRAP':<16}  {'JUMP':<{jump_w}}  FUNCTION")
    try:
        for addr, size, name, module_name, verdict, jump in rows:
            print(f"{addr:#018x} {size:>7}  {module_name:<{mod_w}}  {verdict:<16}  {jump:<{jump_w}}  {name}")
    except BrokenPipeError:
        pass
    return 0
