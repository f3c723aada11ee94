"""Event lines in the ftrace trace format, or as JSON lines.

    comm-tid [cpu] seconds: GROUP/EVENT: (0xaddr) name=value ...
    comm-tid [cpu] seconds: GROUP/EVENT: (0xcaller <- 0xfunction) name=value ...   (return probes)

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
    caller: int | None = None  # a return event: where the function returned to


def ftrace_line(ev: EventLine) -> str:
    task = f"{ev.comm}-{ev.tid}"
    args = "".join(f" {name}={value}" for name, value in ev.args)
    where = f"{ev.caller:#x} <- {ev.addr:#x}" if ev.caller is not None else f"{ev.addr:#x}"
    return f"{task:>22} [{ev.cpu:03d}] {ev.time:12.6f}: {ev.group}/{ev.event}: ({where}){args}"


def json_line(ev: EventLine) -> str:
    return json.dumps(
        {
            "comm": ev.comm, "pid": ev.pid, "tid": ev.tid, "cpu": ev.cpu, "time": round(ev.time, 9),
            "group": ev.group, "event": ev.event, "addr": ev.addr,
            **({"caller": ev.caller} if ev.caller is not None else {}), "args": ev.raw,
        },
        separators=(",", ":"),
    )  # fmt: skip
