"""Arguments and return values the function tracer records, in uftrace's syntax (`record -A
FUNC@arg1,arg2/s,fparg1`, `-R FUNC@retval/x`): what each value is, where the call has it, and
how replay shows it.

    argN[/FMT[SIZE]][%LOC]   the Nth integer argument (System V: rdi, rsi, rdx, rcx, r8, r9,
                             then the stack), or the one at LOC: a register (%r12) or a stack
                             slot above the return address (%stack+1)
    fpargN[/SIZE][%xmmK]     the Nth floating-point argument (xmm0-xmm7); SIZE 32 or 64
    retval[/FMT[SIZE]]       the return value (rax; xmm0 with /f)

FMT: d (the default: decimal, hexadecimal when large), i (signed), u (unsigned), x (hex),
o (octal), c (a character), s (a NUL-terminated string, read where the value points), f
(floating point). SIZE: the value's bits, 8, 16, 32 or 64.
"""

from __future__ import annotations

import math
import re
import struct

from dynprobe.arch.x86_64.regs import ARG_REGS, GPR64
from dynprobe.errors import DynprobeError
from dynprobe.frozen import frozen

FORMATS = "diuxocsf"
MAX_VALUES = 16  # values one call records (each string takes up to STRING_PIECES records)
STRING_PIECES = 12  # a string is read up to 8 * STRING_PIECES bytes
SHOWN_STRING = 8 * STRING_PIECES - 1  # a longer string shows this many characters, then "..." (as uftrace)
_SSE = tuple(f"xmm{n}" for n in range(8))
_LOCATIONS = tuple(r for r in GPR64 if r != "rsp")  # (rsp: the tracer's own by then; %stack+N names slots)
_ITEM = re.compile(r"(?P<what>arg|fparg)(?P<index>[1-9][0-9]{0,2})|(?P<retval>retval)")  # then /FMT[SIZE], %LOC
_FORMAT = re.compile(r"(?P<fmt>[a-zA-Z]?)(?P<bits>[0-9]*)")


class ArgSpecError(DynprobeError):
    """An argument or return-value spec that is not uftrace's syntax."""


@frozen
class ArgSpec:
    """One value a traced call records: `source` says where the call has it (a general
    register's name, "xmmK", or "stack+N" for the Nth stack slot above the return address)."""

    index: int  # argN / fpargN: N; retval: 0
    fmt: str  # one of FORMATS
    bits: int
    source: str
    floating: bool = False  # fpargN

    @property
    def retval(self) -> bool:
        return self.index == 0

    @property
    def is_string(self) -> bool:
        return self.fmt == "s"

    @property
    def text(self) -> str:
        """The spec as uftrace writes it, with its location: it parses back to itself."""
        name = "retval" if self.retval else f"{'fparg' if self.floating else 'arg'}{self.index}"
        size = "" if self.fmt in "sc" else str(self.bits)
        return f"{name}/{self.fmt}{size}" + ("" if self.retval else f"%{self.source}")


def parse_values(text: str, *, retval: bool) -> list[ArgSpec]:
    """The values of one -A (`retval` False) or -R spec's part after '@', comma-separated."""
    values = [parse_value(item.strip(), retval=retval) for item in text.split(",") if item.strip()]
    if not values:
        raise ArgSpecError(f"no value in {text!r}: name one, e.g. {'retval' if retval else 'arg1,arg2/s'}")
    if len(values) > MAX_VALUES:
        raise ArgSpecError(f"{len(values)} values in {text!r}: at most {MAX_VALUES} a function")
    return values


def parse_value(item: str, *, retval: bool) -> ArgSpec:
    """One value: 'arg2/s', 'fparg1/32', 'retval/x', 'arg7%stack+1', as `ArgSpec.text` too."""
    head, _, location = item.partition("%")
    name, _, form = head.partition("/")
    match = _ITEM.fullmatch(name)
    if match is None:
        raise ArgSpecError(f"{item!r} is not argN, fpargN or retval (uftrace's names)")
    if bool(match["retval"]) != retval:
        raise ArgSpecError(f"{item!r}: -R records retval, -A argN and fpargN")
    floating = match["what"] == "fparg"
    index = 0 if retval else int(match["index"])
    fmt_match = _FORMAT.fullmatch(form)
    if fmt_match is None:
        raise ArgSpecError(f"{item!r}: after '/' comes a format ({', '.join(FORMATS)}) and a size in bits")
    fmt = fmt_match["fmt"] or ("f" if floating else "d")
    if fmt not in FORMATS:
        raise ArgSpecError(f"{item!r}: format {fmt!r} is not one dynprobe records ({', '.join(FORMATS)})")
    if floating and fmt != "f":
        raise ArgSpecError(f"{item!r}: a floating-point argument is shown as a number (fpargN/32 or /64)")
    if fmt == "f" and not floating and not retval:
        raise ArgSpecError(f"{item!r}: floating-point arguments are fpargN (they come in xmm registers)")
    bits = _bits(item, fmt, fmt_match["bits"])
    source = _source(item, location, index, floating=floating, retval=retval, fmt=fmt)
    return ArgSpec(index, fmt, bits, source, floating)


def _bits(item: str, fmt: str, given: str) -> int:
    if fmt in "sc":
        if given:
            raise ArgSpecError(f"{item!r}: format {fmt!r} takes no size")
        return 64 if fmt == "s" else 8
    bits = int(given) if given else 64
    allowed = (32, 64) if fmt == "f" else (8, 16, 32, 64)
    if bits not in allowed:
        raise ArgSpecError(f"{item!r}: the size is {' or '.join(map(str, allowed))} bits")
    return bits


def _source(item: str, location: str, index: int, *, floating: bool, retval: bool, fmt: str) -> str:
    """Where the value is: as given after '%', else where the calling convention puts it."""
    if location:
        if retval:
            raise ArgSpecError(f"{item!r}: the return value is where the function leaves it (no %LOCATION)")
        if floating:
            known = location in _SSE
        else:
            known = location in _LOCATIONS or re.fullmatch(r"stack\+[1-9][0-9]*", location) is not None
        if known:
            return location
        wanted = "xmm0-xmm7" if floating else "a 64-bit register (%rdi) or a stack slot (%stack+1)"
        raise ArgSpecError(f"{item!r}: {location!r} is not {wanted}")
    if retval:
        return "xmm0" if fmt == "f" else "rax"
    if floating:
        if index > len(_SSE):
            raise ArgSpecError(f"{item!r}: fparg1-fparg{len(_SSE)} come in registers; name another with %xmmK")
        return _SSE[index - 1]
    return ARG_REGS[index - 1] if index <= len(ARG_REGS) else f"stack+{index - len(ARG_REGS)}"


# --- showing values, as uftrace's replay does ------------------------------------------------------------
def show_value(spec: ArgSpec, raw: int) -> str:
    """An integer, character or floating-point value (`raw`: its 64 bits as recorded)."""
    bits, fmt = spec.bits, spec.fmt
    value = raw & ((1 << bits) - 1)
    signed = value - (1 << bits) if value >> (bits - 1) else value
    if fmt == "f":
        number = struct.unpack("<f" if bits == 32 else "<d", value.to_bytes(bits // 8, "little"))[0]
        return "nan" if math.isnan(number) else format(number, "#f")
    if fmt == "c":
        return "'" + _escaped(bytes([value])) + "'"
    if fmt == "d":
        if signed > 100000 or signed < -100000:
            if bits == 64 and 0xFFFF0000 < value <= 0xFFFFFFFF:
                return str(value - (1 << 32))  # an int's small negative value in a 64-bit register
            return hex(value)
        return str(signed)
    if fmt == "i":
        return str(signed)
    if fmt == "u":
        return hex(value) if value > 100000 else str(value)
    if fmt == "x":
        return hex(value) if value else "0"
    return "0" + format(value, "o") if value else "0"  # o


def show_string(data: bytes, *, cut: bool = False, faulted: bool = False, pointer: int | None = None) -> str:
    """A string value: quoted, escaped, cut with "..." as uftrace cuts long ones; what could be
    read of one that ran into unmapped memory. A `pointer` that cannot be read at all shows as
    uftrace (v0.13) shows it: "NULL", "<0x10>"."""
    if pointer is not None:
        return '"NULL"' if pointer == 0 else f'"<{pointer:#x}>"'
    text = _escaped(data[:SHOWN_STRING] if cut else data)
    return f'"{text}{"..." if cut or faulted else ""}"'


def _escaped(data: bytes) -> str:
    """The target's bytes as text: UTF-8 as is; a newline and a backspace as uftrace shows them
    (\\n, \\b); other control characters as \\xNN, so that no byte of the traced program
    drives the terminal."""
    out = []
    for char in data.decode("utf-8", "backslashreplace"):
        if char in "\n\b":
            out.append("\\n" if char == "\n" else "\\b")
        elif (ord(char) < 0x20 and char != "\t") or ord(char) == 0x7F:
            out.append(f"\\x{ord(char):02x}")
        else:
            out.append(char)
    return "".join(out)


# -a: the values of library functions programs call most (their C prototypes, as uftrace's
# --auto-args shows them): name -> (arguments, return value), "" for none.
AUTO_VALUES: dict[str, tuple[str, str]] = {
    "malloc": ("arg1/u", "retval/x"), "calloc": ("arg1/u,arg2/u", "retval/x"),
    "realloc": ("arg1/x,arg2/u", "retval/x"), "free": ("arg1/x", ""),
    "strlen": ("arg1/s", "retval/u"), "strcmp": ("arg1/s,arg2/s", "retval/i32"),
    "strncmp": ("arg1/s,arg2/s,arg3/u", "retval/i32"), "strcasecmp": ("arg1/s,arg2/s", "retval/i32"),
    "strcpy": ("arg1/x,arg2/s", "retval/x"), "strncpy": ("arg1/x,arg2/s,arg3/u", "retval/x"),
    "strcat": ("arg1/s,arg2/s", "retval/x"), "strchr": ("arg1/s,arg2/c", "retval/x"),
    "strrchr": ("arg1/s,arg2/c", "retval/x"), "strstr": ("arg1/s,arg2/s", "retval/x"),
    "strdup": ("arg1/s", "retval/x"), "strtol": ("arg1/s,arg2/x,arg3/i32", "retval/i"),
    "atoi": ("arg1/s", "retval/i32"), "memcpy": ("arg1/x,arg2/x,arg3/u", "retval/x"),
    "memmove": ("arg1/x,arg2/x,arg3/u", "retval/x"), "memset": ("arg1/x,arg2/i32,arg3/u", "retval/x"),
    "memcmp": ("arg1/x,arg2/x,arg3/u", "retval/i32"), "puts": ("arg1/s", "retval/i32"),
    "putchar": ("arg1/c", "retval/i32"), "printf": ("arg1/s", "retval/i32"),
    "fprintf": ("arg1/x,arg2/s", "retval/i32"), "sprintf": ("arg1/x,arg2/s", "retval/i32"),
    "snprintf": ("arg1/x,arg2/u,arg3/s", "retval/i32"), "fputs": ("arg1/s,arg2/x", "retval/i32"),
    "fopen": ("arg1/s,arg2/s", "retval/x"), "fclose": ("arg1/x", "retval/i32"),
    "fwrite": ("arg1/x,arg2/u,arg3/u,arg4/x", "retval/u"), "fread": ("arg1/x,arg2/u,arg3/u,arg4/x", "retval/u"),
    "open": ("arg1/s,arg2/x32", "retval/i32"), "close": ("arg1/i32", "retval/i32"),
    "read": ("arg1/i32,arg2/x,arg3/u", "retval/i"), "write": ("arg1/i32,arg2/x,arg3/u", "retval/i"),
    "getenv": ("arg1/s", "retval/s"), "setenv": ("arg1/s,arg2/s,arg3/i32", "retval/i32"),
    "exit": ("arg1/i32", ""), "_exit": ("arg1/i32", ""), "abort": ("", ""),
    "fork": ("", "retval/i32"), "getpid": ("", "retval/i32"), "system": ("arg1/s", "retval/i32"),
    "execv": ("arg1/s,arg2/x", "retval/i32"), "execvp": ("arg1/s,arg2/x", "retval/i32"),
    "execve": ("arg1/s,arg2/x,arg3/x", "retval/i32"), "sleep": ("arg1/u32", "retval/u32"),
    "usleep": ("arg1/u32", "retval/i32"), "signal": ("arg1/i32,arg2/x", "retval/x"),
    "raise": ("arg1/i32", "retval/i32"), "kill": ("arg1/i32,arg2/i32", "retval/i32"),
    "pthread_create": ("arg1/x,arg2/x,arg3/x,arg4/x", "retval/i32"), "pthread_join": ("arg1/x,arg2/x", "retval/i32"),
    "pthread_mutex_lock": ("arg1/x", "retval/i32"), "pthread_mutex_unlock": ("arg1/x", "retval/i32"),
    "qsort": ("arg1/x,arg2/u,arg3/u,arg4/x", ""), "time": ("arg1/x", "retval/i"),
}  # fmt: skip
