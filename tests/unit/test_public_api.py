"""What `import dynprobe` offers: every error dynprobe raises, by kind; the integer types of
fetch arguments as handlers' typed views apply them."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import dynprobe
from dynprobe.core.session import Session
from dynprobe.errors import DynprobeError, ParseError
from dynprobe.spec.parser import integer_type


def _subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    return found.union(*(_subclasses(c) for c in found)) if found else found


def test_every_error_is_importable_from_dynprobe() -> None:
    for module in pkgutil.walk_packages(dynprobe.__path__, "dynprobe."):
        if not module.name.endswith("__main__"):  # (that one runs the CLI)
            importlib.import_module(module.name)
    errors = {c for c in _subclasses(DynprobeError) if c.__module__.startswith("dynprobe.")}
    cli_only = {c for c in errors if c.__module__.startswith("dynprobe.cli.")}  # (UsageError: a command line's)
    missing = {c.__name__ for c in errors - cli_only if getattr(dynprobe, c.__name__, None) is not c}
    assert not missing and "DynprobeError" in dynprobe.__all__


SESSION_API = {
    "batch", "clock", "close", "detach", "drain", "exit_status", "expand", "flight_recorder", "follow_fork",
    "function_tracer", "interrupt_wait", "layout", "optimize", "optimize_now", "output_failure", "pid", "pin_tracer",
    "probe", "probes", "probes_from", "process", "processes", "program", "record_size", "records_discarded",
    "records_drained", "records_overwritten", "records_waited", "request_snapshot", "request_stop", "retprobe",
    "ring_bytes", "run", "slot_bytes", "slot_bytes_in_use", "snapshots_asked", "stats", "stop", "thread_names",
    "traced_functions", "upcalls", "wait_for_room", "write_raw",
}  # fmt: skip


def test_help_of_a_session_shows_its_public_api_alone_each_part_documented() -> None:
    """What the engine asks of itself (core/runtime.py) is not on the Session a user holds."""
    public = {name for name in dir(Session) if not name.startswith("_")}
    assert public == SESSION_API
    for name in public:
        member = inspect.getattr_static(Session, name)
        assert (member.fget if isinstance(member, property) else member).__doc__, name


CASTS = [
    ("u64", -1, 2**64 - 1),
    ("s64", 2**64 - 1, -1),
    ("s32", 0xFFFF_FFF9, -7),
    ("s32", 0x1_0000_0005, 5),  # the upper half of the register is not the int's
    ("u32", -7, 2**32 - 7),
    ("s16", 0x8000, -(2**15)),
    ("s16", 0x7FFF, 2**15 - 1),
    ("u8", 0x1FF, 0xFF),
    ("s8", 0x80, -128),
    ("x16", -1, 0xFFFF),
]


@pytest.mark.parametrize(("name", "value", "expected"), CASTS)
def test_integer_types_cut_and_sign_extend(name: str, value: int, expected: int) -> None:
    assert integer_type(name).cast(value) == expected


@pytest.mark.parametrize("name", ["string", "symbol", "s33", "int", ""])
def test_a_type_that_is_not_an_integer_type_is_refused(name: str) -> None:
    with pytest.raises(ParseError, match="BAD_TYPE"):
        integer_type(name)
