/* The benchmark of the uprobes push-emulation seed (004): N calls of an empty -O0 function,
 * printing the elapsed microseconds. 'boost' calls a function whose first instruction is a
 * RIP-relative load (run from an out-of-line slot) instead of 'push rbp' (emulated). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

volatile int global;

__attribute__((noinline)) void test(void) {}

__attribute__((noinline, naked)) void test_boost(void) {
    __asm__ volatile("mov global(%rip), %eax\n ret");
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    int boost = argc > 2 && !strcmp(argv[2], "boost");
    struct timeval start, end;
    gettimeofday(&start, NULL);
    if (boost)
        for (long i = 0; i < n; i++) test_boost();
    else
        for (long i = 0; i < n; i++) test();
    gettimeofday(&end, NULL);
    printf("%ld\n", (end.tv_sec * 1000000 + end.tv_usec) - (start.tv_sec * 1000000 + start.tv_usec));
    return 0;
}
