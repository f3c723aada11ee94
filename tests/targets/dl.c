/* Hazard 20: a library loaded later by dlopen, closed, and another library at the same address. */
#include <dlfcn.h>
#include <stdio.h>

int main(int argc, char **argv) {
    for (int round = 0; round < 2; round++) {
        void *h = dlopen(argv[1], RTLD_NOW);
        if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
        int (*f)(int) = (int (*)(int))dlsym(h, "lib_func");
        int s = 0;
        for (int i = 0; i < 3; i++) s += f(i);
        printf("%s round=%d sum=%d\n", argv[1], round, s);
        dlclose(h);
        void *g = dlopen(argv[2], RTLD_NOW);
        int (*f2)(int) = (int (*)(int))dlsym(g, "lib_func");
        printf("%s round=%d value=%d\n", argv[2], round, f2(10));
        dlclose(g);
    }
    return 0;
}
