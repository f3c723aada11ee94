"""ElfImage (symbols/elf.py) on real files: what it reads fast agrees with pyelftools."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import iced_x86 as iced
import numpy as np
import pytest

from dynprobe.arch.x86_64.decode import iter_instructions
from dynprobe.arch.x86_64.jumptables import landing
from dynprobe.arch.x86_64.optimize import plt_slot
from dynprobe.errors import OptimizeRefusal
from dynprobe.symbols.elf import ElfImage
from dynprobe.symbols.lines import source_line
from dynprobe.symbols.resolve import resolve_symbol
from tests.conftest import build_target


def test_unwind_ranges_from_the_header_table_are_the_unwind_tables() -> None:
    """ElfImage reads function ranges from .eh_frame_hdr's table in bulk; pyelftools, parsing
    .eh_frame entry by entry, must agree (libc: thousands of entries, and a test binary)."""
    for path in ("/usr/lib/x86_64-linux-gnu/libc.so.6", build_target("ifunc", flags=("-O1",))):
        fast = ElfImage(path)
        ranges = fast.eh_frame_ranges()
        slow = ElfImage(path)
        slow._eh_frame_hdr_ranges = lambda: None  # type: ignore[method-assign]
        assert len(ranges) > 3 and ranges == slow.eh_frame_ranges()


def split_debug(built: str, tmp_path: Path, strip: str) -> tuple[Path, Path]:
    """A copy of `built` stripped (`strip`: its option) with its debug information in a
    separate file it links to (objcopy --only-keep-debug, --add-gnu-debuglink, as gdb finds it)."""
    binary, debug = tmp_path / "wordcount", tmp_path / "wordcount.debug"
    shutil.copy(built, binary)
    subprocess.run(["objcopy", "--only-keep-debug", str(binary), str(debug)], check=True)
    subprocess.run(["strip", strip, str(binary)], check=True)
    subprocess.run(["objcopy", f"--add-gnu-debuglink={debug}", str(binary)], cwd=tmp_path, check=True)
    return binary, debug


def test_a_stripped_file_takes_its_symbols_from_its_debug_file(tmp_path: Path) -> None:
    """gdb's separate debug file, found next to the file (Debian's -dbg packages put them under
    /usr/lib/debug/.build-id)."""
    built = build_target("wordcount", "../../examples/wordcount.c", flags=("-O2",))
    binary, debug = split_debug(built, tmp_path, "--strip-all")
    stripped, original = ElfImage(str(binary)), ElfImage(built)
    assert stripped.debug_file == str(debug)
    assert stripped.functions == original.functions and stripped.by_name["add_word"].size > 0
    debug.unlink()  # without it: only what the stripped file itself names
    assert ElfImage(str(binary)).debug_file is None and "add_word" not in ElfImage(str(binary)).by_name


def test_a_file_keeping_its_symbols_takes_lines_and_cfi_from_its_debug_file(tmp_path: Path) -> None:
    """strip --strip-debug keeps .symtab: the debug file (found as gdb finds it, whatever the
    file keeps) gives the lines and the .debug_frame of code built without unwind tables; the
    symbols are the file's own."""
    built = build_target("wordcount_debug_frame", "../../examples/wordcount.c",
                         flags=("-O2", "-fno-asynchronous-unwind-tables", "-fno-unwind-tables"))  # fmt: skip
    binary, debug = split_debug(built, tmp_path, "--strip-debug")
    stripped, original = ElfImage(str(binary)), ElfImage(built)
    add_word = stripped.by_name["add_word"].addr
    assert stripped.has_symtab and stripped.debug_file == str(debug)
    assert source_line(str(binary), add_word) == source_line(built, add_word) == "wordcount.c:16"
    assert stripped.functions == original.functions
    row = stripped.unwind_table.find(add_word)
    assert row is not None and row == original.unwind_table.find(add_word)
    debug.unlink()
    assert ElfImage(str(binary)).unwind_table.find(add_word) is None


def test_a_name_a_library_exports_is_found_without_reading_its_debug_file(tmp_path: Path) -> None:
    """A stripped library with a separate debug file: the name it exports is resolved from its
    own symbols (reading libc's debug file costs ~40 ms of every probe on it); a static function
    only the debug file names is still found, from it."""
    source = tmp_path / "lib.c"
    source.write_text("static int hidden(int x) { return x * 3; }\n"
                      "int exported(int x) { return hidden(x) + 1; }\n"
                      "int (*keep)(int) = hidden;\n")  # fmt: skip
    library, debug = tmp_path / "libx.so", tmp_path / "libx.so.debug"
    subprocess.run(["gcc", "-O1", "-g", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    subprocess.run(["objcopy", "--only-keep-debug", str(library), str(debug)], check=True)
    subprocess.run(["strip", "--strip-all", str(library)], check=True)
    subprocess.run(["objcopy", f"--add-gnu-debuglink={debug}", str(library)], cwd=tmp_path, check=True)
    image = ElfImage(str(library))
    exported = resolve_symbol(image, "exported", 0)
    assert exported.function is not None and exported.function.name == "exported" and exported.function.size > 0
    assert "_symbol_tables" not in image.__dict__ and "_debug" not in image.__dict__
    hidden = resolve_symbol(image, "hidden", 0)
    assert image.debug_file == str(debug) and hidden.function is not None and hidden.function.name == "hidden"
    assert hidden.vaddr != exported.vaddr


def test_aliases_show_their_public_name() -> None:
    libc = ElfImage("/usr/lib/x86_64-linux-gnu/libc.so.6")
    malloc = libc.by_name["malloc"]
    assert libc.by_name["__libc_malloc"].addr == malloc.addr  # one function, two names
    assert libc.function_at(malloc.addr) == malloc and libc.function_at(malloc.addr + 1) == malloc


def test_a_name_means_its_default_version() -> None:
    """libm's exp@@GLIBC_2.29 is what programs call; exp@GLIBC_2.2.5 is kept for old ones (and
    comes first in the file). libc's memcpy@GLIBC_2.2.5 likewise, behind an indirect function."""
    libm = ElfImage("/usr/lib/x86_64-linux-gnu/libm.so.6")
    default, old = libm.by_name["exp"], libm.by_name["exp@GLIBC_2.2.5"]
    assert default.addr != old.addr and libm.function_at(old.addr) == old
    libc = ElfImage("/usr/lib/x86_64-linux-gnu/libc.so.6")
    assert "memcpy" in libc.ifuncs and "memcpy" not in libc.by_name and "memcpy@GLIBC_2.2.5" in libc.by_name


def test_mapping_at_finds_each_address_s_mapping_and_none_in_the_gaps() -> None:
    """mapping_at bisects /proc/PID/maps: at each mapping's first and last byte, the mapping;
    just past one, the next mapping or None (a gap); below the first, None."""
    import os

    from dynprobe.symbols.maps import mapping_at, read_maps

    maps = read_maps(os.getpid())
    assert len(maps) > 10

    def by_scan(addr: int) -> object:
        return next((m for m in maps if m.start <= addr < m.end), None)

    probes = [maps[0].start - 1, 0]
    for m in maps:
        probes += [m.start, m.end - 1, m.end]
    for addr in probes:
        assert mapping_at(maps, addr) is by_scan(addr), hex(addr)
    assert mapping_at(maps, maps[0].start - 1) is None
    assert any(by_scan(m.end) is None for m in maps)  # some gaps were tried


@pytest.mark.parametrize(
    "flags",
    [("-O1",), ("-O1", "-fno-PIE", "-no-pie"), ("-O1", "-Wl,-z,now"), ("-O1", "-fcf-protection=full", "-Wl,-z,ibtplt")],
    ids=["pie-lazy", "no-pie", "bind-now", "ibt-plt"],
)
def test_plt_stubs_are_named_after_the_slot_they_jump_through(flags: tuple[str, ...]) -> None:
    """Each stub of .plt, .plt.sec and .plt.got, however the program was linked: one stub per
    library function the program calls, at a stub's start, reading that function's GOT slot."""
    binary = build_target(f"ret_plt_{'_'.join(f.strip('-=,') for f in flags)}", "ret.c", flags=(*flags, "-pthread"))
    image = ElfImage(binary)
    stubs = {f.name: f for f in image.plt_stubs}
    assert {"printf", "fork", "pthread_create", "longjmp"} <= set(stubs)
    for name, stub in stubs.items():
        slot = plt_slot(image.code(stub.addr, stub.size), stub.addr)
        assert slot in image.symbol_slots[name] and stub.size in (8, 16)


def test_an_address_resolves_to_the_file_it_maps_or_says_why_not() -> None:
    """An absolute address in this process: in libc's text, its file offset and function; in
    a mapping with no file or not executable, or in no mapping, a one-line error."""
    import ctypes
    import os

    from dynprobe.errors import SymbolError
    from dynprobe.symbols.maps import read_maps
    from dynprobe.symbols.resolve import resolve, resolve_address

    maps = read_maps(os.getpid())
    getpid = ctypes.cast(ctypes.CDLL(None).getpid, ctypes.c_void_p).value
    assert getpid is not None
    located = resolve_address(getpid, maps)
    assert located.path.endswith("libc.so.6") and located.function is not None and "getpid" in located.function.name
    heap = next(m for m in maps if m.path == "[heap]" or not m.executable)
    with pytest.raises(SymbolError, match=f"{heap.start:#x} is not in executable code mapped from a file"):
        resolve_address(heap.start, maps)
    with pytest.raises(SymbolError, match="0x10 is not mapped in the target"):
        resolve_address(0x10, maps)
    with pytest.raises(SymbolError, match="no symbol in '\\+0x10'"):
        resolve("+0x10", located.path)


@pytest.mark.parametrize("lookups", [10**9, 0], ids=["each question weighed", "from every target"])
def test_a_file_s_branch_targets_are_those_of_its_functions_decoded(
    lookups: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """libc: at every function's first bytes (what a probe's jump covers), `addr in targets` says
    what decoding every function says (among them, the jumps of mempcpy into memmove's start),
    whether it weighs each question's candidates or, past BranchTargets.LOOKUPS, looks in the
    set of every target."""
    from dynprobe.arch.x86_64.optimize import branches_in
    from dynprobe.symbols.elf import BranchTargets

    monkeypatch.setattr(BranchTargets, "LOOKUPS", lookups)
    monkeypatch.setattr(BranchTargets, "FUNCTIONS_PER_LOOKUP", 1 << 60)
    libc = ElfImage("/usr/lib/x86_64-linux-gnu/libc.so.6")
    targets = libc.branch_targets()
    ranges = {(f.addr, f.end) for f in libc.functions if f.size} | set(libc.eh_frame_ranges())
    decoded: set[int] = set()
    for start, end in ranges:
        decoded |= {target for _, target in branches_in(libc.code(start, end - start), start)}
    inside = [a for f in libc.functions for a in range(f.addr + 1, f.addr + 5)]
    assert [a for a in inside if (a in targets) != (a in decoded)] == []
    assert any(a in decoded for a in inside) and all(a in targets for a in sorted(decoded)[::97])


def test_code_that_reads_as_branches_everywhere_makes_every_address_a_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file is untrusted: executable bytes that all read as calls (real code: one byte in 30)
    would take memory without bound to list; every address is then a target (probes there stay
    traps). (A small file may have that many: here none may.)"""
    from dynprobe.symbols.elf import BranchTargets

    monkeypatch.setattr(BranchTargets, "_ANY_FILE", 0)
    binary = Path(build_target("ret_o1", "ret.c", flags=("-O1",)))  # (not ret: its flags differ)
    image = ElfImage(str(binary))
    assert not image.branch_targets().everything
    code = next(s for s in image.segments if s.executable)
    data = bytearray(binary.read_bytes())
    data[code.offset : code.offset + code.filesz] = b"\xe8" * code.filesz
    (tmp_path / "calls").write_bytes(bytes(data))
    targets = ElfImage(str(tmp_path / "calls")).branch_targets()
    assert targets.everything and code.vaddr + 1 in targets and 12345 in targets


@pytest.mark.parametrize("made", ["leas", "addresses"])
def test_a_file_that_takes_addresses_everywhere_makes_every_address_a_target(
    made: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for what a file takes the address of: code that reads as RIP-relative `lea`s
    everywhere, or (not position-independent) data that reads as addresses of its code."""
    from dynprobe.symbols.elf import BranchTargets

    monkeypatch.setattr(BranchTargets, "_ANY_FILE", 0)
    built = build_target(
        "switchy-nopie", "switchy.c", flags=("-O2", "-fno-pie", "-no-pie", "-fno-tree-switch-conversion")
    )
    image = ElfImage(built)
    assert not image.branch_targets().everything
    data = bytearray(Path(built).read_bytes())
    code = next(s for s in image.segments if s.executable)
    if made == "leas":
        data[code.offset : code.offset + code.filesz] = (b"\x48\x8d\x05\x00\x00\x00\x00" * code.filesz)[: code.filesz]
    else:
        other = next(s for s in image.segments if not s.executable and s.offset >= 0x1000 and s.filesz > 64)
        addresses = b"".join((code.vaddr + i % code.filesz).to_bytes(4, "little") for i in range(other.filesz // 4))
        data[other.offset : other.offset + len(addresses)] = addresses
    (tmp_path / "taken").write_bytes(bytes(data))
    targets = ElfImage(str(tmp_path / "taken")).branch_targets()
    assert targets.everything and code.vaddr + 3 in targets


def test_a_data_symbol_s_address_and_an_offset_in_no_segment() -> None:
    """@SYM takes data symbols too (libc's environ); a file offset no segment maps is refused."""
    from dynprobe.errors import SymbolError
    from dynprobe.symbols.resolve import resolve_file_offset

    libc = ElfImage("/usr/lib/x86_64-linux-gnu/libc.so.6")
    assert libc.address_of("environ") == libc.objects["environ"] and libc.address_of("malloc") is not None
    assert libc.address_of("no_such_symbol") is None
    beyond = len(libc.data) + 0x1000
    with pytest.raises(SymbolError, match=f"offset {beyond:#x} is not in executable code of"):
        resolve_file_offset(libc, beyond)


def test_an_xbegin_s_abort_target_is_a_branch_target() -> None:
    """`xbegin rel32` (C7 F8): its abort path lands on its target, as a jump does."""
    from types import SimpleNamespace

    from dynprobe.symbols.elf import BranchTargets

    code = bytes.fromhex("90" * 16 + "c7f8" + (0x20).to_bytes(4, "little", signed=True).hex() + "c3" * 64)
    image = SimpleNamespace(segments=[SimpleNamespace(executable=True, vaddr=0x1000, filesz=len(code), offset=0)],
                            data=code, own_functions=[], eh_frame_ranges=lambda: [], path="x", is_pie=True,
                            _relocations=lambda: iter(()))  # fmt: skip
    targets = BranchTargets(image, BranchTargets.scan(image))  # type: ignore[arg-type]
    assert 0x1000 + 16 + 6 + 0x20 in targets and 0x1000 + 16 + 6 + 0x21 not in targets


def test_where_code_may_take_an_address_as_numpy_finds_it() -> None:
    """`lea r, [rip+d]` with and without REX.W; the imm32 of `mov r32, imm32`, `push imm32` and
    `mov r/m, imm32` after each ModRM, SIB and displacement form."""
    from dynprobe.symbols.elf import _immediates, _rip_leas

    leas = bytes.fromhex("488d0510000000" + "4c8d3d20000000" + "8d0d30000000")  # lea rax; lea r15; lea ecx
    found = set(_rip_leas(np.frombuffer(leas, dtype=np.uint8), 0x1000).tolist())
    assert {0x1000 + 7 + 0x10, 0x1007 + 7 + 0x20, 0x100E + 6 + 0x30} <= found
    forms = {  # encoding (the imm32 is 11223344) -> where the imm32 starts
        "b844332211": 1, "41bf44332211": 2, "6844332211": 1, "48c7c044332211": 3, "c7042444332211": 3,
        "c744240844332211": 4, "48c78424000100004433221144": 8, "c7050000000044332211": 6,
    }  # fmt: skip
    for encoding, start in forms.items():
        code = np.frombuffer(bytes.fromhex(encoding) + b"\xcc" * 8, dtype=np.uint8)
        assert start in _immediates(code).tolist(), encoding


def test_the_addresses_a_file_takes(tmp_path: Path) -> None:
    """A shared library's computed gotos: their labels are in RELATIVE relocations, taken; a
    non-PIE program's switch table of addresses: each case taken; an address inside an
    instruction that nothing names is not."""
    source = tmp_path / "goto.c"
    source.write_text("int hop(int x) { static void *at[] = {&&a, &&b}; goto *at[x & 1];"
                      " a: return 1; b: return 2; }\n")  # fmt: skip
    library = tmp_path / "libgoto.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    image = ElfImage(str(library))
    relative = [r["r_addend"] for s in image._elf.iter_sections("SHT_RELA") for r in s.iter_relocations()
                if r["r_info_type"] == 8]  # fmt: skip
    hop = image.by_name["hop"]
    labels = [a for a in relative if hop.addr < a < hop.end]
    assert len(labels) == 2 and all(image.branch_targets().is_taken(a) for a in labels)
    assert not any(image.branch_targets().is_taken(a) for a in range(hop.addr + 1, hop.addr + 4))
    switchy = build_target(
        "switchy-nopie", "switchy.c", flags=("-O2", "-fno-pie", "-no-pie", "-fno-tree-switch-conversion")
    )
    program = ElfImage(switchy)
    dispatch = program.by_name["dispatch"]
    insns = list(iter_instructions(program.code(dispatch.addr, dispatch.size), dispatch.addr))
    jump = next(i for i, insn in enumerate(insns) if insn.is_jmp_near_indirect)
    cases = landing(insns, jump, program.read)
    assert isinstance(cases, frozenset) and len(cases) >= 7
    assert all(program.branch_targets().is_taken(case) for case in cases)


def test_reading_a_file_and_the_padding_after_a_function() -> None:
    switchy = build_target(
        "switchy-nopie", "switchy.c", flags=("-O2", "-fno-pie", "-no-pie", "-fno-tree-switch-conversion")
    )
    image = ElfImage(switchy)
    zero = image.by_name["zero"]
    assert zero.size == 3 and image.read(zero.addr, 3) == bytes.fromhex("31c0c3")
    padding = image.padding_after(zero.end)
    assert len(padding) == 16 - 3 and image.read(zero.end, len(padding)) == padding
    assert image.padding_after(image.by_name["one"].addr) == b""  # (a function starts there)
    assert image.read(zero.addr, 1 << 40) is None and image.read(1 << 50, 4) is None


def test_a_switch_whose_load_begins_past_its_table_is_never_patched(tmp_path: Path) -> None:
    """GCC's switch on cases from -2 with no default (no compare bounds it) loads its offsets
    from 8 bytes into the table (`movslq 8(%rdx,%rdi,4)`): the entries before are cases too, so
    nothing bounds where it lands, and no site of the function takes a jump (one did: a case's
    code inside the patched bytes)."""
    source = tmp_path / "biased.c"
    source.write_text(
        "extern volatile int sink;\nint g(long x) {\n  int r = 0;\n  switch (x) {\n"
        "  case -2: sink = 11; r += 3; /* fall through */\n"
        "  case -1: sink = 21; sink = 22; sink = 23; sink = 24; sink = 25; return r + 2;\n"
        "  case 0: sink = 31; return 3; case 1: sink = 41; return 4; case 2: sink = 51; return 5;\n"
        "  case 3: sink = 61; return 6; case 4: sink = 71; return 7; case 5: sink = 81; return 8;\n"
        "  default: __builtin_unreachable();\n  }\n}\nvolatile int sink;\n"
    )  # fmt: skip
    library = tmp_path / "libbiased.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    image = ElfImage(str(library))
    g = image.by_name["g"]
    insns = list(iter_instructions(image.code(g.addr, g.size), g.addr))
    assert any(i.mnemonic == iced.Mnemonic.MOVSXD and i.memory_displacement == 8 for i in insns)  # (the form)
    verdicts = {image.jump_plan(g.addr, g.size, int(i.ip)) for i in insns}
    assert verdicts <= {OptimizeRefusal.INDIRECT_JUMP, OptimizeRefusal.TOO_SHORT}, verdicts


def test_tables_are_read_only_where_the_program_cannot_write() -> None:
    """A jump plan reads the file's bytes only from segments that are not writable: what is in
    .data (`seed`, a variable) may be another value by the time a jump goes through it."""
    image = ElfImage(build_target("counter", flags=("-O1", "-pthread")))
    seed = image.objects["seed"]
    assert image.read(seed, 8) == (1).to_bytes(8, "little") and image.read(seed, 8, constant=True) is None
    work = image.by_name["work"]
    assert image.read(work.addr, 4, constant=True) == image.code(work.addr, 4)
    holding = {name: [s.writable for s in image.segments if s.vaddr <= addr < s.vaddr + s.memsz]
               for name, addr in (("seed", seed), ("work", work.addr))}  # fmt: skip
    assert holding == {"seed": [True], "work": [False]}
