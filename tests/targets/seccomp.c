/* A sandboxed program: after its seccomp filter is in place, mmap and memfd_create kill it (as in
 * a service with SystemCallFilter=). Prints "ready", then calls work() every millisecond for the
 * given number of seconds (or until SIGUSR1: "usr1") and prints the sum. */
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

__attribute__((noinline)) long work(long i) {
    volatile long x = i;
    for (int k = 0; k < 3; k++) x += k;
    return x;
}

static volatile sig_atomic_t stop;
static void on_usr1(int sig) { (void)sig; stop = 1; }

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 1.0;
    if (argc > 1 && !strcmp(argv[1], "usr1")) {
        seconds = 1e9;
        signal(SIGUSR1, on_usr1);
    }
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_memfd_create, 2, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_mmap, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
    };
    struct sock_fprog prog = {.len = sizeof(f) / sizeof(f[0]), .filter = f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) {
        perror("seccomp");
        return 2;
    }
    printf("ready\n");
    fflush(stdout);
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    long sum = 0, calls = 0;
    do {
        sum += work(calls++);
        usleep(1000);
        clock_gettime(CLOCK_MONOTONIC, &now);
    } while (!stop && now.tv_sec - start.tv_sec + (now.tv_nsec - start.tv_nsec) / 1e9 < seconds);
    printf("calls=%ld sum=%ld\n", calls, sum - calls * 3 - calls * (calls - 1) / 2);
    return 0;
}
