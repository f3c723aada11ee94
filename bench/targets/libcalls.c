/* N calls of libc's memcpy (16 bytes) or of malloc and free (16 bytes), through pointers the
 * compiler cannot see through; prints the elapsed microseconds. glibc's memcpy is where mempcpy
 * jumps into: its probe takes that branch along (make bench compares its cost with malloc's). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

static void *(*volatile copy)(void *, const void *, size_t) = memcpy;
static void *(*volatile get)(size_t) = malloc;
static void (*volatile put)(void *) = free;

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    int copies = argc < 3 || strcmp(argv[2], "malloc") != 0;
    char from[64] = {1}, to[64];
    struct timeval t0, t1;
    gettimeofday(&t0, NULL);
    if (copies)
        for (long i = 0; i < n; i++) copy(to, from, 16);
    else
        for (long i = 0; i < n; i++) put(get(16));
    gettimeofday(&t1, NULL);
    printf("%ld\n", (t1.tv_sec - t0.tv_sec) * 1000000L + (t1.tv_usec - t0.tv_usec));
    return copies && to[0] != 1;
}
