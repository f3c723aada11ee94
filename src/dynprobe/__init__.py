"""dynprobe: kprobes, optprobes, kretprobes and ftrace for user-space x86-64 processes.

The public API is `spawn(argv)` and `attach(pid)`, each returning a context-managed `Session`;
`Trace(directory)` reads what `dynprobe record` wrote.
"""

from __future__ import annotations

from dynprobe.arch.x86_64.regs import Regs
from dynprobe.core.probe import Probe, ProbeMode
from dynprobe.core.session import Session, attach, spawn
from dynprobe.errors import DynprobeError, ParseError, ProbeRefused, ProcessError, Refusal
from dynprobe.tracefile import Trace, TraceEvent

__all__ = [
    "DynprobeError",
    "ParseError",
    "Probe",
    "ProbeMode",
    "ProbeRefused",
    "ProcessError",
    "Refusal",
    "Regs",
    "Session",
    "Trace",
    "TraceEvent",
    "attach",
    "spawn",
]
__version__ = "0.1.0"
