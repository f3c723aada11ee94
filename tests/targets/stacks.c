/* Stacks to walk (tests/integration/test_stacks.py): leaf() is reached through libc (a qsort
 * callback), from a thread's start routine, from a signal handler, and down a deep chain; built
 * at -O0 and -O2, with and without frame pointers. Each leaf() call's argument says which. */
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>

volatile int sink;

__attribute__((noinline)) void leaf(int why) { sink += why; }

static int compare(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    leaf(1);
    return (x > y) - (x < y);
}

__attribute__((noinline)) void sorter(void) {
    int values[2] = {2, 1};
    qsort(values, 2, sizeof values[0], compare);
    sink += values[0];
}

static void *worker(void *arg) {
    leaf(2);
    return arg;
}

static void on_signal(int sig) { leaf(3 + 0 * sig); }

__attribute__((noinline)) void deep(int n) {
    if (n == 0)
        leaf(4);
    else
        deep(n - 1);
    sink += n;  /* (no tail call) */
}

int main(void) {
    sorter();
    pthread_t thread;
    pthread_create(&thread, NULL, worker, NULL);
    pthread_join(thread, NULL);
    signal(SIGUSR1, on_signal);
    raise(SIGUSR1);
    deep(12);
    return 0;
}
