"""Every refusal of the Python API, one per raise site: one clear error, raised before anything
changes in the target (the same session takes the next call, and the program then runs as if
untraced)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import dynprobe
from dynprobe.core.ftrace import ValueRequest
from dynprobe.errors import NoSuchProcess, ParseError, ProcessError, SessionError, SymbolError
from dynprobe.ringbuf import layout as L
from dynprobe.spec.argspec import parse_values
from dynprobe.symbols.patterns import NamePattern
from tests.conftest import build_target


@pytest.fixture(scope="module")
def counter() -> str:
    return build_target("counter", flags=("-O1", "-pthread"))


@pytest.fixture
def session(counter: str) -> Iterator[dynprobe.Session]:
    with dynprobe.spawn([counter, "1000", "1"], stdout=subprocess.DEVNULL) as session:
        yield session


Call = Callable[[dynprobe.Session], object]

REFUSALS: list[tuple[str, Call, type[Exception], str]] = [
    ("a pattern given to probe()", lambda s: s.probe("wor*"), SessionError, "is a pattern: session.expand"),
    ("pre/post on a return probe", lambda s: s.probe("r work", pre=lambda hit: None), SessionError,
     "takes on_entry/on_return handlers, not pre/post"),
    ("a histogram with no value", lambda s: s.probe("p work", action="hist"), SessionError,
     "a histogram needs a value"),
    ("an unknown action", lambda s: s.probe("p work", action="sum"), SessionError,
     "unknown action 'sum' (count, record, hist)"),
    ("on_event with another action", lambda s: s.probe("p work", action="count", on_event=print), SessionError,
     "on_event receives records: use action='record'"),
    ("a missing @SYMBOL", lambda s: s.probe("p work x=@no_such_symbol"), SymbolError,
     "no symbol 'no_such_symbol' in"),
    ("a 'p' spec given to retprobe()", lambda s: s.retprobe("p work"), SessionError,
     "'p work' is not a return probe spec"),
    ("data_size beyond an entry's room", lambda s: s.retprobe("work", data_size=1 << 20), SessionError,
     "data_size 1048576 is out of range"),
    ("maxactive 0", lambda s: s.retprobe("work", maxactive=0), SessionError, "maxactive 0 is out of range"),
    ("a wait for room below 0", lambda s: setattr(s, "wait_for_room", -1), SessionError,
     "wait_for_room -1 is out of range (0..60.0 s)"),
    ("a spec that does not parse", lambda s: s.probe("p work x="), ParseError, "column"),
    ("an offset past the function", lambda s: s.probe("work+0x10000"), SymbolError,
     "work\\+0x10000 is past the end of work"),
    ("a file offset out of the code", lambda s: s.probe(f"{s.process(s.pid).exe}:0x0"), SymbolError,  # type: ignore[union-attr]
     "offset 0x0 is not in executable code of"),
    ("a tracer of nothing", lambda s: s.function_tracer(filter=["no_such_function*"]), SessionError,
     "no function to trace: the filters match nothing"),
    ("a tracer depth of 0", lambda s: s.function_tracer(depth=0), SessionError,
     f"a depth limit is from 1 to {L.SHADOW_CAPACITY}, in graph mode"),
    ("a depth without graph mode", lambda s: s.function_tracer(graph=False, depth=2), SessionError,
     "a depth limit is from 1"),
    ("a negative time threshold", lambda s: s.function_tracer(threshold_ns=-1), SessionError,
     "a time threshold is a positive time, in graph mode"),
    ("return values without graph mode", lambda s: s.function_tracer(graph=False).record_values(
        [ValueRequest(NamePattern("work"), tuple(parse_values("retval", retval=True)))]), SessionError,
     "return values are recorded in graph mode"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "error", "message"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_each_refusal_says_what_was_wrong(
    session: dynprobe.Session, call: Call, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        call(session)
    assert session.probes == []  # nothing placed: the session goes on
    probe = session.probe("work")
    assert session.run(timeout=60) == 0 and probe.hits == 1000


def test_a_retprobe_on_a_function_named_like_a_spec_takes_its_arguments() -> None:
    """`retprobe("redzone_leaf b=$arg2")` is the function with a fetch argument (its first word
    was taken for a spec's kind, since it begins with r); only p and r (or p:, r:) are kinds."""
    opt = build_target("opt", "opt.c", "opt_asm.S", flags=("-O1", "-pthread"))
    with dynprobe.spawn([opt, "shapes", "1", "100"], stdout=subprocess.DEVNULL) as session:
        named = session.retprobe("redzone_leaf b=$arg2 ret=$retval", action="record")
        spelled = session.retprobe("r:mine/leaf redzone_leaf")
        assert [a.name for a in named.args] == ["b", "ret"] and spelled.event == "leaf"
        assert session.run(timeout=60) == 0
        assert named.hits == spelled.hits == 100


@pytest.mark.parametrize(
    ("ring_bytes", "record_size", "message"),
    [
        (12345, None, "ring size 12345 is not a power of two"),
        (1 << 40, None, "ring size 1099511627776 is out of range"),
        (1 << 20, 24, "record size 24 is not a power of two from 16 to 4096"),
        (1 << 20, 8192, "record size 8192 is not a power of two from 16 to 4096"),
    ],
)
def test_a_ring_or_record_size_out_of_range_is_refused(
    counter: str, ring_bytes: int, record_size: int | None, message: str
) -> None:
    with dynprobe.spawn([counter, "1000", "1"], stdout=subprocess.DEVNULL) as session:
        session.ring_bytes = ring_bytes
        session.record_size = record_size
        with pytest.raises(SessionError, match=message):
            session.layout  # noqa: B018  (fixed when the first thread area is made)


def test_after_the_target_exited_nothing_can_be_placed(counter: str) -> None:
    with dynprobe.spawn([counter, "10", "1"], stdout=subprocess.DEVNULL) as session:
        counted = session.probe("work")
        assert session.run(timeout=60) == 0 and counted.hits == 10
        for call, message in [
            (lambda: session.probe("work"), "the target has exited; no probe can be placed"),
            (lambda: session.expand("p wor*"), "the target has exited; no probe can be placed"),
            (lambda: session.function_tracer(), "the target has exited; nothing can be traced"),
        ]:
            with pytest.raises(SessionError, match=message):
                call()
        assert session._runtime.counters_of_index(10**6) == (0, 0, 0)  # (an index no thread area has)
    with pytest.raises(SessionError, match="the session is closed"):
        session.probe("work")


@pytest.mark.parametrize(
    ("argv", "message"),
    [([], "no command given"), (["no-such-command-here"], "command not found: no-such-command-here"),
     (["/no/such/file"], "no such file: /no/such/file")],
)  # fmt: skip
def test_spawn_refuses_what_it_cannot_run(argv: list[str], message: str) -> None:
    with pytest.raises(ProcessError, match=message):
        dynprobe.spawn(argv)


def test_attach_refuses_what_it_cannot_trace_and_takes_a_thread_for_its_process(spinner: str) -> None:
    """pid 0, itself, a kernel thread: refused in one line; a thread: its process."""
    with pytest.raises(NoSuchProcess, match="no process with pid 0"):
        dynprobe.attach(0)
    with pytest.raises(ProcessError, match="dynprobe cannot trace itself"):
        dynprobe.attach(os.getpid())
    kernel = next(
        pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if parent_of(pid) == 2
    )  # kthreadd's
    with pytest.raises(ProcessError, match=f"pid {kernel} is a kernel thread: dynprobe traces programs"):
        dynprobe.attach(kernel)
    with subprocess.Popen([spinner, "2"], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        thread = max(int(t) for t in os.listdir(f"/proc/{proc.pid}/task"))
        assert thread != proc.pid
        with dynprobe.attach(thread) as session:
            assert session.pid == proc.pid
        proc.terminate()
        assert "ticks=" in proc.communicate(timeout=20)[0]


def parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("PPid:"))
    except OSError:
        return 0


def test_a_program_without_the_right_to_run_says_so(counter: str, tmp_path: Path) -> None:
    copy = tmp_path / "counter"
    shutil.copy(counter, copy)
    copy.chmod(0o644)
    with pytest.raises(ProcessError, match=f"cannot run {copy}: Permission denied"):
        dynprobe.spawn([str(copy)])
