"""Trap probes on live processes: exact counts, handlers, registers, aggregation, enable/disable."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest

import dynprobe
from dynprobe.arch.x86_64 import ResumeKind
from dynprobe.core.probe import Hit
from dynprobe.errors import ProbeRefused, Refusal, SymbolError
from dynprobe.symbols.elf import load_elf
from tests.conftest import build_target

from .helpers import run_plain, symbols, traced


@pytest.fixture(scope="module")
def counter() -> str:
    return build_target("counter", flags=("-O1", "-pthread"))


@pytest.mark.parametrize("threads", [1, 8])
def test_exact_hit_counts(counter: str, threads: int) -> None:
    status, out, (entry, inner) = traced(
        [counter, "2000", str(threads)], lambda s: (s.probe("work"), s.probe("work+7"))
    )
    assert status == 0
    assert out == run_plain([counter, "2000", str(threads)]).stdout
    assert entry.hits == 2000 * threads
    assert inner.hits == 2000 * threads
    assert dict(entry.resumes) == {ResumeKind.BOOST: 2000 * threads}  # mov rax,[rip+seed]
    assert dict(inner.resumes) == {ResumeKind.EMULATE: 2000 * threads}  # lea


def test_a_thread_of_the_program_using_dynprobe_does_not_stall_its_run(counter: str) -> None:
    """A timed run sleeps until a SIGCHLD says a tracee stopped. Another thread of the Python
    program (this one: the test's) has SIGCHLD unblocked and may take it, and a stop would wait
    for the run's whole time limit: every one of 20,000 must be served well within it."""
    done = threading.Event()
    other = threading.Thread(target=done.wait)
    other.start()
    try:
        status, _, (entry,) = traced([counter, "20000", "1"], lambda s: (s.probe("work"),), timeout=60)
    finally:
        done.set()
        other.join()
    assert status == 0 and entry.hits == 20000


@pytest.mark.parametrize("threads", [1, 8])
def test_a_push_on_a_lasting_trap_runs_from_its_slot(counter: str, threads: int) -> None:
    """A push is emulated with a write to the stack (a system call); where the site stays a trap
    (a Python handler here) it runs from a slot instead, made at placement: same results, exact
    counts. A site the optimizer will take keeps emulating its few trap hits (no slot for it)."""
    argv = [counter, "2000", str(threads), "push"]
    seen: list[int] = []
    status, out, (probe,) = traced(argv, lambda s: [s.probe("pushy", pre=lambda hit: seen.append(hit.regs.rdi))])
    assert status == 0 and out == run_plain(argv).stdout
    assert probe.hits == len(seen) == 2000 * threads and sorted(set(seen)) == list(range(2000))
    assert dict(probe.resumes) == {ResumeKind.BOOST: 2000 * threads}
    status, out, (counted,) = traced(argv, lambda s: [s.probe("pushy", action="count")], optimize=True)
    assert status == 0 and out == run_plain(argv).stdout and counted.hits == 2000 * threads
    assert ResumeKind.BOOST not in counted.resumes


@pytest.mark.parametrize("threads", [1, 8])
def test_trap_hits_run_their_actions_in_the_target(counter: str, threads: int) -> None:
    """Trap probes whose work is an action (a record, a histogram, a filtered count) run it in
    the target as the thread resumes, from the site's action code then the instruction's slot
    (an emulated `lea` too): every hit counted once, its record's values those of the hit."""
    events: list[dynprobe.ProbeEvent] = []
    argv = [counter, "2000", str(threads)]

    def setup(s: dynprobe.Session) -> list[dynprobe.Probe]:
        return [
            s.probe("p work i=%di", on_event=events.append),
            s.probe("p work+7 i=%di", action="hist", value="i"),
            s.probe("p work+7 i=%di", action="count", filter="i < 100"),
        ]

    status, out, (record, hist, count) = traced(argv, setup)
    assert status == 0 and out == run_plain(argv).stdout
    assert sorted(e.values["i"] for e in events) == sorted(list(range(2000)) * threads)
    assert record.hits == hist.hits == 2000 * threads and count.hits == 100 * threads
    assert dict(record.resumes) == {ResumeKind.BOOST: 2000 * threads}
    assert dict(hist.resumes) == {ResumeKind.BOOST: 2000 * threads}  # lea, from its slot after the actions
    expected = [0] * len(hist.histogram)
    for i in range(2000):
        expected[i.bit_length()] += threads
    assert hist.histogram == expected


def test_handler_reads_arguments_and_changes_registers(counter: str) -> None:
    seen: list[int] = []

    def pre(hit: Hit) -> None:
        seen.append(hit.regs.arg(1))
        hit.regs.rdi = 0  # every call now computes work(0) == 1

    status, out, _ = traced([counter, "10", "1"], lambda s: s.probe("work", pre=pre))
    assert status == 0
    assert seen == list(range(10))
    assert out == "total=10\n"


def test_handler_fetches_the_probes_arguments(counter: str) -> None:
    """What a handler asks of its hit (fetch arguments, comm, memory), made when it asks."""
    seen: list[tuple[object, ...]] = []

    def pre(hit: Hit) -> None:
        values = hit.fetch()
        seen.append((values["n"], values["c"].text, hit.comm(), dict(hit.formatted())["n"]))  # type: ignore[union-attr]

    status, _, _ = traced([counter, "3", "1"], lambda s: s.probe("work n=%di:s32 c=$comm", pre=pre))
    assert status == 0
    assert seen == [(i, "counter", "counter", str(i)) for i in range(3)]


def test_pre_handler_returning_true_skips_the_instruction(counter: str) -> None:
    def pre(hit: Hit) -> bool:
        # Emulate 'return 1' ourselves: rax = 1, pop the return address.
        hit.regs.rax = 1
        hit.regs.rip = int.from_bytes(hit.read(int(hit.regs.rsp), 8), "little")
        hit.regs.rsp += 8
        return True

    status, out, _ = traced([counter, "7", "1"], lambda s: s.probe("work", pre=pre))
    assert status == 0 and out == "total=7\n"


def test_aggregate_probes_run_in_order_and_disable_independently(counter: str) -> None:
    order: list[str] = []

    def setup(session: dynprobe.Session) -> list[dynprobe.Probe]:
        a = session.probe("p:t/a work", pre=lambda h: order.append("a"))
        b = session.probe("p:t/b work", pre=lambda h: order.append("b"))
        c = session.probe("p:t/c work", pre=lambda h: order.append("c"), enabled=False)
        b.disable()
        return [a, b, c]

    status, _, (a, b, c) = traced([counter, "3", "1"], setup)
    assert status == 0
    assert order == ["a"] * 3
    assert (a.hits, b.hits, c.hits) == (3, 0, 0)


def test_post_handler_sees_state_after_the_instruction(counter: str) -> None:
    after: list[int] = []

    def setup(session: dynprobe.Session) -> dynprobe.Probe:
        return session.probe("work", post=lambda h: after.append(int(h.regs.rip)))

    status, _, probe = traced([counter, "4", "1"], setup)
    assert status == 0 and probe.hits == 4
    # 'work' starts with a boosted load: a post-handler makes it single-step.
    assert dict(probe.resumes) == {ResumeKind.STEP: 4}
    assert len(after) == 4 and len(set(after)) == 1


def test_enable_disable_from_a_handler(counter: str) -> None:
    def setup(session: dynprobe.Session) -> tuple[dynprobe.Probe, dynprobe.Probe]:
        watched = session.probe("p:t/watched work")
        switch = session.probe("p:t/switch work", pre=lambda h: watched.disable() if watched.hits >= 5 else None)
        return watched, switch

    status, _, (watched, switch) = traced([counter, "20", "1"], setup)
    assert status == 0
    assert watched.hits == 5 and switch.hits == 20


@pytest.mark.parametrize("how", ["remove", "disable"])
def test_threads_already_at_a_trap_removed_meanwhile_go_on_uncounted(counter: str, how: str) -> None:
    """8 threads call work nonstop; the first hit's handler removes (or disables) the probe.
    Threads that had hit the int3 meanwhile (their stops not yet served) are put back before it,
    as if it had never been there: exactly one hit, and every call returns the right value."""
    removed: list[int] = []

    def setup(session: dynprobe.Session) -> tuple[dynprobe.Probe]:
        def once(hit: Hit) -> None:
            removed.append(hit.tid)
            hit.probe.remove() if how == "remove" else hit.probe.disable()

        return (session.probe("work", pre=once),)

    status, out, (probe,) = traced([counter, "20000", "8"], setup)
    assert status == 0 and out == run_plain([counter, "20000", "8"]).stdout
    assert probe.hits == 1 and len(removed) == 1


def test_the_last_probe_removed_from_an_armed_trap_puts_the_original_bytes_back(counter: str) -> None:
    """`work`'s only probe removes itself at its 5th hit: its code is the file's again at once
    (not repaired later by the rescue handler, which would also keep the program alive), and
    still when the program next stops for dynprobe (printf, at its end); no hit after it."""
    offset = load_elf(counter).vaddr_to_offset(symbols(counter)["work"])
    assert offset is not None
    with open(counter, "rb") as f:
        f.seek(offset)
        original = f.read(16)
    seen: dict[str, object] = {}
    work_at: dict[int, int] = {}  # pid -> where `work` runs

    def code_at_work(hit: Hit) -> bytes:
        with open(f"/proc/{hit.pid}/mem", "rb", buffering=0) as mem:
            return os.pread(mem.fileno(), 16, work_at[hit.pid])

    def setup(session: dynprobe.Session) -> dynprobe.Probe:
        def pre(hit: Hit) -> None:
            work_at[hit.pid] = hit.address
            if work.hits == 5:
                work.remove()
                seen["armed"] = work.armed_addresses
                seen["at removal"] = code_at_work(hit)

        def at_printf(hit: Hit) -> None:
            seen["at the end"] = code_at_work(hit)

        work = session.probe("p:t/work work", pre=pre)
        session.probe("p:t/printf libc:printf", pre=at_printf)
        return work

    status, out, work = traced([counter, "20", "1"], setup)
    assert status == 0 and out == run_plain([counter, "20", "1"]).stdout
    assert work.hits == 5 and work.removed and seen["armed"] == []
    assert seen["at removal"] == original and seen["at the end"] == original


def test_a_trap_record_removed_mid_run_keeps_the_hits_before_it(ret: str) -> None:
    """is_even's record runs in the target from its site's action code; is_odd's handler removes
    that probe at its 100th hit: the site goes (its action code freed once no thread is in it),
    the records are exactly those of the 100 calls before, and the program's answer is right."""
    events: list[dynprobe.ProbeEvent] = []

    def setup(session: dynprobe.Session) -> list[dynprobe.Probe]:
        def pre(hit: Hit) -> None:
            if odd.hits == 100:
                even.remove()

        even = session.probe("p is_even n=%di", on_event=events.append)
        odd = session.probe("p is_odd", pre=pre)
        return [even, odd]

    status, out, (even, odd) = traced([ret, "evenodd", "2000"], setup)
    assert (status, out) == (0, "1\n") and even.removed and odd.hits == 1000
    assert [e.values["n"] for e in events] == list(range(2000, 1800, -2))


def test_probe_on_main_and_constructor_hits(build: object) -> None:
    ctor = build_target("ctor", "ctor.c")
    status, out, (c, m) = traced([ctor], lambda s: (s.probe("init_early"), s.probe("main")))
    assert status == 0 and out == "ctor ran\n"
    assert (c.hits, m.hits) == (1, 1)


def test_library_probe_arms_when_loaded(counter: str) -> None:
    status, _, probe = traced([counter, "1", "1"], lambda s: s.probe("p libc:printf fmt=+0(%di):string"))
    assert status == 0 and probe.hits == 1


def test_refusals(counter: str) -> None:
    with dynprobe.spawn([counter, "1"]) as session:
        with pytest.raises(ProbeRefused) as info:
            session.probe("work+1")  # inside 'mov rax,[rip+seed]'
        assert info.value.reason == Refusal.NOT_INSN_BOUNDARY
        with pytest.raises(SymbolError):
            session.probe("no_such_function")
        with pytest.raises(SymbolError):
            session.probe("/nonexistent/lib.so:f")
    # the spawned command was never started: it is gone, not left stopped


@pytest.mark.parametrize("optimize", [False, True])
def test_indirect_functions_are_probed_where_they_resolve(optimize: bool) -> None:
    """libc's strlen and memcpy are IFUNCs: their symbols are resolvers (and memcpy's plain
    symbol an old compatibility function). Probes count the calls of what programs run."""
    target = build_target("ifunc", flags=("-O1",))
    status, out, probes = traced(
        [target, "1000"],
        lambda s: [s.probe(f"libc:{name}", action="count") for name in ("strlen", "memcpy", "malloc")],
        optimize=optimize,
    )
    assert status == 0 and out == f"{1000 * len(target)}\n"
    assert [p.hits for p in probes] == [1000, 1000, 1001]  # printf's buffer: one malloc more


def test_a_name_means_its_default_version(tmp_path: Path) -> None:
    """libm's exp: programs call exp@@GLIBC_2.29; exp@GLIBC_2.2.5, first in the file, is the
    compatibility function for programs linked before it."""
    source = tmp_path / "exp.c"
    source.write_text(
        "#include <math.h>\n#include <stdio.h>\n#include <stdlib.h>\n"
        "int main(int c, char **v) { double (*volatile f)(double) = exp; double s = 0;\n"
        '  for (int i = 0; i < atoi(v[1]); i++) s += f(i * 1e-3);\n  printf("%.3f\\n", s); return 0; }\n'
    )
    subprocess.run(["gcc", "-O1", "-o", str(tmp_path / "exp"), str(source), "-lm"], check=True)
    argv = [str(tmp_path / "exp"), "1000"]
    named = ("libm:exp", "libm:exp@GLIBC_2.2.5", "libm:exp@@GLIBC_2.29", "libm:exp@GLIBC_2.29")
    status, out, probes = traced(argv, lambda s: [s.probe(name) for name in named])
    assert status == 0 and out == run_plain(argv).stdout
    # nm -D's names: exp@@GLIBC_2.29 (and exp@GLIBC_2.29) are the default version, exp
    assert [p.hits for p in probes] == [1000, 0, 1000, 1000]  # type: ignore[attr-defined]
    with dynprobe.spawn(argv, stdout=subprocess.DEVNULL) as session:
        with pytest.raises(SymbolError, match=r"'exp@@GLIBC_2\.2\.5' in .*: its default version is exp@@GLIBC_2\.29"):
            session.probe("libm:exp@@GLIBC_2.2.5")
        with pytest.raises(SymbolError, match=r"'exp@@NOPE' .*: its default version is exp@@GLIBC_2\.29"):
            session.probe("libm:exp@@NOPE")


def test_a_pattern_names_each_function_once(counter: str) -> None:
    """Shell-style patterns (as perf probe and funccount take): a spec for each function whose
    name matches, one per address, named after it; none matching, or more than the cap, is an
    error that says so; session.probe refuses a pattern (expand it first)."""
    with dynprobe.spawn([counter, "10", "1"], stdout=subprocess.DEVNULL) as session:
        specs = session.expand("p:c/hit counter:[wp][ou]*y*")  # work (no 'y'), pushy: only pushy
        assert [(s.location.rsplit(":", 1)[1], s.event) for s in session.expand("p counter:[wp][ou]*")] == [
            ("work", None), ("pushy", None)]  # fmt: skip
        assert [(s.location.rsplit(":", 1)[1], s.event) for s in specs] == [("pushy", "hit")]
        named = session.expand("p:c/hit counter:[wp][ou]*+1")
        assert [s.event for s in named] == ["hit_work_1", "hit_pushy_1"]
        probes = [session.probe(s) for s in session.expand("p counter:[wp][ou]*")]
        with pytest.raises(SymbolError, match=r"no function of .*counter matches 'nothing\*'"):
            session.expand("p counter:nothing*")
        with pytest.raises(dynprobe.SessionError, match=r"is a pattern: session\.expand"):
            session.probe("p counter:wo*")
        libc = session.expand("p libc:mem*")  # memcpy and memmove share an implementation here
        assert len({s.location for s in libc}) == len(libc) > 3
        assert session.run(timeout=60) == 0
    assert [p.hits for p in probes] == [10, 0]


def test_a_pattern_naming_too_many_functions_is_refused(counter: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from dynprobe.symbols import resolve

    monkeypatch.setattr(resolve, "MAX_MATCHES", 3)
    with (
        dynprobe.spawn([counter, "10", "1"], stdout=subprocess.DEVNULL) as session,
        pytest.raises(SymbolError, match=r"functions of .*libc.* match 'str\*', more than 3 probes from one pattern"),
    ):
        session.expand("p libc:str*")
