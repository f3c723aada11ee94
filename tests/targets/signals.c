/* Hazards 10/11: a SIGALRM storm over a probed loop (exact counts), a target that single-steps
 * itself through probed code (its trap count), and the target's own int3 (its handler runs once). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

static volatile long alarms, traps, own_traps;

__attribute__((noinline)) long step_me(long x) {
    x = x * 3 + 1;
    x ^= x >> 3;
    return x + 7;
}

static void on_alarm(int sig) { (void)sig; alarms++; }

static void on_trap(int sig, siginfo_t *si, void *ctx) {
    (void)sig; (void)ctx;
    if (si->si_code == 0x80 || si->si_code == 1) own_traps++;  /* SI_KERNEL (int3) or TRAP_BRKPT */
    else traps++;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "storm";
    long n = argc > 2 ? atol(argv[2]) : 1000, sum = 0;
    if (!strcmp(mode, "storm")) {
        signal(SIGALRM, on_alarm);
        struct itimerval it = {{0, 200}, {0, 200}};
        setitimer(ITIMER_REAL, &it, NULL);
        for (long i = 0; i < n; i++) sum += step_me(i);
        struct itimerval off = {{0, 0}, {0, 0}};
        setitimer(ITIMER_REAL, &off, NULL);
        printf("calls=%ld sum=%ld alarms>0=%d\n", n, sum, alarms > 0);
    } else if (!strcmp(mode, "selfstep")) {
        struct sigaction sa = {0};
        sa.sa_sigaction = on_trap;
        sa.sa_flags = SA_SIGINFO;
        sigaction(SIGTRAP, &sa, NULL);
        /* Set TF, call step_me, clear TF: every instruction in between traps once. */
        __asm__ volatile("pushf\n orq $0x100, (%%rsp)\n popf" ::: "memory", "cc");
        sum = step_me(5);
        __asm__ volatile("pushf\n andq $~0x100, (%%rsp)\n popf" ::: "memory", "cc");
        printf("sum=%ld traps=%ld\n", sum, traps);
    } else {
        struct sigaction sa = {0};
        sa.sa_sigaction = on_trap;
        sa.sa_flags = SA_SIGINFO;
        sigaction(SIGTRAP, &sa, NULL);
        __asm__ volatile("int3");
        sum = step_me(1);
        printf("own_traps=%ld sum=%ld\n", own_traps, sum);
    }
    return 0;
}
