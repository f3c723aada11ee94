"""ElfImage (symbols/elf.py) on real files: what it reads fast agrees with pyelftools."""

from __future__ import annotations

from dynprobe.symbols.elf import ElfImage
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
