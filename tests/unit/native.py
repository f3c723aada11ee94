"""Generated code run in this process, as a target thread runs it: an executable mapping to place
code and hand-assembled functions in (all within rel32 reach of each other), and a thread area
(a numpy buffer) this thread's GS base points at while the code runs.

Functions are patched as the engine patches them: a `jmp` to the detour over their first bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import signal
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from dynprobe.arch.x86_64.codegen.asm import Trampoline
from dynprobe.arch.x86_64.codegen.returns import build_trampoline
from dynprobe.arch.x86_64.optimize import OptimizePlan, can_optimize
from dynprobe.arch.x86_64.relocate import jump_to
from dynprobe.arch.x86_64.rescue import SA_RESTORER, SA_SIGINFO
from dynprobe.ringbuf import layout as L

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
ARCH_PRCTL = 158
ARCH_SET_GS, ARCH_GET_FS, ARCH_GET_GS = 0x1001, 0x1003, 0x1004
_ALIGN = 64

# Functions to probe, System V ABI. Each clobbers what its caller must not rely on (argument
# registers), so a return that reads them from the registers instead of its entry is caught.
ADD = bytes.fromhex(  # u64 add(a, b) = a + b
    "55"  # push rbp
    "4889e5"  # mov rbp,rsp
    "488d0437"  # lea rax,[rdi+rsi]
    "31ff31f6"  # xor edi,edi; xor esi,esi
    "5dc3"  # pop rbp; ret
)
WHOAMI = bytes.fromhex(  # u64 whoami(void) = its return address
    "554889e5"  # push rbp; mov rbp,rsp
    "488b4508"  # mov rax,[rbp+8]
    "5dc3"  # pop rbp; ret
)
ESCAPE = bytes.fromhex(  # u64 escape(a) = a + 1, leaving as longjmp does: to r13, not to its caller
    "554889e5"  # push rbp; mov rbp,rsp
    "488d4701"  # lea rax,[rdi+1]
    "5d4c892c24c3"  # pop rbp; mov [rsp],r13; ret
)
THEN = bytes.fromhex(  # u64 then(f, g, x) = g(x, x) after f(x, x): both calls from one frame (one slot)
    "53415441554156"  # push rbx; push r12; push r13; push r14
    "4889fb4989f64989d4"  # mov rbx,rdi; mov r14,rsi; mov r12,rdx
    "4c8d2d08000000"  # lea r13,[rip+8] (where an escape goes on: after the call)
    "4c89e74c89e6ffd3"  # mov rdi,r12; mov rsi,r12; call rbx
    "4c8d2d09000000"  # lea r13,[rip+9]
    "4c89e74c89e641ffd6"  # mov rdi,r12; mov rsi,r12; call r14
    "415e415d415c5bc3"  # pop r14; pop r13; pop r12; pop rbx; ret
)
PEEK = bytes.fromhex(  # u64 peek(void) = the word below its return address (see codegen.enter_tail)
    "488b4424f8"  # mov rax,[rsp-8]
    "c3"  # ret
)
HEAD_NOW = bytes.fromhex(  # u64 head_now(void) = gs:[HEAD]: the records published when it runs
    "65488b042540000000"  # mov rax,gs:[0x40]
    "c3"  # ret
)
PUSHING = bytes.fromhex(  # u64 pushing(f, a, b) = f(a, b), called with 0x1234 pushed: +0(%sp) after its return
    "4889f84889f74889d6"  # mov rax,rdi; mov rdi,rsi; mov rsi,rdx
    "6834120000"  # push 0x1234
    "ffd0"  # call rax
    "4883c408c3"  # add rsp,8; ret
)
OUTER = bytes.fromhex(  # u64 outer(f, x) = f(x, x) + 1
    "554889e5"  # push rbp; mov rbp,rsp
    "4889f84889f7"  # mov rax,rdi; mov rdi,rsi
    "ffd0"  # call rax
    "48ffc0"  # inc rax
    "5dc3"  # pop rbp; ret
)
SPIN = bytes.fromhex(  # void spin(ticks): returns once the time-stamp counter moved `ticks` on
    "554889e54889f9"  # push rbp; mov rbp,rsp; mov rcx,rdi
    "0f3148c1e2204809d04c8d0408"  # rdtsc; shl rdx,32; or rax,rdx; lea r8,[rax+rcx]
    "0f3148c1e2204809d04c39c072f2"  # again: rdtsc; shl rdx,32; or rax,rdx; cmp rax,r8; jb again
    "5dc3"  # pop rbp; ret
)


def sum_to(at: int) -> bytes:
    """u64 sum(n) = n + sum(n - 1), sum(0) = 0: a recursive function placed at `at` (its call
    goes to its own entry, so through its probe)."""
    head = bytes.fromhex(
        "554889e55350"  # push rbp; mov rbp,rsp; push rbx; push rax (aligned)
        "4889fb31c0"  # mov rbx,rdi; xor eax,eax
        "4885ff740c"  # test rdi,rdi; je done
        "488d7fff"  # lea rdi,[rdi-1]
    )
    call = b"\xe8" + (at - (at + len(head) + 5)).to_bytes(4, "little", signed=True)
    return head + call + bytes.fromhex("4801d8595b5dc3")  # add rax,rbx; done: pop rcx; pop rbx; pop rbp; ret


_RT_SIGACTION = 13
_MAX_FIXUPS = 4096
_UC_RIP = 40 + 8 * 16  # in a ucontext_t: uc_mcontext.gregs[REG_RIP]


def _fault_handler(table: int) -> bytes:
    """A SIGSEGV handler (rdx: the ucontext): a fault at a load the table at `table` names (u64
    count, then (load, go on at) pairs) goes on where it says; any other ends the process with
    status 99 (the test's child dies: a crash, as it would have been)."""
    rip = _UC_RIP.to_bytes(4, "little").hex()
    return bytes.fromhex(
        "488b82" + rip +  # mov rax,[rdx+UC_RIP]: the faulting rip
        "48b9" + table.to_bytes(8, "little").hex() +  # mov rcx, table
        "4c8b01" "4883c108"  # mov r8,[rcx]; add rcx,8
        "4d85c0" "741a"  # next: test r8,r8; je unknown
        "483901" "7409"  # cmp [rcx],rax; je found
        "4883c110" "49ffc8" "ebed"  # add rcx,16; dec r8; jmp next
        "488b4108" "488982" + rip + "c3"  # found: mov rax,[rcx+8]; mov [rdx+UC_RIP],rax; ret
        "b8e7000000" "bf63000000" "0f05"  # unknown: exit_group(99)
    )  # fmt: skip


def _step_handler(start: int, end: int, count: int, function: int) -> bytes:
    """A SIGTRAP handler (rdx: the ucontext) for a thread single-stepping (TF): after each
    instruction run at an address in [start, end), it calls u64 function(n) with n the number of
    such calls so far (the u64 at `count`, incremented first), as a signal handler hitting the
    same probe would. The kernel clears TF for the handler and sigreturn sets it again."""
    rip = _UC_RIP.to_bytes(4, "little").hex()

    def word(value: int) -> str:
        return value.to_bytes(8, "little").hex()

    return bytes.fromhex(
        "488b82" + rip +  # mov rax,[rdx+UC_RIP]
        "48b9" + word(start) + "4839c8" "722d"  # mov rcx,start; cmp rax,rcx; jb out
        "48b9" + word(end) + "4839c8" "731e"  # mov rcx,end; cmp rax,rcx; jae out
        "53"  # push rbx (the stack aligned for the call)
        "48bb" + word(count) + "48ff03" "488b3b"  # mov rbx,count; inc qword [rbx]; mov rdi,[rbx]
        "48b8" + word(function) + "ffd0"  # mov rax,function; call rax
        "5b"  # pop rbx
        "c3"  # out: ret
    )  # fmt: skip


STEPPED = bytes.fromhex(  # u64 stepped(a, f) = f(a), run with TF set: a SIGTRAP after each instruction
    "4883ec08"  # sub rsp,8
    "9c" "48810c2400010000" "9d"  # pushfq; or qword [rsp],0x100 (TF); popfq
    "ffd6"  # call rsi
    "9c" "48812424fffeffff" "9d"  # pushfq; and qword [rsp],~0x100; popfq
    "4883c408c3"  # add rsp,8; ret
)  # fmt: skip


class NativeArea:
    """A thread area in this process, and code placed next to each other in one mapping."""

    def __init__(self, layout: L.AreaLayout, code_bytes: int = 1 << 20) -> None:
        self.layout = layout
        self.mem = np.zeros(layout.size, dtype=np.uint8)
        self.words = self.mem.view(np.uint64)
        self.code = mmap.mmap(-1, code_bytes, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.code))
        self.used = 0
        self.pages: list[mmap.mmap] = []
        self.fixups = np.zeros(1 + 2 * _MAX_FIXUPS, dtype=np.uint64)  # count, then (load, go on at)
        self.fault_handler = self.place(_fault_handler(self.fixups.ctypes.data))
        self.fault_handler_return = self.place(bytes.fromhex("b80f0000000f05"))  # mov eax, 15 (rt_sigreturn); syscall

    def close(self) -> None:
        for page in self.pages:
            page.close()
        self.code.close()

    def place(self, code_at: Callable[[int], bytes] | bytes) -> int:
        """Put code (or `code_at(address)`'s) at the next free address; returns that address."""
        at = self.base + self.used
        code = code_at if isinstance(code_at, bytes) else code_at(at)
        self.write(at, code)
        self.used += (len(code) + _ALIGN - 1) // _ALIGN * _ALIGN
        return at

    def write(self, at: int, code: bytes) -> None:
        self.code[at - self.base : at - self.base + len(code)] = code

    @functools.cached_property
    def trampoline(self) -> Trampoline:
        """The process's return trampoline, placed on first use."""
        at = self.base + self.used
        assert self.place(lambda here: build_trampoline(self.layout, here)[0]) == at
        return build_trampoline(self.layout, at)[1]

    def patch(self, function: int, detour: int) -> None:
        """Enter `function` through `detour`, as the engine does: a jump over its first bytes."""
        self.write(function, jump_to(function, detour))

    def plan(self, function: int, length: int) -> OptimizePlan:
        made = can_optimize(self.code[function - self.base : function - self.base + length], function, function)
        assert isinstance(made, OptimizePlan), made
        return made

    def add_fixups(self, fixups: Iterable[tuple[int, int]] | dict[int, int]) -> None:
        """Loads that may fault, and where a thread that faults at one goes on: what the tracer
        does for them, done here by a SIGSEGV handler while generated code runs."""
        for load, then in fixups.items() if isinstance(fixups, dict) else fixups:
            count = int(self.fixups[0])
            self.fixups[1 + 2 * count : 3 + 2 * count] = (load, then)
            self.fixups[0] = count + 1

    def call_at(self, address: int, *args: int | float) -> int:
        """u64 f(args...) at `address` (floats passed as doubles), run on this thread with its GS
        base at the area and faults at the fix-ups' loads sent on."""
        types = [ctypes.c_double if isinstance(a, float) else ctypes.c_uint64 for a in args]
        func = ctypes.CFUNCTYPE(ctypes.c_uint64, *types)(address)
        old_gs = ctypes.c_uint64()
        old_action = (ctypes.c_uint64 * 4)()
        action = (ctypes.c_uint64 * 4)(self.fault_handler, SA_SIGINFO | SA_RESTORER, self.fault_handler_return, 0)
        assert libc.syscall(_RT_SIGACTION, signal.SIGSEGV, action, old_action, 8) == 0
        assert libc.syscall(ARCH_PRCTL, ARCH_GET_GS, ctypes.byref(old_gs)) == 0
        assert libc.syscall(ARCH_PRCTL, ARCH_SET_GS, ctypes.c_uint64(self.mem.ctypes.data)) == 0
        try:
            return int(func(*args))
        finally:
            libc.syscall(ARCH_PRCTL, ARCH_SET_GS, old_gs)
            libc.syscall(_RT_SIGACTION, signal.SIGSEGV, old_action, None, 8)

    def call_interrupted(self, function: int, arg: int, within: tuple[int, int], *, handler: int = 0) -> int:
        """Run u64 function(arg) one instruction at a time, and after each instruction run at an
        address in [within) call it again from a signal handler (so with the first call's work
        half done), or u64 handler(n) if given: returns how many times the handler called it."""
        count = np.zeros(1, dtype=np.uint64)
        stepping = self.place(_step_handler(*within, count.ctypes.data, handler or function))
        action = (ctypes.c_uint64 * 4)(stepping, SA_SIGINFO | SA_RESTORER, self.fault_handler_return, 0)
        old_action = (ctypes.c_uint64 * 4)()
        assert libc.syscall(_RT_SIGACTION, signal.SIGTRAP, action, old_action, 8) == 0
        try:
            self.call(STEPPED, arg, function)
        finally:
            libc.syscall(_RT_SIGACTION, signal.SIGTRAP, old_action, None, 8)
        return int(count[0])

    def call(self, code_at: Callable[[int], bytes] | bytes, *args: int | float) -> int:
        """Place code and run it as u64 f(args...)."""
        return self.call_at(self.place(code_at), *args)

    def guarded(self, data: bytes) -> int:
        """The address of `data` placed right before a page that cannot be read (a string there
        runs into unmapped memory; an address in that page faults)."""
        assert len(data) <= mmap.PAGESIZE
        self.pages.append(page := mmap.mmap(-1, 2 * mmap.PAGESIZE))
        at = ctypes.addressof(ctypes.c_char.from_buffer(page))
        assert libc.mprotect(ctypes.c_void_p(at + mmap.PAGESIZE), mmap.PAGESIZE, 0) == 0  # PROT_NONE
        page[mmap.PAGESIZE - len(data) : mmap.PAGESIZE] = data
        return at + mmap.PAGESIZE - len(data)

    def fill_ring(self, byte: int) -> None:
        """Every byte of the ring `byte`: what is written over it must be written whole."""
        self.mem[self.layout.ring : self.layout.ring + self.layout.ring_bytes] = byte

    def word(self, offset: int) -> int:
        return int(self.words[offset // 8])

    def set_word(self, offset: int, value: int) -> None:
        self.words[offset // 8] = value

    def counter(self, index: int, which: int) -> int:
        return self.word(self.layout.counter(index, which))

    def hist(self, index: int) -> list[int]:
        at = self.layout.hist(index) // 8
        return [int(n) for n in self.words[at : at + L.HIST_BUCKETS]]

    def records(self, first: int = 0) -> list[bytes]:
        """The records numbered `first` up to HEAD (the ring wrapped)."""
        size, ring, slots = self.layout.record_size, self.layout.ring, self.layout.ring_slots
        at = [ring + (number % slots) * size for number in range(first, self.word(L.HEAD))]
        return [bytes(self.mem[a : a + size]) for a in at]

    def shadow_word(self, entry: int, offset: int) -> int:
        return self.word(self.layout.shadow + entry * L.SHADOW_ENTRY + offset)


def asleep_in(tid: int, syscall: int) -> bool:
    """Whether thread `tid` of this process sleeps in system call number `syscall` (a futex
    wait: queued, so only a wake, or its timeout, ends it)."""
    with open(f"/proc/self/task/{tid}/stat") as stat, open(f"/proc/self/task/{tid}/syscall") as call:
        return stat.read().rsplit(")", 1)[1].split()[0] == "S" and call.read().split()[0] == str(syscall)


def field(record: bytes, offset: int, size: int = 8) -> int:
    return int.from_bytes(record[offset : offset + size], "little")


@contextlib.contextmanager
def one_cpu() -> Iterator[None]:
    """This thread on one CPU: two time stamps taken on it are ordered."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)
