/* A C++ exception's path for stack walks (tests/integration/test_stacks.py): leaf() runs in a
 * destructor while the exception unwinds the frame, and in the handler that catches it. */
volatile int sink;

__attribute__((noinline)) void leaf(int why) { sink += why; }

namespace app {
struct Guard {
    ~Guard() { leaf(5); }
};

__attribute__((noinline)) void thrower(int n) {
    Guard guard;
    if (n > 0)
        throw n;
    sink += n;
}
}  // namespace app

int main() {
    try {
        app::thrower(1);
    } catch (int n) {
        leaf(6 + 0 * n);
    }
    return 0;
}
