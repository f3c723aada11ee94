"""The binary layouts shared by generated code and the consumer, declared once.

A thread area (one per target thread, reached by generated code through the thread's GS base):

    0x0000  header page     magic, tid, re-entrancy flag; ring head and consumer tail on their
                            own cache lines (the producer writes head, the consumer writes tail)
    0x1000  counters        PROBE_COUNTERS u64 per probe: hits, missed (re-entered), lost (ring full)
    ....    histograms      HIST_BUCKETS u64 per histogram
    ....    ring            `ring_bytes` (a power of two) of fixed-size records
    ....    shadow stack    SHADOW_CAPACITY entries of SHADOW_ENTRY bytes: the thread's pending
                            return-probe instances (docs/architecture.md §7)

Thread areas live in pools: one shared memory file (memfd) per pool, mapped by the target and by
the tracer; pages never touched cost nothing, so the counter and histogram tables are generous.

A shadow-stack entry: the address of the hijacked return-address slot (0: the entry is free),
the original return address, the address of the code that runs the probe's return part, the
probe index (u32), the tracer's flags (u32), the time stamp at entry, the entry's data (the
probe's `$argN` values at entry, at DATA + 8 * (N - 1)) and, for a return served at a stop, the
time stamp at the return. Entry k is returned through trampoline entry point k, so a frame
finds its entry even if the stack under it was copied elsewhere. Before each entry point, the
call a detour enters the function through (`call [rsp-24]`), so the return address is pushed by
a call and the function's `ret` is predicted.

A record is `record_size` bytes (a power of two): a 16-byte header (u16 probe index, u16 CPU
from the thread's rseq area, rdpid or rdtscp, u32 bit mask of fetch arguments that faulted, u64
time-stamp counter) then the probe's fields: 8 bytes per integer argument (the raw value, narrowed
and sign-extended by the consumer) and, per string, a u16 length, a u16 flag word
(STRING_TRUNCATED) and `STRING_CAPACITY` bytes.
"""

from __future__ import annotations

from functools import cached_property

from dynprobe.frozen import frozen

AREA_MAGIC = 0x0031_4145_5250_5944  # "DYPREA1\0" little-endian
PAGE = 4096

# Header offsets.
MAGIC = 0x00
TID = 0x08
BUSY = 0x10
RESERVE = 0x18  # the next record to write: HEAD, or past it while a tracer holds records back
# A writer that finds its ring full waits up to WAIT_TICKS time-stamp ticks for the reader to
# make room (0: the record is lost at once), until WAIT_UNTIL; WAITS counts the records that
# waited and got room. It spins for WAIT_SPIN ticks, then sleeps (a futex wait on TAIL's low
# half, SLEEP_TIMEOUT at a time) with WAIT_SLEEPING set: the reader wakes it when it moves TAIL,
# and the CPU it would have spun on is the reader's meanwhile. A wait that ran out leaves
# WAIT_GAVE_UP at TAIL + 1: until the reader moves TAIL, a full ring loses records at once
# (a reader that is stopped or gone does not slow the program down a whole wait a record).
WAIT_TICKS = 0x20
WAIT_UNTIL = 0x28
WAITS = 0x30
# A flight recorder's ring (OVERWRITE nonzero): a writer that finds it full takes the room of
# the oldest records, moving TAIL itself (the reader never does). The reader pauses that while
# it copies the ring (OVERWRITE cleared: a writer then waits, as for any full ring), keeps where
# it read up to in READ, and keeps what it copied only from the TAIL it finds after the copy (a
# writer already past the check wrote over older); what it never read, it counts.
OVERWRITE = 0x38
HEAD = 0x40
TAIL = 0x80
SHADOW_TOP = 0xC0  # entries [0, top) of the shadow stack are in use or free (slot 0)
SHADOW_BUSY = 0xC8  # the thread is changing its shadow stack (a signal handler's probes miss)
READ = 0xD0
# A flight recorder's thread that ended a call lasting its tracer's `snapshot_over_ns` or more:
# it paused its ring (OVERWRITE cleared) and asks the reader for a snapshot here; the reader
# clears this, takes the snapshot and resumes the ring.
SNAPSHOT_DUE = 0xD8
WAIT_SPIN = 0xE0
WAIT_SLEEPING = 0xE8
WAIT_GAVE_UP = 0xF0
# A thread resuming from a return probe's trap entry stamps the entries' time itself (the entry
# stamp, codegen/returns.py's build_entry_stamp): the tracer's clock would count the resume (~5-15 us) as the
# call's. BUSY while it does (a nested trap entry, in a signal handler, then takes the tracer's
# time); RESUME where it goes on; SAVED the registers it uses; TARGETS the area offsets of the
# words to stamp (DISCARD for none).
STAMP_BUSY = 0x100
STAMP_RESUME = 0x108
STAMP_SAVED = 0x110  # rax, rdx, rsi
STAMP_TARGETS = 0x128
STAMP_TARGETS_MAX = 4
STAMP_DISCARD = STAMP_TARGETS + 8 * STAMP_TARGETS_MAX
# An upcall (core/upcalls.py): a thread at a site whose probes are Python handlers saves its
# registers in UPCALL_FRAME (struct user_regs_struct: the tracer's Regs over its own mapping of
# the area), REQUEST in UPCALL_STATE (a futex), rings its process's doorbell (DOORBELL_*) and
# waits for ANSWERED: then its registers are the frame's, and it goes on at the relocated copy
# of the site's instruction, or at the frame's rip if the tracer changed it (a handler moved it).
# UPCALL_BUSY: in an upcall (a nested hit, from a signal handler, runs no handler: missed).
# AREA_SELF: the area's own address, for the futex; SLEEP_TIMEOUT: how long each futex wait
# (an upcall's, a full ring's) is at most (a struct timespec), after which the thread looks
# whether the tracer is gone or its time ran out; UPCALL_REGION:
# where the asking detour's copy of the site's instruction is.
# The words the tracer reads at every upcall share the frame's last cache line (each line both
# sides write moves between their CPUs).
UPCALL_FRAME = 0x200
UPCALL_SITE = 0x2D8  # the site it asks for (its rip: where it is, the site or the next instruction)
UPCALL_STATE = 0x2E0
UPCALL_BUSY = 0x2E8
UPCALL_SLEEPING = 0x2F0  # nonzero while it may sleep for its answer (the answer then wakes it)
UPCALL_RSI = 0x2F8  # at a return: the function's rsi (the frame's is the shadow entry's offset)
SLEEP_TIMEOUT = 0x300
UPCALL_REGION = 0x310  # the asking detour's copy of the site's instruction
UPCALL_CPU = 0x320  # the CPU it asked on (read by the tracer only if it sleeps)
AREA_SELF = 0x328
# At a return probes' entry: a word for each the detour took a shadow entry for, in the order
# of the site's return probes: the probe's index in the upper half, the entry's offset in the
# lower (ENTRIES_MISSED: none); ENTRIES_END after the last, unless all are used
UPCALL_ENTRIES = 0x330
UPCALL_ENTRIES_MAX = 4
ENTRIES_MISSED = 0xFFFF_FFFF
ENTRIES_END = (1 << 64) - 1
STACK_SLOT = 0x358  # the table slot of the stack the thread's hit just counted (0: none), for its record
# A bpftrace program's body (arch/x86_64/codegen/lang.py): nonzero while the thread runs one (a
# signal handler's probes skip theirs), the process's id (`pid`), the operands waiting while
# others are worked out, the scratch variables
LANG_BUSY = 0x360
TGID = 0x368
LANG_TEMPS = 0x400
LANG_TEMPS_WORDS = 64  # (so an expression nests 64 deep at most, a map's keys with it)
LANG_VARS = 0x600
LANG_VARS_WORDS = 64
UPCALL_IDLE, UPCALL_REQUEST, UPCALL_ANSWERED = 0, 1, 2
SLEEP_NS = 20_000_000
# A process's doorbell page: RING, a futex every request bumps (and wakes, unless AWAKE: the
# tracer is looking for requests already); GONE, set when no tracer will answer (a detach, the
# guardian), when a waiting thread goes on without its handlers; SPIN, how many time-stamp
# counter ticks a thread that asked looks for its answer before it sleeps, unless it asked on
# CPU, the server's (where spinning would only keep the server from running).
DOORBELL_RING = 0
DOORBELL_GONE = 8
DOORBELL_AWAKE = 16
DOORBELL_SPIN = 24
DOORBELL_CPU = 32
DOORBELL_FOREIGN = 40  # threads that came by with a GS base not ours (the program set its own)
HEADER_BYTES = PAGE

PROBE_COUNTERS = 4  # per probe: hits, missed, lost, pending return instances
PROBE_BYTES = PROBE_COUNTERS * 8  # one probe's counters (a power of two: generated code shifts by it)
HITS, MISSED, LOST, PENDING = 0, 1, 2, 3
HIST_BUCKETS = 66  # [0] zero or negative, [k] values in [2^(k-1), 2^k), k = 1..64, [65] faulted
HIST_FAULTED = 65

RECORD_HEADER = 16
RECORD_PROBE, RECORD_CPU, RECORD_FAULTS, RECORD_TSC = 0, 2, 4, 8
INT_FIELD = 8
STRING_CAPACITY = 64
STRING_FIELD = 4 + STRING_CAPACITY
STRING_TRUNCATED = 1

SHADOW_ENTRY = 128
SHADOW_CAPACITY = 4096  # also the largest maxactive
ENTRY_SLOT, ENTRY_RET, ENTRY_HANDLER, ENTRY_PROBE, ENTRY_FLAGS, ENTRY_TSC, ENTRY_DATA = 0, 8, 16, 24, 28, 32, 40
ENTRY_RETURN_TSC = 88  # a return served at a stop: its time, stamped before the trap
ENTRY_RESTORED = 1  # flag: the tracer put the original return address back while the unwinder ran
ENTRY_VETOED = 2  # flag: its entry handler (served by an upcall) vetoed it: no return handler runs
TRAMPOLINE_CALL = 4  # `call [rsp-24]`, then the entry point
TRAMPOLINE_STRIDE = 14  # bytes per trampoline entry: that call, then `push OFFSET; jmp common`

DEFAULT_RING_BYTES = 1 << 20
MIN_RING_BYTES = 1 << 12
MAX_RING_BYTES = 1 << 30
MAX_RECORD_SIZE = 1 << 12
MARGIN_NS = 1_000_000_000  # a record's time stamp is at most this far outside its session

# The function tracer's records (docs/architecture.md §8): u16 ops, u16 kind, u32 function id,
# u64 time stamp. The kind (in the header's CPU field): bit 0 exit, bits 1-15 the call's frame,
# its shadow entry's index + 1 (0: none, the call is not followed to its return). A frame is
# reused only once its call is over (returned, or left by longjmp or an exception): readers close
# what a reused frame left open.
TRACE_ENTRY, TRACE_EXIT = 0, 1
FRAME_SHIFT = 1
# Data records: the values a traced call's entry or exit record carries (uftrace's -A, -R), in
# the records right after it (written and published with it): u16 ops, u16 TRACE_DATA | the
# value's number in its spec, u32 the bytes the record holds (0-8) | DATA_* flags, then 8 bytes:
# the value, or a piece of a string (a string takes a record per 8 bytes, up to
# spec/argspec.py's STRING_PIECES).
TRACE_DATA = 0x8000
DATA_END, DATA_CUT, DATA_FAULTED, DATA_NULL = 1 << 8, 1 << 9, 1 << 10, 1 << 11


def check_ring_bytes(size: int) -> str | None:
    """Why `size` cannot be a ring size, or None if it can."""
    if size <= 0 or size & (size - 1):
        return f"ring size {size} is not a power of two"
    if not MIN_RING_BYTES <= size <= MAX_RING_BYTES:
        return f"ring size {size} is out of range ({MIN_RING_BYTES}..{MAX_RING_BYTES} bytes)"
    return None


def record_size_for(payload: int) -> int:
    """The smallest power-of-two record size that holds the header and `payload` bytes."""
    size = 16
    while size < RECORD_HEADER + payload:
        size *= 2
    return size


@frozen
class AreaLayout:
    """Where everything is in a thread area, for one session's limits."""

    max_probes: int = 16384  # the record's probe index is a u16
    max_hists: int = 512
    ring_bytes: int = DEFAULT_RING_BYTES
    record_size: int = 64

    @property
    def counters(self) -> int:
        return HEADER_BYTES

    @cached_property
    def hists(self) -> int:
        return _page_up(self.counters + self.max_probes * PROBE_BYTES)

    @cached_property
    def ring(self) -> int:
        return _page_up(self.hists + self.max_hists * HIST_BUCKETS * 8)

    @cached_property
    def shadow(self) -> int:
        return self.ring + self.ring_bytes

    @cached_property
    def size(self) -> int:
        return self.shadow + SHADOW_CAPACITY * SHADOW_ENTRY

    @cached_property
    def ring_slots(self) -> int:
        return self.ring_bytes // self.record_size

    @cached_property
    def prefetch_ahead(self) -> int:
        """How far ahead of the record it writes generated code prefetches the ring."""
        return min(PAGE, self.ring_bytes // 2)

    def counter(self, probe_index: int, which: int) -> int:
        return self.counters + probe_index * PROBE_BYTES + which * 8

    def hist(self, hist_index: int) -> int:
        return self.hists + hist_index * HIST_BUCKETS * 8


def _page_up(n: int) -> int:
    return (n + PAGE - 1) & ~(PAGE - 1)


# --- the rescue page (one per process; arch/x86_64/rescue.py, core/rescue.py) --------------------
# What the target's SIGTRAP handler needs to go on if its tracer dies: which int3s are dynprobe's
# (a sorted table, in two halves: the tracer writes the one not in use, then points the header
# at it), the original byte of each, the one thread whose registers the tracer was changing, and
# the program's own disposition of SIGTRAP. Then, after the header page, the table.
RESCUE_MAGIC = 0x0031_4353_5250_5944  # "DYPRSC1\0"
RESCUE_TABLE = 0x08  # u64: entries in use (low 32 bits), which half (bit 32)
RESCUE_MARK_TID = 0x10  # the thread the tracer is resuming, and the rip it gave it
RESCUE_MARK_RIP = 0x18
RESCUE_RESCUED = 0x20  # u64: the guardian has put the code back (set by it, through /proc)
RESCUE_OWN = 0x28  # the program's sa_handler of SIGTRAP when ours went in: SIG_DFL (0) or SIG_IGN (1)
RESCUE_ACTION = 0x40  # struct kernel_sigaction (handler, flags, restorer, mask): ours
RESCUE_OLD_ACTION = 0x60  # what rt_sigaction says was there
RESCUE_DEFAULT_ACTION = 0x80  # SIG_DFL: how a foreign SIGTRAP is re-raised
RESCUE_MEM_PATH = 0xA0  # b"/proc/self/mem\0": where the handler writes an original byte back
RESCUE_ENTRIES = PAGE  # the table's first half
RESCUE_ENTRY = 16  # u64 address, u8 original byte, u8 flags
RESCUE_WAIT = 1  # flag: wait for the guardian first (an unwinder's entry: pending returns go back)
RESCUE_CAPACITY = 1 << 15  # entries per half
RESCUE_BYTES = RESCUE_ENTRIES + 2 * RESCUE_CAPACITY * RESCUE_ENTRY
