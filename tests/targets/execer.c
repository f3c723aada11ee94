/* A program that runs itself again in its children: fork then exec, and posix_spawn. Each
 * process calls a function of its own, for the function tracer following exec. */
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;
static volatile int sink;

#define WORK(name, expr)                                                                           \
    __attribute__((noinline)) int name(int n) {                                                    \
        for (int i = 0; i < 3; i++) sink += i;                                                     \
        return expr;                                                                               \
    }
WORK(in_child, n * 2)
WORK(in_spawned, n + 1)
WORK(in_parent, n - 1)

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "child")) return in_child(3) == 6 ? 10 : 1;
    if (argc > 1 && !strcmp(argv[1], "spawned")) return in_spawned(3) == 4 ? 20 : 1;
    pid_t child = fork();
    if (child == 0) {
        execl(argv[0], argv[0], "child", (char *)NULL);
        _exit(127);
    }
    int forked = 0, spawned = 0;
    waitpid(child, &forked, 0);
    char *args[] = {argv[0], "spawned", NULL};
    pid_t other;
    if (posix_spawn(&other, argv[0], NULL, NULL, args, environ) != 0) return 2;
    waitpid(other, &spawned, 0);
    printf("%d %d %d\n", WEXITSTATUS(forked), WEXITSTATUS(spawned), in_parent(1));
    return 0;
}
