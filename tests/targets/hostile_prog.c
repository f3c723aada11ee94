/* Calls hostile_fn (an indirect function of libhostile) every 100 us until SIGTERM. */
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

long hostile_fn(long x);
static volatile int stop;
static void on_term(int sig) { (void)sig; stop = 1; }

int main(void) {
    signal(SIGTERM, on_term);
    long sum = 0;
    printf("ready\n");
    fflush(stdout);
    for (long i = 0; !stop; i++) { sum += hostile_fn(i); usleep(100); }
    printf("sum=%ld\n", sum > 0);
    return 0;
}
