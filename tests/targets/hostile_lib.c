/* A library whose owner is not to be trusted: an indirect function (its resolver picks
 * hostile_impl) and a constructor that appends the pid of every process that loads the library to
 * the file named by MARKER. dynprobe must never be one of them. */
#include <stdio.h>
#include <unistd.h>

__attribute__((constructor)) static void loaded(void) {
    FILE *f = fopen(MARKER, "a");
    if (f) { fprintf(f, "%d\n", getpid()); fclose(f); }
}

__attribute__((noinline)) long hostile_impl(long x) { return x + 1; }
static long (*resolve_hostile(void))(long) { return hostile_impl; }
long hostile_fn(long x) __attribute__((ifunc("resolve_hostile")));
