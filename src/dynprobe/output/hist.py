"""log2 histograms as bpftrace prints them:

    [0]                    3 |@@@@@                                               |
    [2, 4)                30 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@|
    [4K, 8K)               1 |@                                                   |

Buckets (ringbuf/layout.py): [0] zero or negative, [k] values in [2^(k-1), 2^k), then faulted.
Rows from the first to the last non-empty bucket are printed; faulted fetches get their own line.
Bucket 0 is labelled by what it holds: `[0]` for an unsigned value, `(..., 0]` for a signed one,
and `< 1 tick` for a latency: a call whose return was stamped in the same tick of the clock as
its entry (or, on another CPU, a little before it), shorter than the clock can tell. A call
takes time; the clock may not see it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

from dynprobe.frozen import frozen
from dynprobe.ringbuf.layout import HIST_FAULTED
from dynprobe.spec.model import FetchArg, Latency

BAR = 52
_UNITS = ("", "K", "M", "G", "T", "P", "E")


def _power(p: int) -> str:
    """2^p as bpftrace writes it: 1, 2, ..., 512, 1K, ..., 512K, 1M, ..."""
    unit = min(p // 10, len(_UNITS) - 1)
    return f"{1 << (p - 10 * unit)}{_UNITS[unit]}"


ZERO_SIGNED, ZERO_UNSIGNED, ZERO_LATENCY = "(..., 0]", "[0]", "< 1 tick"


def zero_label(value: FetchArg | None) -> str:
    """How bucket 0 of a histogram of `value` is labelled (see the module's docstring)."""
    if value is None:
        return ZERO_SIGNED
    if isinstance(value.fetch, Latency):
        return ZERO_LATENCY
    return ZERO_SIGNED if value.type.kind == "s" else ZERO_UNSIGNED


def bucket_label(k: int, zero: str = ZERO_SIGNED) -> str:
    if k == 0:
        return zero
    if k == 1:
        return "[1]"
    return f"[{_power(k - 1)}, {_power(k)})"


def log2_lines(buckets: list[int], zero: str = ZERO_SIGNED) -> list[str]:
    values = buckets[:HIST_FAULTED]
    used = [k for k, n in enumerate(values) if n]
    lines = []
    if used:
        peak = max(values)
        for k in range(used[0], used[-1] + 1):
            n = values[k]
            bar = "@" * (n * BAR // peak) if n else ""
            lines.append(f"{bucket_label(k, zero):<16} {n:>10} |{bar:<{BAR}}|")
    if len(buckets) > HIST_FAULTED and buckets[HIST_FAULTED]:
        lines.append(f"{'(fault)':<16} {buckets[HIST_FAULTED]:>10}")
    return lines


@frozen
class Bucket:
    """One row of a histogram: values in [low, high) (low None: any value up to high, bucket 0
    of a signed value), `label` as printed."""

    low: int | None
    high: int
    label: str
    count: int


class Histogram(Sequence[int]):
    """A probe's log2 histogram: its counts by bucket (index k: [2^(k-1), 2^k); 0: zero, or
    zero or less for a signed value; the last: fetches that faulted), its `buckets()` with
    their ranges, and, as str(), the rows the CLI prints."""

    def __init__(self, counts: Sequence[int], zero: str = ZERO_SIGNED) -> None:
        self.counts = list(counts)
        self.zero = zero

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self.counts[index]

    def __len__(self) -> int:
        return len(self.counts)

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    @property
    def faulted(self) -> int:
        """Hits whose value could not be read."""
        return self.counts[HIST_FAULTED] if len(self.counts) > HIST_FAULTED else 0

    @property
    def total(self) -> int:
        """Values counted (faulted fetches aside)."""
        return sum(self.counts[:HIST_FAULTED])

    def buckets(self, *, empty: bool = False) -> list[Bucket]:
        """The buckets that counted something (`empty`: every bucket), lowest first."""
        rows = []
        for k, count in enumerate(self.counts[:HIST_FAULTED]):
            if count or empty:
                low = (None if self.zero == ZERO_SIGNED else 0) if k == 0 else 1 << (k - 1)
                rows.append(Bucket(low, 1 << k if k else 1, bucket_label(k, self.zero), count))
        return rows

    def __str__(self) -> str:
        return "\n".join(log2_lines(self.counts, self.zero))

    def __repr__(self) -> str:
        return f"Histogram({self.counts!r}, {self.zero!r})"
