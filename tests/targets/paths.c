/* 2^BITS distinct stacks to leaf(): path(n, bits) goes through left() or right() by each bit
 * of n (tests/integration/test_stacks.py: a table of stacks too small for them all). */
#include <stdlib.h>

volatile int sink;

__attribute__((noinline)) void leaf(void) { sink++; }
void path(unsigned n, int bits);
__attribute__((noinline)) void left(unsigned n, int bits) { path(n, bits); sink++; }
__attribute__((noinline)) void right(unsigned n, int bits) { path(n, bits); sink++; }

__attribute__((noinline)) void path(unsigned n, int bits) {
    if (bits == 0)
        leaf();
    else if (n & 1)
        right(n >> 1, bits - 1);
    else
        left(n >> 1, bits - 1);
    sink++;
}

int main(int argc, char **argv) {
    int bits = argc > 1 ? atoi(argv[1]) : 13;
    for (unsigned n = 0; n < 1u << bits; n++)
        path(n, bits);
    return 0;
}
