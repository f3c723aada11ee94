/* memcpy and mempcpy, N calls each (tests/integration/test_optimized.py): glibc's mempcpy sets
 * its return value, then jumps into memcpy's first bytes, where an optimized probe's jump goes.
 * Prints a checksum of every copy. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000;
    char from[256], to[256];
    for (int i = 0; i < 256; i++)
        from[i] = (char)(i * 7 + 1);
    unsigned long sum = 0;
    for (long i = 0; i < n; i++) {
        size_t len = 1 + (size_t)(i % 200);
        char *end = mempcpy(to, from + i % 32, len);
        sum = sum * 31 + (unsigned long)(end - to) + (unsigned char)to[len - 1];
        memcpy(to, from + i % 16, len);
        sum = sum * 31 + (unsigned char)to[len / 2];
    }
    printf("%lu\n", sum);
    return 0;
}
