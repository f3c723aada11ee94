/* A process that exits while a thread it just created is stopped for the tracer (its first
 * stop, when the tracer gives it a thread area through a remote syscall). */
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

static void *idle(void *arg) {
    (void)arg;
    for (;;) pause();
    return NULL;
}

__attribute__((noinline)) int probed(int x) { return x * 3 + 1; }

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 10, s = 0;
    for (int i = 0; i < n; i++) s += probed(i);
    pthread_t t;
    for (int i = 0; i < 4; i++) pthread_create(&t, NULL, idle, NULL);
    exit(s & 1);
}
