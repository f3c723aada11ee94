/* counter N T [push]: T threads each call work() (or pushy()) N times; prints the total. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

static long total;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static volatile long seed = 1;

/* -O1: a RIP-relative load (boosted), then lea and ret (emulated). */
__attribute__((noinline)) long work(long i) { return i * 2 + seed; }

/* Its first instruction a push: emulated (a stack write) or, on a site that stays a trap, run
 * from a slot. */
__attribute__((naked, noinline)) long pushy(long i) {
    __asm__("push %rbx\n mov %rdi, %rbx\n lea 1(%rbx), %rax\n pop %rbx\n ret");
}

static int use_push;

static void *loop(void *arg) {
    long n = (long)arg, sum = 0;
    for (long i = 0; i < n; i++) sum += use_push ? pushy(i) : work(i);
    pthread_mutex_lock(&lock);
    total += sum;
    pthread_mutex_unlock(&lock);
    return NULL;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 10;
    int t = argc > 2 ? atoi(argv[2]) : 1;
    use_push = argc > 3;
    pthread_t th[64];
    for (int i = 0; i < t; i++) pthread_create(&th[i], NULL, loop, (void *)n);
    for (int i = 0; i < t; i++) pthread_join(th[i], NULL);
    printf("total=%ld\n", total);
    return 0;
}
