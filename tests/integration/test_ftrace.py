"""The function tracer: golden call graphs (times masked) of small programs through `dynprobe
record` and `replay`/`report`/`dump`, tracer instances with their own functions, attaching to a
running program, and trace directories that are missing, cut short or from a newer dynprobe."""

from __future__ import annotations

import itertools
import json
import os
import pty
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2

import dynprobe
from dynprobe.core.ftrace import TracerEvent
from dynprobe.core.returns import RETURNS_TWICE
from dynprobe.errors import ProbeRefused, Refusal
from dynprobe.ringbuf import layout as L
from dynprobe.symbols.elf import load_elf
from dynprobe.traces import Trace
from tests.conftest import BUILD, DYNPROBE, build_target

from .helpers import run_plain, run_until


def dp(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynprobe.cli.main", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def masked(replay: str) -> list[str]:
    """Replay lines with durations and thread ids masked."""
    out = []
    for line in replay.splitlines()[1:]:
        m = re.match(r"^(.{11}) \[ *(\d+)\] \| (.*)$", line)
        assert m is not None, line
        out.append(("T" if m.group(1).strip() else " ") + " | " + m.group(3))
    return out


def record(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """`dynprobe record` into tmp_path, run there (a -pg program writes its gmon.out where it runs)."""
    trace = str(tmp_path / "trace")
    r = dp("record", "-o", trace, *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return r, trace


def test_recursion_golden_call_graph(ret: str, tmp_path: Path) -> None:
    r, trace = record(tmp_path, "-P", "main", "-P", "fact", "--", ret, "fact", "3")
    assert r.stdout == "6\n" and "dynprobe: tracing 2 functions" in r.stderr
    replay = dp("replay", trace)
    assert replay.returncode == 0, replay.stderr
    assert masked(replay.stdout) == [
        "  | main() {",
        "  |   fact() {",
        "  |     fact() {",
        "T |       fact();",
        "T |     } /* fact */",
        "T |   } /* fact */",
        "T | } /* main */",
    ]
    report = dp("report", "-s", "calls", trace).stdout.splitlines()
    assert [(line.split()[-2], line.split()[-1]) for line in report[2:]] == [("3", "fact"), ("1", "main")]


_BY_DEPTH = {
    1: ["T | main();"],
    2: ["  | main() {", "T |   fact();", "T | } /* main */"],
    3: ["  | main() {", "  |   fact() {", "T |     fact();", "T |   } /* fact */", "T | } /* main */"],
}


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_depth_leaves_out_deeper_calls(ret: str, tmp_path: Path, depth: int) -> None:
    """--depth N: calls nested deeper than N traced calls are not recorded (decided in the target);
    main -> fact(3) -> fact(2) -> fact(1)."""
    r, trace = record(tmp_path, "--depth", str(depth), "-P", "main", "-P", "fact", "--", ret, "fact", "3")
    assert r.stdout == "6\n" and f"dynprobe: {depth} call{'s' if depth > 1 else ''} recorded in" in r.stderr
    assert masked(dp("replay", trace).stdout) == _BY_DEPTH[depth]


def test_live_records_then_replays_and_keeps_nothing(ret: str, tmp_path: Path) -> None:
    """`dynprobe live`: the program's output alone on stdout; its call graph on stderr, as
    record + replay give it; the temporary trace is gone after, and stderr does not name it."""
    temporary = tmp_path / "tmp"  # (its own: another test's `live` may run meanwhile)
    temporary.mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "dynprobe.cli.main", "live", "-P", "main", "-P", "fact", "--", ret, "fact", "3"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env={**os.environ, "TMPDIR": str(temporary)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    graph = "\n".join(line for line in r.stderr.splitlines() if not line.startswith("dynprobe: "))
    assert r.stdout == "6\n" and masked(graph) == [
        "  | main() {", "  |   fact() {", "  |     fact() {", "T |       fact();", "T |     } /* fact */",
        "T |   } /* fact */", "T | } /* main */",
    ]  # fmt: skip
    assert "dynprobe: 4 calls recorded" in r.stderr.splitlines()
    assert not any(temporary.iterdir())


def test_trace_read_from_python(ret: str, tmp_path: Path) -> None:
    """dynprobe.Trace: the events of a trace and its profile, as report shows it."""
    _, trace = record(tmp_path, "-P", "main", "-P", "fact", "--", ret, "fact", "3")
    events = list(dynprobe.Trace(trace).events())
    assert [(e.function, e.exit) for e in events] == [
        ("main", False), ("fact", False), ("fact", False), ("fact", False), ("fact", True), ("fact", True),
        ("fact", True), ("main", True),
    ]  # fmt: skip
    assert all(a.time_ns <= b.time_ns for a, b in itertools.pairwise(events)) and len({e.tid for e in events}) == 1
    (main, main_time), (fact, fact_time) = dynprobe.Trace(trace).profile()
    assert (main, main_time.calls, fact, fact_time.calls) == ("main", 1, "fact", 3)
    assert fact_time.total == events[-2].time_ns - events[1].time_ns  # the outermost call only
    assert main_time.total == events[-1].time_ns - events[0].time_ns


def test_mutual_recursion_golden_call_graph(ret: str, tmp_path: Path) -> None:
    r, trace = record(tmp_path, "-P", "is_even", "-P", "is_odd", "--", ret, "evenodd", "3")
    assert r.stdout == "0\n"
    assert masked(dp("replay", trace).stdout) == [
        "  | is_even() {",
        "  |   is_odd() {",
        "  |     is_even() {",
        "T |       is_odd();",
        "T |     } /* is_even */",
        "T |   } /* is_odd */",
        "T | } /* is_even */",
    ]


def test_signal_handler_golden_call_graph(ret: str, tmp_path: Path) -> None:
    """The handler runs inside the call that raised the signal, and nests there."""
    r, trace = record(tmp_path, "-P", "signaller", "-P", "on_usr1", "-P", "add", "--", ret, "raise")
    assert r.stdout == "11\n"  # SIGUSR1 is 10
    assert masked(dp("replay", trace).stdout) == [
        "  | signaller() {",
        "  |   on_usr1() {",
        "T |     add();",
        "T |   } /* on_usr1 */",
        "T | } /* signaller */",
    ]


def test_threads_each_have_their_call_graph(ret: str, tmp_path: Path) -> None:
    _, trace = record(tmp_path, "-P", "worker", "-P", "add", "--", ret, "threads", "3", "2")
    lines = dp("replay", trace).stdout.splitlines()[1:]
    by_thread: dict[str, list[str]] = {}
    for line in lines:
        by_thread.setdefault(re.findall(r"\[ *(\d+)\]", line)[0], []).append(line.split("| ", 1)[1])
    assert list(by_thread.values()) == [["worker() {", "  add();", "  add();", "} /* worker */"]] * 3
    info = json.loads((Path(trace) / "info.json").read_text())
    assert info["complete"] and info["calls"] == 9 and info["lost"] == 0
    assert [m["path"] for m in info["modules"]] == [os.path.realpath(ret)] and info["command"][0] == ret
    assert {int(t) for t in info["threads"]} >= {int(t) for t in by_thread}
    one, two = list(by_thread)[:2]  # --tid: only those threads' calls
    only = dp("replay", "--tid", one, "--tid", two, trace).stdout.splitlines()[1:]
    assert sorted(re.findall(r"\[ *(\d+)\]", line)[0] for line in only) == sorted([one] * 4 + [two] * 4)
    assert calls_of(trace) == {"add": 6, "worker": 3}
    assert calls_of(trace, "--tid", one) == {"add": 2, "worker": 1}
    assert calls_of(trace, "-t", "100s") == {}  # report -t: only calls that long


def test_cxx_exceptions_and_a_library(ret_cxx: str, tmp_path: Path) -> None:
    r, trace = record(tmp_path, "--lib", str(BUILD / "libret_lib.so"), "-P", "catcher", "-P", "rethrower", "-P",
                      "middle", "-P", "thrower", "-P", "via_lib", "-P", "lib_.*", "--", ret_cxx, "12")  # fmt: skip
    assert r.stdout == run_plain([ret_cxx, "12"]).stdout
    calls = {line.split()[-1]: int(line.split()[-2]) for line in dp("report", trace).stdout.splitlines()[2:]}
    # a function returns when nothing it called threw past it: 12 calls, 4 throws (n % 3 == 0),
    # 3 throws out of the library (n % 4 == 0)
    assert calls == {"catcher": 12, "rethrower": 8, "middle": 8, "thrower": 8, "via_lib": 12,
                     "lib_outer": 9, "lib_inner": 9}  # fmt: skip


def test_dump_chrome_and_flame(ret: str, tmp_path: Path) -> None:
    _, trace = record(tmp_path, "-P", "main", "-P", "fact", "--", ret, "fact", "3")
    chrome = dp("dump", "--chrome", trace, "-o", str(tmp_path / "t.json"))
    assert chrome.returncode == 0, chrome.stderr
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    phases = [(e["ph"], e["name"]) for e in events if e["ph"] in "BE"]
    assert phases == [("B", "main"), ("B", "fact"), ("B", "fact"), ("B", "fact"),
                      ("E", "fact"), ("E", "fact"), ("E", "fact"), ("E", "main")]  # fmt: skip
    stamps = [e["ts"] for e in events if e["ph"] in "BE"]
    assert stamps == sorted(stamps)
    perfetto = dp("dump", "--perfetto", trace, "-o", str(tmp_path / "t.pftrace"))
    assert perfetto.returncode == 0, perfetto.stderr
    packets = perfetto_trace_pb2.Trace.FromString((tmp_path / "t.pftrace").read_bytes()).packet
    names = {n.iid: n.name for p in packets for n in p.interned_data.event_names}
    slices = [(p.track_event.type, names.get(p.track_event.name_iid)) for p in packets if p.HasField("track_event")]
    begin, end = perfetto_trace_pb2.TrackEvent.TYPE_SLICE_BEGIN, perfetto_trace_pb2.TrackEvent.TYPE_SLICE_END
    assert slices == [(begin, "main"), (begin, "fact"), (begin, "fact"), (begin, "fact"),
                      (end, None), (end, None), (end, None), (end, None)]  # fmt: skip
    assert [p.timestamp for p in packets if p.HasField("track_event")] == [round(ts * 1000) for ts in stamps]
    primary, secondary = pty.openpty()  # the standard output a terminal: no bytes on it
    try:
        terminal = subprocess.run([sys.executable, "-m", "dynprobe.cli.main", "dump", "--perfetto", trace],
                                  stdout=secondary, stderr=subprocess.PIPE, text=True, timeout=120)  # fmt: skip
    finally:
        os.close(secondary)
        os.close(primary)
    assert (
        terminal.returncode == 2
        and "writes a binary trace: give -o FILE (trace.pftrace), or redirect" in terminal.stderr
    )
    flame = dp("dump", "--flame", trace).stdout.splitlines()
    assert sorted(line.rsplit(" ", 1)[0] for line in flame) == [
        "main",
        "main;fact",
        "main;fact;fact",
        "main;fact;fact;fact",
    ]


def test_live_keeps_its_trace_where_asked(ret: str, tmp_path: Path) -> None:
    """`live -d DIR`: the call graph on the standard error, and the trace kept in DIR for
    report and dump (without -d it goes with the run)."""
    r = dp("live", "-d", str(tmp_path / "kept"), "-P", "main", "-P", "fact", "--", ret, "fact", "3")
    assert r.returncode == 0 and r.stdout == "6\n", r.stderr
    replay = "# DURATION" + r.stderr.split("# DURATION", 1)[1]
    assert masked(replay)[:2] == ["  | main() {", "  |   fact() {"]
    assert Trace(str(tmp_path / "kept")).info["calls"] == 4


def test_two_million_calls_are_recorded_whole_at_the_defaults(ret: str, tmp_path: Path) -> None:
    """Issue 25's second case: `record` of a program making 2,000,000 calls, its default ring
    (32 MiB): every entry and exit is in the trace (a writer waits for the reader when its ring
    is full; in a stress run, with both CPUs kept busy), none lost."""
    r, trace = record(tmp_path, "-P", "add", "--", ret, "loop", "2000000")
    info = Trace(trace).info
    assert (info["calls"], info["lost"], info["missed"]) == (2_000_000, 0, 0), r.stderr
    assert sum(len(chunk.kind) for chunk in Trace(trace).chunks()) == 4_000_000
    assert "lost" not in r.stderr


def test_a_flight_recorder_s_trace_holds_the_newest_calls(ret: str, tmp_path: Path) -> None:
    """`record --flight-recorder`, a ring of 4096 records and 50,000 calls of add: the trace holds
    the newest 4096 records, add's last calls and main's exit; every other record is counted as
    given way, none lost."""
    r, trace = record(tmp_path, "--flight-recorder", "--ring-size", "65536", "-P", "main", "-P", "add", "--", ret,
                      "loop", "50000")  # fmt: skip
    events = list(Trace(trace).events())
    assert len(events) == 4096 and Trace(trace).info["lost"] == 0
    assert [(e.function, e.exit) for e in events[-3:]] == [("add", False), ("add", True), ("main", True)]
    assert {e.function for e in events[:-1]} == {"add"}
    assert f"flight recorder: {2 * 50_001 - 4096} older records gave way" in r.stderr, r.stderr
    assert "50001 calls traced, the newest 4096 records kept in" in r.stderr


def test_a_flight_recorder_s_threshold_keeps_what_led_up_to_a_long_call(ret: str, tmp_path: Path) -> None:
    """`record --flight-recorder --threshold 150ms`, a ring of 256 records: 20,000 calls of add
    with a 300 ms nap after the 10,000th. The nap's exit takes a snapshot: the trace holds the 84
    whole calls before it (3 records each: entry, argument, exit), the nap, then the newest
    window at the end (main's exit, which lasted as long, asks too, as its thread ends); nothing
    is lost, the calls in between gave way."""
    r, trace = record(tmp_path, "--flight-recorder", "--threshold", "150ms", "--ring-size", "4096",
                      "-P", "main", "-P", "add", "-P", "nap", "-A", "add@arg1", "--", ret, "spike", "20000", "10000",
                      "300")  # fmt: skip
    assert r.stdout == f"{sum(range(1, 20_001))}\n"
    # (2 calls, unless the machine held a thread 150 ms in the middle of another: then that
    # call lasted as long, and its snapshot is kept too)
    kept = re.search(r"20002 calls traced, the newest (\d+) records kept \((\d+) calls of 150.000 ms or more", r.stderr)
    assert kept is not None and int(kept.group(2)) >= 2 and int(kept.group(1)) >= 512, r.stderr
    shown = [line.split("| ", 1)[1] for line in dp("replay", trace).stdout.splitlines()[1:]]
    before, last = (
        [*(f"add({i});" for i in range(9917, 10_001)), "nap();"],
        [f"add({i});" for i in range(19_915, 20_000)],
    )
    assert shown[-len(last) :] == last
    at = shown.index("nap();")
    assert shown[at + 1 - len(before) : at + 1] == before
    if int(kept.group(2)) == 2:
        assert shown == before + last
    assert Trace(trace).info["lost"] == 0 and Trace(trace).info["snapshot_over_ns"] == 150_000_000


def test_a_flight_recorder_s_time_thresholds_are_its_own(ret: str) -> None:
    """A time threshold drops short calls, which a flight recorder keeps: refused with one; a
    snapshot threshold is a flight recorder's only, and it stays one."""
    with open(os.devnull, "w") as null, dynprobe.spawn([ret, "fact", "3"], stdout=null.fileno()) as session:
        with pytest.raises(dynprobe.SessionError, match="a snapshot threshold is a flight recorder's"):
            session.function_tracer(filter=["fact"], snapshot_over_ns=1000)
        session.flight_recorder = True
        with pytest.raises(dynprobe.SessionError, match="a flight recorder keeps every call, the newest"):
            session.function_tracer(filter=["fact"], threshold_ns=1000)
        session.function_tracer(filter=["fact"], snapshot_over_ns=1000)
        with pytest.raises(dynprobe.SessionError, match="a snapshot threshold is a flight recorder's"):
            session.flight_recorder = False


def test_two_tracers_on_the_same_functions_see_their_own_events(ret: str) -> None:
    """One traces add and fact, the other fact only: fact's site goes through a list trampoline;
    stopping the first re-points fact to the second alone."""
    mine: list[TracerEvent] = []
    theirs: list[TracerEvent] = []
    with open(os.devnull, "w") as null, dynprobe.spawn([ret, "fact", "3"], stdout=null.fileno()) as session:
        a = session.function_tracer(filter=["add", "fact"], on_event=mine.append)
        b = session.function_tracer(filter=["fact"], graph=False, on_event=theirs.append)
        a.start()
        b.start()
        assert (a.patched, b.patched) == (2, 1)
        assert session.run(timeout=30) == 0
        session.drain()
    assert [(e.function.name, e.exit) for e in mine] == [("fact", False)] * 3 + [("fact", True)] * 3
    assert [(e.function.name, e.exit) for e in theirs] == [("fact", False)] * 3  # entries only
    assert a.calls == 3 and b.calls == 3


@pytest.mark.parametrize("tracers", [1, 2], ids=["one-tracer", "list-trampoline"])
def test_registers_the_caller_keeps_across_a_traced_call_survive(ret: str, tracers: int) -> None:
    """GCC's IPA-RA keeps values in call-clobbered registers (r11 too) across a call to a function
    it knows does not touch them: a traced entry and exit change none of them, through a tracer's
    own entry or a list trampoline (a graph tracer and an entries-only one)."""
    with tempfile.TemporaryFile("w+") as out:
        with dynprobe.spawn([ret, "ipa", "1000"], stdout=out.fileno()) as session:
            started = [session.function_tracer(filter=["ipa_leaf"], graph=i == 0) for i in range(tracers)]
            for tracer in started:
                tracer.start()
            assert session.run(timeout=60) == 0
        out.seek(0)
        assert out.read() == "0\n"  # the registers ipa_check found changed
    assert [t.calls for t in started] == [1000] * tracers


def test_a_traced_function_is_entered_through_the_trampoline_table(ret: str) -> None:
    """So that its return is predicted (see the return-probe test of the same name)."""
    with tempfile.TemporaryFile("w+") as out:
        with dynprobe.spawn([ret, "peek"], stdout=out.fileno()) as session:
            tracer = session.function_tracer(filter=["peek_leaf"])
            tracer.start()
            assert session.run(timeout=60) == 0
        out.seek(0)
        assert out.read() == f"{L.TRAMPOLINE_CALL}\n"
    assert tracer.calls == 1 and tracer.patched == 1


def test_a_probe_on_a_traced_function_is_refused_with_the_reason(ret: str) -> None:
    with open(os.devnull, "w") as null, dynprobe.spawn([ret, "fact", "3"], stdout=null.fileno()) as session:
        tracer = session.function_tracer(["fact"])
        tracer.start()
        with pytest.raises(ProbeRefused) as refused:
            session.probe("fact")
        assert refused.value.reason == Refusal.FUNCTION_TRACED
        tracer.stop()
        probe = session.probe("fact", action="count")  # the tracer is gone: the bytes are the file's
        assert session.run(timeout=30) == 0
        assert probe.hits == 3


def test_a_function_with_a_probe_is_left_out_of_a_tracer_with_the_reason(ret: str) -> None:
    """The other way round: the probe stays, the tracer says why it left the function out, and
    starting or stopping a tracer twice does nothing more."""
    with open(os.devnull, "w") as null, dynprobe.spawn([ret, "fact", "3"], stdout=null.fileno()) as session:
        probe = session.probe("fact", action="count")
        tracer = session.function_tracer(["fact", "main"])
        tracer.start()
        tracer.start()
        assert dict(tracer.not_patched) == {"PROBED": 1} and tracer.patched == 1
        assert session.run(timeout=30) == 0
        tracer.stop()
        tracer.stop()
        assert probe.hits == 3 and tracer.calls == 1  # main's


def test_a_tracer_tells_its_progress(ret: str) -> None:
    """`start(progress)`: told as each hundred functions are done (libc's ~3,000 here)."""
    with open(os.devnull, "w") as null, dynprobe.spawn([ret, "fact", "3"], stdout=null.fileno()) as session:
        tracer = session.function_tracer(libraries=["libc"], graph=False)
        told: list[int] = []
        tracer.start(progress=told.append)
        assert len(tracer.functions) > 1000 and told == [100] * (len(tracer.functions) // 100)
        assert session.run(timeout=60) == 0


def test_stop_one_tracer_the_other_keeps_tracing(ret: str) -> None:
    with subprocess.Popen([ret, "sleep"], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            with dynprobe.attach(proc.pid) as session:
                a = session.function_tracer(["nap"])
                b = session.function_tracer(["nap"])
                a.start()
                b.start()
                run_until(session, lambda: a.calls >= 3 and b.calls >= 3, "3 calls seen by each")
                a.stop()
                a_calls, b_calls = a.calls, b.calls
                run_until(session, lambda: b.calls > b_calls, "another call seen by b")
                assert a.calls == a_calls
            # detached with nap pending: the program goes on
            before = int(proc.stdout.readline())
            assert [int(proc.stdout.readline()) for _ in range(3)] == [before + 1, before + 2, before + 3]
        finally:
            proc.kill()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("missing", "is not a trace: info.json is missing"),
        ("newer", "was written by a newer dynprobe (format 99; this one reads 3)"),
        ("nodir", "no trace directory"),
        ("no clock", "info.json is damaged: no clock"),
        ("record_size", "info.json is damaged: record_size is not a power of two from 16 to 4096"),
        ("threshold", "info.json is damaged: threshold_ns is not a number"),
        ("functions", "info.json is damaged: the function table is not a list of [name, ...]"),
        ("many values", "info.json is damaged: the recorded values are not a table of function id"),
        ("two retvals", "info.json is damaged: the recorded values are not a table of function id"),
        ("nested", "info.json is not JSON: maximum recursion depth exceeded"),
        ("binary", "info.json is not JSON:"),
        ("fifo info", "info.json cannot be read: not a regular file"),
        ("fifo events", "events.raw cannot be read: not a regular file"),
    ],
)
def test_bad_trace_directory_one_line(ret: str, tmp_path: Path, damage: str, message: str) -> None:
    _, trace = record(tmp_path, "-P", "fact", "--", ret, "fact", "3")
    info = Path(trace) / "info.json"
    edits: dict[str, Callable[[dict[str, Any]], object]] = {
        "newer": lambda i: i.update(version=99),
        "no clock": lambda i: i.pop("clock"),
        "record_size": lambda i: i.update(record_size=1 << 40),
        "threshold": lambda i: i.update(threshold_ns="10us"),
        "functions": lambda i: i.update(functions=[[1, "a.out", 0, 0]]),
        "many values": lambda i: i.update(captures={"0": [["arg1"] * 1000, []]}),
        "two retvals": lambda i: i.update(captures={"0": [[], ["retval", "retval"]]}),
    }
    if damage == "missing":
        info.unlink()
    elif damage in edits:
        content = json.loads(info.read_text())
        edits[damage](content)
        info.write_text(json.dumps(content))
    elif damage == "nested":
        info.write_text("[" * 100_000 + "]" * 100_000)
    elif damage == "binary":
        info.write_bytes(b"\xff\xfe" * 100)
    elif damage.startswith("fifo"):  # read, a FIFO would block dynprobe for ever
        fifo = info if damage == "fifo info" else Path(trace) / "events.raw"
        fifo.unlink()
        os.mkfifo(fifo)
    else:
        trace += "-nothing"
    r = dp("replay", trace)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def test_forged_records_are_left_out_with_a_count(ret: str, tmp_path: Path) -> None:
    """The target writes its ring: a function id past the table, a time before the recording
    began or after it ended, are left out (a forged id once made replay build 12e9 strings)."""
    _, trace = record(tmp_path, "-P", "fact", "--", ret, "fact", "4")
    events = Path(trace) / "events.raw"
    data = bytearray(events.read_bytes())
    record_size = json.loads((Path(trace) / "info.json").read_text())["record_size"]
    assert int.from_bytes(data[8:16], "little") == 8  # one chunk: 4 entries, then 4 exits

    def forge(index: int, offset: int, value: int, size: int) -> None:
        at = 16 + index * record_size + offset
        data[at : at + size] = value.to_bytes(size, "little")

    forge(2, 8, 1, 8)  # the third entry: a time stamp at the counter's start, before the recording
    forge(3, 4, 0xFFFF_FFF0, 4)  # the fourth: a function id past the table
    forge(4, 8, 1 << 62, 8)  # its exit: a time long after the recording ended
    forge(5, 4, 1, 4)  # the third's exit: function 1 of a table of 1
    events.write_bytes(data)
    r = dp("replay", trace)
    assert r.returncode == 0 and r.stderr.splitlines() == [
        "dynprobe: warning: 4 records left out: a function id past the trace's table or a time outside the "
        "recording (written by the traced program itself?)"
    ], r.stderr
    assert masked(r.stdout) == ["  | fact() {", "T |   fact();", "T | } /* fact */"]
    assert len(list(Trace(trace).events())) == 4


def test_truncated_trace_replays_what_it_has(ret: str, tmp_path: Path) -> None:
    _, trace = record(tmp_path, "-P", "fact", "--", ret, "fact", "3")
    events = Path(trace) / "events.raw"
    data = events.read_bytes()
    events.write_bytes(data[: len(data) - 20])  # the last record and a half gone
    r = dp("replay", trace)
    assert r.returncode == 0 and "truncated: read up to byte" in r.stderr
    assert masked(r.stdout)[:3] == ["  | fact() {", "  |   fact() {", "T |     fact();"]


def test_filters_that_match_nothing_say_so(ret: str, tmp_path: Path) -> None:
    r = dp("record", "-o", str(tmp_path / "t"), "-P", "no_such_function.*", "--", ret, "fact", "3")
    assert r.returncode == 1 and "no function to trace: the filters match nothing" in r.stderr
    assert not os.path.exists(tmp_path / "t")


def test_a_library_the_program_does_not_load_is_named(ret: str, ret_cxx: str, tmp_path: Path) -> None:
    """`--lib` of a library the program does not load at start: traced if it is loaded later,
    and said so, rather than an empty trace without a word. Its own libraries are not named."""
    library = str(BUILD / "libret_lib.so")
    r = dp("record", "-o", str(tmp_path / "t"), "--lib", library, "--", ret, "fact", "3")
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stderr.splitlines() if "loads at start" in line]
    assert said == [
        "dynprobe: libret_lib.so is not a library ret loads at start: its functions are traced if the "
        "program loads it later (dlopen)"
    ]
    r = dp("record", "-o", str(tmp_path / "u"), "--lib", library, "-P", "lib_.*", "--", ret_cxx, "3")
    assert r.returncode == 0 and "loads at start" not in r.stderr, r.stderr


@pytest.mark.parametrize(
    "flags",
    [
        ("-pg", "-mfentry", "-mnop-mcount", "-fno-PIE", "-no-pie"),
        ("-fpatchable-function-entry=5", "-fcf-protection=full"),
    ],
    ids=["mnop-mcount", "patchable-entry"],
)
def test_patchable_nop_entries(flags: tuple[str, ...], tmp_path: Path) -> None:
    """Functions built with a NOP area for tracers are patched over it (after endbr64)."""
    binary = build_target("ret_" + flags[-1].strip("-=").replace("=", "_"), "ret.c", flags=("-O1", "-pthread", *flags))
    r, trace = record(tmp_path, "-P", "main", "-P", "fact", "--", binary, "fact", "3")
    assert r.stdout == "6\n" and "tracing 2 functions (2 at their patchable NOP entry)" in r.stderr
    assert [line.split("| ", 1)[1] for line in masked(dp("replay", trace).stdout)] == [
        "main() {", "  fact() {", "    fact() {", "      fact();", "    } /* fact */", "  } /* fact */", "} /* main */",
    ]  # fmt: skip


def test_pg_entries_that_call_mcount_through_the_got(tmp_path: Path) -> None:
    """-pg without -mfentry: each entry is `push rbp; mov rbp,rsp; call [rip+mcount@GOT]`; that
    call ends the relocated region, as a jmp through the same GOT slot (mcount still runs: the
    program writes its gmon.out)."""
    binary = build_target("ret_pg", "ret.c", flags=("-O1", "-pthread", "-pg"))
    image = load_elf(binary)
    for name in ("is_even", "is_odd"):  # push rbp; mov rbp,rsp; call [rip+...]
        assert image.code(image.by_name[name].addr, 6)[-2:] == b"\xff\x15"
    trace = str(tmp_path / "trace")
    r = dp("record", "-o", trace, "-P", "is_even", "-P", "is_odd", "--", binary, "evenodd", "3", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout == "0\n" and "tracing 2 functions" in r.stderr, r.stderr
    assert [line.split("| ", 1)[1] for line in masked(dp("replay", trace).stdout)] == [
        "is_even() {", "  is_odd() {", "    is_even() {", "      is_odd();", "    } /* is_even */", "  } /* is_odd */",
        "} /* is_even */",
    ]  # fmt: skip
    assert (tmp_path / "gmon.out").stat().st_size > 0


def test_same_call_graph_as_uftrace(tmp_path: Path) -> None:
    """uftrace (dynamic patching, `-P .`) and dynprobe on the same -mnop-mcount binary: the same
    calls, thread by thread (uftrace merges threads by time and marks scheduling; compared as
    entries and exits per thread)."""
    uftrace = shutil.which("uftrace")
    if uftrace is None:
        pytest.skip("uftrace is not installed (Debian package uftrace; `make test` installs it where it can)")
    flags = ("-O1", "-pthread", "-pg", "-mfentry", "-mnop-mcount", "-fno-PIE", "-no-pie")
    binary = build_target("ret_mnop-mcount_uftrace", "ret.c", flags=flags)
    theirs = tmp_path / "uftrace.data"
    args = ["-P", "main", "-P", "worker", "-P", "add"]
    subprocess.run([uftrace, "record", "-P", ".", "--no-libcall", "--no-event", "-d", str(theirs), *args, binary,
                    "threads", "2", "3"], check=True, capture_output=True, cwd=tmp_path)  # fmt: skip
    uftrace_graph = subprocess.run([uftrace, "replay", "-d", str(theirs)], check=True, capture_output=True, text=True)
    _, trace = record(tmp_path, *args, "--", binary, "threads", "2", "3")
    ours = dp("replay", trace).stdout

    def calls(text: str) -> list[list[str]]:
        threads: dict[str, list[str]] = {}
        for line in text.splitlines()[1:]:
            tid, call = re.findall(r"\[ *(\d+)\]", line)[0], line.split("| ", 1)[1].strip()
            events = threads.setdefault(tid, [])
            if call.endswith("();"):
                events += ["> " + call[:-3], "<"]
            elif call.endswith("{"):
                events.append("> " + call[:-4])
            elif call.startswith("}"):
                events.append("<")
        return sorted(threads.values())

    assert calls(ours) == calls(uftrace_graph.stdout)
    assert calls(ours) == sorted([["> main", "<"]] + [["> worker"] + ["> add", "<"] * 3 + ["<"]] * 2)


def calls_of(trace: str, *options: str) -> dict[str, int]:
    report = dp("report", *options, trace)
    assert report.returncode == 0, report.stderr
    return {line.split()[-1]: int(line.split()[-2]) for line in report.stdout.splitlines()[2:]}


def test_longjmp_signal_handler_pointer_and_library(ret: str, tmp_path: Path) -> None:
    """Frames left by longjmp close with their caller; a signal handler's calls nest where the
    signal came; a call through a pointer and a library function are traced like any call."""
    _, trace = record(tmp_path, "-P", "main", "-P", "dive", "-P", "fact", "--", ret, "longjmp", "3", "2")
    assert calls_of(trace) == {"main": 1, "fact": 5}  # dive never returns
    # Each jump's calls are left where the next ones reuse their frames: no pile-up of open calls
    # (10^5 jumps would indent by 10^5 levels), each chain starts at main's depth.
    lines = [line.split("| ", 1)[1] for line in masked(dp("replay", trace).stdout)]
    dives = ["  dive() {", "    dive() {", "      dive() {"]
    assert lines[:10] == ["main() {", *dives * 3]
    assert lines[10:] == [
        "  fact() {", "    fact() {", "      fact() {", "        fact() {", "          fact();",
        "        } /* fact */", "      } /* fact */", "    } /* fact */", "  } /* fact */", "} /* main */",
    ]  # fmt: skip

    # A signal that lands in the tracer's own code (most of a traced add's time): the handler's
    # events wait for nothing, they are missed and counted (the ring takes one writer at a time).
    # ~7 in 8 land there: a signal every 100 us (~150 in the run) leaves some handler calls
    # recorded (every 500 us, ~20, left none about one run in 12).
    r, trace = record(tmp_path, "-P", "add", "-P", "on_alarm", "--", ret, "signal", "300000", "100")
    handler_calls = int(r.stdout.split()[1])
    calls = calls_of(trace)
    missed = json.loads((Path(trace) / "info.json").read_text())["missed"]
    assert handler_calls > 0 and 0 < calls["on_alarm"] <= handler_calls
    assert calls["add"] + missed >= 300000 + handler_calls and missed >= handler_calls - calls["on_alarm"]
    replay = dp("replay", trace).stdout
    assert "on_alarm() {" in replay and re.search(r"\| +  add\(\);", replay)  # add inside the handler

    r, trace = record(tmp_path, "-P", "add", "--", ret, "pointer", "5")
    assert r.stdout == "15\n" and calls_of(trace) == {"add": 5}

    r, trace = record(tmp_path, "--no-libcall", "--lib", "libc", "-P", "main", "-P", "printf", "--", ret, "loop", "3")
    assert r.stdout == "6\n" and "tracing 1 function, 1 more once their library is mapped" in r.stderr
    assert [line.split("| ", 1)[1] for line in masked(dp("replay", trace).stdout)] == [
        "main() {",
        "  printf();",
        "} /* main */",
    ]


@pytest.mark.parametrize("threshold", [[], ["--threshold", "1ns"]], ids=["all", "threshold"])
@pytest.mark.parametrize("follow", [False, True], ids=["child-let-go", "child-followed"])
def test_fork_with_traced_functions(ret: str, tmp_path: Path, follow: bool, threshold: list[str]) -> None:
    """The parent's calls; a followed child's own calls too (the default), and its returns from
    the calls it began inside, counted as calls, as uftrace counts them. With a threshold, the
    entries the parent held back when it forked are not the child's: those returns are not
    recorded in it."""
    args = threshold if follow else ["--no-follow-fork", *threshold]
    r, trace = record(tmp_path, *args, "-P", "forking", "-P", "fork_outer", "-P", "add", "--", ret, "fork")
    assert sorted(r.stdout.split("\n")) == ["", "child 20", "parent 30"]
    inherited = 2 if follow and not threshold else 1
    assert calls_of(trace) == {"forking": inherited, "fork_outer": inherited, **({"add": 1} if follow else {})}


def test_threshold_drops_short_calls_in_the_target(ret: str, tmp_path: Path) -> None:
    """`--threshold`: a call that ends sooner takes its records back in the target (its callees'
    with them); the trace holds exactly the calls that lasted, in call-graph order."""
    r, trace = record(tmp_path, "--threshold", "1ms", "-P", "main", "-P", "add", "-P", "slow", "-P", "nap", "--",
                      ret, "mixed", "100")  # fmt: skip
    assert r.stdout == "5050\n"
    assert "121 calls traced, those of 1.000 ms or more recorded" in r.stderr  # 90 + 10 x (slow, nap, add) + main
    assert [line.split("| ", 1)[1] for line in masked(dp("replay", trace).stdout)] == [
        "main() {", *["  slow() {", "    nap();", "  } /* slow */"] * 10, "} /* main */",
    ]  # fmt: skip
    assert sum(len(chunk.kind) for chunk in Trace(trace).chunks()) == 2 * 21  # nothing else reached the disk


@pytest.fixture(scope="module")
def names() -> str:
    return build_target("names", "names.cpp", flags=("-O0", "-lstdc++"))


def test_cxx_names_demangled_in_filters_and_call_graphs(names: str, tmp_path: Path) -> None:
    """-P matches demangled names; replay shows uftrace's simple form, --demangle full and no
    the others; aliases (the destructor's D1 and D2, one address) are one function."""
    r, trace = record(tmp_path, "-P", "app::.*", "-U", "app::twice", "--", names)
    assert r.stdout == "12 3 4 2\ntotal=6\n" and "tracing 4 functions" in r.stderr, r.stderr
    assert [line.split("| ", 1)[1] for line in masked(dp("replay", trace).stdout)] == [
        "app::Counter::add();",
        "app::Counter::add();",
        "app::Counter::add();",
        "app::largest();",
        "app::Counter::operator()();",
        "app::Counter::~Counter();",
    ]  # fmt: skip (printf's arguments are evaluated from the right)
    full = [line.split("| ", 1)[1] for line in masked(dp("replay", "--demangle", "full", trace).stdout)]
    assert full[3:5] == ["long app::largest<long>(long, long);", "app::Counter::operator()(long) const;"]
    assert "_ZN3app7largestIlEET_S1_S1_" in dp("report", "--demangle", "no", trace).stdout


def test_cxx_names_as_probe_locations(names: str) -> None:
    """A C++ function by its demangled name, simple or full with spaces left out (templates,
    overloads); an overloaded simple name is refused with the candidates."""
    specs = ["app::Counter::add", "app::twice(double)", "r app::largest<long>(long,long) ret=$retval",
             "app::Counter::operator()", "app::Counter::~Counter"]  # fmt: skip
    r = dp("trace", *specs, "--", names)
    assert r.returncode == 0, r.stderr
    hits = re.findall(r"^  (\S+) .* hits=(\d+) missed=0$", r.stderr, re.M)
    assert [int(n) for _, n in hits] == [3, 1, 1, 1, 1], r.stderr
    assert "ret=0x4" in r.stderr
    r = dp("trace", "app::twice", "--", names)
    assert r.returncode != 0 and r.stderr.startswith("dynprobe: error: 'app::twice' names 2 functions in ")
    assert "(overloads): give one's symbol: _ZN3app5twiceEl, _ZN3app5twiceEd\n" in r.stderr
    listed = dp("list", names, "app::Counter::*").stdout
    functions = [line.split("  ")[-1] for line in listed.splitlines()[1:]]
    assert "app::Counter::add" in functions and "app::Counter::~Counter" in functions
    assert not [f for f in functions if "twice" in f]


def test_a_library_unloaded_and_loaded_again_is_traced_again() -> None:
    """Hazard 20 for the tracer: lib_a is dlopen'ed, closed, lib_b takes its place, lib_a comes
    back (tests/targets/dl.c, two rounds). Each load of lib_a is patched anew, and lib_b, mapped
    where lib_a's patched function was, is left as it is."""
    lib_a = build_target("libdl_a", "libdl_a.c", flags=("-O1", "-shared", "-fPIC"), output="libdl_a.so")
    lib_b = build_target("libdl_b", "libdl_b.c", flags=("-O1", "-shared", "-fPIC"), output="libdl_b.so")
    main = build_target("dl", flags=("-O1", "-ldl"))
    argv = [main, lib_a, lib_b]
    events: list[TracerEvent] = []
    with tempfile.TemporaryFile("w+") as out:
        with dynprobe.spawn(argv, stdout=out) as session:
            tracer = session.function_tracer(filter=["lib_func"], libraries=[lib_a], on_event=events.append)
            tracer.start()
            assert session.run(timeout=30) == 0
            assert tracer.patched == 0 and tracer.not_patched == {"NOT_MAPPED": 1}  # lib_a is closed at the end
        out.seek(0)
        assert out.read() == run_plain(argv).stdout
    assert [(e.function.name, e.exit) for e in events] == [("lib_func", False), ("lib_func", True)] * 6


def test_indirect_functions_are_traced_by_their_name(tmp_path: Path) -> None:
    """libc's strlen and memcpy are IFUNCs: traced where they resolve, under their names."""
    target = build_target("ifunc", flags=("-O1",))
    events: list[TracerEvent] = []
    with tempfile.TemporaryFile("w+") as out, dynprobe.spawn([target, "3"], stdout=out) as session:
        tracer = session.function_tracer(filter=["strlen", "memcpy"], libraries=["libc"], on_event=events.append)
        tracer.start()
        assert session.run(timeout=30) == 0
    # memcpy's implementation is also the body of mempcpy, which jumps into its first bytes
    # (libc has no symbols for either: the unwind tables say where they are)
    assert [e.function.name for e in events if not e.exit] == ["strlen"] * 3
    assert tracer.patched == 1 and tracer.not_patched == {"JUMP_INTO_REGION": 1}


def test_libc_functions_that_return_twice_never_crash_the_program(tmp_path: Path) -> None:
    """`record --lib libc` over setjmp/longjmp, sigsetjmp/siglongjmp, getcontext/setcontext,
    swapcontext coroutines, vfork and pthread_exit: the program's output and status are its own
    (a return hook in setjmp crashed it: the jmp_buf kept the hook, taken again by longjmp).
    The functions that return twice are left unpatched and counted; a return probe on one is
    refused."""
    twice = build_target("twice", flags=("-O1", "-pthread"))
    alone = subprocess.run([twice], capture_output=True, text=True, timeout=60)
    assert alone.returncode == 0 and alone.stdout == "jumps=4 resumed=1 switches=4 child=3 thread=7\n"
    r = dp("record", "--lib", "libc", "-o", str(tmp_path / "t.data"), "--", twice)
    assert (r.returncode, r.stdout) == (0, alone.stdout), r.stderr
    assert re.search(r"not patched: \d+ \(.*RETURNS_TWICE \d+", r.stderr), r.stderr
    names = {f[0] for f in Trace(str(tmp_path / "t.data")).info["functions"]}
    assert {"longjmp", "pthread_exit", "setcontext"} <= names
    with dynprobe.spawn([twice], stdout=subprocess.DEVNULL) as session, pytest.raises(ProbeRefused) as refused:
        session.retprobe("libc:_setjmp")
    assert refused.value.reason == Refusal.RETURNS_TWICE


@pytest.mark.parametrize(
    ("target", "argv", "options"),
    [
        ("ret_cxx", ["12"], []),
        ("ret_cxx", ["12"], ["--lib", "libstdc++", "--lib", "libgcc_s"]),
        ("twice", [], []),
        ("ret", ["longjmp", "3", "2"], []),
        ("ret", ["signal", "200000", "100"], []),
        ("ret", ["swap", "5"], []),
        ("ret", ["backtrace"], []),
        ("ret", ["exit", "7"], []),
        ("ret", ["threads", "3", "100"], []),
    ],
    ids=["cxx", "cxx-libstdc++", "twice", "longjmp", "signal", "swap", "backtrace", "exit", "threads"],
)
def test_library_calls_never_crash_the_program(
    ret: str, ret_cxx: str, target: str, argv: list[str], options: list[str], tmp_path: Path
) -> None:
    """`record` traces the program's library calls by default: exceptions thrown and resumed
    through them (_Unwind_Resume, called where a cleanup ends, unwinds from its caller: its own
    hooked return address goes back first), setjmp/longjmp, contexts, vfork, pthread_exit,
    signals, backtrace(), exit: the program prints and exits as it does alone."""
    binary = {"ret": ret, "ret_cxx": ret_cxx}.get(target) or build_target(target, flags=("-O1", "-pthread"))
    alone = subprocess.run([binary, *argv], capture_output=True, text=True, timeout=60)
    r = dp("record", *options, "-o", str(tmp_path / "t.data"), "--", binary, *argv)
    if argv[:1] == ["signal"]:  # (how many alarms come depends on how long the loop takes: each its own sum)
        total, alarms, alarm_sum = (int(word) for word in r.stdout.split())
        assert r.returncode == alone.returncode == 0 and total == int(alone.stdout.split()[0]), r.stderr
        assert alarm_sum == alarms * (alarms + 1) // 2, r.stdout
        return
    assert (r.returncode, r.stdout) == (alone.returncode, alone.stdout), r.stderr


REAL_PROGRAMS = {
    "sort": ["sort", "{input}"],
    "gzip": ["gzip", "-c", "{input}"],
    "python3": ["/usr/bin/python3", "-c", "import json, re; print(json.dumps(sorted(re.findall('[a-z]+', 'b a c'))))"],
    "sqlite3": ["sqlite3", ":memory:", "create table t(x); insert into t values (3), (1); select * from t order by x;"],
    "python3-libm": ["/usr/bin/python3", "-c", "import math; print(math.sqrt(2), math.sin(1), math.lgamma(9.5))"],
}


@pytest.mark.parametrize("program", REAL_PROGRAMS, ids=list(REAL_PROGRAMS))
def test_real_programs_under_record_lib_libc_print_and_exit_as_alone(program: str, tmp_path: Path) -> None:
    argv = REAL_PROGRAMS[program]
    if shutil.which(argv[0]) is None:
        pytest.skip(f"{argv[0]} is not installed here")
    text = tmp_path / "input.txt"
    text.write_text("".join(f"line {i * 7919 % 1000}\n" for i in range(2000)))
    argv = [a.format(input=text) for a in argv]
    alone = subprocess.run(argv, capture_output=True, timeout=60)
    libraries = ["--lib", "libm", "--lib", "libc"] if program.endswith("libm") else ["--lib", "libc"]
    if program == "sqlite3":  # (its library too: switch tables and tiny functions, patched)
        libraries += ["--lib", "libsqlite3"]
    record = ["record", *libraries, "-o", str(tmp_path / "t.data")]
    traced = subprocess.run([*DYNPROBE, *record, "--", *argv], capture_output=True, timeout=300)
    assert (traced.returncode, traced.stdout) == (alone.returncode, alone.stdout), traced.stderr
    assert re.search(rb"dynprobe: [1-9]\d* calls recorded", traced.stderr), traced.stderr


def test_record_names_the_programs_functions_it_could_not_trace(tmp_path: Path) -> None:
    """A function a loop jumps back into cannot be patched: it is absent from the call graph,
    and record says which, by name and why, not only how many; one with a switch table is
    patched (its table read: no case lands in the patched bytes) and traced."""
    switchy = build_target("switchy", flags=("-O1", "-fjump-tables"))
    r = dp("record", "-o", str(tmp_path / "t.data"), "--", switchy)
    assert r.returncode == 0 and r.stdout == "11\n", r.stderr
    assert r.stderr.splitlines()[-1] == "dynprobe: not traced, of switchy's functions: count_down (JUMP_INTO_REGION)"
    replay = dp("replay", str(tmp_path / "t.data"))
    assert "dispatch();" in replay.stdout and "plain();" in replay.stdout and "count_down" not in replay.stdout


def test_record_follows_children_and_the_programs_they_exec(tmp_path: Path) -> None:
    """As uftrace does, by default: a child made by fork that execs, and one made by posix_spawn
    (a vfork-style clone then exec), are traced in the program they run, with their own threads;
    --no-follow-fork traces the parent alone. The program's output and status are its own."""
    execer = build_target("execer", flags=("-O1",))
    for options, expected in (
        ([], {("in_child", "main"), ("in_spawned", "main"), ("in_parent", "main")}),
        (["--no-follow-fork"], {("in_parent", "main")}),
    ):
        trace = tmp_path / f"t{len(options)}.data"
        r = dp("record", "--no-libcall", *options, "-o", str(trace), "--", execer)
        assert (r.returncode, r.stdout) == (0, "10 20 0\n"), r.stderr
        by_thread: dict[int, list[str]] = {}
        for event in Trace(str(trace)).events():
            if not event.exit:
                by_thread.setdefault(event.tid, []).append(event.function)
        assert {(calls[1], calls[0]) for calls in by_thread.values()} == expected, by_thread
        assert len(by_thread) == len(expected)


def call_tree(replay: str, leave_out: Collection[str] = ()) -> list[list[tuple[int, str]]]:
    """Per thread, each line of a replay as (depth, call), durations and thread ids dropped, the
    lines of functions in `leave_out` too. `f() {` then `} /* f */` is `f();` (uftrace writes a
    call so when other threads' lines come between, as it merges threads by time)."""
    threads: dict[str, list[tuple[int, str]]] = {}
    for line in replay.splitlines()[1:]:
        found = re.findall(r"\[ *(\d+)\]", line)
        if not found or "| " not in line:
            continue
        text = line.split("| ", 1)[1]
        depth, call = (len(text) - len(text.lstrip())) // 2, text.strip()
        if re.sub(r"\W.*", "", call.removeprefix("} /* ")) in leave_out:
            continue
        tree = threads.setdefault(found[0], [])
        if call.startswith("} /* ") and tree and tree[-1] == (depth, call[5:-3] + "() {"):
            tree[-1] = (depth, call[5:-3] + "();")
        else:
            tree.append((depth, call))
    return sorted(threads.values())


@pytest.mark.parametrize(
    ("program", "filters"),
    [
        (["fact", "4"], ["-F", "fact"]),
        (["evenodd", "5"], ["-F", "is_odd", "-D", "2"]),
        (["evenodd", "4"], ["-F", "is_.*"]),
        (["threads", "2", "3"], ["-F", "worker", "-N", "add"]),
        (["fact", "5"], ["-N", "fact", "-F", "main"]),
        (["evenodd", "3"], ["-C", "is_odd"]),
        (["threads", "2", "3"], ["-C", "add"]),
        (["fact", "4"], ["-C", "fact", "-F", "main"]),
        (["evenodd", "3"], ["-F", "main", "-T", "is_odd@trace_off"]),
        (["evenodd", "3"], ["-T", "is_odd@trace_on", "--disable"]),
        (["evenodd", "5"], ["-F", "main", "-T", "is_odd@depth=1"]),
        (["evenodd", "3"], ["-F", "main", "-T", "is_odd@notrace"]),
        (["evenodd", "5"], ["-T", "is_odd@filter", "-D", "2"]),  # (record: -D counted from is_odd, when read)
        (["evenodd", "4"], ["-F", "main", "-T", "is_odd@backtrace"]),
        (["fact", "4"], ["-F", "fact", "-T", "fact@backtrace"]),  # (main, not shown, is in the backtraces)
    ],
)
def test_filters_mean_what_uftrace_s_mean(tmp_path: Path, program: list[str], filters: list[str]) -> None:
    """-F keeps a function's calls with everything under them, -N drops them with everything
    under them, -D counts from the nearest -F call, -C keeps a function's calls and the calls
    that led to them, triggers start and stop showing or set a depth under a function; patterns
    are regular expressions. The call trees are uftrace's (dynamic patching of the same
    -mnop-mcount binary, the filters given to its replay), thread by thread, whether the filters
    are given to record or to replay. (uftrace's record applies them as it records: after a
    trace_on of --disable, it no longer knows the depth the calls began at; dynprobe's record
    keeps them for the readers, which know it.)"""
    uftrace = shutil.which("uftrace")
    if uftrace is None:
        pytest.skip("uftrace is not installed (Debian package uftrace; `make test` installs it where it can)")
    flags = ("-O1", "-pthread", "-pg", "-mfentry", "-mnop-mcount", "-fno-PIE", "-no-pie")
    binary = build_target("ret_mnop-mcount_uftrace", "ret.c", flags=flags)

    def uftrace_tree(recording: list[str], replaying: list[str]) -> list[list[tuple[int, str]]]:
        theirs = tmp_path / f"uftrace{len(recording)}.data"
        subprocess.run([uftrace, "record", "-P", ".", "--no-libcall", "--no-event", "-d", str(theirs), *recording,
                        binary, *program], check=True, capture_output=True, cwd=tmp_path)  # fmt: skip
        replayed = subprocess.run([uftrace, "replay", "-d", str(theirs), *replaying], check=True, capture_output=True,
                                  text=True)  # fmt: skip
        return call_tree(replayed.stdout)

    expected = uftrace_tree([], filters)
    assert expected and all(expected)
    if "--disable" not in filters and not any(f.endswith("@backtrace") for f in filters):
        assert uftrace_tree(filters, []) == expected  # (uftrace's record prints backtraces, replay does not)
    _, filtered = record(tmp_path, "--no-libcall", *filters, "--", binary, *program)
    assert call_tree(dp("replay", filtered).stdout) == expected
    whole = str(tmp_path / "whole")
    assert dp("record", "-o", whole, "--no-libcall", "--", binary, *program, cwd=tmp_path).returncode == 0
    assert call_tree(dp("replay", *filters, whole).stdout) == expected


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        (["-F", "main", "-N", "dive"],
         ["main() {", *(f"{'  ' * d}fact() {{" for d in range(1, 5)), "          fact();",
          *(f"{'  ' * d}}} /* fact */" for d in range(4, 0, -1)), "} /* main */"]),
        (["-F", "dive"], [*(f"{'  ' * d}dive() {{" for d in range(4))] * 2),
        (["-F", "main", "-D", "2"], ["main() {", "  dive() {", "  dive() {", "  fact();", "} /* main */"]),
    ],
)  # fmt: skip
def test_filters_after_a_longjmp(ret: str, tmp_path: Path, filters: list[str], expected: list[str]) -> None:
    """A longjmp out of a kept call ends it (its frame is entered again): fact, called by main
    after the jumps, is under main, not under the dive calls the jump left (uftrace v0.13 with
    --no-libcall keeps them open: it sees fact 8 dives deep under -F dive, and nothing under
    -F main -D 2). Left calls show open, as replay shows them without filters."""
    whole = str(tmp_path / "whole")
    assert dp("record", "-o", whole, "--no-libcall", "--", ret, "longjmp", "2", "3").returncode == 0
    tree = call_tree(dp("replay", *filters, whole).stdout)
    assert tree == [[((len(line) - len(line.lstrip())) // 2, line.strip()) for line in expected]]


def test_a_forked_child_goes_on_at_its_parent_s_depth(tmp_path: Path) -> None:
    """The child returns from the calls it began inside (its parent's, fork_outer and forking)
    at their depth, and its own calls nest under them, as uftrace shows a child (with its
    library calls, fork among them, left out here: dynprobe traces the program's functions)."""
    flags = ("-O1", "-pthread", "-pg", "-mfentry", "-mnop-mcount", "-fno-PIE", "-no-pie")
    binary = build_target("ret_mnop-mcount_uftrace", "ret.c", flags=flags)
    ours_dir = str(tmp_path / "ours")
    assert dp("record", "-o", ours_dir, "-F", "main", "--", binary, "fork").returncode == 0
    program = {"main", "fork_outer", "forking", "add"}

    def own_calls(replay: str) -> list[list[tuple[int, str]]]:
        """The lines of the program's functions."""
        names = {re.sub(r"\W.*", "", c.removeprefix("} /* ")) for tree in call_tree(replay) for _, c in tree}
        return call_tree(replay, names - program)

    ours = own_calls(dp("replay", ours_dir).stdout)
    parent = [(0, "main() {"), (1, "fork_outer() {"), (2, "forking();"), (1, "} /* fork_outer */"), (0, "} /* main */")]
    child = [(2, "} /* forking */"), (1, "} /* fork_outer */"), (1, "add();")]
    assert ours == sorted([parent, child])
    uftrace = shutil.which("uftrace")
    if uftrace is None:
        pytest.skip("uftrace is not installed (Debian package uftrace; `make test` installs it where it can)")
    theirs = tmp_path / "uftrace.data"
    subprocess.run([uftrace, "record", "-P", ".", "--no-event", "-d", str(theirs), binary, "fork"], check=True,
                   capture_output=True, cwd=tmp_path)  # fmt: skip
    replayed = subprocess.run([uftrace, "replay", "-d", str(theirs)], check=True, capture_output=True, text=True)
    assert own_calls(replayed.stdout) == ours


@pytest.mark.parametrize("program", [["fact", "3"], ["threads", "2", "2"], ["longjmp", "2", "2"]])
def test_library_calls_as_the_program_makes_them(tmp_path: Path, program: list[str]) -> None:
    """By default, as uftrace: the calls the program makes to library functions, named after
    them (`printf();` under the caller), not libc's insides, nor its start-up frames. The same
    trees as uftrace's, thread by thread (main's subtree: start-up code differs, uftrace does
    not patch crt's functions)."""
    flags = ("-O1", "-pthread", "-pg", "-mfentry", "-mnop-mcount", "-fno-PIE", "-no-pie")
    binary = build_target("ret_mnop-mcount_uftrace", "ret.c", flags=flags)
    _, trace = record(tmp_path, "-F", "main", "-F", "worker", "--", binary, *program)
    ours = call_tree(dp("replay", trace).stdout)
    main = next(tree for tree in ours if tree[0] == (0, "main() {"))
    assert (1, "printf();") in main and not any("vfprintf" in call or "_IO_" in call for _, call in main)
    # FUNC@plt names the calls: without them, the tree of a recording without library calls
    (tmp_path / "without").mkdir()
    _, without = record(tmp_path / "without", "--no-libcall", "-F", "main", "-F", "worker", "--", binary, *program)
    assert call_tree(dp("replay", "-N", ".*@plt", trace).stdout) == call_tree(dp("replay", without).stdout)
    uftrace = shutil.which("uftrace")
    if uftrace is None:
        pytest.skip("uftrace is not installed (Debian package uftrace; `make test` installs it where it can)")
    theirs = tmp_path / "uftrace.data"
    subprocess.run([uftrace, "record", "-P", ".", "--no-event", "-F", "main", "-F", "worker", "-d", str(theirs), binary,
                    *program], check=True, capture_output=True, cwd=tmp_path)  # fmt: skip
    replayed = subprocess.run([uftrace, "replay", "-d", str(theirs)], check=True, capture_output=True, text=True)
    assert ours == call_tree(replayed.stdout, RETURNS_TWICE)  # (shown by uftrace; not yet by dynprobe)


@pytest.mark.parametrize(
    ("program", "function"),
    [(["threads", "2", "3"], None), (["fork"], None), (["fork"], "fork_outer"), (["evenodd", "5"], "is_odd"),
     (["fact", "4"], "strcmp")],
)  # fmt: skip
def test_graph_as_uftrace_draws_it(tmp_path: Path, program: list[str], function: str | None) -> None:
    """`graph`: every thread's call paths merged in one tree with calls and total times, or a
    function's backtraces and the tree of its calls; drawn as uftrace draws them (times, the
    session id and addresses left out of the comparison)."""
    uftrace = shutil.which("uftrace")
    if uftrace is None:
        pytest.skip("uftrace is not installed (Debian package uftrace; `make test` installs it where it can)")
    flags = ("-O1", "-pthread", "-pg", "-mfentry", "-mnop-mcount", "-fno-PIE", "-no-pie")
    binary = build_target("ret_mnop-mcount_uftrace", "ret.c", flags=flags)
    filters = ["-F", "main", "-F", "worker"]
    _, trace = record(tmp_path, *filters, "--", binary, *program)
    theirs = tmp_path / "uftrace.data"
    subprocess.run([uftrace, "record", "-P", ".", "--no-event", *filters, "-d", str(theirs), binary, *program],
                   check=True, capture_output=True, cwd=tmp_path)  # fmt: skip
    wanted = [function] if function else []

    def masked(text: str) -> list[str]:
        lines = text.splitlines()[1:]  # (uftrace's heading names its session)
        return [re.sub(r" \(0x[0-9a-f]+\)$", "", re.sub(r" *[0-9.]+ [mu]?s", " T", line)).rstrip() for line in lines]

    ours = dp("graph", "-d", trace, *wanted)
    assert ours.returncode == 0, ours.stderr
    replayed = subprocess.run(
        [uftrace, "graph", "-d", str(theirs), *wanted], check=True, capture_output=True, text=True
    )
    drawn, expected = masked(ours.stdout), masked(replayed.stdout)
    if program == ["fork"] and function is None:
        # uftrace shows no call of _exit (it never returns): its line and the blank line before
        # it go. And main's callees are in the order of their first calls, the parent's and the
        # child's: which of the two processes first called wait, add or printf is not the same
        # in two runs, so the lines are compared as a set.
        at = drawn.index(" T :  +-(1) _exit")
        assert drawn[at - 1] == "             :  |"
        del drawn[at - 1 : at + 1]
        drawn, expected = sorted(drawn), sorted(expected)
    assert drawn == expected
    assert ours.stdout.startswith(f"# Function Call Graph for '{function or os.path.basename(binary)}'\n")


def test_a_time_range_shows_what_happened_in_it(ret: str, tmp_path: Path) -> None:
    """-r START~STOP (times since the trace's first event, either end open): the events in it."""
    _, trace = record(tmp_path, "--", ret, "mixed", "20")
    first = Trace(trace).first_ns()
    times = sorted(e.time_ns - first for e in Trace(trace).events())
    assert times[0] == 0
    middle = times[len(times) // 2]

    def events(*options: str) -> int:
        r = dp("dump", "--chrome", *options, trace)
        assert r.returncode == 0, r.stderr
        return sum(1 for e in json.loads(r.stdout)["traceEvents"] if e["ph"] in "BE")

    assert events() == events("-r", "0ns~") == len(times)
    assert events("-r", f"~{middle}ns") == sum(t <= middle for t in times)
    assert events("-r", f"{middle}ns~") == sum(t >= middle for t in times)
    assert events("-r", f"{times[-1] + 1}ns~") == 0
    r = dp("replay", "-r", "5ms", trace)
    assert r.returncode == 2 and "not a time range: '5ms' (START~STOP" in r.stderr


def uftrace_reads(tmp_path: Path, recording: list[str], reading: list[str]) -> str:
    """What `uftrace READING` prints of `uftrace record RECORDING` (run in tmp_path, its own data
    directory); the test is skipped, saying why, where uftrace is not installed."""
    uftrace = shutil.which("uftrace")
    if uftrace is None:
        pytest.skip("uftrace is not installed (Debian package uftrace; `make test` installs it where it can)")
    theirs = tmp_path / "uftrace.data"
    subprocess.run([uftrace, "record", "-d", str(theirs), *recording], check=True, capture_output=True, cwd=tmp_path)
    return subprocess.run([uftrace, *reading, "-d", str(theirs)], check=True, capture_output=True, text=True).stdout


ARGS_SPEC = [
    "-A", "add@arg1/i32,arg2/i32", "-R", "add@retval/i32", "-A", "neg@arg1", "-R", "neg@retval",
    "-A", "triple@arg1/u", "-R", "triple@retval/x", "-A", "echo@arg1/s", "-R", "echo@retval/s",
    "-A", "given@arg1/s", "-R", "given@retval", "-A", "next_letter@arg1/c", "-R", "next_letter@retval/c",
    "-A", "half@fparg1", "-R", "half@retval/f", "-A", "scale@fparg1/32,fparg2", "-R", "scale@retval/f32",
    "-A", "eight@arg1,arg2,arg3,arg4,arg5,arg6,arg7,arg8", "-R", "eight@retval",
    "-A", "outer@arg1", "-R", "outer@retval", "-A", "fact@arg1", "-R", "fact@retval",
]  # fmt: skip
_UFTRACE_FLAGS = ("-O1", "-pg", "-mfentry", "-mnop-mcount", "-fno-PIE", "-no-pie")


def test_arguments_and_return_values_as_uftrace_shows_them(tmp_path: Path) -> None:
    """-A and -R: integers of each size and format, strings (cut at 95 characters, escaped, a
    null and an unmapped pointer), characters, floats and doubles, the 7th and 8th arguments
    (on the stack), return values of calls with callees and of recursive calls; recorded by
    the target's generated code and shown by replay line for line as uftrace shows them (the
    same -mnop-mcount binary), the values read back through filters (-F, -C) too."""
    binary = build_target("args_uftrace", "args.c", flags=_UFTRACE_FLAGS)
    _, trace = record(tmp_path, "--no-libcall", *ARGS_SPEC, "--", binary, "2")
    ours = call_tree(dp("replay", trace).stdout)
    calls = [line for _, line in ours[0]]
    for expected in [
        "add(1, 2) = 3;", "add(-5, 3) = -2;", "neg(0xfffffffff8a432eb) = 0x75bcd15;",
        "triple(0xffffffffffffffff) = 0xfffffffffffffffd;", 'echo("hello world") = "hello world";',
        'echo("tab\there, quote" and newline\\n") = "tab\there, quote" and newline\\n";',
        'given("NULL") = 0;', 'given("<0x10>") = 1;', "next_letter('a') = 'b';",
        "half(3.000000) = 1.500000;", "scale(1.500000, 2.250000) = 3.375000;",
        "eight(1, 2, 3, 4, 5, 6, 7, 8) = 36;", "} = 8; /* outer */", "fact(1) = 1;", "} = 24; /* fact */",
    ]:  # fmt: skip
        assert calls.count(expected) == 2, (expected, calls)
    cut = f'"{"x" * 95}..."'
    assert calls.count(f"echo({cut}) = {cut};") == 2
    filtered = [line for _, line in call_tree(dp("replay", "-F", "outer", trace).stdout)[0]]
    assert filtered == ["outer(3) {", "inner();", "} = 8; /* outer */"] * 2
    callers = [line for _, line in call_tree(dp("replay", "-C", "inner", trace).stdout)[0]]
    assert callers == ["main() {", *["outer(3) {", "inner();", "} = 8; /* outer */"] * 2, "} /* main */"]
    replayed = uftrace_reads(tmp_path, ["-P", ".", "--no-libcall", "--no-event", *ARGS_SPEC, binary, "2"], ["replay"])
    profiling = {"__gmon_start__", "__monstartup", "__cxa_atexit", "atexit"}  # (-pg's start-up, not args.c's)
    assert call_tree(dp("replay", trace).stdout, profiling) == call_tree(replayed, profiling)


def test_auto_args_of_library_calls_as_uftrace_shows_them(tmp_path: Path) -> None:
    """-a: the values of the library functions a program calls (strlen, printf, puts: their
    prototypes known), as uftrace's -a shows them. (uftrace also reads the program's own
    functions' from DWARF; dynprobe does not yet, so only library calls are compared.)"""
    binary = build_target("args_uftrace", "args.c", flags=_UFTRACE_FLAGS)
    _, trace = record(tmp_path, "-a", "-F", "main", "--", binary)
    library = {"strlen", "printf", "puts"}

    def calls_of_library(replay: str) -> list[str]:
        return [line for _, line in call_tree(replay)[0] if re.sub(r"\W.*", "", line) in library]

    ours = calls_of_library(dp("replay", trace).stdout)
    assert ours == [
        'strlen("hello world") = 11;', f'strlen("{"x" * 95}...") = 199;',
        'strlen("tab\there, quote" and newline\\n") = 29;', 'printf("total %ld %d %zu\\n") = 20;',
        'puts("done") = 5;',
    ]  # fmt: skip
    replayed = uftrace_reads(tmp_path, ["-P", ".", "-a", "--no-event", "-F", "main", binary], ["replay"])
    assert ours == calls_of_library(replayed)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["-A", "add"], "-A 'add': give FUNC@arg1,arg2/s"),
        (["-A", "add@arg1/q"], "format 'q' is not one dynprobe records"),
        (["-R", "add@arg1"], "-R records retval"),
    ],
)
def test_bad_value_specs_are_one_line(ret: str, tmp_path: Path, options: list[str], message: str) -> None:
    r = dp("record", "-o", str(tmp_path / "t"), *options, "--", ret)
    assert r.returncode != 0
    assert r.stderr.strip() == f"dynprobe: error: {message}" or message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_finish_trigger_ends_the_trace_at_the_function_s_first_call(tmp_path: Path) -> None:
    """-T FUNC@finish: the trace ends at FUNC's first call (its entry shown open), and replay says
    which calls were left open, as uftrace's record with that trigger shows it; dynprobe keeps
    the whole trace and ends it when reading, so a replay can be given the trigger too."""
    flags = ("-O1", "-pthread", "-pg", "-mfentry", "-mnop-mcount", "-fno-PIE", "-no-pie")
    binary = build_target("ret_mnop-mcount_uftrace", "ret.c", flags=flags)
    _, trace = record(tmp_path, "--no-libcall", "-T", "is_odd@finish", "--", binary, "evenodd", "4")
    replayed = dp("replay", trace).stdout
    tree = call_tree(replayed)
    assert tree[0][-3:] == [(0, "main() {"), (1, "is_even() {"), (2, "is_odd() {")]
    assert replayed.endswith("dynprobe stopped tracing with remaining functions\n" + "=" * 49
                             + f"\ntask: {replayed.split('[')[1].split(']')[0].strip()}\n[2] is_odd\n[1] is_even\n"
                             "[0] main\n\n")  # fmt: skip
    whole = str(tmp_path / "whole")
    assert dp("record", "-o", whole, "--no-libcall", "--", binary, "evenodd", "4", cwd=tmp_path).returncode == 0
    assert call_tree(dp("replay", "-T", "is_odd@finish", whole).stdout) == tree
    recording = ["-P", ".", "--no-libcall", "--no-event", "-T", "is_odd@finish", binary, "evenodd", "4"]
    profiling = {"__gmon_start__", "atexit"}  # (-pg's start-up: dynprobe traces it, uftrace does not)
    assert call_tree(uftrace_reads(tmp_path, recording, ["replay"])) == call_tree(dp("replay", trace).stdout, profiling)


@pytest.mark.parametrize(
    "fields", ["duration", "tid,addr", "time,delta", "elapsed,task", "module", "+elapsed", "none",
               "duration,tid,addr,time,delta,elapsed,task,module"],
)  # fmt: skip
def test_replay_fields_as_uftrace_lays_them_out(tmp_path: Path, fields: str) -> None:
    """replay -f: uftrace's columns, headings and widths (the task and module names, and where
    the call begins, as uftrace's); times are each run's own. (ADDRESS is the function's address;
    uftrace's is a few bytes in, where its mcount call returns.)"""
    flags = ("-O1", "-pthread", "-pg", "-mfentry", "-mnop-mcount", "-fno-PIE", "-no-pie")
    binary = build_target("ret_mnop-mcount_uftrace", "ret.c", flags=flags)
    _, trace = record(tmp_path, "--no-libcall", "--", binary, "evenodd", "3")
    ours = dp("replay", "-F", "main", "-f", fields, trace).stdout.splitlines()
    if fields == "none":
        assert ours[0] == "main() {" and ours[-1] == "} /* main */"
    else:
        assert ours[0].startswith("#") and ours[0].endswith("FUNCTION")
        assert len({line.index("| ") for line in ours[1:]}) == 1  # every call starts in one column
        for line in ours[1:]:
            assert ("task" not in fields or " ret_mnop-mcount " in line) and (
                "module" not in fields or " ret_mnop-mcount_ | " in line
            )
            assert "time" not in fields or re.search(r" +\d+\.\d{9} ", line)
    recording = ["-P", ".", "--no-libcall", "--no-event", binary, "evenodd", "3"]
    replayed = uftrace_reads(tmp_path, recording, ["replay", "-F", "main", "-f", fields]).splitlines()
    assert len(ours) == len(replayed)
    for mine, uftraces in zip(ours, replayed, strict=True):
        assert mine.find("| ") == uftraces.find("| ") and mine.split("| ", 1)[-1] == uftraces.split("| ", 1)[-1]
    assert fields == "none" or ours[0] == replayed[0]


def test_nested_library_calls(ret_cxx: str, tmp_path: Path) -> None:
    """--nest-libcall: the calls the program's libraries make to library functions show under
    the library call that made them (libstdc++'s __cxa_allocate_exception calls malloc through its
    PLT), as uftrace's --nest-libcall shows them; without it, the program's own library calls
    have no callees. The program prints what it prints alone."""
    r, trace = record(tmp_path, "--nest-libcall", "--", ret_cxx, "12")
    assert r.stdout == run_plain([ret_cxx, "12"]).stdout
    tree = call_tree(dp("replay", trace).stdout)[0]
    at = tree.index(next(line for line in tree if line[1] == "__cxa_allocate_exception() {"))
    assert tree[at + 1] == (tree[at][0] + 1, "malloc();")
    plain = str(tmp_path / "plain")
    assert dp("record", "-o", plain, "--", ret_cxx, "12").returncode == 0
    calls = [line for _, line in call_tree(dp("replay", plain).stdout)[0]]
    assert "__cxa_allocate_exception();" in calls and "__cxa_allocate_exception() {" not in calls


def test_report_fields_as_uftrace_shows_them(tmp_path: Path) -> None:
    """report -f: uftrace's columns and headings; per function its calls' average, shortest and
    longest, with and without callees (fact 4: 4 calls, the longest the outermost, the shortest
    the innermost, all of it its own); -s sorts by any of them."""
    flags = ("-O1", "-pthread", "-pg", "-mfentry", "-mnop-mcount", "-fno-PIE", "-no-pie")
    binary = build_target("ret_mnop-mcount_uftrace", "ret.c", flags=flags)
    _, trace = record(tmp_path, "--no-libcall", "-P", "main", "-P", "fact", "--", binary, "fact", "4")
    fields = "total,total-avg,total-min,total-max,self,self-avg,self-min,self-max,call"
    lines = dp("report", "-f", fields, "-s", "call", trace).stdout.splitlines()
    headings = ["Total time", "Total avg", "Total min", "Total max", "Self time", "Self avg", "Self min", "Self max"]
    assert lines[0] == "".join(f"  {h:>10}" for h in [*headings, "Calls"]) + "  Function"
    rows = {line.split()[-1]: line.split()[:-1] for line in lines[2:]}
    assert list(rows) == ["fact", "main"]
    fact = [float(v) * {"us": 1e3, "ms": 1e6, "s": 1e9}[u] for v, u in zip(rows["fact"][0:16:2], rows["fact"][1:16:2],
                                                                           strict=True)]  # fmt: skip
    total, average, shortest, longest, _, self_average, least_self, most_self = fact
    assert rows["fact"][-1] == "4" and total == longest and shortest <= average <= longest
    assert least_self <= self_average <= most_self and least_self <= shortest  # (the innermost: all self)
    recording = ["-P", ".", "--no-libcall", "--no-event", binary, "fact", "4"]
    assert uftrace_reads(tmp_path, recording, ["report", "-f", fields]).splitlines()[:2] == lines[:2]
