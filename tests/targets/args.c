/* Functions with arguments and return values of every kind uftrace's -A/-R show: integers of
 * each size and sign, strings (short, long, with escapes), characters, floats and doubles,
 * arguments past the sixth (on the stack), nested calls, recursion; and library calls whose
 * values do not change between runs (for -a). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KEEP __attribute__((noipa)) /* called as written: no call folded, hoisted or inlined */

KEEP int add(int a, int b) { return a + b; }
KEEP long neg(long x) { return -x; }
KEEP unsigned long triple(unsigned long x) { return x * 3; }
KEEP const char *echo(const char *s) { return s; }
KEEP int given(const char *s) { return s != 0; }
KEEP char next_letter(char c) { return (char)(c + 1); }
KEEP double half(double x) { return x / 2; }
KEEP float scale(float x, double by) { return (float)(x * by); }
KEEP long eight(long a, long b, long c, long d, long e, long f, long g, long h) {
    return a + b + c + d + e + f + g + h;
}
KEEP int inner(int x) { return x + 1; }
KEEP int outer(int x) { return inner(x) * 2; }
KEEP int fact(int n) { return n <= 1 ? 1 : n * fact(n - 1); }

int main(int argc, char **argv) {
    char long_text[200];
    memset(long_text, 'x', sizeof long_text - 1);
    long_text[sizeof long_text - 1] = 0;
    int rounds = argc > 1 ? atoi(argv[1]) : 1;
    long total = 0;
    for (int i = 0; i < rounds; i++) {
        total += add(1, 2) + add(-5, 3);
        total += neg(5) + neg(-123456789);
        total += (long)triple(7) + (long)triple(~0UL);
        total += (long)strlen(echo("hello world")) + (long)strlen(echo(long_text));
        total += (long)strlen(echo("tab\there, quote\" and newline\n"));
        total += given(0) + given((const char *)16);  /* NULL, and memory that is not mapped */
        total += next_letter('a');
        total += (long)half(3.0) + (long)scale(1.5f, 2.25);
        total += eight(1, 2, 3, 4, 5, 6, 7, 8);
        total += outer(3) + fact(4);
    }
    printf("total %ld %d %zu\n", total, strcmp("abc", "abd") < 0, strlen("four"));
    puts("done");
    return 0;
}
