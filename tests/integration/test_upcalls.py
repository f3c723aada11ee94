"""Python pre-handlers served by upcalls (core/upcalls.py) and by ptrace stops: the same hits, the
same registers, the same effects; upcalls without a stop, from many threads at once, through a
handler that raises or stops the session, and never waiting for a tracer that is gone."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import pytest

import dynprobe
from dynprobe.core.probe import Hit
from dynprobe.errors import OptimizeRefusal
from tests.conftest import build_target
from tests.killing import hot_program

from .helpers import run_plain, run_until, started, traced

MODES = ["trap", "upcall"]


@pytest.fixture(scope="module")
def counter() -> str:
    return build_target("counter", flags=("-O1", "-pthread"))


def in_mode(mode: str, place: Callable[[dynprobe.Session], object]) -> Callable[[dynprobe.Session], object]:
    """`place` with the session in `mode`: trap probes, or upcalls (jumps)."""

    def setup(session: dynprobe.Session) -> object:
        session.upcalls = mode == "upcall"
        return place(session)

    return setup


def run(argv: list[str], mode: str, place: Callable[[dynprobe.Session], object]) -> tuple[int | None, str, object]:
    return traced(argv, in_mode(mode, place), optimize=mode == "upcall")


@pytest.mark.parametrize("mode", MODES)
def test_a_handler_sees_the_registers_of_the_hit(counter: str, mode: str) -> None:
    seen: list[tuple[int, int, int, bool]] = []

    def pre(hit: Hit) -> None:
        seen.append((hit.regs.arg(1), int(hit.regs.rip) - hit.address, int(hit.regs.rsp) % 16, hit.tid != hit.pid))

    status, out, probe = run([counter, "100", "1"], mode, lambda s: s.probe("work", pre=pre))
    assert status == 0 and out == "total=10000\n"
    assert seen == [(i, 0, 8, True) for i in range(100)]  # (rsp at an entry: the return address pushed)
    assert isinstance(probe, dynprobe.Probe) and probe.hits == 100
    assert probe.mode == (dynprobe.ProbeMode.OPTIMIZED if mode == "upcall" else dynprobe.ProbeMode.TRAP)


def test_an_upcall_takes_no_stop_and_its_server_ends_with_the_session(counter: str) -> None:
    with dynprobe.spawn([counter, "1000", "1"], stdout=subprocess.DEVNULL) as session:
        session.upcalls = True
        baseline = session.stats["stops"]
        probe = session.probe("work", pre=lambda hit: None)
        assert session.run(timeout=60) == 0 and probe.hits == 1000 and probe.trap_reason is None
        assert session.stats["stops"] - baseline < 10  # (the loader's hook: no hit of the probe)
        assert any(t.name == "dynprobe-upcalls" for t in threading.enumerate())
    assert not any(t.name == "dynprobe-upcalls" for t in threading.enumerate())


@pytest.mark.parametrize("mode", MODES)
def test_a_handler_changes_registers(counter: str, mode: str) -> None:
    def pre(hit: Hit) -> None:
        hit.regs.rdi = 0  # every call now computes work(0) == 1

    status, out, _ = run([counter, "10", "1"], mode, lambda s: s.probe("work", pre=pre))
    assert status == 0 and out == "total=10\n"


@pytest.mark.parametrize("mode", MODES)
def test_a_handler_returning_true_skips_the_instruction(counter: str, mode: str) -> None:
    def pre(hit: Hit) -> bool:
        # 'return 1' done here: rax = 1, the return address popped
        hit.regs.rax = 1
        hit.regs.rip = int.from_bytes(hit.read(int(hit.regs.rsp), 8), "little")
        hit.regs.rsp += 8
        return True

    status, out, _ = run([counter, "7", "1"], mode, lambda s: s.probe("work", pre=pre))
    assert status == 0 and out == "total=7\n"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("then", ["returns", "raises"])
def test_a_handler_that_changes_rip_without_returning_true_moves_nothing(counter: str, mode: str, then: str) -> None:
    """Only True moves the thread: a pre-handler (or an entry handler) that sets rip and
    returns None, or raises, leaves it at its instruction (the rip of the middle of the jump
    here: taken, it would crash the program)."""

    def pre(hit: Hit) -> None:
        hit.regs.rip = hit.address + 2
        if then == "raises":
            raise ValueError("after setting rip")

    def entry(hit: Hit) -> None:
        hit.regs.rip = hit.address + 2

    def place(session: dynprobe.Session) -> object:
        session.probe("work", pre=pre)
        return session.retprobe("work", handler=lambda hit: None, entry=entry)

    status, out, probe = run([counter, "7", "1"], mode, place)
    assert status == 0 and out == "total=49\n"
    assert isinstance(probe, dynprobe.Probe) and probe.hits == 7


@pytest.mark.parametrize("mode", MODES)
def test_a_handler_fetches_the_probes_arguments(counter: str, mode: str) -> None:
    seen: list[tuple[object, ...]] = []

    def pre(hit: Hit) -> None:
        values = hit.fetch()
        seen.append((values["n"], values["c"].text, hit.comm()))  # type: ignore[union-attr]

    status, _, _ = run([counter, "3", "1"], mode, lambda s: s.probe("work n=%di:s32 c=$comm", pre=pre))
    assert status == 0 and seen == [(i, "counter", "counter") for i in range(3)]


@pytest.mark.parametrize("mode", MODES)
def test_threads_hitting_at_once_are_each_served(counter: str, mode: str) -> None:
    calls: dict[int, int] = {}

    def pre(hit: Hit) -> None:
        calls[hit.tid] = calls.get(hit.tid, 0) + 1

    argv = [counter, "2000", "8"]
    status, out, probe = run(argv, mode, lambda s: s.probe("work", pre=pre))
    assert status == 0 and out == run_plain(argv).stdout
    assert isinstance(probe, dynprobe.Probe) and probe.hits == 16_000 and probe.nmissed == 0
    assert sorted(calls.values()) == [2000] * 8


def test_a_thread_that_asks_while_another_keeps_the_server_busy_is_served() -> None:
    """A second thread starts asking while a first asks without a pause (the server answers
    the first without going round its loop): its asks are heard, or the first, which stops once
    the second is done, would never stop (the run's timeout)."""
    relay = build_target("relay", flags=("-O1", "-pthread"))
    threads: set[int] = set()
    status, out, probe = run(
        [relay, "20000"], "upcall", lambda s: s.probe("work", pre=lambda hit: threads.add(hit.tid))
    )
    assert (status, out) == (0, "first>=1 second=20000\n")
    assert isinstance(probe, dynprobe.Probe) and probe.mode == dynprobe.ProbeMode.OPTIMIZED and len(threads) == 2


@pytest.mark.parametrize("mode", MODES)
def test_a_handler_that_raises_is_reported_once_and_the_program_goes_on(counter: str, mode: str) -> None:
    def pre(hit: Hit) -> None:
        raise ValueError(f"no {hit.regs.arg(1)}")

    with dynprobe.spawn([counter, "50", "1"], stdout=subprocess.DEVNULL) as session:
        session.upcalls = mode == "upcall"
        probe = session.probe("p:t/failing work", pre=pre)
        assert session.run(timeout=60) == 0 and probe.hits == 50
        assert session.warnings == ["t/failing: its handler raised ValueError: no 0 (reported once)"]


def test_a_handler_that_exits_or_closes_the_session_is_reported_and_the_program_goes_on(counter: str) -> None:
    """What would end the tracing thread (sys.exit, close()) ends neither the server nor the
    program: reported once each."""
    with dynprobe.spawn([counter, "20", "1"], stdout=subprocess.DEVNULL) as session:
        session.upcalls = True
        exits = session.probe("p:t/exits work", pre=lambda hit: sys.exit(3))
        closes = session.probe("p:t/closes work", pre=lambda hit: session.close())
        entry_exits = session.probe(
            "r:t/entry_exits work", on_entry=lambda hit: sys.exit(4), on_return=lambda hit: None
        )
        return_exits = session.probe("r:t/return_exits work", on_return=lambda hit: sys.exit(5))
        assert session.run(timeout=60) == 0 and exits.hits == closes.hits == 20
        assert entry_exits.hits == return_exits.hits == 20  # (a handler that raised vetoes nothing)
        assert session.warnings == [
            "t/exits: its handler raised SystemExit: 3 (reported once)",
            "t/closes: its handler raised SessionError: closing the session from a handler served by an upcall is "
            "not possible: set session.upcalls = False (reported once)",
            "t/entry_exits: its handler raised SystemExit: 4 (reported once)",
            "t/return_exits: its handler raised SystemExit: 5 (reported once)",
        ]


@pytest.mark.parametrize("mode", MODES)
def test_a_handler_stops_the_session_and_the_next_run_goes_on(counter: str, mode: str) -> None:
    """After `stop()` from a handler no other handler runs until the next run: the threads
    that come by wait for it, at a trap stop or in their upcall."""
    with dynprobe.spawn([counter, "100", "1"], stdout=subprocess.DEVNULL) as session:
        session.upcalls = mode == "upcall"
        probe = session.probe("work", pre=lambda hit: session.stop() if hit.regs.arg(1) == 10 else None)
        assert session.run(timeout=60) is None and probe.hits == 11
        assert session.run(timeout=60) == 0 and probe.hits == 100


@pytest.mark.parametrize("mode", MODES)
def test_a_handler_places_removes_and_disables_probes(counter: str, mode: str) -> None:
    """From a handler: a probe placed (its handler runs from the next call on), one that removes
    itself, one that disables itself; the stop loop makes those calls for a handler served by
    an upcall, which waits for them."""
    seen: list[int] = []
    placed: list[dynprobe.Probe] = []
    sessions: list[dynprobe.Session] = []

    def later(hit: Hit) -> None:
        seen.append(hit.regs.arg(1))
        if hit.regs.arg(1) == 19:
            hit.probe.remove()

    def first(hit: Hit) -> None:
        if hit.regs.arg(1) == 9:
            placed.append(sessions[0].probe("p:t/later work", pre=later))
        if hit.regs.arg(1) == 49:
            hit.probe.disable()

    def place(session: dynprobe.Session) -> dynprobe.Probe:
        sessions.append(session)
        return session.probe("p:t/first work", pre=first)

    status, out, probe = run([counter, "100", "1"], mode, place)
    assert status == 0 and out == "total=10000\n"
    assert seen == list(range(10, 20))
    assert isinstance(probe, dynprobe.Probe) and probe.hits == 50 and not probe.enabled
    assert len(placed) == 1 and placed[0].removed


def test_a_handler_asks_for_the_loop_only_while_it_runs() -> None:
    """Between two runs the threads still ask and are served, but nobody would make a call
    for a handler: it is told so (reported once), and the program goes on."""
    wanted, tried = threading.Event(), threading.Event()

    def pre(hit: Hit) -> None:
        if wanted.is_set():
            tried.set()
            session.probe("main")

    with started([hot_program(), "2", "2.0"], "ready") as program:
        with dynprobe.attach(program.pid) as session:
            session.upcalls = True
            probe = session.probe("p:t/placing work", pre=pre)
            run_until(session, lambda: probe.hits > 0, "a hit")
            wanted.set()
            assert tried.wait(60)
            tried_at = probe.hits  # (the server answers one hit at a time: a later one comes after the report)
            deadline = time.monotonic() + 60
            while probe.hits <= tried_at and time.monotonic() < deadline:
                time.sleep(0.001)
            assert session.warnings == [
                "t/placing: its handler raised SessionError: placing a probe from a handler served by an upcall "
                "needs session.run() to be running (reported once)"
            ]
        out, _ = program.communicate(timeout=60)
        assert program.returncode == 0 and out.startswith("ok "), out


def test_a_target_ringing_its_doorbell_without_asking_never_holds_the_detach() -> None:
    """The doorbell is the target's to write: rung on and on with nobody asking, the server
    still looks at whether it should stop, and the detach ends; the program goes on. (In a
    process of its own: a detach that hangs fails the test, not the suite. On 2 CPUs the rings
    leave gaps longer than SPIN now and then, which let even a server that counted no such ring
    out of its spin: this checks the detach end to end, not that rule alone.)"""
    ringer = build_target("ringer", flags=("-O1", "-pthread"))
    script = f"""
import sys, time
import dynprobe
from tests.integration.helpers import run_until, started
with started([{ringer!r}, "3000"], "ready") as program:
    session = dynprobe.attach(program.pid)
    session.upcalls = True
    probe = session.probe("work", pre=lambda hit: None)
    run_until(session, lambda: probe.hits > 0, "a hit")  # (then the threads run between runs too)
    assert program.stdout.readline() == "ringing\\n"
    time.sleep(0.2)  # (the server among the rings)
    session.close()
    out, _ = program.communicate(timeout=60)
    print(program.returncode, probe.hits > 0, out, end="")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"0 True total={3000 * 3000}\n"


def test_switching_upcalls_replans_the_sites_placed(counter: str) -> None:
    with dynprobe.spawn([counter, "10", "1"], stdout=subprocess.DEVNULL) as session:
        session.upcalls = False
        probe = session.probe("work", pre=lambda hit: None)
        assert probe.mode == dynprobe.ProbeMode.TRAP and probe.trap_reason == OptimizeRefusal.PYTHON_HANDLER
        session.upcalls = True
        session.optimize_now()
        assert probe.mode == dynprobe.ProbeMode.OPTIMIZED
        session.upcalls = False
        assert probe.mode == dynprobe.ProbeMode.TRAP and probe.trap_reason == OptimizeRefusal.PYTHON_HANDLER
        assert session.run(timeout=60) == 0 and probe.hits == 10 and session.stats["stops"] >= 10


@pytest.mark.parametrize("mode", MODES)
def test_a_post_handler_sees_the_instruction_done_and_its_register_writes_hold(counter: str, mode: str) -> None:
    """work() starts with `mov rax, [rip+seed]`: after it, rax is the seed (1) and rip the next
    instruction; a post-handler's rax = 5 makes every call return 2i + 5."""
    seen: list[tuple[int, int]] = []

    def post(hit: Hit) -> None:
        seen.append((int(hit.regs.rax), int(hit.regs.rip) - hit.address))
        hit.regs.rax = 5

    status, out, probe = run([counter, "4", "1"], mode, lambda s: s.probe("work", post=post))
    assert status == 0 and out == f"total={sum(2 * i + 5 for i in range(4))}\n"
    assert seen == [(1, 7)] * 4 and isinstance(probe, dynprobe.Probe) and probe.hits == 4
    assert probe.mode == (dynprobe.ProbeMode.OPTIMIZED if mode == "upcall" else dynprobe.ProbeMode.TRAP)


@pytest.mark.parametrize("mode", MODES)
def test_pre_and_post_handlers_on_one_site_each_run_once_a_hit(counter: str, mode: str) -> None:
    order: list[str] = []

    def place(session: dynprobe.Session) -> list[dynprobe.Probe]:
        return [
            session.probe("p:t/before work", pre=lambda hit: order.append("pre")),
            session.probe("p:t/after work", post=lambda hit: order.append("post")),
        ]

    status, _, probes = run([counter, "3", "1"], mode, place)
    assert status == 0 and order == ["pre", "post"] * 3
    assert [p.hits for p in probes] == [3, 3]  # type: ignore[attr-defined]


def test_a_detach_lets_every_thread_go_on() -> None:
    """Attached to a running program whose threads ask all the time, run briefly and close: no
    thread is left waiting for an answer, and the program ends as it would have (its own check
    of every call's result). A tracer killed meanwhile: tests/killing.py's "upcall" mode."""
    with started([hot_program(), "4", "1.0"], "ready") as program:
        with dynprobe.attach(program.pid) as session:
            session.upcalls = True
            probe = session.probe("work", pre=lambda hit: None)
            run_until(session, lambda: probe.hits > 0, "a hit")
            assert probe.mode == dynprobe.ProbeMode.OPTIMIZED
        out, _ = program.communicate(timeout=60)
        assert program.returncode == 0 and out.startswith("ok "), out


def test_a_process_under_seccomp_keeps_its_handlers_at_traps() -> None:
    """A seccomp filter may forbid futex, which an upcall makes in the target: a process under
    one keeps its Python handlers at traps, and says why."""
    target = build_target("seccomp", flags=("-O0",))
    with started([target, "usr1"], "ready") as program:
        with dynprobe.attach(program.pid) as session:
            session.upcalls = True
            seen: list[int] = []
            probe = session.probe("work", pre=lambda hit: seen.append(hit.regs.arg(1)))
            run_until(session, lambda: len(seen) > 10, "10 hits")
            assert probe.mode == dynprobe.ProbeMode.TRAP and probe.trap_reason == OptimizeRefusal.SECCOMP_FILTER
        program.send_signal(signal.SIGUSR1)
        out, _ = program.communicate(timeout=60)
        assert program.returncode == 0 and out.endswith(" sum=0\n"), out


def _factorial(n: int) -> int:
    product = 1
    for i in range(2, n + 1):
        product = product * i & ((1 << 64) - 1)
    return product


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("depth", "maxactive"), [(200, 200), (30, 10)], ids=["all", "past-maxactive"])
def test_return_handlers_in_a_recursion_each_see_their_own_entry(
    ret: str, mode: str, depth: int, maxactive: int
) -> None:
    """fact(depth) with `maxactive` instances at most: each return handler gets the data its own
    entry kept and its own value, the returns deepest first; the calls past `maxactive` are
    missed, their entry handler does not run, and they leave the others' data as it was."""
    entered: list[int] = []
    seen: list[tuple[object, int]] = []

    def entry(hit: Hit) -> None:
        entered.append(hit.regs.arg(1))
        hit.data = hit.regs.arg(1)

    def place(session: dynprobe.Session) -> dynprobe.Probe:
        handler = lambda hit: seen.append((hit.data, hit.retval))  # noqa: E731
        return session.retprobe("fact", handler=handler, entry=entry, maxactive=maxactive)

    status, out, probe = run([ret, "fact", str(depth)], mode, place)
    kept = min(depth, maxactive)  # the outermost calls
    assert status == 0 and out == f"{_factorial(depth)}\n"
    assert entered == list(range(depth, depth - kept, -1))
    assert seen == [(n, _factorial(n)) for n in range(depth - kept + 1, depth + 1)]
    assert isinstance(probe, dynprobe.Probe) and probe.hits == kept and probe.nmissed == depth - kept


@pytest.mark.parametrize("mode", MODES)
def test_a_return_handler_fetches_its_entry_s_arguments_now_or_later(ret: str, mode: str) -> None:
    """At each return $arg1 is what its own entry had and $retval its result, whenever the hit is
    first asked: in its handler, in the next call's (whose entry took the same shadow entry:
    each add() of a loop does), or after the run (the process gone). fact(8): the kept hits'
    latencies grow with n, each call enclosing the one before."""
    late: list[tuple[object, object]] = []
    previous: list[Hit] = []

    def add_returned(hit: Hit) -> None:
        if previous:
            values = previous.pop().fetch()
            late.append((values["a"], values["r"]))
        previous.append(hit)

    def place_add(session: dynprobe.Session) -> dynprobe.Probe:
        return session.probe("r add a=$arg1:s64 r=$retval:s64", on_return=add_returned)

    status, out, _ = run([ret, "loop", "50"], mode, place_add)
    assert status == 0 and out == f"{sum(range(1, 51))}\n"
    assert late == [(i, i + 1) for i in range(49)] and len(previous) == 1

    now: list[tuple[object, object]] = []
    kept: list[Hit] = []

    def fact_returned(hit: Hit) -> None:
        if len(now) + len(kept) < 4:
            kept.append(hit)
        else:
            values = hit.fetch()
            now.append((values["n"], values["r"]))

    def place_fact(session: dynprobe.Session) -> dynprobe.Probe:
        return session.probe("r fact n=$arg1:u64 r=$retval:u64 ns=$latency:u64", on_return=fact_returned)

    status, out, _ = run([ret, "fact", "8"], mode, place_fact)
    assert status == 0 and out == f"{_factorial(8)}\n"
    after = [hit.fetch() for hit in kept]
    assert [(v["n"], v["r"]) for v in after] + now == [(n, _factorial(n)) for n in range(1, 9)]
    # (fact(1) calls nothing: its few ns may read as 0; each later one encloses an upcall or a stop)
    latencies = [int(v["ns"]) for v in after]  # type: ignore[call-overload]
    assert 0 < latencies[1] < latencies[2] < latencies[3] < 10**9, latencies


@pytest.mark.parametrize("mode", MODES)
def test_return_probes_sharing_a_function_each_get_their_own_entry(ret: str, mode: str) -> None:
    """Three return probes on fact(50), two keeping data at their entry (each its own, a third
    keeping none): each return handler gets its own probe's data for its own call, however the
    detour ordered their entries."""
    seen: dict[str, list[tuple[object, int]]] = {"a": [], "b": [], "c": []}

    def place(session: dynprobe.Session) -> list[dynprobe.Probe]:
        def entry_of(name: str) -> Callable[[Hit], None]:
            def entry(hit: Hit) -> None:
                if name != "c":
                    hit.data = (name, hit.regs.arg(1))

            return entry

        def return_of(name: str) -> Callable[[Hit], None]:
            return lambda hit: seen[name].append((hit.data, hit.retval))

        return [session.retprobe("fact", handler=return_of(n), entry=entry_of(n), maxactive=60) for n in "abc"]

    status, out, probes = run([ret, "fact", "50"], mode, place)
    assert status == 0 and out == f"{_factorial(50)}\n"
    for name in "ab":
        assert seen[name] == [((name, n), _factorial(n)) for n in range(1, 51)]
    assert seen["c"] == [(None, _factorial(n)) for n in range(1, 51)]
    assert isinstance(probes, list) and [(p.hits, p.nmissed) for p in probes] == [(50, 0)] * 3


@pytest.mark.parametrize("mode", MODES)
def test_return_probes_with_handlers_from_many_threads(ret: str, mode: str) -> None:
    """8 threads of 300 calls each: every entry's data comes back with its own return."""
    pairs: list[tuple[int, object, int]] = []

    def entry(hit: Hit) -> None:
        hit.data = (hit.tid, hit.regs.arg(1))

    def handler(hit: Hit) -> None:
        pairs.append((hit.tid, hit.data, hit.retval))

    def place(session: dynprobe.Session) -> dynprobe.Probe:
        return session.retprobe("add", handler=handler, entry=entry)

    status, out, probe = run([ret, "threads", "8", "300"], mode, place)
    plain = run_plain([ret, "threads", "8", "300"]).stdout
    assert status == 0 and out == plain
    assert len(pairs) == 2400 and len({tid for tid, _, _ in pairs}) == 8
    assert all(data[0] == tid for tid, data, _ in pairs)  # type: ignore[index]
    assert isinstance(probe, dynprobe.Probe) and probe.hits == 2400 and probe.nmissed == 0


@pytest.mark.parametrize("mode", MODES)
def test_return_probes_with_handlers_keep_maxactive(ret: str, mode: str) -> None:
    """fact(20) with 5 instances at most: the 5 outermost calls are seen, 15 missed."""
    seen: list[int] = []

    def place(session: dynprobe.Session) -> dynprobe.Probe:
        return session.retprobe("fact", handler=lambda hit: seen.append(hit.retval), maxactive=5)

    status, _, probe = run([ret, "fact", "20"], mode, place)
    assert status == 0 and seen == [_factorial(n) for n in range(16, 21)]
    assert isinstance(probe, dynprobe.Probe) and probe.hits == 5 and probe.nmissed == 15


@pytest.mark.parametrize("mode", MODES)
def test_return_handlers_that_raise_are_reported_once(ret: str, mode: str) -> None:
    with dynprobe.spawn([ret, "loop", "30"], stdout=subprocess.DEVNULL) as session:
        session.upcalls = mode == "upcall"
        at_entry = session.retprobe("r:t/entry add", entry=lambda hit: 1 / 0, handler=lambda hit: None)
        at_return = session.retprobe("r:t/return add", handler=lambda hit: {}["x"])
        assert session.run(timeout=60) == 0
        assert at_return.hits == at_entry.hits == 30  # (a failed entry handler vetoes nothing)
        modes = {at_entry.mode, at_return.mode}
        assert modes == {dynprobe.ProbeMode.OPTIMIZED if mode == "upcall" else dynprobe.ProbeMode.TRAP}
        assert session.warnings == [
            "t/entry: its handler raised ZeroDivisionError: division by zero (reported once)",
            "t/return: its handler raised KeyError: 'x' (reported once)",
        ]


def test_a_detach_with_return_instances_pending_lets_them_return(ret: str) -> None:
    """nap() is asleep inside a probed call when the session detaches: it returns to its caller,
    and the program goes on."""
    with started([ret, "sleep"], "ready") as proc:
        assert proc.stdout is not None
        with dynprobe.attach(proc.pid) as session:
            session.upcalls = True
            probe = session.retprobe("nap", entry=lambda hit: None, handler=lambda hit: None)
            run_until(session, lambda: probe.hits >= 3, "3 returns")
            assert probe.mode == dynprobe.ProbeMode.OPTIMIZED
        before = int(proc.stdout.readline())
        assert [int(proc.stdout.readline()) for _ in range(3)] == [before + 1, before + 2, before + 3]


def test_a_program_that_sets_its_own_gs_base_goes_on_untouched_and_is_told() -> None:
    """Its threads' areas were given (their GS base), then the program set its own: an upcall
    there touches nothing of the program's and runs no handler; the user is told, once."""
    opt = build_target("opt", "opt.c", "opt_asm.S", flags=("-O1", "-pthread"))
    calls: list[int] = []
    with tempfile.TemporaryFile("w+") as out:
        with dynprobe.spawn([opt, "gs", "1", "500"], stdout=out.fileno()) as session:
            session.upcalls = True
            probe = session.probe("hammer", pre=lambda hit: calls.append(hit.regs.arg(1)))
            assert session.run(timeout=60) == 0 and probe.mode == dynprobe.ProbeMode.OPTIMIZED
        out.seek(0)
        assert out.read() == "gs kept\n"
    assert calls == [] and session.warnings == [
        f"pid {session.pid} set its own GS base: its Python handlers served without a stop no longer run"
        " (session.upcalls = False serves them at traps)"
    ]


@pytest.mark.parametrize("mode", MODES)
def test_return_handlers_across_cxx_exceptions(ret_cxx: str, mode: str) -> None:
    """Throws, catches and rethrows through frames whose returns are served by handlers: the
    program runs as alone, and each return handler runs once per frame that returns (not for
    the frames an exception unwinds), with the data its own entry kept."""
    plain = run_plain([ret_cxx, "300"])
    returned: dict[str, list[int]] = {}

    def place(session: dynprobe.Session) -> list[dynprobe.Probe]:
        def entry(hit: Hit) -> None:
            hit.data = hit.regs.arg(1)

        def handler(hit: Hit) -> None:
            returned.setdefault(hit.probe.name, []).append(hit.data)  # type: ignore[arg-type]

        names = ("thrower", "middle", "rethrower", "catcher")
        return [session.retprobe(f"r:t/{name} {name}", entry=entry, handler=handler) for name in names]

    status, out, probes = run([ret_cxx, "300"], mode, place)
    assert status == 0 and out == plain.stdout
    assert isinstance(probes, list) and [p.hits for p in probes] == [200, 200, 200, 300]
    assert {name: len(seen) for name, seen in returned.items()} == {
        "t/thrower": 200, "t/middle": 200, "t/rethrower": 200, "t/catcher": 300
    }  # fmt: skip
    assert returned["t/catcher"] == list(range(300))  # (each its own entry's argument)


@pytest.mark.parametrize(("argv", "calls"), [(["fork"], 2 + 5), (["threads"], 402 + 2), (["exec"], 1 + 4)])
def test_processes_that_fork_exec_and_end_keep_their_handlers(argv: list[str], calls: int) -> None:
    """Followed children ask too, and a process that ends or execs (its areas let go under the
    server) leaves the server serving the others: every call is seen, nothing reported."""
    forks = build_target("forks", flags=("-O1", "-pthread"))
    seen: list[int] = []

    def place(session: dynprobe.Session) -> dynprobe.Probe:
        session.upcalls = True
        return session.probe("probed", pre=lambda hit: seen.append(hit.pid))

    with tempfile.TemporaryFile("w+") as out:
        with dynprobe.spawn([forks, *argv], follow_fork=True, stdout=out.fileno()) as session:
            probe = place(session)
            assert session.run(timeout=60) == 0
            assert probe.hits == len(seen) == calls and session.warnings == []
        out.seek(0)
        assert out.read() == run_plain([forks, *argv]).stdout
