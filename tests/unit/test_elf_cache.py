"""What symbols/elf.py works out of a file, kept on disk (symbols/elf_cache.py): read back, it is
what parsing the file gives; a later run reads it without loading pyelftools; a changed file, or
a debug file replaced, is worked out again; an entry cut short or scribbled over is never used.
(The cache's directory and files are made and checked as the unwind tables' are:
test_unwind_cache.py.)"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import pytest

from dynprobe.symbols import elf_cache
from dynprobe.symbols.elf import ElfImage
from tests.conftest import build_target

LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
HIDDEN = "static int hidden(int x) { return x * 3; }\nint (*keep)(int) = hidden;\n"  # (named by the debug file only)


@pytest.fixture
def cache(cache_home: Path) -> Path:
    """The cache's own directory, in an XDG cache directory of this test's."""
    return cache_home / elf_cache.KIND


def analysis(path: str) -> tuple[Any, ...]:
    """Everything ElfImage works out of the file at `path` that the cache keeps."""
    image = ElfImage(path)
    targets = image.branch_targets()
    return (
        image.headers, image.functions, image.own_functions, image.objects, image.ifuncs, image.default_versions,
        image.debug_file, list(targets.sources), list(targets.targets), list(targets.taken), targets.everything,
        image.eh_frame_ranges(),
    )  # fmt: skip


def parsed(path: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    with monkeypatch.context() as patch:
        patch.setenv("DYNPROBE_CACHE", "0")
        return analysis(path)


def test_an_entry_read_back_is_the_one_written(cache: Path) -> None:
    key = elf_cache.key_of("a file", 1)
    meta = {"a": [1, "two", None], "b": {"c": True}}
    arrays = {"signed": array("q", [-1, 0, 1 << 62]), "unsigned": array("Q", [(1 << 64) - 1, 0]), "none": array("q")}
    strings = {"names": ["malloc", "", "ünïcode", "a b"], "empty": [], "one empty": [""]}
    elf_cache.store(key, meta, arrays, strings)
    assert elf_cache.load(key) == (meta, arrays, strings)
    assert elf_cache.load(elf_cache.key_of("a file", 2)) is None
    assert (cache / key).stat().st_mode & 0o777 == 0o600 and os.listdir(cache) == [key]


def test_what_is_read_back_is_what_parsing_gives(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """libc (its symbols merged with its debug file's, where one is installed), a program."""
    for path in (LIBC, build_target("counter", flags=("-O1", "-pthread"))):
        first = analysis(path)
        kept = {name: (cache / name).stat().st_ino for name in os.listdir(cache)}
        assert analysis(path) == first == parsed(path, monkeypatch)
        targets, taken, eh_ranges = first[8], first[9], first[11]  # (what bisect looks into: sorted)
        assert targets and taken and eh_ranges
        assert targets == sorted(targets) and taken == sorted(taken) and list(eh_ranges) == sorted(eh_ranges)
        again = {name: (cache / name).stat().st_ino for name in os.listdir(cache)}
        assert again == kept and kept  # (read back, not written again: a rewrite is a new file, renamed in)


def test_a_later_run_does_not_load_pyelftools(cache: Path) -> None:
    """What a probe on libc:malloc needs (the symbol, whether its entry can take a jump) comes
    from the cache; pyelftools is loaded only to work it out the first time."""
    script = (
        "import sys\n"
        "from dynprobe.symbols.elf import ElfImage\n"
        f"image = ElfImage({LIBC!r})\n"
        "malloc = image.own_function('malloc')\n"
        "plan = image.jump_plan(malloc.addr, malloc.size, malloc.addr)\n"
        "print(image.function_at(malloc.addr + 1).name, type(plan).__name__, 'elftools' in sys.modules)\n"
    )  # fmt: skip
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
            for _ in range(2)]  # fmt: skip
    assert runs[0][:2] == runs[1][:2] == ["malloc", "OptimizePlan"]
    assert (runs[0][2], runs[1][2]) == ("True", "False")


def test_a_changed_file_is_worked_out_again(cache: Path, tmp_path: Path) -> None:
    source, library = tmp_path / "lib.c", tmp_path / "lib.so"
    for functions in (["first"], ["first", "second"]):
        source.write_text("".join(f"int {name}(int x) {{ return x + {len(name)}; }}\n" for name in functions))
        subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
        assert {"first", "second"} & set(ElfImage(str(library)).by_name) == set(functions)


def test_a_debug_file_replaced_is_looked_at_again(cache: Path, tmp_path: Path) -> None:
    """The debug file is kept by its identity (inode, size, times), not read whole: one replaced
    by another program's (another build-id) is not taken for it; put back, it is again."""
    source = tmp_path / "lib.c"
    library, debug, other = tmp_path / "libx.so", tmp_path / "libx.so.debug", tmp_path / "other.debug"
    for output, text in ((other, "int other(void) { return 2; }\n"), (library, HIDDEN)):
        source.write_text(text)
        subprocess.run(["gcc", "-O1", "-g", "-shared", "-fPIC", "-o", str(output), str(source)], check=True)
    subprocess.run(["objcopy", "--only-keep-debug", str(library), str(debug)], check=True)
    subprocess.run(["strip", "--strip-all", str(library)], check=True)
    subprocess.run(["objcopy", f"--add-gnu-debuglink={debug.name}", str(library)], cwd=tmp_path, check=True)
    assert ElfImage(str(library)).debug_file == str(debug)
    shutil.move(debug, tmp_path / "kept")
    shutil.copy(other, debug)
    image = ElfImage(str(library))
    assert image.debug_file is None and "hidden" not in image.by_name
    shutil.move(tmp_path / "kept", debug)
    image = ElfImage(str(library))
    assert image.debug_file == str(debug) and "hidden" in image.by_name


def rehashed(entry: bytes, body: bytes) -> bytes:
    """`entry` with another body behind its header, and the header's hash of it."""
    return entry[:16] + hashlib.sha256(body).digest() + body


def test_an_entry_cut_short_or_scribbled_over_is_not_used(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = build_target("counter", flags=("-O1", "-pthread"))
    truth = parsed(path, monkeypatch)
    analysis(path)
    entries = {name: (cache / name).read_bytes() for name in os.listdir(cache)}
    assert len(entries) >= 2  # (the headers and symbols; the branch scan)
    header = 48  # (magic, the JSON's length, a SHA-256 of all that follows)
    for name, data in entries.items():
        size = int.from_bytes(data[8:16], "little")
        text = data[header : header + size]
        typecode = re.sub(rb'\["[qQ]", ', b'["d", ', text, count=1)  # (an array of doubles)
        assert typecode != text
        rest = data[header + size :]
        digest = hashlib.sha256(data[header:]).digest()
        assert data[16:header] == digest

        # (a bit of an array flipped: still well formed, and sorted or not, never used)
        flipped = data[: header + size + 8] + bytes([data[header + size + 8] ^ 1]) + data[header + size + 9 :]
        longer = data[:8] + (size + 1).to_bytes(8, "little") + data[16:]
        for bad in (data[:-1], data + b"\0", b"X" + data[1:], longer, rehashed(data, b"[" + text[1:] + rest),
                    rehashed(data, typecode + rest), data[:12], flipped):  # fmt: skip
            (cache / name).write_bytes(bad)
            assert elf_cache.load(name) is None, bad[:64]
            assert analysis(path) == truth  # (worked out again, and kept again)
            assert (cache / name).read_bytes() == data


def test_an_entry_of_the_wrong_types_is_not_used(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Well-formed entries whose contents are not what elf.py keeps (a field of another type,
    a number JSON spells that is no integer, an entry without the headers it should have) are
    worked out again, as if not there."""
    path = build_target("counter", flags=("-O1", "-pthread"))
    truth = parsed(path, monkeypatch)
    analysis(path)
    entries = {name: elf_cache.load(name) for name in os.listdir(cache)}
    headers_key = next(k for k, kept in entries.items() if kept is not None and "headers" in kept[0])
    branches_key = next(k for k, kept in entries.items() if kept is not None and "scanned" in kept[0])

    meta, arrays, strings = entries[headers_key]  # type: ignore[misc]
    scan_meta, scan_arrays, scan_strings = entries[branches_key]  # type: ignore[misc]
    headers = meta["headers"]
    for key, bad in (
        (headers_key, ({"headers": headers | {"build_id": 5}}, arrays, strings)),
        (headers_key, ({"headers": headers | {"segments": [s | {"vaddr": "0"} for s in headers["segments"]]}},
                       arrays, strings)),
        (headers_key, ({}, arrays, strings)),
        (branches_key, (scan_meta | {"scanned": 1.5}, scan_arrays, scan_strings)),
        (branches_key, (scan_meta | {"everything": "no"}, scan_arrays, scan_strings)),
    ):  # fmt: skip
        elf_cache.store(key, *bad)
        assert analysis(path) == truth
        assert elf_cache.load(key) == entries[key]  # (written again)
    elf_cache.store(branches_key, scan_meta | {"scanned": 12345678}, scan_arrays, scan_strings)
    kept = (cache / branches_key).read_bytes().replace(b"12345678", b"Infinity")
    (cache / branches_key).write_bytes(rehashed(kept, kept[48:]))
    assert elf_cache.load(branches_key) is None and analysis(path) == truth  # (JSON's Infinity: no integer)
