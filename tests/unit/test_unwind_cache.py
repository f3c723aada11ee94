"""The unwind tables' cache on disk (symbols/unwind_cache.py): a table read back is the one
written; a directory or file someone else could have changed, a link planted in the way, a file
cut short or scribbled over are never used (nor written through), and the table is compiled
again."""

from __future__ import annotations

import os
import shutil
from array import array
from pathlib import Path

import pytest

from dynprobe.arch.x86_64.unwind import RSP, BpRule, CfiSection, Kind, Row, UnwindTable, pack
from dynprobe.symbols import unwind_cache
from dynprobe.symbols.elf import ElfImage
from tests.conftest import build_target

KEY = unwind_cache.key_of([CfiSection(b"some CFI", 0x1000)])
ROWS = [
    Row(Kind.CFA, RSP, 8, BpRule.SAME, 0),
    Row(Kind.CFA, RSP, 16, BpRule.SAVED, -16),
    Row(Kind.END, RSP, 0, BpRule.LOST, 0),
]
TABLE = UnwindTable(array("Q", [0x1000, 0x1004, 0x1020]), array("q", map(pack, ROWS)), skipped=2)


@pytest.fixture
def cache(cache_home: Path) -> Path:
    """The cache's own directory, in an XDG cache directory of this test's."""
    return cache_home / f"unwind-{unwind_cache.FORMAT}"


def same(a: UnwindTable | None, b: UnwindTable) -> bool:
    return a is not None and (list(a.starts), list(a.rows), a.skipped) == (list(b.starts), list(b.rows), b.skipped)


def test_a_table_read_back_is_the_one_written(cache: Path) -> None:
    assert unwind_cache.load(KEY) is None
    unwind_cache.store(KEY, TABLE)
    assert same(unwind_cache.load(KEY), TABLE)
    assert (cache / KEY).stat().st_mode & 0o777 == 0o600 and cache.stat().st_mode & 0o777 == 0o700
    assert os.listdir(cache) == [KEY]  # (the file written under another name first is gone)


@pytest.mark.parametrize("key", ["", "../../etc/passwd", "0123", KEY.upper(), KEY + "/x", KEY[:-1]])
def test_a_key_that_is_not_a_hash_is_never_a_file_name(cache: Path, key: str) -> None:
    unwind_cache.store(key, TABLE)
    assert unwind_cache.load(key) is None and not cache.exists()


def test_the_key_is_the_sections() -> None:
    """Another file claiming the same build-id, with other CFI, is another name; the same
    section at another address, or as .debug_frame, or with a second section, too; bytes moved
    from one section to the next make another name."""
    a, b = CfiSection(b"a", 0), CfiSection(b"b", 0)
    moved = [CfiSection(b"ab", 0), CfiSection(b"", 0)]
    choices = ([a], [b], [CfiSection(b"a", 8)], [CfiSection(b"a", 0, True)], [a, b], moved)
    keys = {unwind_cache.key_of(sections) for sections in choices}
    assert len(keys) == len(choices) and unwind_cache.key_of([CfiSection(b"a", 0)]) in keys


def test_a_directory_others_may_write_is_not_used(cache: Path) -> None:
    cache.parent.parent.chmod(0o777)  # (the XDG directory: anyone could swap what is below it)
    unwind_cache.store(KEY, TABLE)
    assert not cache.exists()
    cache.parent.parent.chmod(0o700)
    unwind_cache.store(KEY, TABLE)
    cache.chmod(0o777)
    assert unwind_cache.load(KEY) is None


def test_a_link_in_the_way_is_never_followed(cache: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    cache.parent.mkdir(mode=0o700)
    cache.symlink_to(elsewhere)  # the cache's directory: a link
    unwind_cache.store(KEY, TABLE)
    assert unwind_cache.load(KEY) is None and not os.listdir(elsewhere)
    cache.unlink()
    cache.mkdir(mode=0o700)
    target = tmp_path / "target"
    (cache / KEY).symlink_to(target)  # the file: a link
    assert unwind_cache.load(KEY) is None
    unwind_cache.store(KEY, TABLE)  # (written under its own name, then renamed over the link)
    assert not target.exists() and same(unwind_cache.load(KEY), TABLE)


def test_a_file_cut_short_or_scribbled_over_is_not_used(cache: Path) -> None:
    unwind_cache.store(KEY, TABLE)
    path = cache / KEY
    data = path.read_bytes()
    rows = 24 + 8 * 3

    def row_with(value: int) -> bytes:
        return data[:rows] + value.to_bytes(8, "little", signed=True) + data[rows + 8 :]

    for bad in (data[:-1], data + b"\0", b"XXXXXXXX" + data[8:], data[:24] + data[32:40] + data[24:32] + data[40:],
                (10**9).to_bytes(8, "little").join((data[:8], data[16:])), data[:20],
                row_with(5), row_with(3 << 4), row_with(1 << 6)):  # fmt: skip
        path.write_bytes(bad)
        assert unwind_cache.load(KEY) is None, bad[:48]
    path.write_bytes(data)
    path.chmod(0o622)
    assert unwind_cache.load(KEY) is None


def test_a_file_left_half_written_does_not_stop_the_next(cache: Path) -> None:
    unwind_cache.store(KEY, TABLE)
    (cache / KEY).unlink()
    (cache / f".{KEY}.{os.getpid()}").write_bytes(b"half")  # (a run killed as it wrote)
    unwind_cache.store(KEY, TABLE)
    assert same(unwind_cache.load(KEY), TABLE)


def test_off_when_asked(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYNPROBE_CACHE", "0")
    unwind_cache.store(KEY, TABLE)
    assert unwind_cache.load(KEY) is None and not cache.exists()


def test_an_image_reads_its_table_from_the_cache(cache: Path) -> None:
    """The first image of a file compiles its table and caches it; the next reads it from the
    cache (here, one put in its place: read, not compiled again)."""
    binary = build_target("counter", flags=("-O1", "-pthread"))
    first = ElfImage(binary)
    assert len(first.unwind_table)
    [key] = os.listdir(cache)
    assert same(unwind_cache.load(key), first.unwind_table)
    unwind_cache.store(key, TABLE)
    assert same(ElfImage(binary).unwind_table, TABLE)
    shutil.rmtree(cache)
    assert same(ElfImage(binary).unwind_table, first.unwind_table)
