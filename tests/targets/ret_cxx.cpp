// C++ exceptions through return-probed frames (tests/integration/test_returns.py): throw, catch,
// rethrow, destructors run by the unwinder, and a throw from a shared library (ret_lib.cpp).
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#define NOINLINE extern "C" __attribute__((noinline))

extern "C" int lib_outer(int n);

struct Err {
    int n;
};

static long destroyed;
struct Guard {
    ~Guard() { destroyed++; }
};

NOINLINE int thrower(int n) {
    if (n % 3 == 0)
        throw Err{n};
    asm volatile("" ::: "memory");
    return n;
}

NOINLINE int middle(int n) {
    Guard g;
    int r = thrower(n) + 1;
    asm volatile("" ::: "memory");
    return r;
}

NOINLINE int rethrower(int n) {
    try {
        return middle(n);
    } catch (Err &) {
        throw;
    }
}

NOINLINE int catcher(int n) {
    try {
        return rethrower(n);
    } catch (Err &e) {
        return -e.n;
    }
}

NOINLINE int via_lib(int n) {
    try {
        return lib_outer(n);
    } catch (std::exception &) {
        return -1;
    }
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 100;
    long sum = 0;
    for (int i = 0; i < n; i++)
        sum += catcher(i) + via_lib(i);
    printf("%ld %ld\n", sum, destroyed);
    return 0;
}
