/* What a time stamp costs on this machine: N rdtscp, N rdtsc (ns each), the floor of any record. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 10000000;
    long t0 = now_ns();
    for (long i = 0; i < n; i++) __asm__ volatile("rdtscp" ::: "rax", "rdx", "rcx");
    long t1 = now_ns();
    for (long i = 0; i < n; i++) __asm__ volatile("rdtsc" ::: "rax", "rdx");
    long t2 = now_ns();
    printf("%.2f %.2f\n", (double)(t1 - t0) / n, (double)(t2 - t1) / n);
    return 0;
}
