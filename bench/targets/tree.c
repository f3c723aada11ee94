/* A call tree as a parser makes one: N statements, each lexing and evaluating an expression
 * 0-3 levels deep (~11 calls, ~23 trace events a statement). Prints elapsed us. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>

__attribute__((noinline)) int lex(int c) { return c + 1; }

__attribute__((noinline)) int term(int x) { return lex(x) * 2; }

__attribute__((noinline)) int expr(int depth, int x) {
    if (depth == 0)
        return term(x);
    return expr(depth - 1, x) + term(x);
}

__attribute__((noinline)) int statement(int i) {
    int s = lex(i);
    s += expr(i % 4, s);
    return s + lex(s);
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 100000, s = 0;
    struct timeval start, end;
    gettimeofday(&start, NULL);
    for (long i = 0; i < n; i++)
        s += statement((int)i);
    gettimeofday(&end, NULL);
    printf("%ld\n", (end.tv_sec - start.tv_sec) * 1000000 + end.tv_usec - start.tv_usec + (s == 42));
    return 0;
}
