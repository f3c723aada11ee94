"""Batched access to a stopped target's memory: reads see held writes, nothing reaches the target
before the batch ends, writes a few bytes apart go out as one without touching the bytes between."""

from __future__ import annotations

import os

import pytest

import dynprobe
from dynprobe.symbols.elf import load_elf
from dynprobe.symbols.maps import read_maps


def test_batched_writes_are_held_then_written_out(spinner: str) -> None:
    with dynprobe.spawn([spinner]) as session:
        pid = session.pid
        tracee = session.process(pid).tracee  # type: ignore[union-attr]
        text = next(m for m in read_maps(pid) if m.executable and m.path == os.path.realpath(spinner))
        at = text.start + 0x100
        before = tracee.read(at, 64)
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        try:
            with tracee.batched():
                tracee.write(at, b"\xcc")
                tracee.write(at + 40, b"\xcc\xcc")
                assert tracee.read(at, 64) == b"\xcc" + before[1:40] + b"\xcc\xcc" + before[42:]
                assert os.pread(fd, 64, at) == before  # held
            after = os.pread(fd, 64, at)
        finally:
            os.close(fd)
        assert after == b"\xcc" + before[1:40] + b"\xcc\xcc" + before[42:]
        vaddr = load_elf(spinner).offset_to_vaddr(text.offset)
        assert vaddr is not None and before == load_elf(spinner).code(vaddr + 0x100, 64)  # the bytes between too
        tracee.write(at, before)


def test_reads_that_reach_unmapped_memory(spinner: str) -> None:
    """The last 8 bytes of a mapping followed by a hole: 16 bytes from there are an error, in a
    batch too; `read_upto` gives the 8 that are there."""
    with dynprobe.spawn([spinner]) as session:
        tracee = session.process(session.pid).tracee  # type: ignore[union-attr]
        maps = read_maps(session.pid)
        starts = {m.start for m in maps}
        end = next(m.end for m in maps if m.end not in starts and m.perms[0] == "r" and not m.path.startswith("["))
        last = tracee.read(end - 8, 8)
        with pytest.raises(OSError, match=f"short read at {end - 8:#x}"):
            tracee.read(end - 8, 16)
        assert tracee.read_upto(end - 8, 16) == last
        with tracee.batched():
            assert tracee.read_upto(end - 8, 16) == last and tracee.read(end - 8, 8) == last
            with pytest.raises(OSError):  # (the next page: EIO)
                tracee.read(end - 8, 16)
