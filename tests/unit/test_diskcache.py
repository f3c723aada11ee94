"""What the disk cache (symbols/diskcache.py) keeps when it is full: a kind's entries past its
budget go, those used longest ago first (a read counts as a use, the entry just written always
stays), and so do the temporary files of writes killed midway, once they are old; nothing
else in the directory is touched. (How its directory and files are made and checked:
test_unwind_cache.py.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dynprobe.symbols import diskcache

KIND = "test-1"


def key(n: int) -> str:
    return f"{n:064x}"


@pytest.fixture
def cache(cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The kind's directory, holding at most three entries of 1000 bytes."""
    monkeypatch.setattr(diskcache, "BUDGET", 3000)
    return cache_home / KIND


def write_at(cache: Path, n: int, when: float) -> None:
    """Entry `n` (1000 bytes) written, dated `when` (as if written or read then)."""
    diskcache.write(KIND, key(n), [bytes([n]) * 1000])
    os.utime(cache / key(n), (when, when))


def test_past_the_budget_the_entries_used_longest_ago_go(cache: Path) -> None:
    now = time.time()
    for n in range(1, 4):
        write_at(cache, n, now - 100 + n)  # 1 the oldest
    assert diskcache.read(KIND, key(1), most=1000) == b"\1" * 1000  # (now 1 was used last)
    write_at(cache, 4, now)
    assert sorted(p.name for p in cache.iterdir()) == [key(1), key(3), key(4)]
    diskcache.write(KIND, key(5), [b"\5" * 1000])
    assert sorted(p.name for p in cache.iterdir()) == [key(1), key(4), key(5)]


def test_an_entry_larger_than_the_budget_stays_until_the_next_write(cache: Path) -> None:
    diskcache.write(KIND, key(1), [b"\1" * 1000])
    diskcache.write(KIND, key(2), [b"\2" * 5000])
    assert [p.name for p in cache.iterdir()] == [key(2)]
    assert diskcache.read(KIND, key(2), most=5000) == b"\2" * 5000
    diskcache.write(KIND, key(3), [b"\3" * 10])
    assert [p.name for p in cache.iterdir()] == [key(3)]


def test_old_temporary_files_go_and_nothing_else_is_touched(cache: Path, tmp_path: Path) -> None:
    diskcache.write(KIND, key(1), [b"\1"])
    outside = tmp_path / "outside"
    outside.write_bytes(b"y" * 10_000)
    (cache / key(12)).symlink_to(outside)  # (a link by an entry's name: neither it nor what it names goes)
    old, fresh = cache / f".{key(7)}.{'0' * 16}", cache / f".{key(8)}.{'1' * 16}"
    others = [cache / "notes", cache / f"{key(9)}.bak", cache / key(10)[1:]]
    for path in [old, fresh, *others]:
        path.write_bytes(b"x" * 10_000)
        os.utime(path, (time.time() - 2 * diskcache.LEFT_BEHIND,) * 2)
    os.utime(fresh)
    (cache / key(11)).mkdir()  # (a directory by an entry's name is left alone too)
    diskcache.write(KIND, key(2), [b"\2"])
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [key(1), key(2), key(11), key(12), fresh.name, *(p.name for p in others)]
    )
    assert outside.read_bytes() == b"y" * 10_000


def test_a_read_where_its_date_cannot_change_still_gives_the_entry(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    diskcache.write(KIND, key(1), [b"\1" * 10])

    def read_only(*args: object, **kwargs: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "utime", read_only)
    assert diskcache.read(KIND, key(1), most=10) == b"\1" * 10
