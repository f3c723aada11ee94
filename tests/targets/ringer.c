/* ringer N: a hostile target. It says "ready", then calls work() N times a millisecond apart,
 * while a thread rings every one-page memfd mapping named dynprobe (an upcall doorbell) as fast
 * as it can, without asking (it says "ringing" once it found one); prints the total. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static volatile int done;

__attribute__((noinline)) long work(long i) { return i * 2 + 1; }

static void *ring(void *arg) {
    (void)arg;
    int told = 0;
    while (!done) {
        FILE *maps = fopen("/proc/self/maps", "r");
        char line[512];
        while (maps && fgets(line, sizeof line, maps)) {
            unsigned long low, high;
            if (sscanf(line, "%lx-%lx", &low, &high) != 2 || high - low != 4096 || !strstr(line, "memfd:dynprobe"))
                continue;
            if (!told) {
                printf("ringing\n");
                fflush(stdout);
                told = 1;
            }
            while (!done)
                __atomic_fetch_add((unsigned *)low, 1, __ATOMIC_SEQ_CST);
        }
        if (maps)
            fclose(maps);
    }
    return NULL;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000, total = 0;
    pthread_t ringer;
    pthread_create(&ringer, NULL, ring, NULL);
    printf("ready\n");
    fflush(stdout);
    for (long i = 0; i < n; i++) {
        total += work(i);
        usleep(1000);
    }
    done = 1;
    pthread_join(ringer, NULL);
    printf("total=%ld\n", total);
    return 0;
}
