"""The loader's cache as symbols/loader.py reads it (/etc/ld.so.cache, as glibc writes it) is what
`ldconfig -p` lists: every x86-64 soname with the first path the cache gives it."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from dynprobe.symbols.loader import ld_cache


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
