/* Calls on known CPUs, for the CPU number of records: work(cpu) runs pinned to `cpu`, from the
 * main thread, from a pthread, and from a thread made by clone() whose thread pointer is not
 * glibc's (its rseq area would be at an unmapped address). Waits 300 ms first: the probes are
 * optimized by then. Prints "done". */
#define _GNU_SOURCE
#include <sched.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#define CALLS 50

extern ptrdiff_t __rseq_offset;
volatile int sink;
static volatile int raw_done;

__attribute__((noinline)) void work(long cpu) { sink += (int)cpu; }

/* Raw system calls only: errno is thread-local, and the raw thread has no glibc thread block. */
static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    syscall(SYS_sched_setaffinity, 0, sizeof set, &set);
}

static void on_each_cpu(void) {
    for (int cpu = 0; cpu < 2; cpu++) {
        pin(cpu);
        for (int i = 0; i < CALLS; i++) work(cpu);
    }
}

static void *thread_main(void *arg) {
    (void)arg;
    on_each_cpu();
    return NULL;
}

static int raw_main(void *arg) {
    (void)arg;
    on_each_cpu();
    raw_done = 1;
    return 0;
}

int main(void) {
    usleep(300000);
    on_each_cpu();
    pthread_t t;
    pthread_create(&t, NULL, thread_main, NULL);
    pthread_join(t, NULL);
    static char stack[1 << 16] __attribute__((aligned(16)));
    char *tls = (char *)0x8000 - __rseq_offset;  /* its rseq area: below mmap_min_addr */
    int flags = CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD | CLONE_SYSVSEM | CLONE_SETTLS;
    if (clone(raw_main, stack + sizeof stack, flags, NULL, NULL, tls, NULL) < 0) {
        perror("clone");
        return 1;
    }
    while (!raw_done) sched_yield();
    usleep(10000);  /* its exit */
    puts("done");
    return 0;
}
