#include <stdio.h>
static int ready;
__attribute__((constructor, noinline)) void init_early(void) { ready = 1; }
int main(void) { if (ready) puts("ctor ran"); return 0; }
