"""Optimized probes on live processes: exact counts through mode changes with threads running,
which mode each probe ends in and why, the red zone, fetches that fault, ring losses, the target's
own GS, an untrusted target, fork and exec (hazards 12-18, 24-26)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

import dynprobe
from dynprobe.core.datapath import DEFAULT_WAIT_FOR_ROOM
from dynprobe.core.probe import Hit, ProbeEvent
from dynprobe.errors import OptimizeRefusal
from dynprobe.spec.fetch import FAULT, StringValue
from tests.conftest import build_target

from .helpers import run_plain, run_until, traced

OPTIMIZED, TRAP = dynprobe.ProbeMode.OPTIMIZED, dynprobe.ProbeMode.TRAP


@pytest.fixture(scope="module")
def opt() -> str:
    return build_target("opt", "opt.c", "opt_asm.S", flags=("-O1", "-pthread"))


def shm_files() -> set[str]:
    return set(os.listdir("/dev/shm"))


class Forever:
    """The target's "forever" mode under a session: threads call hammer() until `finish()`
    closes their stdin; then the target prints how many calls it made in all."""

    def __init__(self, opt: str, threads: int) -> None:
        self.opt, self.threads = opt, threads
        self.calls: int | None = None
        self.status: int | None = None

    @contextlib.contextmanager
    def session(self) -> Iterator[dynprobe.Session]:
        stdin_r, self._stdin_w = os.pipe()
        with tempfile.TemporaryFile("w+") as out:
            try:
                with dynprobe.spawn([self.opt, "forever", str(self.threads)], stdin=stdin_r,
                                    stdout=out.fileno()) as session:  # fmt: skip
                    os.close(stdin_r)
                    yield session
                    self.finish(session)
            finally:
                if self._stdin_w >= 0:
                    os.close(self._stdin_w)
            out.seek(0)
            lines = out.read().splitlines()
        assert lines[0] == "ready" and lines[-1].startswith("done ")
        self.calls = int(lines[-1].split()[1])

    def finish(self, session: dynprobe.Session) -> None:
        os.close(self._stdin_w)
        self._stdin_w = -1
        self.status = session.run(timeout=60)


@pytest.mark.parametrize("threads", [1, 8])
def test_exact_counts_across_1000_optimize_unoptimize_cycles(opt: str, threads: int) -> None:
    """Hazard 14: threads hammer the probed function while its site turns from jump to trap and
    back 1000 times (each change under stop-the-world); the target counts its own calls: no hit
    is lost or counted twice, in either mode or in between."""
    target = Forever(opt, threads)
    with target.session() as session:
        counter = session.probe("hammer")
        python = session.probe("hammer", pre=lambda hit: None, enabled=False)
        modes = set()
        for _ in range(1000):
            assert session.run(timeout=0.001) is None
            modes.add(counter.mode)
            python.enable()  # a Python handler: the site goes back to a trap
            modes.add(counter.mode)
            assert session.run(timeout=0.0005) is None
            python.disable()  # actions only again
            session.optimize_now()
    assert target.status == 0
    assert modes == {TRAP, OPTIMIZED}
    assert python.hits > 0 and counter.hits > python.hits
    assert target.calls == counter.hits
    assert counter.nmissed == 0


def test_attach_optimize_detach_cycles_leave_the_program_unharmed(opt: str) -> None:
    """Hazards 14/21: 8 threads call the probed function nonstop while dynprobe attaches,
    optimizes and detaches 30 times; every call returns the right value, text is restored."""
    proc = subprocess.Popen([opt, "forever", "8"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        for _ in range(30):
            with dynprobe.attach(proc.pid) as session:
                probe = session.probe("hammer")
                for _ in range(100):  # the first run may spend its time optimizing
                    assert session.run(timeout=0.02) is None
                    if probe.hits:
                        break
                assert probe.mode == OPTIMIZED and probe.hits > 0
        assert proc.poll() is None
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0 and proc.stdout.read().startswith("done ")
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("placed", ["one by one", "in a batch"])
def test_which_mode_each_probe_ends_in(opt: str, placed: str) -> None:
    """Hazards 12, 13, 17: odd shapes are traps with the reason, or jumps that keep results. In
    a batch, sites are optimized at its end without a trap first: those refused get theirs then."""
    rounds = 2000

    def setup(session: dynprobe.Session) -> dict[str, dynprobe.Probe]:
        session.upcalls = False  # (why Python handlers stay traps without upcalls)
        names = ["jump_into", "one_ret", "call_first", "add_one", "endbr_func", "endbr_func+4", "redzone_leaf+10"]
        with session.batch() if placed == "in a batch" else contextlib.nullcontext():
            probes = {name: session.probe(name) for name in names}
            probes["python"] = session.probe("hammer", pre=lambda hit: None)
            probes["post"] = session.probe("redzone_leaf", post=lambda hit: None)
        return probes

    status, out, made = traced([opt, "shapes", "1", str(rounds)], setup, optimize=True)
    probes: dict[str, dynprobe.Probe] = made  # type: ignore[assignment]
    assert status == 0 and out == f"shapes ok {rounds}\n"
    assert probes["jump_into"].mode == TRAP
    assert probes["jump_into"].trap_reason == OptimizeRefusal.JUMP_INTO_REGION
    assert probes["one_ret"].trap_reason == OptimizeRefusal.TOO_SHORT
    assert probes["python"].trap_reason == OptimizeRefusal.PYTHON_HANDLER
    assert probes["post"].trap_reason == OptimizeRefusal.POST_HANDLER and probes["post"].hits == rounds
    assert probes["endbr_func"].trap_reason == OptimizeRefusal.REGION_OVERLAP  # endbr_func+4 is probed
    for name in ("call_first", "add_one", "endbr_func+4", "redzone_leaf+10"):  # add_one: lea; ret
        assert probes[name].mode == OPTIMIZED, (name, probes[name].trap_reason)
    expected = {"jump_into": rounds, "one_ret": 2 * rounds, "call_first": rounds, "add_one": rounds,
                "endbr_func": rounds, "endbr_func+4": rounds, "redzone_leaf+10": rounds}  # fmt: skip
    assert {name: probes[name].hits for name in expected} == expected


@pytest.mark.parametrize(
    "flags", [("-O1", "-fjump-tables"), ("-O2", "-fno-pie", "-no-pie", "-fno-tree-switch-conversion")]
)
def test_a_switch_table_and_a_tiny_function_take_a_jump(flags: tuple[str, ...]) -> None:
    """dispatch() jumps through a switch table (relative offsets in a PIE, addresses without):
    read, no case in its first bytes; zero() is 3 bytes, its jump covering the padding after
    it. Both optimized, the counts exact, the program's output its own; count_down() loops back
    into its first bytes and stays a trap."""
    switchy = build_target(f"switchy{'-nopie' if '-no-pie' in flags else ''}", "switchy.c", flags=flags)
    rounds = 3000

    def setup(session: dynprobe.Session) -> list[dynprobe.Probe]:
        return [session.probe(name) for name in ("dispatch", "zero", "count_down")]

    status, out, (dispatch, zero, count_down) = traced([switchy, str(rounds)], setup, optimize=True)
    assert (status, out) == (0, run_plain([switchy, str(rounds)]).stdout)
    assert dispatch.mode == zero.mode == OPTIMIZED, (dispatch.trap_reason, zero.trap_reason)  # type: ignore[attr-defined]
    assert count_down.trap_reason == OptimizeRefusal.JUMP_INTO_REGION  # type: ignore[attr-defined]
    assert (dispatch.hits, zero.hits, count_down.hits) == (rounds + 1, rounds, 1)  # type: ignore[attr-defined]


def test_memcpy_and_mempcpy_take_jumps_with_the_branch_between_them_taken_along() -> None:
    """glibc's mempcpy jumps into memcpy's first bytes: that branch is re-aimed at the detour's
    copy of the instruction it lands on (after memcpy's probe), so both take a jump. Exact
    counts (the program's calls, and libc's own, counted apart with none of the program's),
    the same as ltrace's where it runs; the program's output its own."""
    copies = build_target("copies", flags=("-O1", "-fno-builtin"))
    counts = []
    for calls in (0, 5000):
        status, out, probes = traced(
            [copies, str(calls)], lambda s: [s.probe("libc:memcpy"), s.probe("libc:mempcpy")], optimize=True
        )
        assert (status, out) == (0, run_plain([copies, str(calls)]).stdout)
        assert all(p.mode == OPTIMIZED for p in probes), [p.trap_reason for p in probes]  # type: ignore[attr-defined]
        counts.append([p.hits for p in probes])  # type: ignore[attr-defined]
    (memcpy_own, mempcpy_own), (memcpy_all, mempcpy_all) = counts
    assert (memcpy_all - memcpy_own, mempcpy_all - mempcpy_own) == (5000, 5000)
    if shutil.which("ltrace") is None:
        pytest.skip("ltrace is not installed (make toolchains installs it): the counts were checked, not compared")
    report = subprocess.run(["ltrace", "-c", copies, "5000"], capture_output=True, text=True, timeout=300).stderr
    theirs = {line.split()[-1]: int(line.split()[-2]) for line in report.splitlines() if line.endswith("cpy")}
    assert theirs == {"memcpy": 5000, "mempcpy": 5000}, report


# glibc's string functions that index a jump table by a bit scan plus or minus an offset (no
# compare bounds it: the table is read as far as its entries land in code), each chosen by
# libc's resolvers once the CPU features above it are turned off (GLIBC_TUNABLES)
STRING_FUNCTIONS = {
    "-AVX2,-AVX,-AVX512F,-AVX512VL,-AVX512BW,-EVEX,-SSE4_2,-SSSE3,-SSE4_1,-Fast_Unaligned_Load": (
        "__strcmp_sse2", "__strncmp_sse2", "__strcasecmp_l_sse2", "__strncasecmp_l_sse2", "__strncat_sse2_unaligned",
        "__strncpy_sse2_unaligned", "__stpncpy_sse2_unaligned",
    ),
    "-AVX2,-AVX512F,-AVX512VL,-AVX512BW,-EVEX": (
        "__strcmp_sse42", "__strncmp_sse42", "__strcasecmp_l_sse42", "__strncasecmp_l_sse42", "__strcpy_sse2_unaligned",
        "__stpcpy_sse2_unaligned", "__strcat_sse2_unaligned",
    ),
}  # fmt: skip


@pytest.mark.parametrize("features", list(STRING_FUNCTIONS))
def test_string_functions_whose_tables_nothing_bounds_take_a_jump(
    features: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """strcmp, strcpy and their kin over strings at every alignment (each dispatching through
    its tables): optimized, every call counted, the program's output its own."""
    strings = build_target("strings", flags=("-O1", "-fno-builtin"))
    monkeypatch.setenv("GLIBC_TUNABLES", f"glibc.cpu.hwcaps={features}")
    rounds = 3000
    names = STRING_FUNCTIONS[features]
    status, out, probes = traced([strings, str(rounds)], lambda s: [s.probe(f"libc:{n}") for n in names], optimize=True)
    assert (status, out) == (0, run_plain([strings, str(rounds)]).stdout)
    assert [p.mode for p in probes] == [OPTIMIZED] * len(names), [p.trap_reason for p in probes]  # type: ignore[attr-defined]
    assert [p.hits for p in probes] == [rounds] * len(names)  # type: ignore[attr-defined]


def test_a_python_handler_s_upcall_detour_takes_the_branch_along_too() -> None:
    """memcpy with a Python pre-handler served by upcalls: its detour asks, then runs its copy
    of the region, where mempcpy's re-aimed branch lands (after the upcall: mempcpy's calls run
    no handler of memcpy's). Both take a jump; the handler runs once per memcpy call."""
    copies = build_target("copies", flags=("-O1", "-fno-builtin"))
    counts = []
    for calls in (0, 2000):
        seen: list[int] = []

        def setup(session: dynprobe.Session, seen: list[int] = seen) -> list[dynprobe.Probe]:
            session.upcalls = True
            return [session.probe("libc:memcpy", pre=lambda hit: seen.append(1)), session.probe("libc:mempcpy")]

        status, out, probes = traced([copies, str(calls)], setup, optimize=True)
        assert (status, out) == (0, run_plain([copies, str(calls)]).stdout)
        assert all(p.mode == OPTIMIZED for p in probes), [p.trap_reason for p in probes]  # type: ignore[attr-defined]
        counts.append((len(seen), probes[1].hits))  # type: ignore[attr-defined]
    (memcpy_own, mempcpy_own), (memcpy_all, mempcpy_all) = counts
    assert (memcpy_all - memcpy_own, mempcpy_all - mempcpy_own) == (2000, 2000)


def test_a_probe_on_a_branch_taken_along_turns_its_site_back() -> None:
    """A probe placed (once main runs, libc mapped) on mempcpy's branch into memcpy, which
    memcpy's optimized probe took along: memcpy goes back to a trap (REGION_OVERLAP), the
    branch's own bytes come back for the new probe's int3, and every call is counted by both."""
    copies = build_target("copies", flags=("-O1", "-fno-builtin"))
    placed: list[dynprobe.Probe] = []

    def setup(session: dynprobe.Session) -> list[dynprobe.Probe]:
        memcpy, mempcpy = session.probe("libc:memcpy"), session.probe("libc:mempcpy")

        def in_main(hit: Hit) -> None:
            session.optimize_now()
            proc = session.process(hit.pid)
            assert proc is not None and memcpy.mode == OPTIMIZED
            ((branch, _),) = proc.sites[memcpy.sites[hit.pid]].moved
            placed.append(session.probe(f"libc:mempcpy+{branch - mempcpy.sites[hit.pid]}"))
            assert memcpy.mode == TRAP and memcpy.trap_reason == OptimizeRefusal.REGION_OVERLAP  # type: ignore[attr-defined]
            assert not proc.moving and placed[0].sites[hit.pid] == branch

        session.upcalls = False
        session.probe(f"{copies}:main", pre=in_main)
        return [memcpy, mempcpy]

    status, out, (memcpy, mempcpy) = traced([copies, "3000"], setup, optimize=True)
    assert (status, out) == (0, run_plain([copies, "3000"]).stdout)
    (jump,) = placed
    assert memcpy.hits >= 3000 and jump.hits == mempcpy.hits >= 3000  # type: ignore[attr-defined]


def test_enabling_a_probe_on_a_branch_taken_along_turns_its_site_back() -> None:
    """A disabled probe sits on mempcpy's branch into memcpy; memcpy's probe takes that branch
    along (nothing is armed there). Enabled once main runs, the probe's int3 would land on the
    re-aimed jump: memcpy goes back to a trap first, and both count every call."""
    copies = build_target("copies", flags=("-O1", "-fno-builtin"))
    offsets: list[int] = []

    def find(session: dynprobe.Session) -> list[dynprobe.Probe]:
        memcpy, mempcpy = session.probe("libc:memcpy"), session.probe("libc:mempcpy")

        def in_main(hit: Hit) -> None:
            session.optimize_now()
            proc = session.process(hit.pid)
            assert proc is not None
            offsets.extend(at - mempcpy.sites[hit.pid] for at, _ in proc.sites[memcpy.sites[hit.pid]].moved)

        session.upcalls = False
        session.probe(f"{copies}:main", pre=in_main)
        return [memcpy]

    traced([copies, "10"], find, optimize=True)
    (offset,) = offsets
    states: list[object] = []

    def setup(session: dynprobe.Session) -> list[dynprobe.Probe]:
        jump = session.probe(f"libc:mempcpy+{offset}")
        jump.disable()
        memcpy = session.probe("libc:memcpy")

        def in_main(hit: Hit) -> None:
            session.optimize_now()
            states.append(memcpy.mode)
            jump.enable()
            states.extend([memcpy.mode, memcpy.trap_reason])  # type: ignore[attr-defined]

        session.upcalls = False
        session.probe(f"{copies}:main", pre=in_main)
        return [memcpy, jump]

    status, out, (memcpy, jump) = traced([copies, "3000"], setup, optimize=True)
    assert (status, out) == (0, run_plain([copies, "3000"]).stdout)
    assert states == [OPTIMIZED, TRAP, OptimizeRefusal.REGION_OVERLAP]
    assert memcpy.hits >= 3000 and jump.hits >= 3000  # type: ignore[attr-defined]


def test_a_five_byte_leaf_ending_in_ret_is_optimized_for_every_mechanism(opt: str) -> None:
    """add_one is `lea rax,[rdi+1]; ret`, the 5 bytes a jump replaces: its `ret` runs from the
    detour. An entry probe and a return probe ($retval from the trampoline), then the function
    tracer (entered through call_first's relocated call too), get jumps and every call, exactly."""
    rounds = 2000
    returns: list[tuple[int, int]] = []

    def probes(session: dynprobe.Session) -> list[dynprobe.Probe]:
        back = session.probe("r add_one n=$arg1 r=$retval", on_event=lambda e: returns.append(
            (e.values["n"], e.values["r"])))  # fmt: skip
        return [session.probe("add_one", action="count"), back]

    status, out, (entry, back) = traced([opt, "shapes", "1", str(rounds)], probes, optimize=True)
    assert status == 0 and out == f"shapes ok {rounds}\n"
    assert entry.mode == OPTIMIZED and back.mode == OPTIMIZED  # type: ignore[attr-defined]
    assert entry.hits == rounds and back.hits == rounds  # type: ignore[attr-defined]
    assert sorted(returns) == [(i, i + 1) for i in range(rounds)]
    events: list[tuple[str, bool]] = []

    def tracer(session: dynprobe.Session) -> list[object]:
        made = session.function_tracer(filter=["add_one", "call_first"],
                                       on_event=lambda e: events.append((e.function.name, e.exit)))  # fmt: skip
        made.start()
        return [made]

    status, out, [made] = traced([opt, "shapes", "1", str(rounds)], tracer, optimize=True)
    assert status == 0 and out == f"shapes ok {rounds}\n"
    assert made.patched == 2 and made.calls == 2 * rounds, made.not_patched  # type: ignore[attr-defined]
    assert events == [("call_first", False), ("add_one", False), ("add_one", True), ("call_first", True)] * rounds


def test_record_of_faulting_fetches_and_strings(opt: str) -> None:
    """Hazard 24: a NULL dereference, a string running into an unmapped page, a 4 KiB string:
    values marked faulted or truncated; the target never sees a signal."""
    events: list[ProbeEvent] = []

    def setup(session: dynprobe.Session) -> list[dynprobe.Probe]:
        spec = "p:t/takes takes n=%di s=+0(%si):string first=+0(%si):u8 c=$comm"
        return [session.probe(spec, on_event=events.append)]

    before = shm_files()
    status, out, [probe] = traced([opt, "strings"], setup, optimize=True)
    assert status == 0 and out == "strings ok\n"
    assert probe.mode == OPTIMIZED  # type: ignore[attr-defined]
    assert [e.values["n"] for e in events] == [1, 2, 3, 4, 5]
    s = [e.values["s"] for e in events]
    assert s[0] == StringValue("hello")
    assert s[1] is FAULT and events[1].values["first"] is FAULT
    assert s[2] == StringValue("q" * 10, truncated=True)  # stopped by the unmapped page
    assert isinstance(s[3], StringValue) and s[3].truncated and set(s[3].text) == {"x"}
    assert s[4] is FAULT and events[4].values["first"] is FAULT
    assert events[0].values["first"] == ord("h")
    assert all(e.values["c"] == StringValue("opt") for e in events)
    assert shm_files() == before


@pytest.mark.parametrize("wait", [0.0, DEFAULT_WAIT_FOR_ROOM], ids=["lossy", "waiting"])
def test_a_million_events_into_a_small_ring_lose_exactly(opt: str, wait: float) -> None:
    """Hazard 25: what is not delivered is counted lost, exactly; per-thread times increase. By
    default a writer waits for the reader to make room: nothing is lost (of a burst 50 times the
    ring, handed to a Python handler one event at a time)."""
    n = 1_000_000 if wait == 0 else 100_000
    sessions: list[dynprobe.Session] = []
    got: list[int] = []
    times: list[int] = []

    def on_event(event: ProbeEvent) -> None:
        value = event.values["i"]
        assert isinstance(value, int)
        got.append(value)
        times.append(event.time_ns)

    def setup(session: dynprobe.Session) -> list[dynprobe.Probe]:
        session.ring_bytes = 4096 if wait == 0 else 65536  # 128 records of 32 bytes, or 2048
        session.wait_for_room = wait
        sessions.append(session)
        return [session.probe("p:t/ev event i=%di", on_event=on_event)]

    status, out, [probe] = traced([opt, "events", "1", str(n)], setup, optimize=True)
    assert status == 0 and out == f"events {n}\n"
    lost = probe.lost  # type: ignore[attr-defined]
    assert (lost > 0) == (wait == 0) and len(got) + lost == n and probe.hits == n  # type: ignore[attr-defined]
    assert (sessions[0].records_waited > 0) == (wait > 0)
    assert got == sorted(got) and len(set(got)) == len(got)
    assert times == sorted(times)


def test_a_flight_recorder_keeps_the_newest_records(opt: str) -> None:
    """A flight recorder's ring of 2048 records, 100,000 events, nothing read until the end:
    the newest 2048 are delivered, in order; the others are counted overwritten, none lost,
    no writer waited."""
    n, held = 100_000, 2048
    got: list[object] = []
    sessions: list[dynprobe.Session] = []

    def setup(session: dynprobe.Session) -> list[dynprobe.Probe]:
        session.ring_bytes = 65536  # 2048 records of 32 bytes
        session.flight_recorder = True
        sessions.append(session)
        return [session.probe("p:t/ev event i=%di", on_event=lambda event: got.append(event.values["i"]))]

    status, out, [probe] = traced([opt, "events", "1", str(n)], setup, optimize=True)
    assert status == 0 and out == f"events {n}\n"
    assert got == list(range(n - held, n))
    assert sessions[0].records_overwritten == n - held and sessions[0].records_waited == 0
    assert probe.lost == 0 and probe.hits == n  # type: ignore[attr-defined]


def test_a_pass_delivered_a_window_at_a_time_keeps_every_event_in_order(
    opt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass's records are made into events a window of time at a time (100 here): every
    event is delivered, once, in the order written and in time order."""
    from dynprobe.core import delivery

    monkeypatch.setattr(delivery, "DELIVERED_AT_ONCE", 100)
    n = 100_000
    got: list[int] = []
    times: list[int] = []

    def on_event(event: ProbeEvent) -> None:
        assert isinstance(event.values["i"], int)
        got.append(event.values["i"])
        times.append(event.time_ns)

    def setup(session: dynprobe.Session) -> list[dynprobe.Probe]:
        session.ring_bytes = 16 << 20
        return [session.probe("p:t/ev event i=%di", on_event=on_event)]

    status, out, [probe] = traced([opt, "events", "1", str(n)], setup, optimize=True)
    assert status == 0 and out == f"events {n}\n"
    assert probe.lost == 0 and got == list(range(n)) and times == sorted(times)  # type: ignore[attr-defined]


def test_target_using_gs_keeps_trap_probes(opt: str) -> None:
    """A target that sets its own GS base: dynprobe cannot install thread areas and says so; the
    probe counts every hit as a trap probe. A return probe, which needs a thread area for its
    shadow stack, is refused where it is placed (it would miss every call)."""
    made: list[dynprobe.Probe] = []
    refused: list[dynprobe.ProbeRefused] = []

    def place_after_gs_is_set(hit: object) -> None:
        if not made:
            made.append(session.probe("hammer"))
            with pytest.raises(dynprobe.ProbeRefused) as no_return:
                session.retprobe("hammer", action="count")
            refused.append(no_return.value)
            session.optimize_now()

    def setup(s: dynprobe.Session) -> list[dynprobe.Probe]:
        nonlocal session
        session = s
        s.upcalls = False  # (the handler at a stop: served by upcalls, it would go unheard, test_upcalls.py)
        s.probe("worker", pre=place_after_gs_is_set)  # main has set GS when it calls worker
        return made

    session: dynprobe.Session
    status, out, [probe] = traced([opt, "gs", "1", "500"], setup, optimize=True)
    assert status == 0 and out == "gs kept\n"
    assert probe.trap_reason == OptimizeRefusal.GS_IN_USE  # type: ignore[attr-defined]
    assert probe.hits == 500  # type: ignore[attr-defined]
    assert [r.reason for r in refused] == [dynprobe.Refusal.GS_IN_USE]


def test_scribbling_target_gets_a_clear_error_not_a_crash(opt: str) -> None:
    """Hazard 26: the target overwrites its thread area (head, tail); the consumer says so."""
    events: list[ProbeEvent] = []
    warnings: list[str] = []

    def setup(session: dynprobe.Session) -> list[dynprobe.Probe]:
        session.on_warning = warnings.append
        return [session.probe("p:t/ev event i=%di", on_event=events.append)]

    status, out, _ = traced([opt, "scribble", "1", "100"], setup, optimize=True)
    assert status == 0 and out == "scribbled yes\n"
    assert any("corrupted ring" in w for w in warnings), warnings


def test_threaded_malloc_and_clock_gettime(opt: str) -> None:
    """Hazard 18: actions never call anything, so probing malloc cannot recurse; counts are exact
    for what the program itself calls (at least that many: libc calls malloc too)."""

    def setup(session: dynprobe.Session) -> list[dynprobe.Probe]:
        return [session.probe("libc:malloc"), session.probe("libc:free"), session.probe("libc:clock_gettime")]

    status, out, [malloc, free, clock] = traced([opt, "malloc", "4", "20000"], setup, optimize=True)
    assert status == 0 and out == "malloc ok\n"
    for probe in (malloc, free, clock):
        assert probe.mode == OPTIMIZED  # type: ignore[attr-defined]
    assert malloc.hits >= 80_000 and free.hits >= 80_000  # type: ignore[attr-defined]
    assert clock.hits == 80_000  # type: ignore[attr-defined]


def test_probe_inside_an_optimized_region_turns_it_back(opt: str) -> None:
    def setup(session: dynprobe.Session) -> list[dynprobe.Probe]:
        outer = session.probe("redzone_leaf+10")
        session.optimize_now()
        assert outer.mode == OPTIMIZED
        inner = session.probe("redzone_leaf+14")  # the mov rcx,rax inside the 7-byte region
        assert outer.mode == TRAP and outer.trap_reason == OptimizeRefusal.REGION_OVERLAP
        return [outer, inner]

    status, out, [outer, inner] = traced([opt, "shapes", "1", "300"], setup, optimize=True)
    assert status == 0 and out == "shapes ok 300\n"
    assert outer.hits == inner.hits == 300  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["fork", "vfork", "threads", "exec"])
@pytest.mark.parametrize("follow", [False, True], ids=["unfollowed", "followed"])
def test_fork_vfork_exec_with_optimized_probes(mode: str, follow: bool) -> None:
    """Hazard 19 with jumps: a child not followed gets the original bytes back before it runs; a
    followed child gets thread areas of its own; after exec the probe is optimized again."""
    forks = build_target("forks", flags=("-O1", "-pthread"))
    plain = run_plain([forks, mode]).stdout
    calls = {"fork": (2, 7), "vfork": (2, 6), "threads": (402, 404), "exec": (5, 5)}[mode]

    def setup(session: dynprobe.Session) -> list[dynprobe.Probe]:
        return [session.probe("probed")]

    status, out, [probe] = traced([forks, mode], setup, follow_fork=follow, optimize=True)
    assert status == 0 and out == plain
    assert probe.mode == OPTIMIZED  # type: ignore[attr-defined]
    assert probe.hits == calls[follow]  # type: ignore[attr-defined]


def test_probes_added_and_disabled_on_an_optimized_site(opt: str) -> None:
    """The detour runs exactly the enabled probes: a probe added to an optimized site and one
    disabled each change the detour (through a trap); a third probe counts every call throughout.
    Once the detour has changed, a thread counts a disabled probe once more at most (it was
    inside the old detour)."""
    threads = 2
    target = Forever(opt, threads)
    with target.session() as session:
        always = session.probe("hammer")
        first = session.probe("hammer")
        run_until(session, lambda: first.hits > 0, "a call counted")
        second = session.probe("hammer")
        session.optimize_now()
        run_until(session, lambda: second.hits > 0, "a call counted by the probe added")
        first.disable()
        session.optimize_now()
        frozen = first.hits
        run_until(session, lambda: always.hits > frozen + 2 * threads, "calls after the disable")
        assert always.mode == first.mode == second.mode == OPTIMIZED
    assert target.status == 0 and target.calls == always.hits
    assert frozen <= first.hits <= frozen + threads and 0 < second.hits < always.hits and first.hits < always.hits
    assert first.hits + second.hits > always.hits  # both counted while both were enabled


def test_records_of_different_sizes_all_fit(opt: str) -> None:
    """The record size is fixed when the first thread area is made, from every probe placed by
    then: a small record placed first does not shut out a bigger one placed after it."""
    events: list[ProbeEvent] = []

    def setup(session: dynprobe.Session) -> list[dynprobe.Probe]:
        return [
            session.probe("p:t/small hammer x=%di", on_event=events.append),
            session.probe("p:t/big takes n=%di s=+0(%si):string c=+0(%si):u8", on_event=events.append),
        ]

    status, out, [small, big] = traced([opt, "strings"], setup, optimize=True)
    assert status == 0 and out == "strings ok\n"
    assert small.mode == big.mode == OPTIMIZED  # type: ignore[attr-defined]
    assert len([e for e in events if e.probe is big]) == 5


@pytest.mark.parametrize(
    ("spec", "values"),
    [
        ("p work a=%di b=%di c=%di d=%di", lambda i: {"a": i, "b": i, "c": i, "d": i}),
        ("r work a=$arg1 b=$arg1 c=$arg1 ret=$retval", lambda i: {"a": i, "b": i, "c": i, "ret": 2 * i + 1}),
    ],
)
def test_a_record_larger_than_the_fixed_record_size_is_made_at_a_stop(
    spec: str, values: Callable[[int], object]
) -> None:
    """Once the layout is fixed, a probe whose record does not fit is served at stops
    (RECORD_TOO_LARGE; a return probe's return part at the trap stub: once, its return code wrote
    records past their slots), every event with its values."""
    counter = build_target("counter", flags=("-O1", "-pthread"))
    events: list[ProbeEvent] = []

    def setup(session: dynprobe.Session) -> list[dynprobe.Probe]:
        session.record_size = 32
        assert session.layout.record_size == 32
        return [session.probe(spec, on_event=events.append)]

    status, out, [big] = traced([counter, "100"], setup, optimize=True)
    assert (status, out) == (0, run_plain([counter, "100"]).stdout)
    assert big.hits == 100 and [e.values for e in events] == [values(i) for i in range(100)]  # type: ignore[attr-defined]
    if spec.startswith("p"):
        assert big.mode == dynprobe.ProbeMode.TRAP and big.refusal == OptimizeRefusal.RECORD_TOO_LARGE  # type: ignore[attr-defined]


def test_asking_the_clock_first_leaves_the_record_size_to_the_probes() -> None:
    """The clock is the session's, not the consumer's: reading it (or setting how long a full
    ring is waited on) before any probe fixes nothing, and a record of 4 values is optimized."""
    counter = build_target("counter", flags=("-O1", "-pthread"))
    events: list[ProbeEvent] = []

    def setup(session: dynprobe.Session) -> list[dynprobe.Probe]:
        assert session.clock()["scale"] > 0
        session.wait_for_room = 0.5
        return [session.probe("p work a=%di b=%di c=%di d=%di", on_event=events.append)]

    status, _, [probe] = traced([counter, "100"], setup, optimize=True)
    assert status == 0 and probe.mode == dynprobe.ProbeMode.OPTIMIZED  # type: ignore[attr-defined]
    assert [e.values["a"] for e in events] == list(range(100))


def test_a_histogram_past_the_thread_area_s_table_stays_a_trap_and_counts_the_same() -> None:
    """The thread area holds 512 histograms: the 513th probe's runs at the stops (TOO_MANY_PROBES,
    and the site with it), with the same buckets."""
    counter = build_target("counter", flags=("-O1", "-pthread"))

    def setup(session: dynprobe.Session) -> list[dynprobe.Probe]:
        return [session.probe("p work i=%di", action="hist", value="i") for _ in range(513)]

    status, _, hists = traced([counter, "40"], setup, optimize=True)
    assert status == 0
    assert hists[-1].refusal == OptimizeRefusal.TOO_MANY_PROBES  # type: ignore[attr-defined]
    expected = [1, 1, 2, 4, 8, 16, 8] + [0] * 59  # 0..39: [0], [1], [2, 4), ... [32, 40)
    assert {tuple(h.histogram) for h in hists} == {tuple(expected)}  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["optimized", "trap"])
@pytest.mark.parametrize("rseq", ["registered", "off"])
def test_records_carry_the_cpu_the_thread_ran_on(rseq: str, mode: str) -> None:
    """The CPU number of each record, from the thread's rseq area (glibc registers one per
    thread) or by rdpid: without rseq (a tunable turns it off: a negative CPU there), and on a
    thread whose thread pointer is not glibc's (the load faults, and its fix-up takes rdpid).
    Served at a trap stop, the same numbers: from the rseq area, else from /proc."""
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs CPUs 0 and 1")
    target = build_target("cpus", flags=("-O1", "-pthread"))
    env = dict(os.environ)
    if rseq == "off":
        env["GLIBC_TUNABLES"] = "glibc.pthread.rseq=0"
    events: list[ProbeEvent] = []
    with tempfile.TemporaryFile("w+") as out:
        with dynprobe.spawn([target], env=env, stdout=out.fileno()) as session:
            session.optimize = mode == "optimized"
            probe = session.probe("p work cpu=%di:s64", on_event=events.append)
            assert session.run(timeout=60) == 0
        out.seek(0)
        assert out.read() == "done\n"
    if mode == "optimized":
        assert probe.mode == OPTIMIZED and not probe.resumes  # every hit in the detour
    else:
        assert probe.mode != OPTIMIZED and sum(probe.resumes.values()) == 300
    by_thread = Counter(e.tid for e in events)
    assert len(by_thread) == 3 and set(by_thread.values()) == {2 * 50}
    assert [e.values["cpu"] for e in events] == [0] * 50 + [1] * 50 + [0] * 50 + [1] * 50 + [0] * 50 + [1] * 50
    assert [e.cpu for e in events] == [e.values["cpu"] for e in events]


@pytest.mark.parametrize("how", ["a batch", "optimize_now"])
def test_probes_placed_from_a_handler_are_optimized_after_it(how: str) -> None:
    """A handler runs while its thread is being served: optimizing then (which gives threads
    their GS base) would be undone when the thread's registers are written back, and the
    thread would crash in the detour. Placed from a handler, probes start as traps and the loop
    optimizes them once the handler has returned."""
    counter = build_target("counter", flags=("-O1", "-pthread"))
    placed: list[dynprobe.Probe] = []

    def setup(session: dynprobe.Session) -> list[dynprobe.Probe]:
        def pre(hit: object) -> None:
            if placed:
                return
            if how == "a batch":
                placed.extend(session.probes_from(["libc:pthread_mutex_lock"], action="count"))
            else:
                placed.append(session.probe("libc:pthread_mutex_lock", action="count"))
                session.optimize_now()

        return [session.probe("work", pre=pre)]

    argv = [counter, "20000", "8"]
    status, out, (work,) = traced(argv, setup, optimize=True)
    assert (status, out) == (0, run_plain(argv).stdout)
    assert work.hits == 8 * 20000  # type: ignore[attr-defined]
    assert placed[0].mode == OPTIMIZED and placed[0].hits >= 1  # the thread locks once as it ends
