"""The shared binary layouts (ringbuf/layout.py): every field naturally aligned, inside its
table and apart from every other; the thread area's sections in order, page-aligned, each
holding what it is sized for; the sizes the generated code and the consumer agree on."""

from __future__ import annotations

import itertools

import pytest

from dynprobe.arch.x86_64.regs import REG_NAMES
from dynprobe.ringbuf import layout as L
from dynprobe.spec.parser import MAX_MAXACTIVE

CACHE_LINE = 64


def check_fields(fields: dict[str, tuple[int, int]], size: int) -> None:
    """Each (offset, bytes) naturally aligned (up to 8), inside `size`, overlapping no other."""
    spans = sorted((offset, offset + width, name) for name, (offset, width) in fields.items())
    for offset, end, name in spans:
        assert offset % min(8, end - offset) == 0, f"{name} at {offset:#x} is not aligned"
        assert offset >= 0 and end <= size, f"{name} ({offset:#x}..{end:#x}) outside 0..{size:#x}"
    for (_, end, name), (offset, _, after) in itertools.pairwise(spans):
        assert end <= offset, f"{name} overlaps {after}"


def test_the_thread_area_header() -> None:
    fields = {
        "magic": (L.MAGIC, 8),
        "tid": (L.TID, 8),
        "busy": (L.BUSY, 8),
        "reserve": (L.RESERVE, 8),
        "wait ticks": (L.WAIT_TICKS, 8),
        "wait until": (L.WAIT_UNTIL, 8),
        "waits": (L.WAITS, 8),
        "overwrite": (L.OVERWRITE, 8),
        "head": (L.HEAD, CACHE_LINE),  # the producer's line
        "tail": (L.TAIL, CACHE_LINE),  # the consumer's line
        "shadow top": (L.SHADOW_TOP, 8),
        "shadow busy": (L.SHADOW_BUSY, 8),
        "read": (L.READ, 8),
        "stamp busy": (L.STAMP_BUSY, 8),
        "stamp resume": (L.STAMP_RESUME, 8),
        "stamp saved": (L.STAMP_SAVED, 3 * 8),  # rax, rdx, rsi
        "stamp targets": (L.STAMP_TARGETS, 8 * L.STAMP_TARGETS_MAX),
        "stamp discard": (L.STAMP_DISCARD, 8),
        "snapshot due": (L.SNAPSHOT_DUE, 8),
        "wait spin": (L.WAIT_SPIN, 8),
        "wait sleeping": (L.WAIT_SLEEPING, 8),
        "wait gave up": (L.WAIT_GAVE_UP, 8),
        "upcall frame": (L.UPCALL_FRAME, 8 * len(REG_NAMES)),  # struct user_regs_struct
        "upcall state": (L.UPCALL_STATE, 8),
        "upcall busy": (L.UPCALL_BUSY, 8),
        "area self": (L.AREA_SELF, 8),
        "sleep timeout": (L.SLEEP_TIMEOUT, 16),  # struct timespec
        "upcall region": (L.UPCALL_REGION, 8),
        "upcall site": (L.UPCALL_SITE, 8),
        "upcall cpu": (L.UPCALL_CPU, 8),
        "upcall sleeping": (L.UPCALL_SLEEPING, 8),
        "upcall entries": (L.UPCALL_ENTRIES, 8 * L.UPCALL_ENTRIES_MAX),
        "upcall rsi": (L.UPCALL_RSI, 8),
        "stack slot": (L.STACK_SLOT, 8),
        "lang busy": (L.LANG_BUSY, 8),
        "tgid": (L.TGID, 8),
        "lang temps": (L.LANG_TEMPS, 8 * L.LANG_TEMPS_WORDS),
        "lang vars": (L.LANG_VARS, 8 * L.LANG_VARS_WORDS),
    }
    check_fields(fields, L.HEADER_BYTES)
    assert L.HEAD % CACHE_LINE == 0 and L.TAIL % CACHE_LINE == 0
    assert L.HEADER_BYTES == L.PAGE
    assert L.AREA_MAGIC.to_bytes(8, "little") == b"DYPREA1\0"
    assert sorted((L.UPCALL_IDLE, L.UPCALL_REQUEST, L.UPCALL_ANSWERED)) == [0, 1, 2]
    bell = {"ring": (L.DOORBELL_RING, 4), "gone": (L.DOORBELL_GONE, 8), "awake": (L.DOORBELL_AWAKE, 8)}
    bell |= {"spin": (L.DOORBELL_SPIN, 8), "cpu": (L.DOORBELL_CPU, 8), "foreign": (L.DOORBELL_FOREIGN, 8)}
    check_fields(bell, L.PAGE)


def test_the_per_probe_counters_and_histogram_buckets() -> None:
    assert sorted((L.HITS, L.MISSED, L.LOST, L.PENDING)) == list(range(L.PROBE_COUNTERS))
    assert L.HIST_BUCKETS == 1 + 64 + 1  # <= 0, [2^(k-1), 2^k) for k = 1..64, faulted
    assert L.HIST_FAULTED == L.HIST_BUCKETS - 1


def test_the_record_header() -> None:
    check_fields(
        {
            "probe": (L.RECORD_PROBE, 2),
            "cpu": (L.RECORD_CPU, 2),
            "faults": (L.RECORD_FAULTS, 4),
            "tsc": (L.RECORD_TSC, 8),
        },
        L.RECORD_HEADER,
    )
    assert L.RECORD_HEADER == 16 and L.INT_FIELD == 8
    assert L.STRING_FIELD == 2 + 2 + L.STRING_CAPACITY  # length, flags, bytes


def test_a_shadow_stack_entry() -> None:
    check_fields(
        {
            "slot": (L.ENTRY_SLOT, 8),
            "return address": (L.ENTRY_RET, 8),
            "handler": (L.ENTRY_HANDLER, 8),
            "probe": (L.ENTRY_PROBE, 4),
            "flags": (L.ENTRY_FLAGS, 4),
            "tsc": (L.ENTRY_TSC, 8),
            "data": (L.ENTRY_DATA, 6 * 8),  # $arg1..$arg6
            "return tsc": (L.ENTRY_RETURN_TSC, 8),
        },
        L.SHADOW_ENTRY,
    )
    assert L.SHADOW_ENTRY & (L.SHADOW_ENTRY - 1) == 0


def test_the_rescue_page() -> None:
    check_fields(
        {
            "magic": (0, 8),
            "table": (L.RESCUE_TABLE, 8),
            "mark tid": (L.RESCUE_MARK_TID, 8),
            "mark rip": (L.RESCUE_MARK_RIP, 8),
            "rescued": (L.RESCUE_RESCUED, 8),
            "own": (L.RESCUE_OWN, 8),
            "action": (L.RESCUE_ACTION, 32),  # struct kernel_sigaction
            "old action": (L.RESCUE_OLD_ACTION, 32),
            "default action": (L.RESCUE_DEFAULT_ACTION, 32),
            "mem path": (L.RESCUE_MEM_PATH, len(b"/proc/self/mem\0")),
        },
        L.RESCUE_ENTRIES,
    )
    assert L.RESCUE_ENTRIES == L.PAGE
    assert L.RESCUE_BYTES == L.RESCUE_ENTRIES + 2 * L.RESCUE_CAPACITY * L.RESCUE_ENTRY
    assert L.RESCUE_ENTRY == 8 + 1 + 1 + 6  # address, byte, flags, padding
    assert L.RESCUE_MAGIC.to_bytes(8, "little") == b"DYPRSC1\0"


@pytest.mark.parametrize(
    "layout",
    [
        L.AreaLayout(),
        L.AreaLayout(max_probes=1, max_hists=1, ring_bytes=L.MIN_RING_BYTES, record_size=16),
        L.AreaLayout(max_probes=16384, max_hists=512, ring_bytes=L.MAX_RING_BYTES, record_size=L.MAX_RECORD_SIZE),
        L.AreaLayout(max_probes=3, max_hists=7, ring_bytes=1 << 16, record_size=128),
    ],
)
def test_the_thread_area_sections(layout: L.AreaLayout) -> None:
    assert layout.counters == L.HEADER_BYTES
    assert layout.hists % L.PAGE == 0 and layout.ring % L.PAGE == 0 and layout.shadow % L.PAGE == 0
    last_counter = layout.counter(layout.max_probes - 1, L.PROBE_COUNTERS - 1)
    assert layout.counter(0, L.HITS) == layout.counters
    assert layout.counter(1, L.HITS) == layout.counter(0, L.HITS) + L.PROBE_COUNTERS * 8
    assert last_counter + 8 <= layout.hists < last_counter + 8 + L.PAGE
    last_bucket = layout.hist(layout.max_hists - 1) + (L.HIST_BUCKETS - 1) * 8
    assert layout.hist(0) == layout.hists
    assert layout.hist(1) == layout.hists + L.HIST_BUCKETS * 8
    assert last_bucket + 8 <= layout.ring < last_bucket + 8 + L.PAGE
    assert layout.shadow == layout.ring + layout.ring_bytes
    assert layout.size == layout.shadow + L.SHADOW_CAPACITY * L.SHADOW_ENTRY
    assert layout.ring_slots * layout.record_size == layout.ring_bytes
    assert layout.prefetch_ahead == min(L.PAGE, layout.ring_bytes // 2)
    assert layout.max_probes <= 1 << 16  # a record's probe index is a u16


@pytest.mark.parametrize(
    ("payload", "size"),
    [(0, 16), (1, 32), (16, 32), (17, 64), (48, 64), (49, 128), (L.MAX_RECORD_SIZE - 16, L.MAX_RECORD_SIZE)],
)
def test_record_size_for(payload: int, size: int) -> None:
    assert L.record_size_for(payload) == size


@pytest.mark.parametrize(
    ("size", "why"),
    [
        (L.MIN_RING_BYTES, None),
        (L.MAX_RING_BYTES, None),
        (L.DEFAULT_RING_BYTES, None),
        (L.MIN_RING_BYTES // 2, "out of range"),
        (L.MAX_RING_BYTES * 2, "out of range"),
        (3 << 20, "not a power of two"),
        (0, "not a power of two"),
        (1, "out of range"),
        (-4096, "not a power of two"),
    ],
)
def test_check_ring_bytes(size: int, why: str | None) -> None:
    found = L.check_ring_bytes(size)
    assert (found is None) if why is None else (found is not None and why in found)


def test_the_ring_limits() -> None:
    for size in (L.MIN_RING_BYTES, L.MAX_RING_BYTES, L.DEFAULT_RING_BYTES, L.MAX_RECORD_SIZE):
        assert size & (size - 1) == 0
    assert L.MIN_RING_BYTES >= L.PAGE and L.MAX_RECORD_SIZE <= L.MIN_RING_BYTES


def test_every_maxactive_the_parser_takes_fits_the_shadow_stack() -> None:
    assert MAX_MAXACTIVE == L.SHADOW_CAPACITY  # the kernel's limit, 4096


def test_flags_are_single_bits() -> None:
    for flag in (L.STRING_TRUNCATED, L.ENTRY_RESTORED, L.RESCUE_WAIT):
        assert flag > 0 and flag & (flag - 1) == 0


def test_the_trace_record_format_is_that_of_the_trace_file_s_version() -> None:
    """Trace directories keep the function tracer's records as written (tracefile.py): changing
    any of these values makes a new format version, which this test names."""
    from dynprobe.tracefile import VERSION

    assert VERSION == 3
    assert (L.TRACE_ENTRY, L.TRACE_EXIT, L.FRAME_SHIFT, L.TRACE_DATA) == (0, 1, 1, 0x8000)
    assert (L.DATA_END, L.DATA_CUT, L.DATA_FAULTED, L.DATA_NULL) == (0x100, 0x200, 0x400, 0x800)
