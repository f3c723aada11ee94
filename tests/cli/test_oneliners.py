"""bpftrace's one-liners, rewritten for user space, over two deterministic programs (the bundled
wordcount, words "alpha be gamma be delta alpha be"; counter, one thread's 200 calls of work(i):
bpftrace's `++` and `+=` are not atomic): the exact maps and lines `dynprobe run` prints; and,
where bpftrace runs here, the same under bpftrace, on a copy of the program (its kernel uprobes
put an int3 in every process that maps the file: on libc, in other tests' targets too, where
dynprobe refuses to patch over it; the libc one-liners' maps were checked against bpftrace's,
`pid == cpid`, when written): bpftrace is the oracle, but for the order of entries of equal
values (its hash table's)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.cli.test_cli import dp
from tests.cli.test_run import bpftrace
from tests.conftest import build_target

WORDS = "alpha be gamma be delta alpha be"
# (program: W or C, the one-liner ({W}, {C}: the program's path), what `dynprobe run` prints after
# "Attaching N probes...")
ONE_LINERS = [
    ("W", "uprobe:{W}:add_word { @ = count(); }", "\n\n@: 7\n"),
    ("W", "uprobe:{W}:add_word { @[arg1] = count(); }", "\n\n@[2]: 3\n@[5]: 4\n"),
    ("W", "uprobe:{W}:add_word { @[str(arg0)] = count(); }", "\n\n@[delta]: 1\n@[gamma]: 1\n@[alpha]: 2\n@[be]: 3\n"),
    ("W", "uretprobe:{W}:add_word { @[retval] = count(); }", "\n\n@[3]: 1\n@[2]: 2\n@[1]: 4\n"),
    (
        "W",
        "uprobe:{W}:add_word { @len = hist(arg1); }",
        (
            "\n"
            "\n"
            "@len: \n"
            "[2, 4)                 3 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@             |\n"
            "[4, 8)                 4 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@|\n"
            "\n"
        ),
    ),
    (
        "W",
        "uprobe:{W}:add_word { @len = lhist(arg1, 0, 10, 2); }",
        (
            "\n"
            "\n"
            "@len: \n"
            "[2, 4)                 3 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@             |\n"
            "[4, 6)                 4 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@|\n"
            "\n"
        ),
    ),
    (
        "W",
        "uprobe:{W}:add_word { @s = sum(arg1); @mn = min(arg1); @mx = max(arg1); @a = avg(arg1); }",
        "\n\n@a: 3\n\n@mn: 2\n@mx: 5\n@s: 26\n",
    ),
    ("W", "uprobe:{W}:add_word { @st = stats(arg1); }", "\n\n@st: count 7, average 3, total 26\n\n"),
    (
        "W",
        "uprobe:{W}:add_word /arg1 > 3/ { @long[str(arg0)] = count(); }",
        "\n\n@long[delta]: 1\n@long[gamma]: 1\n@long[alpha]: 2\n",
    ),
    ("W", "uprobe:{W}:hash { @[str(arg0)] = count(); }", "\n\n@[delta]: 1\n@[gamma]: 1\n@[alpha]: 2\n@[be]: 3\n"),
    ("W", "uretprobe:{W}:hash { @[retval] = count(); }", "\n\n@[15]: 1\n@[40]: 1\n@[43]: 2\n@[12]: 3\n"),
    (
        "W",
        "uprobe:{W}:add_word, uprobe:{W}:hash { @[probe] = count(); }",
        "\n\n@[uprobe:{W}:add_word]: 7\n@[uprobe:{W}:hash]: 7\n",
    ),
    (
        "W",
        "uprobe:{W}:*_word, uprobe:{W}:ha* { @[probe] = count(); }",
        "\n\n@[uprobe:{W}:add_word]: 7\n@[uprobe:{W}:hash]: 7\n",
    ),
    ("W", "uprobe:{W}:add_word { @[str(arg0, 2)] = count(); }", "\n\n@[de]: 1\n@[ga]: 1\n@[al]: 2\n@[be]: 3\n"),
    ("W", "uretprobe:{W}:add_word { @[retval > 1 ? 1 : 0] = count(); }", "\n\n@[1]: 3\n@[0]: 4\n"),
    (
        "W",
        'uprobe:{W}:add_word { printf("%s %d\\n", str(arg0), arg1); }',
        "alpha 5\nbe 2\ngamma 5\nbe 2\ndelta 5\nalpha 5\nbe 2\n\n\n",
    ),
    ("W", 'uprobe:{W}:add_word /arg1 == 5/ { printf("%s\\n", str(arg0)); exit(); }', "alpha\n\n\n"),
    ("W", "uprobe:libc:malloc { @bytes = sum(arg0); @n = count(); }", "\n\n@bytes: 4213\n@n: 9\n"),
    (
        "W",
        "uprobe:libc:malloc { @sizes = hist(arg0); }",
        (
            "\n"
            "\n"
            "@sizes: \n"
            "[2, 4)                 1 |@@@@@@@@@@@@@                                       |\n"
            "[4, 8)                 3 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@             |\n"
            "[8, 16)                0 |                                                    |\n"
            "[16, 32)               4 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@|\n"
            "[32, 64)               0 |                                                    |\n"
            "[64, 128)              0 |                                                    |\n"
            "[128, 256)             0 |                                                    |\n"
            "[256, 512)             0 |                                                    |\n"
            "[512, 1K)              0 |                                                    |\n"
            "[1K, 2K)               0 |                                                    |\n"
            "[2K, 4K)               0 |                                                    |\n"
            "[4K, 8K)               1 |@@@@@@@@@@@@@                                       |\n"
            "\n"
        ),
    ),
    ("W", "uprobe:libc:strtok { @ = count(); }", "\n\n@: 14\n"),
    ("W", "uretprobe:libc:strtok /retval == 0/ { @end = count(); }", "\n\n@end: 7\n"),
    ("W", "uprobe:libc:write { @bytes[arg0] = sum(arg2); }", "\n\n@bytes[1]: 17\n"),
    ("W", "uprobe:libc:strndup { @[arg1] = count(); }", "\n\n@[2]: 1\n@[5]: 3\n"),
    ("C", "uprobe:{C}:work { @[comm] = count(); }", "\n\n@[counter]: 200\n"),
    ("C", "uprobe:{C}:work { @s = sum(arg0); @c = count(); }", "\n\n@c: 200\n@s: 19900\n"),
    ("C", "uprobe:{C}:work /arg0 % 2 == 0/ { @even = count(); }", "\n\n@even: 100\n"),
    ("C", "uprobe:{C}:work { @[arg0 % 4] = count(); }", "\n\n@[0]: 50\n@[1]: 50\n@[2]: 50\n@[3]: 50\n"),
    (
        "C",
        (
            "uprobe:{C}:work { @start[tid] = nsecs; } "
            "uretprobe:{C}:work /@start[tid]/ { @calls = count(); delete(@start[tid]); }"
        ),
        "\n\n@calls: 200\n\n",
    ),
    ("C", "uprobe:{C}:work { @big[arg0 > 50 ? 1 : 0] = count(); }", "\n\n@big[0]: 51\n@big[1]: 149\n"),
    ("C", "uprobe:{C}:work { $v = arg0 * 2; @m = max($v); }", "\n\n@m: 398\n"),
    ("C", "uprobe:{C}:work { @c++; @d += 2; @e--; }", "\n\n@c: 200\n@d: 400\n@e: -200\n"),
    (
        "C",
        "uretprobe:{C}:work { @r = hist(retval); }",
        (
            "\n"
            "\n"
            "@r: \n"
            "[1]                    1 |                                                    |\n"
            "[2, 4)                 1 |                                                    |\n"
            "[4, 8)                 2 |@                                                   |\n"
            "[8, 16)                4 |@@                                                  |\n"
            "[16, 32)               8 |@@@@@                                               |\n"
            "[32, 64)              16 |@@@@@@@@@@@                                         |\n"
            "[64, 128)             32 |@@@@@@@@@@@@@@@@@@@@@@@                             |\n"
            "[128, 256)            64 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@      |\n"
            "[256, 512)            72 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@|\n"
            "\n"
        ),
    ),
    (
        "C",
        "uprobe:{C}:work /arg0 < 3/ { @[arg0, comm] = count(); }",
        "\n\n@[0, counter]: 1\n@[1, counter]: 1\n@[2, counter]: 1\n",
    ),
]


@pytest.fixture(scope="module")
def programs() -> dict[str, tuple[str, list[str]]]:
    wordcount = build_target("wordcount", "../../examples/wordcount.c", flags=("-O2",))
    counter = build_target("counter", flags=("-O1", "-pthread"))
    return {"W": (wordcount, WORDS.split()), "C": (counter, ["200", "1"])}


def _program(text: str, found: dict[str, tuple[str, list[str]]]) -> str:
    """`text` with {W} and {C} the programs' paths."""
    return text.replace("{W}", found["W"][0]).replace("{C}", found["C"][0])


@pytest.mark.parametrize(("which", "text", "expected"), ONE_LINERS, ids=[t for _, t, _ in ONE_LINERS])
def test_a_one_liner_prints_what_bpftrace_prints(
    which: str, text: str, expected: str, programs: dict[str, tuple[str, list[str]]], tmp_path: Path
) -> None:
    binary, args = programs[which]
    program = _program(text, programs)
    run = dp("run", "-e", program, "--", binary, *args, timeout=120)
    assert run.returncode == 0, run.stderr
    head, _, printed = run.stderr.partition("\n")
    assert re.fullmatch(r"Attaching \d+ probes?\.\.\.", head) and printed == _program(expected, programs), run.stderr
    if shutil.which("bpftrace") is None or ":libc:" in program:
        return  # (make toolchains installs it: the maps were checked, not compared)
    theirs = bpftrace(binary, program, " ".join(args), tmp_path)
    printed_by_them = theirs.stdout.split("\n", 1)[1]
    printed_by_them = re.sub(r"^\d+ distinct words\n|^total=\d+\n", "", printed_by_them, flags=re.M)  # (its output)
    assert sorted(printed_by_them.splitlines()) == sorted(printed.splitlines())
