"""Fuzz the readers of files dynprobe is handed: ELF files and trace directories.

    python -m tests.fuzz elf FILE... --cases N --seed S
    python -m tests.fuzz trace DIR --cases N --seed S

Each case is a mutation of a valid input (bytes flipped or set to extremes where the format
keeps its counts, offsets and sizes, a truncation, a field of info.json changed), read the way
the commands read it. A reader may refuse a case with a DynprobeError, never with another
exception, and never hang: each case has CASE_SECONDS. The first case that breaks the rule is
printed with its traceback and the process exits 1. Run by tests/unit/test_fuzz_readers.py in
a subprocess with bounded memory.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
import traceback
from collections.abc import Callable
from types import FrameType

from dynprobe.cli.main import main as main_command
from dynprobe.errors import DynprobeError
from dynprobe.output import callgraph, timeline
from dynprobe.symbols.elf import ElfImage
from dynprobe.tracefile import EVENTS, INFO
from dynprobe.traces import Trace

CASE_SECONDS = 10
_EXTREMES = (0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 0x7FFF_FFFF, 0xFFFF_FFFF, 0xFFFF_FFFF_FFFF_FFFF, 1 << 40)


class Hang(Exception):
    pass


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise Hang(f"a case ran longer than {CASE_SECONDS} s")


def _structural_offsets(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of the fields of an ELF-64 file that say where and how much: the ELF
    header, every program header and section header."""
    fields = [(0x18, 8), (0x20, 8), (0x28, 8), (0x36, 2), (0x38, 2), (0x3A, 2), (0x3C, 2), (0x3E, 2)]
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phnum, shentsize, shnum = struct.unpack_from("<H", data, 0x38)[0], *struct.unpack_from("<HH", data, 0x3A)
    for i in range(phnum):
        base = phoff + 56 * i
        fields += [(base, 4), (base + 8, 8), (base + 16, 8), (base + 32, 8), (base + 40, 8)]
    for i in range(shnum if shentsize == 64 else 0):
        base = shoff + 64 * i
        fields += [(base + 4, 4), (base + 24, 8), (base + 32, 8), (base + 40, 4), (base + 56, 8)]
    return [(off, width) for off, width in fields if off + width <= len(data)]


def mutate_elf(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    how = rng.randrange(4)
    if how == 0:  # truncated
        return bytes(out[: rng.randrange(len(out))])
    if how == 1:  # random bytes anywhere
        for _ in range(rng.randrange(1, 64)):
            out[rng.randrange(len(out))] = rng.randrange(256)
        return bytes(out)
    fields = _structural_offsets(data)
    for _ in range(rng.randrange(1, 4)):
        off, width = rng.choice(fields)
        value = rng.choice(_EXTREMES) if how == 2 else rng.randrange(1 << (8 * width))
        out[off : off + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
    return bytes(out)


def read_elf(path: str) -> None:
    """What `list`, probes and the tracer ask of a file."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main_command(["list", path])
    image = ElfImage(path)
    for func in image.functions[:50]:
        image.symbolize(func.addr + 1)
        image.code(func.addr, 16)
    image.function_at(image.entry)
    image.functions_named("main")
    image.eh_frame_ranges()
    image.irelative  # noqa: B018
    image.symbol_slots  # noqa: B018
    targets = image.branch_targets()
    for func in image.functions[:50]:
        assert isinstance(func.addr + 1 in targets, bool)


def mutate_trace(source: str, target: str, rng: random.Random) -> None:
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    if rng.randrange(2):
        with open(os.path.join(target, INFO)) as f:
            info = json.load(f)
        _mutate_json(info, rng)
        with open(os.path.join(target, INFO), "w") as f:
            json.dump(info, f)
    else:
        with open(os.path.join(target, EVENTS), "rb") as f:
            events = bytearray(f.read())
        if rng.randrange(4) == 0:
            events = events[: rng.randrange(len(events) + 1)]
        for _ in range(rng.randrange(1, 16)):
            if not events:
                break
            off = rng.randrange(len(events))
            width = min(rng.choice((1, 2, 4, 8)), len(events) - off)
            value = rng.choice(_EXTREMES) if rng.randrange(2) else rng.randrange(1 << 64)
            events[off : off + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
        with open(os.path.join(target, EVENTS), "wb") as f:
            f.write(events)


_JSON_VALUES: tuple[object, ...] = (None, True, -1, 0, 1 << 40, 1 << 70, 1e308, -1e-308, "x", "", [], {}, [[]])


def _mutate_json(value: dict[str, object] | list[object], rng: random.Random) -> None:
    """One change somewhere in the tree: a key dropped, a value replaced."""
    keys = list(value) if isinstance(value, dict) else list(range(len(value)))
    if not keys:
        return
    key = rng.choice(keys)
    child = value[key]  # type: ignore[index]
    if isinstance(child, (dict, list)) and child and rng.randrange(3):
        _mutate_json(child, rng)
    elif isinstance(value, dict) and rng.randrange(4) == 0:
        del value[key]  # type: ignore[arg-type]
    else:
        value[key] = rng.choice(_JSON_VALUES)  # type: ignore[index]


def read_trace(path: str) -> None:
    """What replay, report and dump read."""
    for show in (
        lambda t: callgraph.replay(t, io.StringIO()),
        lambda t: callgraph.report(t, io.StringIO(), "total"),
        lambda t: timeline.dump_chrome(t, io.StringIO()),
        lambda t: timeline.dump_perfetto(t, io.BytesIO()),
        lambda t: callgraph.dump_flame(t, io.StringIO()),
        lambda t: callgraph.graph(t, io.StringIO()),
        lambda t: callgraph.graph(t, io.StringIO(), "main"),
    ):
        show(Trace(path))


def run(cases: int, seed: int, make_case: Callable[[random.Random, int], str], read: Callable[[str], None]) -> int:
    rng = random.Random(seed)
    signal.signal(signal.SIGALRM, _alarm)
    refused = 0
    for case in range(cases):
        path = make_case(rng, case)
        signal.alarm(CASE_SECONDS)
        try:
            read(path)
        except DynprobeError:
            refused += 1
        except BaseException:
            print(f"case {case} (seed {seed}): {path}", file=sys.stderr)
            traceback.print_exc()
            return 1
        finally:
            signal.alarm(0)
    print(f"{cases} cases, {refused} refused with one line, none broke the reader")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz")
    parser.add_argument("kind", choices=("elf", "trace"))
    parser.add_argument("inputs", nargs="+")
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="dynprobe-fuzz-")
    status = 1
    try:
        if args.kind == "elf":
            originals = []
            for path in args.inputs:
                with open(path, "rb") as f:
                    originals.append(f.read())

            def elf_case(rng: random.Random, case: int) -> str:
                path = os.path.join(work, f"case-{case % 2}")  # the last case stays for a look
                with open(path, "wb") as f:
                    f.write(mutate_elf(rng.choice(originals), rng))
                return path

            status = run(args.cases, args.seed, elf_case, read_elf)
            return status

        def trace_case(rng: random.Random, case: int) -> str:
            path = os.path.join(work, f"case-{case % 2}")  # the last case stays for a look
            mutate_trace(rng.choice(args.inputs), path, rng)
            return path

        status = run(args.cases, args.seed, trace_case, read_trace)
        return status
    finally:
        if status == 0:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
