/* One thread hits a probe whose handler holds the tracer; meanwhile another thread execs
 * /bin/true: the exec stop waits while an optimization the handler queued comes due. The
 * probe is hit once the other thread runs: its birth stop, were it still waiting for the
 * tracer, would wait for the handler, and the handler for its exec. */
#include <pthread.h>
#include <unistd.h>

__attribute__((noinline)) void hit(void) { __asm__ volatile(""); }
__attribute__((noinline)) void other(void) { __asm__ volatile(""); }

static volatile int running;

static void *execer(void *arg) {
    (void)arg;
    running = 1;
    usleep(100000);
    execl("/bin/true", "true", (char *)0);
    return 0;
}

int main(void) {
    pthread_t t;
    pthread_create(&t, 0, execer, 0);
    while (!running) usleep(100);
    hit();
    other();
    pthread_join(t, 0);
    return 1;
}
