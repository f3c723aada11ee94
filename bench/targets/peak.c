/* peak FILE COMMAND...: runs COMMAND and writes its peak RSS (KiB) in FILE. A child's peak
 * counts the pages of the process it was forked from (the kernel keeps the maximum across exec):
 * run from this small process, not from Python, a command's own peak is measured. */
#include <stdio.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc < 3)
        return 2;
    pid_t pid = fork();
    if (pid == 0) {
        execvp(argv[2], argv + 2);
        _exit(127);
    }
    int status;
    struct rusage usage;
    if (pid < 0 || wait4(pid, &status, 0, &usage) != pid)
        return 2;
    FILE *out = fopen(argv[1], "w");
    if (!out)
        return 2;
    fprintf(out, "%ld\n", usage.ru_maxrss);
    fclose(out);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
