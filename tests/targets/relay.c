/* relay N: a first thread calls work() until a second, started once the first has made N calls,
 * has made its own N calls; prints both counts. Under a probe whose handler serves each call,
 * the second thread's calls must be served while the first keeps asking. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

static atomic_long first_calls, second_done;
static volatile long seed = 1;

__attribute__((noinline)) long work(long i) { return i * 2 + seed; }

static void *first(void *arg) {
    long sum = 0;
    (void)arg;
    while (!atomic_load(&second_done)) sum += work(atomic_fetch_add(&first_calls, 1));
    return (void *)sum;
}

static void *second(void *arg) {
    long n = (long)arg, sum = 0;
    for (long i = 0; i < n; i++) sum += work(i);
    atomic_store(&second_done, 1);
    return (void *)sum;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000;
    pthread_t a, b;
    pthread_create(&a, NULL, first, NULL);
    while (atomic_load(&first_calls) < n) {
    }
    pthread_create(&b, NULL, second, (void *)n);
    pthread_join(b, NULL);
    pthread_join(a, NULL);
    printf("first>=%d second=%ld\n", atomic_load(&first_calls) >= n, n);
    return 0;
}
