/* A long-running target for attach/detach: T threads call tick() until SIGTERM or a time limit;
 * with 'churn' it also keeps creating short-lived threads. Prints the number of ticks at the end. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static volatile int stop;
static volatile long ticks;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

__attribute__((noinline)) void tick(void) {
    pthread_mutex_lock(&lock);
    ticks++;
    pthread_mutex_unlock(&lock);
}

static void *loop(void *arg) {
    (void)arg;
    while (!stop) { tick(); usleep(1000); }
    return NULL;
}

static void *brief(void *arg) { (void)arg; tick(); return NULL; }

static void on_term(int sig) { (void)sig; stop = 1; }

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    int churn = argc > 2 && !strcmp(argv[2], "churn");
    double limit = argc > 3 ? atof(argv[3]) : 30.0;
    signal(SIGTERM, on_term);
    pthread_t th[32];
    for (int i = 0; i < threads; i++) pthread_create(&th[i], NULL, loop, NULL);
    printf("ready\n");
    fflush(stdout);
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    while (!stop) {
        if (churn) { pthread_t t; pthread_create(&t, NULL, brief, NULL); pthread_join(t, NULL); }
        else usleep(1000);
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (now.tv_sec - start.tv_sec + (now.tv_nsec - start.tv_nsec) / 1e9 > limit) stop = 1;
    }
    for (int i = 0; i < threads; i++) pthread_join(th[i], NULL);
    printf("ticks=%ld\n", ticks);
    return 0;
}
