"""Run inside gdb (`gdb -batch -x gdb_stacks.py --args PROGRAM`): at each call of `leaf` (its
first instruction), the stack as gdb unwinds it, one JSON line per hit on the file named by
$DYNPROBE_GDB_OUT: {"physical": [[file, offset in file, "source:line" or null], ...],
"all": [[inlined, function, "source:line" or null], ...]}, innermost first, down to _start.
"physical" leaves out inlined frames, its lines those of the innermost function inlined there
(where the code is); both leave out the tail calls gdb infers from DWARF's call sites, which
have no frame on the stack."""

import json
import os

import gdb  # type: ignore[import-not-found]


def mappings(pid: int) -> list[tuple[int, int, int, str]]:
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end, int(parts[2], 16), parts[5].strip() if len(parts) > 5 else ""))
    return out


def where(maps: list[tuple[int, int, int, str]], pc: int) -> list[object]:
    for start, end, offset, path in maps:
        if start <= pc < end:
            return [path, pc - start + offset]
    return ["", pc]


def line_of(sal: gdb.Symtab_and_line) -> str | None:
    return f"{os.path.basename(sal.symtab.filename)}:{sal.line}" if sal.symtab and sal.line else None


for command in (
    "set pagination off",
    "set confirm off",
    "set backtrace past-main on",
    "set backtrace past-entry on",
    "handle SIGUSR1 nostop noprint pass",
    "break *leaf",
    "run",
):
    gdb.execute(command, to_string=True)
with open(os.environ["DYNPROBE_GDB_OUT"], "w") as out:
    while gdb.selected_inferior().pid:
        maps = mappings(gdb.selected_inferior().pid)
        frame, stack, every, sal = gdb.newest_frame(), [], [], None
        while frame is not None:
            kind = frame.type()
            if kind != gdb.TAILCALL_FRAME:
                own = frame.find_sal()
                every.append([kind == gdb.INLINE_FRAME, frame.name(), line_of(own)])
                sal = sal or own
                if kind != gdb.INLINE_FRAME:
                    stack.append([*where(maps, frame.pc()), line_of(sal)])
                    sal = None
            frame = frame.older()
        out.write(json.dumps({"physical": stack, "all": every}) + "\n")
        gdb.execute("continue", to_string=True)
