"""`hit.stack()` against gdb's backtraces, frame for frame: C built at -O0 and -O2, with and
without frame pointers, through libc (a qsort callback), a thread's start, a signal handler and a
deep chain; C++ through a destructor run by an exception and the handler that catches it. Each
frame is compared as (file, offset in the file): where ASLR puts things differs between the runs.
Trap probes and upcalls walk from the same registers; so do return probes, whose replaced
return addresses must appear as the real callers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

import dynprobe
from dynprobe.core.probe import Hit, Probe, ProbeMode
from dynprobe.core.stacks import Stack
from dynprobe.symbols.elf import load_elf
from dynprobe.symbols.maps import mapping_at, read_maps
from tests.conftest import DYNPROBE, build_target

GDB = shutil.which("gdb")
GDB_SCRIPT = Path(__file__).with_name("gdb_stacks.py")
BUILDS = {
    "O0": ("-O0",), "O2": ("-O2",), "O0-nofp": ("-O0", "-fomit-frame-pointer"),
    "O2-nofp": ("-O2", "-fomit-frame-pointer"),
    # its own code's CFI in .debug_frame only (the C runtime's is in .eh_frame): both are read
    "O2-debug-frame": ("-O2", "-fomit-frame-pointer", "-fno-asynchronous-unwind-tables", "-fno-unwind-tables"),
}  # fmt: skip
CXX_BUILDS = {"cxx-O0": ("-O0",), "cxx-O2": ("-O2", "-fomit-frame-pointer")}
Frames = list[tuple[str, int]]


def program(build: str) -> str:
    if build in CXX_BUILDS:
        return build_target(f"stacks_{build}", "stacks_cxx.cpp", flags=(*CXX_BUILDS[build], "-lstdc++"))
    return build_target(f"stacks_{build}", "stacks.c", flags=(*BUILDS[build], "-pthread"))


_GDB_STACKS: dict[str, list[dict[str, list[list[object]]]]] = {}


def gdb_stacks(path: str, tmp_path: Path) -> list[Frames]:
    """gdb's stack at each call of leaf(): its frames on the stack (inlined ones left out)."""
    return [[(str(f), int(str(o))) for f, o, _ in s["physical"]] for s in gdb_output(path, tmp_path)]  # type: ignore[misc]


def gdb_output(path: str, tmp_path: Path) -> list[dict[str, list[list[object]]]]:
    """What gdb_stacks.py wrote for the program, run once per program."""
    if GDB is None:
        pytest.skip("gdb is not installed (make test installs it): no reference for stacks")
    if path not in _GDB_STACKS:
        out = tmp_path / "gdb.json"
        subprocess.run([GDB, "-batch", "-nx", "-x", str(GDB_SCRIPT), "--args", path],
                       env={**os.environ, "DYNPROBE_GDB_OUT": str(out)}, capture_output=True, timeout=120,
                       check=True)  # fmt: skip
        _GDB_STACKS[path] = [json.loads(line) for line in out.read_text().splitlines()]
    return _GDB_STACKS[path]


def in_files(hit: Hit) -> Frames:
    """The hit's stack as (file, offset) frames; the walk must have reached the outermost."""
    stack = hit.stack()
    assert not stack.cut, str(stack)
    maps = read_maps(hit.pid)
    frames = []
    for frame in (f for f in stack if not f.inlined):
        m = mapping_at(maps, frame.address)
        assert m is not None and m.path == frame.module, frame
        frames.append((m.path, frame.address - m.start + m.offset))
    return frames


def dynprobe_stacks(path: str, mode: str, *, returns_hit: int = 0) -> list[Frames]:
    """The stack at each call of leaf(); with `returns_hit`, a return probe on deep() too (its
    hits: that many)."""
    stacks: list[Frames] = []
    with dynprobe.spawn([path], stdout=subprocess.DEVNULL) as session:
        session.optimize = mode != "trap"
        returns = session.probe(f"r16 {path}:deep") if returns_hit else None
        session.probe(f"{path}:leaf", pre=lambda hit: stacks.append(in_files(hit)))
        assert session.run(timeout=60) == 0
    assert returns is None or returns.hits == returns_hit
    return stacks


@pytest.mark.parametrize("mode", ["trap", "upcall"])
@pytest.mark.parametrize("build", [*BUILDS, *CXX_BUILDS])
def test_stacks_are_gdbs(build: str, mode: str, tmp_path: Path) -> None:
    path = program(build)
    expected = gdb_stacks(path, tmp_path)
    assert len(expected) == (2 if build in CXX_BUILDS else 4)  # (each way to leaf() once)
    assert dynprobe_stacks(path, mode) == expected


def test_a_stack_names_its_frames() -> None:
    """`str(stack)`: a frame a line, `function+0xoff (module) at file:line`, C++ names demangled
    (the lines are gdb's: test_inlined_frames_are_gdbs)."""
    path = program("cxx-O0")
    stacks: list[Stack] = []
    with dynprobe.spawn([path], stdout=subprocess.DEVNULL) as session:
        session.probe(f"{path}:leaf", pre=lambda hit: stacks.append(hit.stack()))
        assert session.run(timeout=60) == 0
    name = os.path.basename(path)
    first = str(stacks[0]).splitlines()
    assert first[0] == f"leaf ({name}) at stacks_cxx.cpp:5"
    assert first[1].startswith("app::Guard::~Guard+0x") and first[1].endswith(f" ({name}) at stacks_cxx.cpp:9")
    assert first[2].startswith("app::thrower+0x") and f" ({name}) at stacks_cxx.cpp:1" in first[2]
    assert first[-1].startswith("_start+")


def test_return_addresses_dynprobe_replaced_are_the_callers(tmp_path: Path) -> None:
    """With a return probe on deep() (each of its 13 calls' return address replaced), the stack
    at leaf() is gdb's: the trampoline never shows."""
    path = program("O2-nofp")
    expected = gdb_stacks(path, tmp_path)
    for mode in ("trap", "upcall"):
        assert dynprobe_stacks(path, mode, returns_hit=13) == expected, mode


def test_max_frames_cuts_the_stack() -> None:
    path = program("O0")
    seen: list[tuple[int, bool]] = []

    def on_leaf(hit: Hit) -> None:
        stack = hit.stack(max_frames=3)
        seen.append((len(stack), stack.cut))
        for wrong in (0, 128, "3"):
            with pytest.raises(dynprobe.SessionError, match="is not a number of frames"):
                hit.stack(max_frames=wrong)  # type: ignore[arg-type]

    with dynprobe.spawn([path], stdout=subprocess.DEVNULL) as session:
        session.probe(f"{path}:leaf", pre=on_leaf)
        for wrong in (0, "abc"):
            with pytest.raises(dynprobe.SessionError, match="is not a number of frames"):
                session.probe(f"{path}:leaf", by="stack", max_frames=wrong)  # type: ignore[arg-type]
        assert session.run(timeout=60) == 0
    assert seen == [(3, True)] * 4


def counted_in_files(stacks: Counter[Stack]) -> Counter[tuple[tuple[str, int], ...]]:
    """Stacks counted by a probe, as (file, offset in the file) frames: the maps named them."""
    out: Counter[tuple[tuple[str, int], ...]] = Counter()
    for stack, count in stacks.items():
        assert not stack.cut, str(stack)
        frames = []
        for frame in (f for f in stack if not f.inlined):
            assert frame.module is not None and frame.symbol is not None, frame
            image = load_elf(frame.module)
            vaddr = image.by_name[frame.symbol].addr + frame.offset
            offset = image.vaddr_to_offset(vaddr)
            assert offset is not None
            frames.append((frame.module, offset))
        out[tuple(frames)] += count
    return out


@pytest.mark.parametrize("mode", ["trap", "optimized"])
@pytest.mark.parametrize("build", [*BUILDS, *CXX_BUILDS])
def test_stacks_counted_in_the_target_are_gdbs(build: str, mode: str, tmp_path: Path) -> None:
    """`by="stack"`: the walk the target runs (in a detour, or as a trap site's actions) counts
    each of gdb's stacks once."""
    path = program(build)
    expected = Counter(tuple(stack) for stack in gdb_stacks(path, tmp_path))
    with dynprobe.spawn([path], stdout=subprocess.DEVNULL) as session:
        session.optimize = mode != "trap"
        probe = session.probe(f"{path}:leaf", by="stack")
        assert session.run(timeout=60) == 0
    assert probe.mode == (ProbeMode.OPTIMIZED if mode == "optimized" else ProbeMode.TRAP)
    assert counted_in_files(probe.stacks) == expected


@pytest.mark.parametrize("mode", ["trap", "optimized"])
@pytest.mark.parametrize("build", ["O0", "O2-nofp"])
def test_a_return_probes_stack_is_where_the_return_went_back_to(build: str, mode: str, tmp_path: Path) -> None:
    """A return probe counted or recorded by stack: each stack is walked from the return
    address (as bpftrace's uretprobe ustack), so it is gdb's stack at the entry without its
    first frame; a record carries it with the return value's fields."""
    path = program(build)
    expected = Counter(tuple(stack[1:]) for stack in gdb_stacks(path, tmp_path))
    events: list[dynprobe.ProbeEvent] = []
    with dynprobe.spawn([path], stdout=subprocess.DEVNULL) as session:
        session.optimize = mode != "trap"
        counted = session.probe(f"r {path}:leaf", by="stack")
        recorded = session.probe(f"r:g/back {path}:leaf why=$arg1:s32", by="stack", on_event=events.append)
        assert session.run(timeout=60) == 0
    assert counted.hits == recorded.hits == 4 and counted.nmissed == recorded.nmissed == 0
    assert counted_in_files(counted.stacks) == counted_in_files(recorded.stacks) == expected
    by_why = {e.values["why"]: e.stack for e in events}
    stacks = [stack[1:] for stack in gdb_stacks(path, tmp_path)]
    assert [counted_in_files(Counter([by_why[why]])) for why in (1, 2, 3, 4)] == [  # type: ignore[list-item]
        Counter([tuple(stack)]) for stack in stacks
    ]


@pytest.mark.parametrize("later", [False, True])
def test_stacks_counted_through_replaced_return_addresses(later: bool, tmp_path: Path) -> None:
    """The return probe placed with the stacks' probe, or `later` (from a handler, once the
    walker runs: its trampoline made after the walker, which finds it in the directory)."""
    path = program("O2-nofp")
    expected = Counter(tuple(stack) for stack in gdb_stacks(path, tmp_path))
    placed: list[Probe] = []
    with dynprobe.spawn([path], stdout=subprocess.DEVNULL) as session:
        probe = session.probe(f"{path}:leaf", by="stack")
        if later:
            session.probe(f"{path}:sorter", pre=lambda hit: placed.append(session.probe(f"r16 {path}:deep")))
        else:
            placed.append(session.probe(f"r16 {path}:deep"))
        assert session.run(timeout=60) == 0
    returns = placed[0]
    assert returns.hits == 13 and probe.mode == ProbeMode.OPTIMIZED
    assert counted_in_files(probe.stacks) == expected


def test_a_full_table_of_stacks_counts_what_it_missed() -> None:
    """8192 distinct stacks, a table of 4096: every hit is in a stack's count or missed, and no
    stack is counted wrong (each counted stack was hit once)."""
    path = build_target("paths", flags=("-O1",))
    with dynprobe.spawn([path, "13"], stdout=subprocess.DEVNULL) as session:
        probe = session.probe(f"{path}:leaf", by="stack")
        assert session.run(timeout=60) == 0
    stacks = probe.stacks
    assert probe.hits == 8192 and probe.nmissed > 0
    assert sum(stacks.values()) + probe.nmissed == 8192 and set(stacks.values()) == {1}
    assert all(len(s) == 2 + 2 * 13 + 4 and not s.cut for s in stacks)  # leaf, path, 13 turns, main .. _start


def test_max_frames_and_what_cannot_count_by_stack() -> None:
    path = program("O0")
    with dynprobe.spawn([path], stdout=subprocess.DEVNULL) as session:
        probe = session.probe(f"{path}:leaf", by="stack", max_frames=2)
        for kwargs, says in (({"by": "caller"}, "by='caller'"),
                             ({"by": "stack", "max_frames": 128}, "not a number of frames"),
                             ({"by": "stack", "action": "hist", "value": "$arg1"}, "not hist"),
                             ({"by": "stack", "pre": print}, "not Python handlers")):  # fmt: skip
            with pytest.raises(dynprobe.SessionError, match=says):
                session.probe(f"{path}:sorter", **kwargs)  # type: ignore[arg-type]
        assert session.run(timeout=60) == 0
    assert sum(probe.stacks.values()) == 4
    assert all(len(s) == 2 and s.cut for s in probe.stacks)


def test_stacks_through_a_library_loaded_later_and_again() -> None:
    """A probe in a library dlopen'd, closed and opened again (where lib_b was meanwhile):
    its rows are in the target's directory each time it is mapped, so no stack is cut."""
    lib_a = build_target("libdl_a", "libdl_a.c", flags=("-O1", "-shared", "-fPIC"), output="libdl_a.so")
    lib_b = build_target("libdl_b", "libdl_b.c", flags=("-O1", "-shared", "-fPIC"), output="libdl_b.so")
    main = build_target("dl", flags=("-O1", "-ldl"))
    with dynprobe.spawn([main, lib_a, lib_b], stdout=subprocess.DEVNULL) as session:
        probe = session.probe(f"{lib_a}:lib_func", by="stack")
        assert session.run(timeout=60) == 0
    assert probe.hits == 6 and sum(probe.stacks.values()) == 6
    for stack in probe.stacks:
        assert not stack.cut and [f.function for f in stack][:2] == ["lib_func", "main"], str(stack)


def test_a_fork_childs_stacks_add_to_its_parents() -> None:
    forks = build_target("forks", flags=("-O1", "-pthread"))
    with dynprobe.spawn([forks, "fork"], stdout=subprocess.DEVNULL, follow_fork=True) as session:
        probe = session.probe(f"{forks}:probed", by="stack")
        assert session.run(timeout=60) == 0
    assert probe.hits == 2 + 5 and sum(probe.stacks.values()) == 7
    assert all(not s.cut and s[1].function == "main" for s in probe.stacks)


@pytest.mark.parametrize("mode", ["trap", "optimized"])
def test_a_module_without_unwind_tables_is_walked_by_frame_pointers(mode: str, tmp_path: Path) -> None:
    """No .eh_frame nor .debug_frame: said once, its frames followed by rbp (built with frame
    pointers: the callers are found; at a function's entry, the return address at rsp), the
    stacks marked as possibly cut."""
    built = build_target("stacks_nocfi", "stacks.c", flags=("-O0", "-fno-asynchronous-unwind-tables",
                                                            "-fno-unwind-tables", "-pthread"))  # fmt: skip
    path = str(tmp_path / "stacks_nocfi")
    subprocess.run(["objcopy", "--strip-debug", "--remove-section=.eh_frame", "--remove-section=.eh_frame_hdr",
                    built, path], check=True)  # fmt: skip
    with dynprobe.spawn([path], stdout=subprocess.DEVNULL) as session:
        session.optimize = mode != "trap"
        probe = session.probe(f"{path}:leaf", by="stack")
        assert session.run(timeout=60) == 0
        warnings = [w for w in session.warnings if "unwind" in w]
    assert warnings == [
        f"{path} has no unwind table dynprobe can read: stacks through its code follow frame pointers, and may be cut"
    ]
    deep = next(s for s in probe.stacks if s[1].function == "deep")
    assert [f.function for f in deep][:15] == ["leaf", *["deep"] * 13, "main"] and deep.cut
    if mode == "trap":  # hit.stack() (the tracer's walk) at the same entry: the caller is there too
        with dynprobe.spawn([path], stdout=subprocess.DEVNULL) as session:
            seen: list[list[str | None]] = []
            session.probe(f"{path}:deep", pre=lambda hit: seen.append([f.function for f in hit.stack()][:3]))
            assert session.run(timeout=60) == 0
        assert seen[-1] == ["deep", "deep", "deep"] and seen[0] == ["deep", "main", "__libc_start_call_main"]


@pytest.mark.parametrize("mode", ["trap", "optimized"])
def test_each_recorded_event_carries_its_stack(mode: str, tmp_path: Path) -> None:
    """A recording probe placed with by="stack": each event's stack (`ProbeEvent.stack`, its
    slot in the table carried by its record) is gdb's for that hit."""
    path = program("O2-nofp")
    expected = gdb_stacks(path, tmp_path)
    events: list[dynprobe.ProbeEvent] = []
    with dynprobe.spawn([path], stdout=subprocess.DEVNULL) as session:
        session.optimize = mode != "trap"
        probe = session.probe(f"p {path}:leaf why=%di:s32", on_event=events.append, by="stack")
        assert session.run(timeout=60) == 0
    assert [e.values["why"] for e in sorted(events, key=lambda e: e.time_ns)] == [1, 2, 3, 4]
    by_why = {e.values["why"]: e.stack for e in events}
    got = [counted_in_files(Counter([by_why[why]])) for why in (1, 2, 3, 4)]  # type: ignore[list-item]
    assert got == [Counter([tuple(stack)]) for stack in expected]
    assert sum(probe.stacks.values()) == 4


@pytest.mark.parametrize("build", [*BUILDS, *CXX_BUILDS])
def test_inlined_frames_are_gdbs(build: str, tmp_path: Path) -> None:
    """Every frame gdb shows, inlined ones too (DWARF's inlined subroutines: no frame on the
    stack), in its order: the inlined ones named as gdb names them; lines the same wherever
    both have one."""
    path = program(build)
    stacks: list[Stack] = []
    with dynprobe.spawn([path], stdout=subprocess.DEVNULL) as session:
        session.probe(f"{path}:leaf", pre=lambda hit: stacks.append(hit.stack()))
        assert session.run(timeout=60) == 0
    inlined = 0
    for stack, theirs in zip(stacks, gdb_output(path, tmp_path), strict=True):
        every = theirs["all"]
        assert [f.inlined for f in stack] == [bool(f[0]) for f in every], str(stack)
        for frame, (is_inlined, name, line) in zip(stack, every, strict=True):
            if is_inlined:
                inlined += 1
                assert frame.function == name, str(stack)
            if frame.line is not None and line is not None:
                assert os.path.basename(frame.line) == line, str(stack)
    assert inlined or build not in ("O2", "cxx-O2")  # (-O2 inlines somewhere in these stacks)


@pytest.mark.parametrize("mode", ["trap", "optimized"])
def test_a_value_summed_by_stack(mode: str) -> None:
    """`by="stack"` with a `value`: each stack's sum of it (leaf's argument says which way it
    was reached), counted too; a value without by='stack' is a histogram's only."""
    path = program("O2-nofp")
    with dynprobe.spawn([path], stdout=subprocess.DEVNULL) as session:
        session.optimize = mode != "trap"
        probe = session.probe(f"p {path}:leaf why=%di:s32", by="stack", value="why")
        with pytest.raises(dynprobe.SessionError, match="a value is for a histogram, or summed by stack"):
            session.probe(f"p {path}:sorter n=%di", value="n")
        assert session.run(timeout=60) == 0
    sums = {stack[1].function: total for stack, total in probe.stack_sums.items()}
    assert sums == {"compare": 1, "worker": 2, "__restore_rt": 3, "deep": 4}
    assert sorted(probe.stacks.values()) == [1, 1, 1, 1]


def test_folded_stacks_say_what_a_full_table_left_out(tmp_path: Path) -> None:
    """`stacks --folded`: the folded lines hold the stacks the table kept; the hits it could not
    keep are said on the standard error (not among the lines: flamegraph.pl would draw them)."""
    path = build_target("paths", flags=("-O1",))
    out = tmp_path / "leaf.folded"
    run = subprocess.run([*DYNPROBE, "stacks", "--folded", "-o", str(out), f"p {path}:leaf", "--", path, "13"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    kept = sum(int(line.rsplit(" ", 1)[1]) for line in out.read_text().splitlines())
    [note] = [line for line in run.stderr.splitlines() if "not in the folded stacks" in line]
    missed = int(note.split()[1])
    assert kept + missed == 8192 and 0 < missed < 8192
    assert (
        note == f"dynprobe: {missed} hits of uprobes/p_leaf are not in the folded stacks: the table of stacks was full"
    )
