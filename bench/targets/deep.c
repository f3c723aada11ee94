/* Recursion DEPTH deep, REPS times, ending in leaf(): the cost of a traced call at depth, and
 * (built -O2 without frame pointers) a stack of DEPTH + 6 frames to count by (leaf, rec
 * DEPTH + 1 times, main, libc's two, _start). Prints elapsed us. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>

volatile long sink;

__attribute__((noinline)) void leaf(void) { sink++; }

__attribute__((noinline)) long rec(long d) {
    if (d == 0) {
        leaf();
        return 0;
    }
    long r = rec(d - 1) + 1;
    __asm__ volatile("" ::: "memory"); /* no tail call */
    return r;
}

int main(int argc, char **argv) {
    long depth = atol(argv[1]), reps = atol(argv[2]), s = 0;
    struct timeval start, end;
    gettimeofday(&start, NULL);
    for (long i = 0; i < reps; i++)
        s += rec(depth);
    gettimeofday(&end, NULL);
    printf("%ld\n", (end.tv_sec - start.tv_sec) * 1000000 + end.tv_usec - start.tv_usec + (s < 0));
    return 0;
}
