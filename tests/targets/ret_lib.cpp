// The shared-library half of ret_cxx.cpp: a probed chain that throws from inside the library.
#include <stdexcept>

#define NOINLINE extern "C" __attribute__((noinline))

NOINLINE int lib_inner(int n) {
    if (n % 4 == 0)
        throw std::runtime_error("from the library");
    asm volatile("" ::: "memory");
    return n * 10;
}

NOINLINE int lib_outer(int n) {
    int r = lib_inner(n) + 1;
    asm volatile("" ::: "memory");
    return r;
}
