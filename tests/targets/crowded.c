/* crowded N: leaves no free address within 2 GiB of its own code (PROT_NONE reservations fill
 * every gap, as sanitizers' and runtimes' reservations can), says "ready", waits for a line on
 * stdin, then calls work() N times from 2 threads and prints the total. Every out-of-line slot,
 * detour or trampoline dynprobe wants near this code has to be refused or placed elsewhere. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#define REACH (2UL << 30)
#define PAGE 4096UL

static volatile long seed = 1;

/* Its first instruction a push (emulated at a trap; a post-handler steps it out of line). */
__attribute__((naked, noinline)) long work(long i) {
    __asm__("push %rbx\n mov %rdi, %rbx\n lea 1(%rbx), %rax\n pop %rbx\n add seed(%rip), %rax\n ret");
}

static void reserve(uintptr_t from, uintptr_t to) {
    if (to > from && mmap((void *)from, to - from, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0) == MAP_FAILED)
        fprintf(stderr, "crowded: cannot reserve %lx-%lx: %m\n", from, to);
}

/* Every gap of /proc/self/maps within REACH of `around`, reserved. */
static void fill_gaps(uintptr_t around) {
    uintptr_t low = (around - REACH + PAGE) & ~(PAGE - 1), high = (around + REACH) & ~(PAGE - 1);
    uintptr_t start, end, cursor = low;
    FILE *maps = fopen("/proc/self/maps", "r");
    char line[512];
    while (fgets(line, sizeof line, maps) && cursor < high) {
        if (sscanf(line, "%lx-%lx", &start, &end) != 2 || end <= cursor) continue;
        reserve(cursor, start < high ? start : high);
        cursor = end;
    }
    fclose(maps);
    reserve(cursor, high);
}

static void *loop(void *arg) {
    long n = (long)arg, sum = 0;
    for (long i = 0; i < n; i++) sum += work(i);
    return (void *)sum;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 10;
    fill_gaps((uintptr_t)work);
    setvbuf(stdout, NULL, _IONBF, 0);
    printf("ready\n");
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 1;
    pthread_t threads[2];
    long total = 0;
    for (int i = 0; i < 2; i++) pthread_create(&threads[i], NULL, loop, (void *)n);
    for (int i = 0; i < 2; i++) {
        void *sum;
        pthread_join(threads[i], &sum);
        total += (long)sum;
    }
    printf("total=%ld\n", total);
    return 0;
}
