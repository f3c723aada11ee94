"""log2 histograms as bpftrace prints them:

    [0]                    3 |@@@@@                                               |
    [2, 4)                30 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@|
    [4K, 8K)               1 |@                                                   |

Buckets (ringbuf/layout.py): [0] zero or negative, [k] values in [2^(k-1), 2^k), then faulted.
Rows from the first to the last non-empty bucket are printed; faulted fetches get their own line.
"""

from __future__ import annotations

from dynprobe.ringbuf.layout import HIST_FAULTED

BAR = 52
_UNITS = ("", "K", "M", "G", "T", "P", "E")


def _power(p: int) -> str:
    """2^p as bpftrace writes it: 1, 2, ..., 512, 1K, ..., 512K, 1M, ..."""
    unit = min(p // 10, len(_UNITS) - 1)
    return f"{1 << (p - 10 * unit)}{_UNITS[unit]}"


def bucket_label(k: int) -> str:
    if k == 0:
        return "(..., 0]"
    if k == 1:
        return "[1]"
    return f"[{_power(k - 1)}, {_power(k)})"


def log2_lines(buckets: list[int]) -> list[str]:
    values = buckets[:HIST_FAULTED]
    used = [k for k, n in enumerate(values) if n]
    lines = []
    if used:
        peak = max(values)
        for k in range(used[0], used[-1] + 1):
            n = values[k]
            bar = "@" * (n * BAR // peak) if n else ""
            lines.append(f"{bucket_label(k):<16} {n:>10} |{bar:<{BAR}}|")
    if len(buckets) > HIST_FAULTED and buckets[HIST_FAULTED]:
        lines.append(f"{'(fault)':<16} {buckets[HIST_FAULTED]:>10}")
    return lines
