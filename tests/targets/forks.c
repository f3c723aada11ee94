/* Hazard 19: fork, vfork+exec, a vfork child that runs probed code, fork in a threaded program,
 * exec of a probed binary. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile int sink;
__attribute__((noinline)) int probed(int x) { sink += x; return x + 1; }

static void *spin(void *arg) { (void)arg; for (int i = 0; i < 100; i++) probed(i); return NULL; }

static int wait_child(pid_t pid) {
    int status;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "fork";
    probed(0);
    if (!strcmp(mode, "fork")) {
        pid_t pid = fork();
        if (pid == 0) { int s = 0; for (int i = 0; i < 5; i++) s += probed(i); _exit(s == 15 ? 0 : 1); }
        printf("child=%d\n", wait_child(pid));
    } else if (!strcmp(mode, "vfork")) {
        pid_t pid = vfork();
        if (pid == 0) { execl(argv[0], argv[0], "leaf", (char *)NULL); _exit(127); }
        printf("child=%d\n", wait_child(pid));
    } else if (!strcmp(mode, "vfork-call")) {  /* a vfork child that runs probed code, then leaves */
        pid_t pid = vfork();
        if (pid == 0) { probed(3); _exit(0); }
        printf("child=%d\n", wait_child(pid));
    } else if (!strcmp(mode, "threads")) {
        pthread_t th[4];
        for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, spin, NULL);
        pid_t pid = fork();
        if (pid == 0) { probed(1); _exit(probed(2) == 3 ? 0 : 1); }
        for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
        printf("child=%d\n", wait_child(pid));
    } else if (!strcmp(mode, "exec")) {
        execl(argv[0], argv[0], "leaf", (char *)NULL);
        return 127;
    } else {  /* leaf */
        int s = 0;
        for (int i = 0; i < 3; i++) s += probed(i);
        printf("leaf=%d\n", s);
        return 0;
    }
    probed(100);
    return 0;
}
