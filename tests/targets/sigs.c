/* Signals pass through unchanged: counts SIGUSR1 it sends itself around a probed call, then
 * ends as argv[1] says: 'exit N' or 'kill SIG'. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static volatile int usr1;
static void on_usr1(int sig) { (void)sig; usr1++; }
static volatile int sink;
__attribute__((noinline)) void probed(int x) { sink += x; }

int main(int argc, char **argv) {
    signal(SIGUSR1, on_usr1);
    for (int i = 0; i < 50; i++) { probed(i); kill(getpid(), SIGUSR1); }
    printf("usr1=%d\n", usr1);
    fflush(stdout);
    if (argc > 2 && !strcmp(argv[1], "kill")) { signal(atoi(argv[2]), SIG_DFL); raise(atoi(argv[2])); }
    return argc > 2 ? atoi(argv[2]) : 0;
}
