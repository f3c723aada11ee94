"""Event lines in the ftrace trace format, or as JSON lines.

    comm-tid [cpu] seconds: GROUP/EVENT: (0xaddr) name=value ...

as /sys/kernel/tracing/trace prints uprobe events, so existing habits (grep, awk, trace-cmd
reading) carry over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class EventLine:
    comm: str
    pid: int
    tid: int
    cpu: int
    time: float
    group: str
    event: str
    addr: int
    args: list[tuple[str, str]]  # formatted values, in spec order
    raw: dict[str, object]  # JSON-ready values (None for a faulted fetch)


def ftrace_line(ev: EventLine) -> str:
    task = f"{ev.comm}-{ev.tid}"
    args = "".join(f" {name}={value}" for name, value in ev.args)
    return f"{task:>22} [{ev.cpu:03d}] {ev.time:12.6f}: {ev.group}/{ev.event}: ({ev.addr:#x}){args}"


def json_line(ev: EventLine) -> str:
    return json.dumps(
        {
            "comm": ev.comm, "pid": ev.pid, "tid": ev.tid, "cpu": ev.cpu, "time": round(ev.time, 9),
            "group": ev.group, "event": ev.event, "addr": ev.addr, "args": ev.raw,
        },
        separators=(",", ":"),
    )  # fmt: skip
