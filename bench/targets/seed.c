/* The benchmark of the uprobes push-emulation seed (004): N calls of an empty -O0 function,
 * printing the elapsed microseconds. 'boost' calls a function whose first instruction is a
 * RIP-relative load (run from an out-of-line slot) instead of 'push rbp' (emulated). A third
 * argument T: T threads make the N calls each, at once. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

volatile int global;

__attribute__((noinline)) void test(void) {}

__attribute__((noinline, naked)) void test_boost(void) {
    __asm__ volatile("mov global(%rip), %eax\n ret");
}

static long n;
static int boost;

static void *calls(void *unused) {
    if (boost)
        for (long i = 0; i < n; i++) test_boost();
    else
        for (long i = 0; i < n; i++) test();
    return unused;
}

int main(int argc, char **argv) {
    n = argc > 1 ? atol(argv[1]) : 1000000;
    boost = argc > 2 && !strcmp(argv[2], "boost");
    int threads = argc > 3 ? atoi(argv[3]) : 1;
    pthread_t th[64];
    struct timeval start, end;
    gettimeofday(&start, NULL);
    if (threads <= 1)
        calls(NULL);
    else {
        for (int i = 0; i < threads && i < 64; i++) pthread_create(&th[i], NULL, calls, NULL);
        for (int i = 0; i < threads && i < 64; i++) pthread_join(th[i], NULL);
    }
    gettimeofday(&end, NULL);
    printf("%ld\n", (end.tv_sec * 1000000 + end.tv_usec) - (start.tv_sec * 1000000 + start.tv_usec));
    return 0;
}
