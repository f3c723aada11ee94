/* A function with a switch table (an indirect jump: the function tracer cannot patch it) and
 * one it can, for the names record gives of what it could not trace. */
#include <stdio.h>

__attribute__((noinline)) int dispatch(int x) {
    switch (x) {
    case 0: return 3;
    case 1: return 7;
    case 2: return 11;
    case 3: return 13;
    case 4: return 17;
    case 5: return 19;
    case 6: return 23;
    default: return 0;
    }
}

__attribute__((noinline)) int plain(int x) {
    __asm__ volatile("" ::: "memory");
    return x * 2 + 1;
}

int main(int argc, char **argv) {
    (void)argv;
    printf("%d\n", dispatch(argc) + plain(argc));
    return 0;
}
