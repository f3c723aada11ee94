"""The one exception tree of dynprobe.

Faults are exceptions from this tree; expected refusals (a site that cannot be probed, an
instruction that cannot be boosted) are values of reason enums, wrapped in `ProbeRefused` only
where the API has to raise. Errors of other libraries (OSError from ptrace, ELFError from
pyelftools, ValueError from iced-x86) are wrapped where they enter dynprobe, so a caller catches
`DynprobeError` and gets one clear line from `str(exc)`.
"""

from __future__ import annotations

import enum
import errno


class DynprobeError(Exception):
    """Base of every error dynprobe raises on purpose."""


class ProcessError(DynprobeError):
    """The target process could not be started, attached, read or written."""


class ThreadGone(ProcessError, ProcessLookupError):
    """A thread ended while dynprobe worked in it (its process exited during a remote syscall):
    an ESRCH, as any thread gone under a ptrace call, and one line for a user."""

    def __init__(self, message: str) -> None:
        ProcessLookupError.__init__(self, errno.ESRCH, message)

    def __str__(self) -> str:
        return str(self.strerror)


class SeccompFiltered(ProcessError):
    """A thread runs under a seccomp filter that dynprobe may not suspend (that needs
    CAP_SYS_ADMIN): a system call of ours run in it could be refused, or kill the process."""


class SharedMemoryRefused(ProcessError):
    """The memory dynprobe had the target make for it could not be taken safely (see
    Tracee.map_shared): its probes stay traps."""


class NoSuchProcess(ProcessError):
    """The pid does not exist (or exited while we worked on it)."""


class PermissionDenied(ProcessError):
    """ptrace is not permitted on the target."""


class AlreadyTraced(ProcessError):
    """Another tracer (a debugger, strace, ...) already traces the target."""


class SymbolError(DynprobeError):
    """A file, symbol or address could not be resolved."""


class ProgramError(DynprobeError):
    """A program in bpftrace's language (`dynprobe run`) that cannot run: `str()` is where and
    what, as bpftrace's first line says it (`stdin:1:24-27: ERROR: Unknown identifier: 'foo'`);
    `render()` adds the line and the span underlined."""

    def __init__(self, message: str, source: str, span: tuple[int, int], filename: str = "stdin") -> None:
        self.message, self.source, self.span, self.filename = message, source, span, filename
        start = max(0, min(span[0], len(source)))
        line_start = source.rfind("\n", 0, start) + 1
        line_end = source.find("\n", start)
        self.line = source[line_start : line_end if line_end >= 0 else len(source)]
        self.line_number = source.count("\n", 0, start) + 1
        self.first = start - line_start + 1
        self.last = self.first + max(1, min(span[1], line_start + len(self.line)) - start)
        super().__init__(f"{filename}:{self.line_number}:{self.first}-{self.last}: ERROR: {message}")

    def render(self) -> str:
        return f"{self}\n{self.line}\n{' ' * (self.first - 1)}{'~' * (self.last - self.first)}"


class ElfError(SymbolError):
    """A file is not an ELF object dynprobe can use (not ELF, not x86-64, corrupt)."""


class ParseError(DynprobeError):
    """A probe specification (or filter) does not parse: `code`, `message`, the `spec`, and
    where: `column`, 1-based as the message says it, `offset` the 0-based index in `spec`."""

    def __init__(self, code: str, message: str, spec: str, offset: int) -> None:
        super().__init__(f"{code}: {message} (column {offset + 1})")
        self.code = code
        self.message = message
        self.spec = spec
        self.offset = offset
        self.column = offset + 1

    def caret(self) -> str:
        """The spec with a caret under the offending column, as tracefs' error_log shows it; a long
        spec is cut to the 80 characters around the column, with "..." where it was cut."""
        start = max(0, min(self.offset - 40, len(self.spec) - 80))
        end = start + 80
        shown = self.spec[start:end]
        column = self.offset - start
        if start > 0:
            shown, column = "..." + shown, column + 3
        if end < len(self.spec):
            shown += "..."
        return f"{shown}\n{' ' * column}^"


class Refusal(enum.Enum):
    """Why a probe cannot be placed at a site. Each value's text is the user-facing reason."""

    NOT_INSN_BOUNDARY = "the address is not on an instruction boundary"
    UNKNOWN_FUNCTION = "no function (symbol or unwind entry) contains the address"
    FOREIGN_INT3 = "the site already holds an int3 that dynprobe did not write"
    BYTES_MISMATCH = "the bytes in memory differ from the file (was the binary replaced?)"
    FILE_REPLACED = "the file was replaced on disk since the process mapped it; restart the process to probe it"
    UNDECODABLE = "the instruction at the site cannot be decoded"
    UNSUPPORTED_INSN = "the instruction cannot be run out of line or emulated"
    RIP_REL_OUT_OF_REACH = "a RIP-relative operand is out of reach of the out-of-line slot"
    NOT_EXECUTABLE = "the address is not in an executable mapping"
    NOT_FUNCTION_ENTRY = "a return probe goes on a function's first instruction (SYMBOL, not SYMBOL+OFFS)"
    SHADOW_STACK = "the process runs with a CET shadow stack: a replaced return address would be a fault"
    MOVING_STACKS = "the program's runtime moves stacks (Go): a replaced return address would be lost"
    GS_IN_USE = "the target uses the GS segment base itself: return probes need a thread area there"
    SECCOMP = "a seccomp filter dynprobe may not suspend (without CAP_SYS_ADMIN): no memory can be made for it"
    SHARED_MEMORY = (
        "the target's shared memory could not be taken safely (another file in its place): return probes "
        "need a thread area"
    )
    FUNCTION_TRACED = "the function tracer patched these bytes; stop that tracer first"
    NO_MEMORY = "no executable memory could be mapped near the code for the return trampoline"
    RETURNS_TWICE = (
        "the function returns twice (setjmp, vfork, getcontext, swapcontext): a replaced return address "
        "would be taken again after its return"
    )


class OptimizeRefusal(enum.Enum):
    """Why a site stays a trap probe instead of taking a 5-byte jump (docs/architecture.md §5)."""

    FUNCTION_UNKNOWN = "the containing function (symbol with a size) is unknown"
    TOO_SHORT = "fewer than 5 bytes of whole instructions remain to the end of the function"
    UNDECODABLE = "the function holds bytes that do not decode as instructions"
    INDIRECT_JUMP = "the function jumps indirectly (a jump table may target the patched bytes)"
    JUMP_INTO_REGION = "a jump in the function lands inside the 5 patched bytes"
    REGION_OVERLAP = "another probe lies inside the 5 patched bytes"
    UNRELOCATABLE_INSN = "an instruction in the 5 bytes cannot run from a detour (int, syscall, ret not last, ...)"
    RIP_REL_OUT_OF_REACH = "a RIP-relative operand is out of reach of the detour"
    POST_HANDLER = "a post-handler needs a single-step after the instruction"
    PYTHON_HANDLER = "a Python pre-handler runs in the tracer, at a stop"
    SECCOMP_FILTER = "the process runs under a seccomp filter, which may forbid the futex calls of an upcall"
    UPCALL_RETURNS = "more than 4 return probes with Python handlers on one function (one detour takes their entries)"
    FETCH_UNSUPPORTED = "a fetch argument has no in-process form (segment or orig_rax register, unknown symbol)"
    RECORD_TOO_LARGE = "the record is larger than the session's record size (set record_size before the first probe)"
    TOO_MANY_PROBES = "the thread area's counter or histogram table is full"
    GS_IN_USE = "the target uses the GS segment base itself: no thread area can be installed"
    SECCOMP = "a seccomp filter dynprobe may not suspend (without CAP_SYS_ADMIN): no thread area can be made"
    NO_MEMORY = "no executable memory within +-2 GB of the site for a detour"
    DISABLED = "optimization is turned off (--no-optimize, session.optimize = False)"
    INTERNAL_SITE = "dynprobe's own hook (the loader breakpoint) stays a trap"
    SHARED_MEMORY = "the target's shared memory could not be taken safely (another file in its place; no pidfd_getfd)"


class ProbeRefused(DynprobeError):
    """A probe was refused for an expected reason (see `Refusal`)."""

    def __init__(self, reason: Refusal, where: str) -> None:
        super().__init__(f"cannot probe {where}: {reason.value} [{reason.name}]")
        self.reason = reason
        self.where = where


class SessionError(DynprobeError):
    """The session was used wrongly (probe after detach, run twice, ...)."""
