"""dynprobe: kprobes, optprobes, kretprobes and ftrace for user-space x86-64 processes.

The public API is `spawn(argv)` and `attach(pid)`, each returning a context-managed `Session`;
`Trace(directory)` reads what `dynprobe record` wrote. Every error dynprobe raises is a
`DynprobeError`; its kinds are here too.
"""

from __future__ import annotations

from dynprobe.arch.x86_64.regs import Regs
from dynprobe.core.probe import Hit, Probe, ProbeEvent, ProbeMode
from dynprobe.core.session import Session, attach, spawn
from dynprobe.errors import (
    AlreadyTraced,
    DynprobeError,
    ElfError,
    NoSuchProcess,
    OptimizeRefusal,
    ParseError,
    PermissionDenied,
    ProbeRefused,
    ProcessError,
    Refusal,
    SeccompFiltered,
    SessionError,
    SharedMemoryRefused,
    SymbolError,
    ThreadGone,
)
from dynprobe.output.files import OutputError
from dynprobe.output.hist import Bucket, Histogram
from dynprobe.spec.argspec import ArgSpecError
from dynprobe.tracefile import Trace, TraceError, TraceEvent

__all__ = [
    "AlreadyTraced",
    "ArgSpecError",
    "Bucket",
    "DynprobeError",
    "ElfError",
    "Histogram",
    "Hit",
    "NoSuchProcess",
    "OptimizeRefusal",
    "OutputError",
    "ParseError",
    "PermissionDenied",
    "Probe",
    "ProbeEvent",
    "ProbeMode",
    "ProbeRefused",
    "ProcessError",
    "Refusal",
    "Regs",
    "SeccompFiltered",
    "Session",
    "SessionError",
    "SharedMemoryRefused",
    "SymbolError",
    "ThreadGone",
    "Trace",
    "TraceError",
    "TraceEvent",
    "attach",
    "spawn",
]
__version__ = "0.1.0"
