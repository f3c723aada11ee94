/* Event producer for the consumer's drain rate: N calls of event(i), paced at RATE per second
 * (0: as fast as possible); prints the elapsed microseconds. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static volatile long last;
__attribute__((noinline)) void event(long i, long t) { last = i + t; }

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    long rate = argc > 2 ? atol(argv[2]) : 0;
    long start = now_ns();
    for (long i = 0; i < n; i++) {
        if (rate && (i & 1023) == 0)
            while ((now_ns() - start) * rate < i * 1000000000L) {}
        event(i, start);
    }
    printf("%ld\n", (now_ns() - start) / 1000);
    return 0;
}
