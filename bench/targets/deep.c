/* Recursion DEPTH deep, REPS times: the cost of a traced call at depth. Prints elapsed us. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>

__attribute__((noinline)) long rec(long d) {
    if (d == 0)
        return 0;
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
