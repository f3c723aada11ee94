"""The rescue handler: the target's own SIGTRAP handler, so that a thread dynprobe left at one of
its traps goes on when dynprobe is killed.

A tracer that dies leaves its stopped threads to the kernel, which lets each go on with the
signal it was stopped for: a thread at an int3 of ours (or whose registers the tracer was
changing, or that it was single-stepping) takes SIGTRAP, whose default action kills the whole
program. The guardian (ptrace/guardian.py) puts the code back as soon as the tracer dies, but
cannot reach those threads: the signal is theirs before it can attach. So dynprobe installs,
in each process it traces, a SIGTRAP handler of its own, generated here, with a table of its
int3s in the rescue page (ringbuf/layout.py). While the tracer lives, no SIGTRAP of its own ever
reaches the handler (ptrace takes them first). After, the handler:

1. lets the thread the tracer was resuming go on as the tracer had set it (the page names the
   thread and the rip it gave it);
2. at one of dynprobe's int3s (rip - 1 in the table) or at a site the tracer moved a thread
   back to (rip in the table): writes the original byte back if it is still an int3 (through
   /proc/self/mem, which writes read-only code), waiting first for the guardian if the entry
   says so, then runs the original instruction (rip = the site);
3. after a single step of ours (TRAP_TRACE with TF clear in the frame: the kernel takes a
   debugger's forced TF out before it builds the frame) goes on; a step with TF in the frame is
   the program's own (it set TF itself);
4. for a SIGTRAP that is not dynprobe's: does what the program's own disposition would have
   (SIG_DFL: back to the default and raised again, so the program dies of it as it would have;
   SIG_IGN: ignored when sent, the default when the CPU raised it, as the kernel does).

dynprobe installs the handler only where the program's disposition of SIGTRAP is SIG_DFL or
SIG_IGN, and puts that back when it detaches. Pure: the page's address in, the code out.
"""

from __future__ import annotations

import iced_x86 as iced

from dynprobe.arch.x86_64.codegen.asm import Asm, mem_at
from dynprobe.ringbuf import layout as L

C = iced.Code
R = iced.Register

SA_SIGINFO, SA_ONSTACK, SA_RESTORER = 0x4, 0x08000000, 0x04000000
HANDLER_FLAGS = SA_SIGINFO | SA_ONSTACK | SA_RESTORER
SIGTRAP = 5
TRAP_TRACE = 2
_SYS_OPEN, _SYS_CLOSE, _SYS_RT_SIGACTION, _SYS_RT_SIGRETURN = 2, 3, 13, 15
_SYS_PWRITE64, _SYS_NANOSLEEP, _SYS_GETPID, _SYS_GETTID, _SYS_TGKILL = 18, 35, 39, 186, 234
_O_RDWR_CLOEXEC = 0o2 | 0o2000000
# ucontext_t: uc_flags, uc_link, uc_stack (24 bytes), then mcontext's gregs (REG_RIP 16, REG_EFL 17)
_UC_RIP, _UC_EFL = 40 + 8 * 16, 40 + 8 * 17
_SI_CODE = 8
_TF_BIT = 8
WAIT_ROUNDS = 5000  # 1 ms naps waiting for the guardian, at most
MEM_PATH = b"/proc/self/mem\0"


def build_rescue_handler(page: int) -> tuple[bytes, int]:
    """The handler for a process whose rescue page is at `page`, placed at 0 (position
    independent); returns the code and the offset of its restorer (sa_restorer:
    rt_sigreturn), both in the code."""
    asm = Asm()
    sites, found, foreign, default, wait, restore, resume, lookup = (asm.label() for _ in range(8))
    restorer = asm.label()
    mov = iced.Instruction.create_reg_reg
    load = iced.Instruction.create_reg_mem

    def syscall(number: int) -> None:
        asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.EAX, number))
        asm.add(iced.Instruction.create(C.SYSCALL))

    def ret() -> None:
        asm.add(iced.Instruction.create(C.RETNQ))

    asm.add(mov(C.MOV_R64_RM64, R.RBX, R.RSI))  # siginfo
    asm.add(mov(C.MOV_R64_RM64, R.R12, R.RDX))  # ucontext
    asm.add(iced.Instruction.create_reg_u64(C.MOV_R64_IMM64, R.R13, page))
    asm.add(load(C.MOV_R64_RM64, R.R14, mem_at(R.R12, _UC_RIP)))
    # 1. the thread the tracer was resuming, where it was sending it
    syscall(_SYS_GETTID)
    asm.add(load(C.CMP_R64_RM64, R.RAX, mem_at(R.R13, L.RESCUE_MARK_TID)))
    asm.jump(C.JNE_REL32_64, sites)
    asm.add(load(C.CMP_R64_RM64, R.R14, mem_at(R.R13, L.RESCUE_MARK_RIP)))
    asm.jump(C.JNE_REL32_64, sites)
    ret()
    # 2. at an int3 of ours, or at a site
    asm.bind(sites)
    asm.add(load(C.LEA_R64_M, R.RDI, mem_at(R.R14, -1)))
    asm.jump(C.CALL_REL32_64, lookup)
    asm.add(mov(C.TEST_RM64_R64, R.RAX, R.RAX))
    asm.jump(C.JNE_REL32_64, found)
    asm.add(mov(C.MOV_R64_RM64, R.RDI, R.R14))
    asm.jump(C.CALL_REL32_64, lookup)
    asm.add(mov(C.TEST_RM64_R64, R.RAX, R.RAX))
    asm.jump(C.JNE_REL32_64, found)
    # 3. a single step of ours
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM32_IMM8, mem_at(R.RBX, _SI_CODE), TRAP_TRACE))
    asm.jump(C.JNE_REL32_64, foreign)
    asm.add(iced.Instruction.create_mem_i32(C.BT_RM64_IMM8, mem_at(R.R12, _UC_EFL), _TF_BIT))
    asm.jump(C.JB_REL32_64, foreign)  # CF set: TF, the program's own
    ret()
    # the site's entry is in rax
    asm.bind(found)
    asm.add(mov(C.MOV_R64_RM64, R.R15, R.RAX))
    asm.add(iced.Instruction.create_mem_u32(C.TEST_RM8_IMM8, mem_at(R.R15, 9), L.RESCUE_WAIT))
    asm.jump(C.JE_REL32_64, restore)
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.EBP, WAIT_ROUNDS))
    asm.bind(wait)
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, mem_at(R.R13, L.RESCUE_RESCUED), 0))
    asm.jump(C.JNE_REL32_64, restore)
    asm.add(iced.Instruction.create_i32(C.PUSHQ_IMM32, 1_000_000))  # struct timespec {0 s, 1 ms}
    asm.add(iced.Instruction.create_i32(C.PUSHQ_IMM8, 0))
    asm.add(mov(C.MOV_R64_RM64, R.RDI, R.RSP))
    asm.add(mov(C.XOR_R32_RM32, R.ESI, R.ESI))
    syscall(_SYS_NANOSLEEP)
    asm.add(load(C.LEA_R64_M, R.RSP, mem_at(R.RSP, 16)))
    asm.add(iced.Instruction.create_reg(C.DEC_RM32, R.EBP))
    asm.jump(C.JNE_REL32_64, wait)
    # the original byte back where an int3 still is
    asm.bind(restore)
    asm.add(load(C.MOV_R64_RM64, R.RAX, mem_at(R.R15)))
    asm.add(iced.Instruction.create_mem_u32(C.CMP_RM8_IMM8, mem_at(R.RAX), 0xCC))
    asm.jump(C.JNE_REL32_64, resume)
    asm.add(load(C.LEA_R64_M, R.RDI, mem_at(R.R13, L.RESCUE_MEM_PATH)))
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.ESI, _O_RDWR_CLOEXEC))
    asm.add(mov(C.XOR_R32_RM32, R.EDX, R.EDX))
    syscall(_SYS_OPEN)
    asm.add(mov(C.TEST_RM64_R64, R.RAX, R.RAX))
    asm.jump(C.JS_REL32_64, resume)
    asm.add(mov(C.MOV_R64_RM64, R.RBP, R.RAX))
    asm.add(mov(C.MOV_R64_RM64, R.RDI, R.RAX))
    asm.add(load(C.LEA_R64_M, R.RSI, mem_at(R.R15, 8)))
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.EDX, 1))
    asm.add(load(C.MOV_R64_RM64, R.R10, mem_at(R.R15)))
    syscall(_SYS_PWRITE64)
    asm.add(mov(C.MOV_R64_RM64, R.RDI, R.RBP))
    syscall(_SYS_CLOSE)
    asm.bind(resume)
    asm.add(load(C.MOV_R64_RM64, R.RAX, mem_at(R.R15)))
    asm.add(iced.Instruction.create_mem_u32(C.CMP_RM8_IMM8, mem_at(R.RAX), 0xCC))
    asm.jump(C.JE_REL32_64, foreign)  # it could not be put back: as if dynprobe were not here
    asm.add(iced.Instruction.create_mem_reg(C.MOV_RM64_R64, mem_at(R.R12, _UC_RIP), R.RAX))
    ret()
    # 4. not dynprobe's: the program's own disposition
    asm.bind(foreign)
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM64_IMM8, mem_at(R.R13, L.RESCUE_OWN), 1))
    asm.jump(C.JNE_REL32_64, default)
    asm.add(iced.Instruction.create_mem_i32(C.CMP_RM32_IMM8, mem_at(R.RBX, _SI_CODE), 0))
    asm.jump(C.JG_REL32_64, default)  # raised by the CPU (an int3): the kernel would have killed it
    ret()  # sent (kill, tgkill): ignored
    asm.bind(default)
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.EDI, SIGTRAP))
    asm.add(load(C.LEA_R64_M, R.RSI, mem_at(R.R13, L.RESCUE_DEFAULT_ACTION)))
    asm.add(mov(C.XOR_R32_RM32, R.EDX, R.EDX))
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.R10D, 8))
    syscall(_SYS_RT_SIGACTION)
    syscall(_SYS_GETPID)
    asm.add(mov(C.MOV_R64_RM64, R.RBP, R.RAX))
    syscall(_SYS_GETTID)
    asm.add(mov(C.MOV_R64_RM64, R.RSI, R.RAX))
    asm.add(mov(C.MOV_R64_RM64, R.RDI, R.RBP))
    asm.add(iced.Instruction.create_reg_u32(C.MOV_R32_IMM32, R.EDX, SIGTRAP))
    syscall(_SYS_TGKILL)  # pending (blocked in the handler): taken at its return, by default
    ret()
    _lookup(asm, lookup)
    asm.bind(restorer)
    syscall(_SYS_RT_SIGRETURN)
    code, _ = asm.encode(0)
    starts = [int(i.ip) for i in iced.Decoder(64, code)]
    return code, starts[asm.bound[restorer]]


def _lookup(asm: Asm, label: int) -> None:
    """rax = the table entry of the address in rdi, or 0 (r13: the page). A binary search of
    the half the header names; a count past the capacity (the target can write the page)
    finds nothing."""
    none, loop, right, same = asm.label(), asm.label(), asm.label(), asm.label()
    mov = iced.Instruction.create_reg_reg
    asm.bind(label)
    asm.add(iced.Instruction.create_reg_mem(C.MOV_R64_RM64, R.R8, mem_at(R.R13, L.RESCUE_TABLE)))
    asm.add(mov(C.MOV_R32_RM32, R.ECX, R.R8D))
    asm.add(iced.Instruction.create_reg_i32(C.SHR_RM64_IMM8, R.R8, 32))
    asm.add(iced.Instruction.create_reg_i32(C.AND_RM32_IMM8, R.R8D, 1))
    asm.add(iced.Instruction.create_reg_reg_i32(C.IMUL_R64_RM64_IMM32, R.R8, R.R8, L.RESCUE_CAPACITY * L.RESCUE_ENTRY))
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.R8, mem_at(R.R13, L.RESCUE_ENTRIES, index=R.R8)))
    asm.add(iced.Instruction.create_reg_i32(C.CMP_RM64_IMM32, R.RCX, L.RESCUE_CAPACITY))
    asm.jump(C.JA_REL32_64, none)
    asm.add(mov(C.XOR_R32_RM32, R.R9D, R.R9D))  # [lo, hi)
    asm.add(mov(C.MOV_R64_RM64, R.R10, R.RCX))
    asm.bind(loop)
    asm.add(mov(C.CMP_R64_RM64, R.R9, R.R10))
    asm.jump(C.JAE_REL32_64, none)
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.R11, mem_at(R.R9, 0, index=R.R10)))
    asm.add(iced.Instruction.create_reg_i32(C.SHR_RM64_IMM8, R.R11, 1))
    asm.add(mov(C.MOV_R64_RM64, R.RAX, R.R11))
    asm.add(iced.Instruction.create_reg_i32(C.SHL_RM64_IMM8, R.RAX, 4))
    asm.add(mov(C.ADD_R64_RM64, R.RAX, R.R8))
    asm.add(iced.Instruction.create_reg_mem(C.CMP_R64_RM64, R.RDI, mem_at(R.RAX)))
    asm.jump(C.JE_REL32_64, same)
    asm.jump(C.JA_REL32_64, right)
    asm.add(mov(C.MOV_R64_RM64, R.R10, R.R11))
    asm.jump(C.JMP_REL32_64, loop)
    asm.bind(right)
    asm.add(iced.Instruction.create_reg_mem(C.LEA_R64_M, R.R9, mem_at(R.R11, 1)))
    asm.jump(C.JMP_REL32_64, loop)
    asm.bind(none)
    asm.add(mov(C.XOR_R32_RM32, R.EAX, R.EAX))
    asm.bind(same)
    asm.add(iced.Instruction.create(C.RETNQ))
