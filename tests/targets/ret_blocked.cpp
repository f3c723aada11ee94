// A C++ exception thrown through a return-probed frame after the tracer has died: main reads a
// line ("go"), then calls blocked(), whose return is hooked; blocked() waits for one more byte
// and throws it. The catcher in main must get it (the unwinder cannot walk through an address
// of the return trampoline: the guardian puts the original return address back).
#include <cstdio>
#include <unistd.h>

struct Err {
    int c;
};

extern "C" __attribute__((noinline)) int blocked(int fd) {
    char c;
    puts("waiting");
    fflush(stdout);
    if (read(fd, &c, 1) == 1)
        throw Err{c};
    return 0;
}

int main() {
    char line[16];
    if (!fgets(line, sizeof line, stdin))
        return 2;
    try {
        blocked(0);
        puts("returned");
    } catch (Err &e) {
        printf("caught %c\n", e.c);
    }
    return 0;
}
