"""bpftrace's printing of maps (issue 21), line for line as bpftrace 0.17 prints them: at exit,
every map by name; `print(@m[, N])`; histograms with bpftrace's buckets, labels and bars. A user
who knows bpftrace's output reads dynprobe's without thinking.

An entry is (keys, value). Values by the map's kind: an integer (int, count, sum, min, max), a
string or a stack's text, (count, total) for avg and stats, per-bucket counts for hist (a dict:
bucket index -> count; `hist_bucket` gives the index) and lhist (a dict: -1 below min, the
step's index, or `(max - min) // step` and above). And `printf`'s formatting (`c_format`), as
bpftrace's: C's conversions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

Key = int | str
Value = int | str | tuple[int, int] | dict[int, int]
Entry = tuple[tuple[Key, ...], Value]

BAR_WIDTH = 52
_SUFFIXES = ("", "K", "M", "G", "T", "P", "E")
_BLANK_AFTER = ("avg", "stats", "hist", "lhist")  # (the kinds bpftrace follows with an empty line)


def hist_bucket(value: int) -> int:
    """The bucket of `value` in a hist: -1 below 0, 0 for 0, 1 for 1, k + 1 for [2^k, 2^(k+1))."""
    return -1 if value < 0 else value.bit_length()


def _power_label(exponent: int) -> str:
    """2^exponent as bpftrace writes a bucket's bound: 512, 1K, 2M."""
    unit = min(exponent // 10, len(_SUFFIXES) - 1)
    return f"{1 << (exponent - 10 * unit)}{_SUFFIXES[unit]}"


def _hist_label(bucket: int) -> str:
    if bucket < 0:
        return "(..., 0)"
    if bucket <= 1:
        return f"[{bucket}]"
    return f"[{_power_label(bucket - 1)}, {_power_label(bucket)})"


def _lhist_label(bucket: int, low: int, high: int, step: int) -> str:
    if bucket < 0:
        return f"(..., {low})"
    start = low + bucket * step
    return f"[{start}, ...)" if start >= high else f"[{start}, {start + step})"


def _bars(rows: list[tuple[str, int]]) -> list[str]:
    most = max((count for _, count in rows), default=0)
    return [f"{label:<16}{count:>8} |{'@' * (count * BAR_WIDTH // most if most else 0):<{BAR_WIDTH}}|"
            for label, count in rows]  # fmt: skip


def hist_lines(buckets: dict[int, int]) -> list[str]:
    """A hist's lines: every bucket from the lowest with a count to the highest."""
    used = [b for b, n in buckets.items() if n]
    if not used:
        return []
    return _bars([(_hist_label(b), buckets.get(b, 0)) for b in range(min(used), max(used) + 1)])


def lhist_lines(buckets: dict[int, int], low: int, high: int, step: int) -> list[str]:
    used = [b for b, n in buckets.items() if n]
    if not used:
        return []
    return _bars([(_lhist_label(b, low, high, step), buckets.get(b, 0)) for b in range(min(used), max(used) + 1)])


def _key_text(keys: tuple[Key, ...]) -> str:
    return f"[{', '.join(map(str, keys))}]" if keys else ""


def _average(count: int, total: int) -> int:
    """total / count as C divides (toward zero), 0 for no count."""
    if not count:
        return 0
    quotient = abs(total) // count
    return -quotient if total < 0 else quotient


def _value_text(kind: str, value: Value) -> str:
    if kind == "avg":
        assert isinstance(value, tuple)
        count, total = value
        return str(_average(count, total))
    if kind == "stats":
        assert isinstance(value, tuple)
        count, total = value
        return f"count {count}, average {_average(count, total)}, total {total}"
    return str(value)


def plain(kind: str, value: Value, lhist: tuple[int, int, int] = (0, 0, 1)) -> object:
    """A value as a Python program reads it, in bpftrace's terms: an avg its average, stats
    their count, average and total, a hist or lhist its counts by bucket as bpftrace labels
    them ("[4, 8)"); anything else as it is."""
    if kind == "avg" and isinstance(value, tuple):
        return _average(*value)
    if kind == "stats" and isinstance(value, tuple):
        return {"count": value[0], "average": _average(*value), "total": value[1]}
    if kind == "hist" and isinstance(value, dict):
        return {_hist_label(bucket): count for bucket, count in sorted(value.items())}
    if kind == "lhist" and isinstance(value, dict):
        return {_lhist_label(bucket, *lhist): count for bucket, count in sorted(value.items())}
    return value


def _order(kind: str, entries: Sequence[Entry]) -> list[Entry]:
    """bpftrace's order: by value (a hist's: its total; avg and stats: the average), strings and
    stacks by key; entries of equal values by key (bpftrace's are in its hash table's order)."""

    def weight(entry: Entry) -> int:
        value = entry[1]
        if isinstance(value, dict):
            return sum(value.values())
        if isinstance(value, tuple):
            return _average(*value)
        assert isinstance(value, int)
        return value

    if kind in ("string", "stack"):
        return sorted(entries, key=lambda entry: tuple(map(str, entry[0])))
    return sorted(entries, key=lambda entry: (weight(entry), _key_order(entry[0])))


def _key_order(keys: tuple[Key, ...]) -> tuple[tuple[int, int | str], ...]:
    """Keys in order: integers by value, before strings."""
    return tuple((0, key) if isinstance(key, int) else (1, str(key)) for key in keys)


def format_map(name: str, kind: str, entries: Sequence[Entry], *, top: int = 0,
               lhist: tuple[int, int, int] = (0, 0, 1)) -> str:  # fmt: skip
    """The map's lines as bpftrace prints it (`top`: only that many of the last in its order, as
    `print(@m, N)`; `lhist`: an lhist's min, max and step)."""
    if not entries:
        return "\n"  # (a map given a value nowhere the program went: an empty line, as bpftrace's)
    ordered = _order(kind, entries)
    if top:
        ordered = ordered[-top:]
    out: list[str] = []
    for keys, value in ordered:
        head = f"@{name}{_key_text(keys)}:"
        if kind in ("hist", "lhist"):
            assert isinstance(value, dict)
            out.append(head + " ")
            out += hist_lines(value) if kind == "hist" else lhist_lines(value, *lhist)
        else:
            out.append(f"{head} {_value_text(kind, value)}")
        if kind in _BLANK_AFTER:
            out.append("")
    return "".join(line + "\n" for line in out)


_CONVERSION = re.compile(r"%(%|[-+ #0]*\d*(?:\.\d+)?)(hh|h|ll|l|z|j)?([diouxXcsp])?")


def c_format(fmt: str, values: list[int | str]) -> str:
    """`fmt` with `values` put in as C's printf (and bpftrace's) puts them: %d %u %x %s %c..."""
    given = iter(values)

    def one(match: re.Match[str]) -> str:
        flags, conversion = match.group(1), match.group(3)
        if flags == "%":
            return "%"
        if conversion is None:
            return match.group(0)
        value = next(given)
        if conversion in "di":
            value = int(value)
            value = value - (1 << 64) if value >= 1 << 63 else value
            return f"%{flags}d" % value
        if conversion in "ouxX":
            return f"%{flags}{conversion}" % (int(value) & ((1 << 64) - 1))
        if conversion == "p":
            return f"0x{int(value) & ((1 << 64) - 1):x}"
        if conversion == "c":
            return f"%{flags}c" % chr(int(value) & 0xFF)
        return f"%{flags}s" % value

    return _CONVERSION.sub(one, fmt)
