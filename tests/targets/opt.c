/* Target for optimized probes: threads hammering a probed function, odd function shapes, fetches
 * that fault, a target that uses GS itself, one that scribbles over its thread area. */
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

long jump_into(long n);
long one_ret(void);
long call_first(long x);
long redzone_leaf(long a, long b);
long endbr_func(long x);

__attribute__((noinline)) long hammer(long x) {
    __asm__ volatile("" ::: "memory");
    return x * 2 + 1;
}

__attribute__((noinline)) long takes(long n, const char *s) {
    __asm__ volatile("" ::: "memory");
    return n + (s != 0);
}

static volatile long last_event;
__attribute__((noinline)) void event(long i) { last_event = i; }

static long per_thread;
static volatile int stop_flag;

static void *worker(void *arg) {
    long sum = 0;
    for (long i = 0; i < per_thread; i++) {
        long r = hammer(i);
        if (r != i * 2 + 1) {
            fprintf(stderr, "wrong result %ld for %ld\n", r, i);
            exit(3);
        }
        sum += r;
    }
    return (void *)sum;
}

static void *forever(void *arg) {
    long i = 0;
    for (; !stop_flag; i++)
        if (hammer(i) != i * 2 + 1) {
            fprintf(stderr, "wrong result for %ld\n", i);
            exit(3);
        }
    return (void *)i;
}

static void on_segv(int sig) {
    fprintf(stderr, "the target got signal %d\n", sig);
    _exit(4);
}

static void *allocs(void *arg) {
    struct timespec ts;
    for (long i = 0; i < per_thread; i++) {
        void *volatile p = malloc(16 + i % 64); /* volatile: the pair cannot be optimized away */
        free(p);
        clock_gettime(CLOCK_MONOTONIC, &ts);
    }
    return NULL;
}

static void run_threads(int n, void *(*fn)(void *)) {
    pthread_t t[64];
    for (int i = 0; i < n; i++) pthread_create(&t[i], NULL, fn, NULL);
    for (int i = 0; i < n; i++) pthread_join(t[i], NULL);
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "threads";
    long a = argc > 2 ? atol(argv[2]) : 1;
    long b = argc > 3 ? atol(argv[3]) : 1000;
    signal(SIGSEGV, on_segv);
    signal(SIGBUS, on_segv);
    if (!strcmp(mode, "threads")) { /* a threads x b calls of hammer */
        per_thread = b;
        run_threads((int)a, worker);
        printf("done %ld\n", a * b);
    } else if (!strcmp(mode, "forever")) { /* a threads call hammer until stdin closes */
        pthread_t t[64];
        for (int i = 0; i < a; i++) pthread_create(&t[i], NULL, forever, NULL);
        printf("ready\n");
        fflush(stdout);
        char c;
        while (read(0, &c, 1) > 0) {}
        stop_flag = 1;
        long calls = 0;
        for (int i = 0; i < a; i++) {
            void *n;
            pthread_join(t[i], &n);
            calls += (long)n;
        }
        printf("done %ld\n", calls);
    } else if (!strcmp(mode, "shapes")) { /* b rounds of every odd-shaped function */
        long (*via_pointer)(long) = endbr_func;
        for (long i = 0; i < b; i++) {
            if (jump_into(i % 7) != i % 7 || call_first(i) != 2 * (i + 1) || redzone_leaf(i, 5) != i + 5 ||
                via_pointer(i) != 3 * i || one_ret() != one_ret()) {
                fprintf(stderr, "wrong result in round %ld\n", i);
                return 3;
            }
        }
        printf("shapes ok %ld\n", b);
    } else if (!strcmp(mode, "strings")) { /* fetches that fault or run into unmapped memory */
        char *page = mmap(NULL, 8192, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        munmap(page + 4096, 4096);
        memset(page, 'q', 4096); /* no NUL before the unmapped page */
        char *big = malloc(5000);
        memset(big, 'x', 4999);
        big[4999] = 0;
        takes(1, "hello");
        takes(2, NULL);
        takes(3, page + 4096 - 10);
        takes(4, big);
        takes(5, (char *)16);
        printf("strings ok\n");
    } else if (!strcmp(mode, "events")) { /* b calls of event, as fast as possible */
        for (long i = 0; i < b; i++) event(i);
        printf("events %ld\n", b);
    } else if (!strcmp(mode, "gs")) { /* the target owns its GS base */
        static long mine[16];
        if (syscall(SYS_arch_prctl, ARCH_SET_GS, mine) != 0) return 5;
        per_thread = b;
        worker(NULL);
        unsigned long now;
        syscall(SYS_arch_prctl, ARCH_GET_GS, &now);
        printf("gs %s\n", now == (unsigned long)mine ? "kept" : "changed");
    } else if (!strcmp(mode, "malloc")) { /* a threads x b malloc/free + clock_gettime */
        per_thread = b;
        run_threads((int)a, allocs);
        printf("malloc ok\n");
    } else if (!strcmp(mode, "scribble")) { /* an untrusted target writes over its thread area */
        event(0);
        unsigned long area = 0;
        syscall(SYS_arch_prctl, ARCH_GET_GS, &area);
        if (area) /* the header: magic, tid, head, tail, ... all different */
            for (int i = 0; i < 512; i++) ((unsigned long *)area)[i] = 0x0123456789ULL * (512 - i);
        for (long i = 0; i < b; i++) event(i);
        printf("scribbled %s\n", area ? "yes" : "no");
    }
    return 0;
}
