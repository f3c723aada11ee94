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
