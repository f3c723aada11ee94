/* One-instruction corpus: each case_NAME loads a known register/flags/memory state, runs the
 * instruction at insn_NAME, and stores every GPR, rflags, xmm0 and xmm1 to out_regs. Built
 * non-PIE with a fixed stack in a fixed mapping, so two runs print identical snapshots. */
    .intel_syntax noprefix

    .data
    .balign 16
    .globl init_regs, out_regs, ripdata, ripdata2, jmpptr
init_regs:  .zero 8 * 17            /* rax rcx rdx rbx rsp(unused) rbp rsi rdi r8..r15 rflags */
init_xmm:   .quad 0x0123456789abcdef, 0xfedcba9876543210, 0x1111222233334444, 0x5555666677778888
out_regs:   .zero 8 * 18 + 32
saved:      .zero 8 * 8
ripdata:    .quad 0x1122334455667788, 0x99aabbccddeeff00
ripdata2:   .quad 0, 0
jmpptr:     .quad 0

    .text
.macro CASE name, insn, setup=
    .globl case_\name
    .type case_\name, @function
case_\name:
    mov [saved + 0], rbx
    mov [saved + 8], rbp
    mov [saved + 16], r12
    mov [saved + 24], r13
    mov [saved + 32], r14
    mov [saved + 40], r15
    mov [saved + 48], rsp
    mov rsp, 0x20008000
    \setup
    push qword ptr [init_regs + 16 * 8]
    popfq
    movdqu xmm0, [init_xmm]
    movdqu xmm1, [init_xmm + 16]
    mov rax, [init_regs + 0 * 8]
    mov rcx, [init_regs + 1 * 8]
    mov rdx, [init_regs + 2 * 8]
    mov rbx, [init_regs + 3 * 8]
    mov rbp, [init_regs + 5 * 8]
    mov rsi, [init_regs + 6 * 8]
    mov rdi, [init_regs + 7 * 8]
    mov r8, [init_regs + 8 * 8]
    mov r9, [init_regs + 9 * 8]
    mov r10, [init_regs + 10 * 8]
    mov r11, [init_regs + 11 * 8]
    mov r12, [init_regs + 12 * 8]
    mov r13, [init_regs + 13 * 8]
    mov r14, [init_regs + 14 * 8]
    mov r15, [init_regs + 15 * 8]
    .globl insn_\name
insn_\name:
    \insn
1:
    mov [out_regs + 0 * 8], rax
    mov [out_regs + 1 * 8], rcx
    mov [out_regs + 2 * 8], rdx
    mov [out_regs + 3 * 8], rbx
    mov [out_regs + 4 * 8], rsp
    mov [out_regs + 5 * 8], rbp
    mov [out_regs + 6 * 8], rsi
    mov [out_regs + 7 * 8], rdi
    mov [out_regs + 8 * 8], r8
    mov [out_regs + 9 * 8], r9
    mov [out_regs + 10 * 8], r10
    mov [out_regs + 11 * 8], r11
    mov [out_regs + 12 * 8], r12
    mov [out_regs + 13 * 8], r13
    mov [out_regs + 14 * 8], r14
    mov [out_regs + 15 * 8], r15
    movdqu [out_regs + 18 * 8], xmm0
    movdqu [out_regs + 18 * 8 + 16], xmm1
    mov rsp, 0x2000f000
    pushfq
    pop rax
    mov [out_regs + 16 * 8], rax
    cld
    mov rsp, [saved + 48]
    mov rbx, [saved + 0]
    mov rbp, [saved + 8]
    mov r12, [saved + 16]
    mov r13, [saved + 24]
    mov r14, [saved + 32]
    mov r15, [saved + 40]
    ret
    .size case_\name, . - case_\name
.endm

    CASE push_rbp, "push rbp"
    CASE push_r12, "push r12"
    CASE push_rsp, "push rsp"
    CASE pop_rsp, "pop rsp"
    CASE pop_rbx, "pop rbx"
    CASE push_imm, "push -5"
    CASE push_riprel, "push qword ptr [rip + ripdata]"
    CASE nop, "nop"
    CASE nopl, ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00"
    CASE nop66, ".byte 0x66, 0x90"
    CASE endbr64, "endbr64"
    CASE mov_rbp_rsp, "mov rbp, rsp"
    CASE mov32, "mov eax, edi"
    CASE mov8_high, "mov al, bh"
    CASE lea_sib, "lea rax, [rbx + rcx * 4 + 0x10]"
    CASE lea_rip, "lea rdi, [rip + ripdata]"
    CASE jmp8, "jmp 1f; ud2"
    CASE jmp32, "jmp 1f; .fill 200, 1, 0x90"
    CASE jz_taken, "jz 1f; ud2"
    CASE jnz_not_taken, "jnz 2f; jmp 1f; 2: ud2"
    CASE call_rel32, "call 1f"
    CASE call_mem, "call qword ptr [rip + jmpptr]", "lea rax, [rip + 1f]; mov [jmpptr], rax"
    CASE jmp_mem, "jmp qword ptr [rip + jmpptr]", "lea rax, [rip + 1f]; mov [jmpptr], rax"
    CASE ret, "ret", "lea rax, [rip + 1f]; push rax"
    CASE ret_imm16, "ret 16", "sub rsp, 16; lea rax, [rip + 1f]; push rax"
    CASE pushf, "pushfq"
    CASE popf, "popfq", "push 0x8d5"
    CASE load_riprel, "mov rax, [rip + ripdata]"
    CASE store_riprel, "mov [rip + ripdata2], rbx"
    CASE vex_load_riprel, "vmovdqu xmm0, [rip + ripdata]"
    CASE vex_andn_riprel, "andn rax, rbx, [rip + ripdata]"
    CASE div, "div rbx"
    CASE cmpxchg16b, "cmpxchg16b [rsi]"
    CASE mulx, "mulx r8, r9, rdx"
    CASE sub_rsp, "sub rsp, 0x10"
    CASE rep_movsb, "rep movsb"
    CASE lock_xadd, "lock xadd [rdi], eax"
    CASE xchg, "xchg rax, r12"
    CASE cmovz, "cmovz rax, rbx"
    CASE adc, "adc rax, rbx"
    CASE bswap, "bswap r13"
    CASE imul3, "imul rax, rbx, 7"
    CASE xor32, "xor eax, eax"
    CASE movzx, "movzx ecx, byte ptr [rsi + 3]"
    CASE syscall_getuid, "syscall"
    CASE stosq, "stosq"
    CASE shld, "shld rax, rbx, 13"
    CASE loop_taken, "loop 1f; ud2"
    CASE loope_taken, "loope 1f; ud2"
    CASE loopne_not_taken, "loopne 2f; jmp 1f; 2: ud2"
    CASE loop_ecx, "addr32 loop 1f; ud2"
    CASE jrcxz_not_taken, "jrcxz 2f; jmp 1f; 2: ud2"
    .section .note.GNU-stack,"",@progbits
