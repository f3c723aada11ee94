/* One thread hits a probe whose handler holds the tracer; meanwhile another thread execs
 * /bin/true: the exec stop waits while an optimization the handler queued comes due. */
#include <pthread.h>
#include <unistd.h>

__attribute__((noinline)) void hit(void) { __asm__ volatile(""); }
__attribute__((noinline)) void other(void) { __asm__ volatile(""); }

static void *execer(void *arg) {
    (void)arg;
    usleep(100000);
    execl("/bin/true", "true", (char *)0);
    return 0;
}

int main(void) {
    pthread_t t;
    pthread_create(&t, 0, execer, 0);
    hit();
    other();
    pthread_join(t, 0);
    return 1;
}
