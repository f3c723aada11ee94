/* The main thread calls pthread_exit while another thread goes on calling a probed function, then
 * exits the process with status 5. With "held": the other thread first waits for its stdin to
 * close (the leader stays a zombie meanwhile). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static volatile int sink;
static int held;
__attribute__((noinline)) void probed(int x) { sink += x; }

static void *worker(void *arg) {
    (void)arg;
    char c;
    if (held)
        while (read(0, &c, 1) > 0) {
        }
    else
        usleep(100000); /* the leader is gone by now */
    for (int i = 0; i < 100; i++) probed(i);
    exit(5);
}

int main(int argc, char **argv) {
    held = argc > 1 && !strcmp(argv[1], "held");
    pthread_t t;
    pthread_create(&t, NULL, worker, NULL);
    pthread_exit(NULL);
}
