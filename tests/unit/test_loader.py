"""The loader's cache as symbols/loader.py reads it (/etc/ld.so.cache, as glibc writes it) is what
`ldconfig -p` lists: every x86-64 soname with the first path the cache gives it."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from dynprobe.symbols.loader import ld_cache, parse_ld_cache


def test_the_loader_cache_is_what_ldconfig_lists() -> None:
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        listed = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"ldconfig -p cannot run here: {exc}")
    expected: dict[str, str] = {}
    for line in listed.splitlines()[1:]:
        if "=>" in line and "x86-64" in line:
            expected.setdefault(line.split()[0], line.split("=>")[1].strip())
    assert "libc.so.6" in expected
    assert ld_cache() == expected


def test_a_cache_in_the_old_and_new_formats_is_read_by_its_new_part() -> None:
    """glibc before 2.32 writes the old format's header and entries first, then the new one's
    (its strings' offsets from its own header): the same entries are read."""
    try:
        with open("/etc/ld.so.cache", "rb") as cache:
            new = cache.read()
    except OSError as exc:
        pytest.skip(f"no loader's cache here: {exc}")
    expected = parse_ld_cache(new)
    assert "libc.so.6" in expected
    for entries in (0, 1, 3):  # (the new part aligned to 8 bytes after them)
        old = b"ld.so-1.7.0\0" + entries.to_bytes(4, "little") + b"\1" * 12 * entries
        old += bytes(-len(old) % 8)
        assert parse_ld_cache(old + new) == expected
    for broken in (new[:47], b"X" + new[1:], b"ld.so-1.7.0\0\xff\xff\xff\x7f" + new, b""):
        assert parse_ld_cache(broken) == {}
    entries_end = 48 + 24 * int.from_bytes(new[20:24], "little")
    cut = parse_ld_cache(new[: (entries_end + len(new)) // 2])  # (strings cut short: those entries left out)
    assert 0 < len(cut) < len(expected) and cut.items() <= expected.items()
