/* pushes N T: T threads each call pushy() N times; prints the total. pushy's first instruction is
 * a push: emulated (a stack write) or, on a site that stays a trap, run from a slot. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

__attribute__((naked, noinline)) long pushy(long i) {
    __asm__("push %rbx\n mov %rdi, %rbx\n lea 1(%rbx), %rax\n pop %rbx\n ret");
}

static long total;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void *loop(void *arg) {
    long n = (long)arg, sum = 0;
    for (long i = 0; i < n; i++) sum += pushy(i);
    pthread_mutex_lock(&lock);
    total += sum;
    pthread_mutex_unlock(&lock);
    return NULL;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 10;
    int t = argc > 2 ? atoi(argv[2]) : 1;
    pthread_t th[64];
    for (int i = 0; i < t; i++) pthread_create(&th[i], NULL, loop, (void *)n);
    for (int i = 0; i < t; i++) pthread_join(th[i], NULL);
    printf("total=%ld\n", total);
    return 0;
}
