/* Negative and positive int arguments and return values, for the handlers' typed views. */
#include <stdio.h>

__attribute__((noinline)) int negate(int x) {
    __asm__ volatile("" ::: "memory");
    return -x;
}

int main(void) {
    printf("%d %d\n", negate(5), negate(-7));
    return 0;
}
