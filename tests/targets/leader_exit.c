/* The main thread calls pthread_exit while another thread goes on calling a probed function, then
 * exits the process with status 5. */
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

static volatile int sink;
__attribute__((noinline)) void probed(int x) { sink += x; }

static void *worker(void *arg) {
    (void)arg;
    usleep(100000);  /* the leader is gone by now */
    for (int i = 0; i < 100; i++) probed(i);
    exit(5);
}

int main(void) {
    pthread_t t;
    pthread_create(&t, NULL, worker, NULL);
    pthread_exit(NULL);
}
