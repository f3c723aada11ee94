"""dynprobe: kprobes, optprobes, kretprobes and ftrace for user-space x86-64 processes.

The public API is `spawn(argv)` and `attach(pid)`, each returning a context-managed `Session`;
`Trace(directory)` reads what `dynprobe record` wrote. Every error dynprobe raises is a
`DynprobeError`; its kinds are here too.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
        ProgramError,
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
    from dynprobe.tracefile import TraceError
    from dynprobe.traces import Trace, TraceEvent

# Where each public name lives: imported on first use, so that `import dynprobe` (and the CLI's
# start-up, which needs none of them to parse its arguments) does not load numpy, iced-x86 and
# pyelftools.
_HOMES = {
    "Regs": "dynprobe.arch.x86_64.regs",
    **dict.fromkeys(("Hit", "Probe", "ProbeEvent", "ProbeMode"), "dynprobe.core.probe"),
    **dict.fromkeys(("Session", "attach", "spawn"), "dynprobe.core.session"),
    **dict.fromkeys(
        (
            "AlreadyTraced", "DynprobeError", "ElfError", "NoSuchProcess", "OptimizeRefusal", "ParseError",
            "PermissionDenied", "ProbeRefused", "ProcessError", "ProgramError", "Refusal", "SeccompFiltered",
            "SessionError",
            "SharedMemoryRefused", "SymbolError", "ThreadGone",
        ),
        "dynprobe.errors",
    ),
    "OutputError": "dynprobe.output.files",
    **dict.fromkeys(("Bucket", "Histogram"), "dynprobe.output.hist"),
    "ArgSpecError": "dynprobe.spec.argspec",
    "TraceError": "dynprobe.tracefile",
    **dict.fromkeys(("Trace", "TraceEvent"), "dynprobe.traces"),
}  # fmt: skip


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'dynprobe' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


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
    "ProgramError",
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
