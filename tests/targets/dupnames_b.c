static __attribute__((noinline)) int helper(int x) { return x * 5 + 2; }
int from_b(int x) { return helper(x); }
