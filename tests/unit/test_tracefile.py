"""Trace directories: what `create_trace_directory` takes, keeps and refuses (nothing that is
not a trace dynprobe wrote is ever deleted), and the record dtype of each record size."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dynprobe import tracefile
from dynprobe.output.files import OutputError


def a_trace(path: Path) -> Path:
    tracefile.create_trace_directory(str(path))
    tracefile.write_info(str(path), {"format": tracefile.FORMAT})
    return path


def test_an_empty_directory_is_taken(tmp_path: Path) -> None:
    (tmp_path / "t").mkdir(mode=0o755)
    tracefile.create_trace_directory(str(tmp_path / "t"))
    assert stat.S_IMODE(os.stat(tmp_path / "t").st_mode) == 0o700 and os.listdir(tmp_path / "t") == []


def test_an_earlier_trace_is_kept_as_old_and_an_older_one_goes(tmp_path: Path) -> None:
    first = a_trace(tmp_path / "t")
    (first / tracefile.EVENTS).write_bytes(b"first")
    tracefile.create_trace_directory(str(first))
    assert (tmp_path / "t.old" / tracefile.EVENTS).read_bytes() == b"first" and os.listdir(first) == []
    tracefile.write_info(str(first), {"format": tracefile.FORMAT})
    tracefile.create_trace_directory(str(first))  # the older one goes, the last one is kept
    assert not (tmp_path / "t.old" / tracefile.EVENTS).exists()


@pytest.mark.parametrize("in_the_way", ["a file", "a directory of someone's"])
def test_what_is_not_a_trace_is_never_replaced(tmp_path: Path, in_the_way: str) -> None:
    a_trace(tmp_path / "t")
    old = tmp_path / "t.old"
    if in_the_way == "a file":
        old.write_text("notes")
    else:
        old.mkdir()
        (old / "notes.txt").write_text("notes")
    with pytest.raises(OutputError, match=f"{old} is in the way \\(not a trace\\): move it, or choose another -o"):
        tracefile.create_trace_directory(str(tmp_path / "t"))
    (tmp_path / "f").write_text("notes")
    with pytest.raises(OutputError, match="exists and is not a trace directory: choose another name with -o"):
        tracefile.create_trace_directory(str(tmp_path / "f"))
    assert tracefile.is_trace_directory(str(tmp_path / "t")) and (tmp_path / "f").read_text() == "notes"


@pytest.mark.parametrize("record_size", [16, 32, 4096])
def test_the_record_dtype_spans_the_record(record_size: int) -> None:
    dtype = tracefile.record_dtype(record_size)
    assert dtype.itemsize == record_size and dtype.names[:4] == ("ops", "kind", "func", "tsc")  # type: ignore[index]


def test_a_string_s_records_after_its_last_are_not_its() -> None:
    """A call's string value: its pieces up to the one that ends it (DATA_END) or up to
    STRING_PIECES; a record for it after that (written by the program itself) is left out;
    a record for a value past the specs too."""
    from dynprobe.ringbuf.layout import DATA_END
    from dynprobe.spec.argspec import STRING_PIECES, parse_values

    specs = parse_values("arg1/s,arg2", retval=False)
    text = int.from_bytes(b"abc", "little")
    parts = [(0, 3 | DATA_END, text), (0, 8, int.from_bytes(b"NOTOURS!", "little")), (1, 8, 7), (5, 8, 1)]
    assert tracefile._shown(specs, parts) == '"abc", 7'
    whole = int.from_bytes(b"x" * 8, "little")
    parts = [(0, 8, whole)] * (STRING_PIECES + 2)  # no end: as many pieces as a string has, then cut
    assert tracefile._shown(specs, parts) == f'"{"x" * 8 * STRING_PIECES}", ?'  # (no arg2: ?)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"clock": {"tsc0": 1, "ns0": 1, "scale": 1.0, "tsc_now": -5}}, "the clock's tsc_now is not a time"),
        ({"captures": {"0": [["arg1/" + "x" * 64], []]}}, "the recorded values are not a table"),
        ({"captures": {"0": [[7], []]}}, "the recorded values are not a table"),
    ],
    ids=["tsc_now", "a spec too long", "a spec not text"],
)
def test_an_info_json_not_as_record_writes_it_is_refused(tmp_path: Path, change: dict[str, object], says: str) -> None:
    info = {"format": tracefile.FORMAT, "version": tracefile.VERSION, "record_size": 16,
            "clock": {"tsc0": 1, "ns0": 1, "scale": 1.0}, "functions": [["main", "x", 0, 1]], **change}  # fmt: skip
    tracefile.write_info(str(tmp_path), info)
    (tmp_path / tracefile.EVENTS).write_bytes(b"")
    with pytest.raises(tracefile.TraceError, match=says):
        tracefile.TraceFile(str(tmp_path))
