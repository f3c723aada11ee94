"""The unwind tables' cache on disk (symbols/unwind_cache.py): a table read back is the one
written; a directory or file someone else could have changed, a link planted in the way, a file
cut short or scribbled over are never used (nor written through), and the table is compiled
again."""

from __future__ import annotations

import os
import shutil
from array import array
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynprobe.arch.x86_64.unwind import RSP, BpRule, Kind, Row, UnwindTable, pack
from dynprobe.symbols import unwind_cache
from dynprobe.symbols.elf import ElfImage
from tests.conftest import build_target

BUILD_ID = "0123456789abcdef0123456789abcdef01234567"
ROWS = [
    Row(Kind.CFA, RSP, 8, BpRule.SAME, 0),
    Row(Kind.CFA, RSP, 16, BpRule.SAVED, -16),
    Row(Kind.END, RSP, 0, BpRule.LOST, 0),
]
TABLE = UnwindTable(array("Q", [0x1000, 0x1004, 0x1020]), array("q", map(pack, ROWS)), skipped=2)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An XDG cache directory of ours; the cache's own directory under it."""
    home = tmp_path / "cache"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    monkeypatch.delenv("DYNPROBE_CACHE", raising=False)
    yield home / "dynprobe" / f"unwind-{unwind_cache.FORMAT}"


def same(a: UnwindTable | None, b: UnwindTable) -> bool:
    return a is not None and (list(a.starts), list(a.rows), a.skipped) == (list(b.starts), list(b.rows), b.skipped)


def test_a_table_read_back_is_the_one_written(cache: Path) -> None:
    assert unwind_cache.load(BUILD_ID) is None
    unwind_cache.store(BUILD_ID, TABLE)
    assert same(unwind_cache.load(BUILD_ID), TABLE)
    assert (cache / BUILD_ID).stat().st_mode & 0o777 == 0o600 and cache.stat().st_mode & 0o777 == 0o700
    assert os.listdir(cache) == [BUILD_ID]  # (the file written under another name first is gone)


@pytest.mark.parametrize("build_id", [None, "", "../../etc/passwd", "0123", BUILD_ID.upper(), BUILD_ID + "/x"])
def test_a_build_id_that_is_not_hex_is_never_a_file_name(cache: Path, build_id: str | None) -> None:
    unwind_cache.store(build_id, TABLE)
    assert unwind_cache.load(build_id) is None and not cache.exists()


def test_a_directory_others_may_write_is_not_used(cache: Path) -> None:
    cache.parent.parent.chmod(0o777)  # (the XDG directory: anyone could swap what is below it)
    unwind_cache.store(BUILD_ID, TABLE)
    assert not cache.exists()
    cache.parent.parent.chmod(0o700)
    unwind_cache.store(BUILD_ID, TABLE)
    cache.chmod(0o777)
    assert unwind_cache.load(BUILD_ID) is None


def test_a_link_in_the_way_is_never_followed(cache: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    cache.parent.mkdir(mode=0o700)
    cache.symlink_to(elsewhere)  # the cache's directory: a link
    unwind_cache.store(BUILD_ID, TABLE)
    assert unwind_cache.load(BUILD_ID) is None and not os.listdir(elsewhere)
    cache.unlink()
    cache.mkdir(mode=0o700)
    target = tmp_path / "target"
    (cache / BUILD_ID).symlink_to(target)  # the file: a link
    assert unwind_cache.load(BUILD_ID) is None
    unwind_cache.store(BUILD_ID, TABLE)  # (written under its own name, then renamed over the link)
    assert not target.exists() and same(unwind_cache.load(BUILD_ID), TABLE)


def test_a_file_cut_short_or_scribbled_over_is_not_used(cache: Path) -> None:
    unwind_cache.store(BUILD_ID, TABLE)
    path = cache / BUILD_ID
    data = path.read_bytes()
    for bad in (data[:-1], data + b"\0", b"XXXXXXXX" + data[8:], data[:24] + data[32:40] + data[24:32] + data[40:],
                (10**9).to_bytes(8, "little").join((data[:8], data[16:]))):  # fmt: skip
        path.write_bytes(bad)
        assert unwind_cache.load(BUILD_ID) is None, bad[:48]
    path.write_bytes(data)
    path.chmod(0o622)
    assert unwind_cache.load(BUILD_ID) is None


def test_off_when_asked(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYNPROBE_CACHE", "0")
    unwind_cache.store(BUILD_ID, TABLE)
    assert unwind_cache.load(BUILD_ID) is None and not cache.exists()


def test_an_image_reads_its_table_from_the_cache(cache: Path) -> None:
    """The first image of a file compiles its table and caches it; the next reads it from the
    cache (here, one put in its place: read, not compiled again)."""
    binary = build_target("counter", flags=("-O1", "-pthread"))
    first = ElfImage(binary)
    assert first.build_id is not None and len(first.unwind_table)
    assert same(unwind_cache.load(first.build_id), first.unwind_table)
    unwind_cache.store(first.build_id, TABLE)
    assert same(ElfImage(binary).unwind_table, TABLE)
    shutil.rmtree(cache)
    assert same(ElfImage(binary).unwind_table, first.unwind_table)
