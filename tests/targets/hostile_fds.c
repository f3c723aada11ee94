/* A hostile target for the shared-memory race: two threads watch for dynprobe's memfd to be
 * mapped, then put a descriptor of the file argv[1] (opened O_PATH: no right to read or write it
 * is needed) in place of the memfd's, before dynprobe takes it, so that dynprobe would open and
 * map the file instead. Meanwhile it starts a thread a millisecond,
 * each calling work() every millisecond for 50 ms, until SIGTERM: new threads need new pools
 * of thread areas, which dynprobe maps while the other threads run. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int victim;
static volatile int stop;
static volatile long calls;

__attribute__((noinline)) void work(void) { __atomic_fetch_add(&calls, 1, __ATOMIC_RELAXED); }

/* The inode of a memfd mapped in this process (dynprobe's), 0 if none. */
static unsigned long mapped_memfd(void) {
    char line[512];
    unsigned long inode = 0;
    FILE *maps = fopen("/proc/self/maps", "r");
    if (!maps) return 0;
    while (!inode && fgets(line, sizeof line, maps))
        if (strstr(line, "/memfd:")) sscanf(line, "%*s %*s %*s %*s %lu", &inode);
    fclose(maps);
    return inode;
}

static void *swap(void *arg) {
    (void)arg;
    struct stat other;
    while (!stop) {
        unsigned long inode = mapped_memfd();  /* mapped: dynprobe is about to take it */
        for (int fd = 3; inode && fd <= 64; fd++)
            if (fd != victim && fstat(fd, &other) == 0 && other.st_ino == inode) dup2(victim, fd);
    }
    return NULL;
}

static void *worker(void *arg) {
    (void)arg;
    for (int i = 0; i < 50 && !stop; i++) { work(); usleep(1000); }
    return NULL;
}

static void on_term(int sig) { (void)sig; stop = 1; }

int main(int argc, char **argv) {
    victim = open(argc > 1 ? argv[1] : "/etc/shadow", O_PATH | O_CLOEXEC);
    if (victim < 0) { perror("open"); return 2; }
    signal(SIGTERM, on_term);
    pthread_t swappers[2];
    for (int i = 0; i < 2; i++) pthread_create(&swappers[i], NULL, swap, NULL);
    printf("ready\n");
    fflush(stdout);
    pthread_attr_t small;
    pthread_attr_init(&small);
    pthread_attr_setstacksize(&small, 64 << 10);
    while (!stop) {
        pthread_t t;
        if (pthread_create(&t, &small, worker, NULL) == 0) pthread_detach(t);
        usleep(1000);
    }
    for (int i = 0; i < 2; i++) pthread_join(swappers[i], NULL);
    printf("calls=%ld\n", calls);
    return 0;
}
