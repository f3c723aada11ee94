// C++ names for demangling: a namespace, a class with a method, an operator and a destructor,
// overloads, a template, and a function in an anonymous namespace.
#include <cstdio>

namespace app {
struct Counter {
    long total = 0;
    __attribute__((noinline)) void add(long n) { total += n; }
    __attribute__((noinline)) long operator()(long n) const { return total * n; }
    __attribute__((noinline)) ~Counter() { std::printf("total=%ld\n", total); }
};
__attribute__((noinline)) long twice(long n) { return 2 * n; }
__attribute__((noinline)) double twice(double x) { return 2 * x; }
template <typename T> __attribute__((noinline)) T largest(T a, T b) { return a > b ? a : b; }
}  // namespace app

namespace {
__attribute__((noinline)) long helper(long n) { return n + 1; }
}

int main() {
    app::Counter c;
    for (long i = 0; i < 3; i++) c.add(app::twice(i));
    std::printf("%ld %g %ld %ld\n", c(2), app::twice(1.5), app::largest(3L, 4L), helper(1));
    return 0;
}
