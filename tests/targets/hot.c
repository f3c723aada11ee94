/* A hot target for killed-tracer tests: T threads call work() (which calls leaf()) until a time
 * limit, each some 25,000 times a second (a short spin between calls), and mempcpy and memcpy
 * (glibc's mempcpy jumps into memcpy's first bytes). At the end it checks what every call
 * returned and prints "ok CALLS" (exit 0) or what went wrong (exit 1). */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double limit;
static volatile int sink;
/* (through pointers: calls the compiler cannot turn into its own copies) */
static void *(*volatile copy)(void *, const void *, size_t) = memcpy;
static void *(*volatile copy_to_end)(void *, const void *, size_t) = mempcpy;

__attribute__((noinline)) long leaf(long i) { return i * 3 + 1; }
__attribute__((noinline)) long work(long i) {
    long r = leaf(i) + 1;
    __asm__ volatile("" ::: "memory");
    return r;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void *loop(void *arg) {
    long calls = 0, wrong = 0;
    char from[64] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_", to[64];
    double end = now() + limit;
    while (now() < end) {
        for (long i = 0; i < 16; i++, calls++) {
            if (work(calls) != calls * 3 + 2) wrong++;
            size_t len = 1 + (size_t)(calls % 60);
            if (copy_to_end(to, from + 1, len) != to + len || to[len - 1] != from[len]) wrong++;
            copy(to, from, len);
            if (to[len - 1] != from[len - 1]) wrong++;
            for (int spin = 0; spin < 800; spin++) sink += spin;
        }
    }
    ((long *)arg)[0] = calls;
    ((long *)arg)[1] = wrong;
    return NULL;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 4;
    limit = argc > 2 ? atof(argv[2]) : 2.0;
    pthread_t th[64];
    long results[64][2];
    printf("ready\n");
    fflush(stdout);
    for (int i = 0; i < threads; i++) pthread_create(&th[i], NULL, loop, results[i]);
    long calls = 0, wrong = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(th[i], NULL);
        calls += results[i][0];
        wrong += results[i][1];
    }
    if (wrong) {
        printf("wrong %ld of %ld\n", wrong, calls);
        return 1;
    }
    printf("ok %ld\n", calls);
    return 0;
}
