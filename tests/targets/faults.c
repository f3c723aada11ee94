/* Hazard 9: faults inside probed instructions. An SA_SIGINFO handler prints si_addr and the rip
 * of the fault relative to the faulting label, then jumps out with siglongjmp. */
#define _GNU_SOURCE
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <ucontext.h>

static sigjmp_buf env;
extern char fault_div[], fault_load[], fault_ud2[];

static void handler(int sig, siginfo_t *si, void *ctx) {
    ucontext_t *uc = ctx;
    uintptr_t rip = (uintptr_t)uc->uc_mcontext.gregs[REG_RIP];
    const char *which = rip == (uintptr_t)fault_div ? "fault_div" : rip == (uintptr_t)fault_load ? "fault_load"
                      : rip == (uintptr_t)fault_ud2 ? "fault_ud2" : "elsewhere";
    long addr_off = (long)((uintptr_t)si->si_addr - rip);
    printf("sig=%d code=%d rip=%s si_addr=%s\n", sig, si->si_code, which,
           addr_off == 0 ? "rip" : (uintptr_t)si->si_addr == 0x10 ? "0x10" : "other");
    siglongjmp(env, 1);
}

__attribute__((noinline)) long divide(long a, long b) {
    long q;
    __asm__ volatile("mov %1, %%rax\n cqo\n .globl fault_div\n fault_div: idiv %2\n mov %%rax, %0"
                     : "=r"(q) : "r"(a), "r"(b) : "rax", "rdx");
    return q;
}

__attribute__((noinline)) long load(long *p) {
    long v;
    __asm__ volatile(".globl fault_load\n fault_load: mov (%1), %0" : "=r"(v) : "r"(p));
    return v;
}

__attribute__((noinline)) void undefined(void) { __asm__ volatile(".globl fault_ud2\n fault_ud2: ud2"); }

int main(void) {
    struct sigaction sa = {0};
    sa.sa_sigaction = handler;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigaction(SIGFPE, &sa, NULL);
    sigaction(SIGSEGV, &sa, NULL);
    sigaction(SIGILL, &sa, NULL);
    if (!sigsetjmp(env, 1)) divide(7, 0);
    if (!sigsetjmp(env, 1)) load((long *)0x10);
    if (!sigsetjmp(env, 1)) undefined();
    printf("divide=%ld\n", divide(42, 6));
    return 0;
}
