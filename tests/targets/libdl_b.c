int filler[64];
__attribute__((noinline)) int other_func(int x) { return x - 1; }
__attribute__((noinline)) int lib_func(int x) { return other_func(x) + 1000; }
