/* Two static functions of one name in two files (this one and dupnames_b.c), and a function
 * with two public names: what a pattern names, and how. */
static __attribute__((noinline)) int helper(int x) { return x * 3 + 1; }
int from_a(int x) { return helper(x); }
int plain(int x) { return x + 1; }
int plain_with_a_longer_alias(int x) __attribute__((alias("plain")));
