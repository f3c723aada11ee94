/* A function with a switch table (the jump table decoded: the function tracer patches it), one
 * with a loop back into its first bytes (it cannot be patched), and a plain one, for the names
 * record gives of what it could not trace. */
#include <stdio.h>
#include <stdlib.h>

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

/* 3 bytes (xor eax, eax; ret), then the padding to the next function's 16-byte boundary */
__attribute__((noipa, aligned(16))) int zero(void) { return 0; }
__attribute__((noipa, aligned(16))) int one(void) { return 1; }

/* count_down(n) = n, through a loop whose head is 2 bytes into the function */
int count_down(long n);
__asm__(".globl count_down\n.type count_down, @function\ncount_down:\n"
        "  xorl %eax, %eax\n1: testq %rdi, %rdi\n  jz 2f\n  addl $1, %eax\n  subq $1, %rdi\n  jmp 1b\n2: ret\n"
        ".size count_down, .-count_down\n");

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 0, sum = 0;
    for (int i = 0; i < rounds; i++)
        sum += dispatch(i % 9) + zero() + one();
    printf("%d\n", sum + dispatch(argc) + plain(argc) + count_down(argc));
    return 0;
}
