"""Event lines in the ftrace trace format, or as JSON lines.

    comm-tid [cpu] seconds: GROUP/EVENT: (0xaddr) name=value ...
    comm-tid [cpu] seconds: GROUP/EVENT: (0xcaller <- 0xfunction) name=value ...   (return probes)
     => function+0xoff (module)                                               (its stack, if taken)

as /sys/kernel/tracing/trace prints uprobe events, so existing habits (grep, awk, trace-cmd
reading) carry over.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from dynprobe.spec.fetch import FAULT, Value, format_value
from dynprobe.spec.model import FetchArg

if TYPE_CHECKING:
    from dynprobe.core.probe import EventColumns, ProbeEvent
    from dynprobe.core.stacks import Stack


def json_line(event: ProbeEvent) -> str:
    probe = event.probe
    return json.dumps(
        {
            "comm": event.comm, "pid": event.pid, "tid": event.tid, "cpu": event.cpu,
            "time": round(event.time_ns / 1e9, 9), "group": probe.group, "event": probe.event,
            "addr": event.address, **({"caller": event.caller} if event.caller is not None else {}),
            "args": event.json_values(),
            **({"stack": [str(f) for f in event.stack]} if event.stack is not None else {}),
            **({"stack_cut": True} if event.stack is not None and event.stack.cut else {}),
        },
        separators=(",", ":"),
    )  # fmt: skip


def _formatted(arg: FetchArg, column: list[Value], columns: EventColumns) -> list[str]:
    """A column of values as `format_value` formats each (integers in one go)."""
    kind = arg.type.kind
    if kind in "us" and FAULT not in column:
        return list(map(str, column))
    if kind == "x" and FAULT not in column:
        return list(map(hex, column))  # type: ignore[arg-type]
    return [format_value(v, arg.type, columns.symbolize) for v in column]


def ftrace_lines(columns: EventColumns) -> list[str]:
    """A line per event of the columns, in the ftrace format (the module's docstring)."""
    probe = columns.probe
    task = f"{columns.comm}-{columns.tid}"
    head = f"{task:>22} ["
    tail = f"{probe.group}/{probe.event}: ("
    n = len(columns.time_ns)
    args = [""] * n
    for arg, column in zip(probe.args, columns.values, strict=True):
        label = f" {arg.name}="
        args = [a + label + v for a, v in zip(args, _formatted(arg, column, columns), strict=True)]
    if columns.callers is not None:
        address = f" <- {columns.address:#x})"
        wheres = [f"{c:#x}{address}" if c is not None else f"{columns.address:#x})" for c in columns.callers]
    else:
        wheres = [f"{columns.address:#x})"] * n
    # (printf-style: twice as fast as an f-string with a float in it, at a line per event)
    lines = [
        "%s%03d] %12.6f: %s%s%s" % (head, cpu, t / 1e9, tail, where, a)  # noqa: UP031
        for cpu, t, where, a in zip(columns.cpu, columns.time_ns, wheres, args, strict=True)
    ]
    if columns.stacks is None:
        return lines
    # (an event and its stack in one entry: the printer puts events in order, not lines)
    return [line + _stack_lines(stack) for line, stack in zip(lines, columns.stacks, strict=True)]


def _stack_lines(stack: Stack | None) -> str:
    """The stack after its event's line, as ftrace prints a user stack trace: ` => frame` a line."""
    if stack is None:
        return "\n => (no stack: none was stored for this hit)"
    return "".join(f"\n => {line}" for line in str(stack).splitlines())


def json_lines(columns: EventColumns) -> list[str]:
    """`json_line` of each event of the columns."""
    return [json_line(event) for event in columns.events()]
