/* Return-probe scenarios (tests/integration/test_returns.py), one per mode:
 *   fact N          recursion to depth N; prints N! (mod 2^64)
 *   loop N          N calls of add(i, 1); prints the sum
 *   threads T N     T threads, N calls of add each; prints the total
 *   longjmp N D     N times: dive D probed frames deep, longjmp out of the deepest; then fact(5)
 *   signal N US     N calls of add while SIGALRM fires every US us; its handler calls add too
 *   exit C          a probed function calls exit(C)
 *   swap N          two contexts ping-pong N times through swapcontext, each inside a probed call
 *   move            a probed call chain whose stack is copied elsewhere mid-way (as Go's runtime does)
 *   backtrace       a probed call chain calls backtrace(); prints the frames' function names
 *   fork            a probed function forks; parent and child both return through it
 *   sleep           prints "ready", then naps in a probed function forever, a line per return
 *   pointer N       N calls of add through a function pointer
 *   evenodd N       is_even(N) by mutual recursion with is_odd
 *   raise           a probed function raises SIGUSR1; its handler calls add
 *   mixed N         N calls of add; every 10th, a slow call (a 2 ms nap, then add); prints the sum
 *   wide N          N calls of wide(i), which returns {i, 2i} in rax:rdx; prints both halves' sums
 *   spike N K MS    N calls of add(i, 1), and after the Kth one nap of MS ms; prints the sum
 *   deep N US       begin(), then recursion N + 1 deep, each call busy for US us first; prints N
 */
#define _GNU_SOURCE
#include <execinfo.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))

NOINLINE unsigned long fact(unsigned long n) {
    if (n <= 1)
        return 1;
    unsigned long r = n * fact(n - 1);
    __asm__ volatile("" ::: "memory");  /* no tail call */
    return r;
}

static long add_calls;
NOINLINE long add(long a, long b) {
    add_calls++;  /* long enough for a jump */
    __asm__ volatile("" ::: "memory");
    return a + b;
}

/* wide: a two-register return value */
struct pair {
    long low, high;
};
NOINLINE struct pair wide(long a) {
    add_calls++;
    __asm__ volatile("" ::: "memory");
    return (struct pair){a, 2 * a};
}

/* longjmp */
static jmp_buf env;
NOINLINE long dive(long d) {
    if (d == 0)
        longjmp(env, 1);
    long r = dive(d - 1) + 1;
    __asm__ volatile("" ::: "memory");
    return r;
}

/* threads */
static long per_thread;
static void *worker(void *arg) {
    long s = 0;
    for (long i = 0; i < per_thread; i++)
        s += add(i, 1);
    *(long *)arg = s;
    return NULL;
}

/* signal */
static volatile long handler_calls, handler_sum;
static void on_alarm(int sig) {
    (void)sig;
    handler_sum += add(handler_calls, 1);
    handler_calls++;
}

NOINLINE void leave(int code) {
    fflush(stdout);
    exit(code);
}

/* swapcontext ping-pong */
static ucontext_t main_ctx, co_ctx;
static long rounds;
NOINLINE long ping(long i) {
    swapcontext(&main_ctx, &co_ctx);
    __asm__ volatile("" ::: "memory");
    return i * 2;
}
NOINLINE long pong(long i) {
    swapcontext(&co_ctx, &main_ctx);
    __asm__ volatile("" ::: "memory");
    return i * 3;
}
static long pong_sum;
static void coroutine(void) {
    for (long i = 0;; i++)
        pong_sum += pong(i);
}

/* a stack that moves: run on stack_a, copy the live part to stack_b and go on there */
static char stack_a[1 << 16] __attribute__((aligned(16)));
static char stack_b[1 << 16] __attribute__((aligned(16)));
void move_stack(char *from_top, char *to_top);
__asm__(".text\n.globl move_stack\nmove_stack:\n"
        "  mov %rdi, %rcx\n  sub %rsp, %rcx\n"        /* rcx = bytes in use */
        "  mov %rsi, %rax\n  sub %rcx, %rax\n"        /* rax = the new rsp */
        "  mov %rax, %r8\n  sub %rsp, %r8\n"          /* r8 = the distance */
        "  mov %rsp, %rsi\n  mov %rax, %rdi\n  cld\n  rep movsb\n"
        "  add %r8, %rsp\n"
        /* frame pointers into the old stack move too (the chain, as Go adjusts it) */
        "  lea stack_a(%rip), %r9\n  lea 65536(%r9), %r10\n"
        "  mov %rbp, %rax\n"
        "1: cmp %r9, %rax\n  jb 2f\n  cmp %r10, %rax\n  jae 2f\n"
        "  add %r8, %rax\n  mov (%rax), %rdx\n"
        "  cmp %r9, %rdx\n  jb 3f\n  cmp %r10, %rdx\n  jae 3f\n"
        "  add %r8, %rdx\n  mov %rdx, (%rax)\n"
        "3: mov %rdx, %rax\n  jmp 1b\n"
        "2: cmp %r9, %rbp\n  jb 4f\n  cmp %r10, %rbp\n  jae 4f\n  add %r8, %rbp\n"
        "4: ret\n");
NOINLINE long moving_leaf(long x) {
    move_stack(stack_a + sizeof stack_a, stack_b + sizeof stack_b);
    __asm__ volatile("" ::: "memory");
    return x * 3;
}
NOINLINE long moving_middle(long x) {
    long r = moving_leaf(x + 1) + 1;
    __asm__ volatile("" ::: "memory");
    return r;
}
NOINLINE long moving_outer(long x) {
    long r = moving_middle(x * 2) * 2;
    __asm__ volatile("" ::: "memory");
    return r;
}
static long moved_result;
static void run_moving(void) { moved_result = moving_outer(5); }

/* backtrace */
NOINLINE int bt_leaf(void) {
    void *frames[32];
    int n = backtrace(frames, 32);
    char **names = backtrace_symbols(frames, n);
    for (int i = 0; i < n; i++) {
        const char *open = strchr(names[i], '('), *plus = open ? strchr(open, '+') : NULL;
        if (open && plus && plus > open + 1)
            printf("%.*s\n", (int)(plus - open - 1), open + 1);
    }
    free(names);
    __asm__ volatile("" ::: "memory");
    return n;
}
NOINLINE int bt_middle(void) {
    int r = bt_leaf() + 1;
    __asm__ volatile("" ::: "memory");
    return r;
}

static long usr1_sum;
NOINLINE void on_usr1(int sig) {
    usr1_sum += add(sig, 1);
}
NOINLINE int signaller(void) {
    raise(SIGUSR1);
    __asm__ volatile("" ::: "memory");
    return (int)usr1_sum;
}

NOINLINE int is_odd(long n);
NOINLINE int is_even(long n) {
    int r = n == 0 ? 1 : is_odd(n - 1);
    __asm__ volatile("" ::: "memory");
    return r;
}
NOINLINE int is_odd(long n) {
    int r = n == 0 ? 0 : is_even(n - 1);
    __asm__ volatile("" ::: "memory");
    return r;
}

NOINLINE int forking(int x) {
    pid_t pid = fork();
    __asm__ volatile("" ::: "memory");
    return pid == 0 ? x + 1 : x + 2;
}
NOINLINE int fork_outer(int x) {
    int r = forking(x) * 10;
    __asm__ volatile("" ::: "memory");
    return r;
}

NOINLINE long nap(long ms) {
    usleep(ms * 1000);
    __asm__ volatile("" ::: "memory");
    return ms;
}

NOINLINE long slow(long i) {
    nap(2);
    long r = add(i, 1);
    __asm__ volatile("" ::: "memory");
    return r;
}

NOINLINE void begin(void) { __asm__ volatile("" ::: "memory"); }

static void busy(long us) {
    struct timespec from, now;
    clock_gettime(CLOCK_MONOTONIC, &from);
    do
        clock_gettime(CLOCK_MONOTONIC, &now);
    while ((now.tv_sec - from.tv_sec) * 1000000 + (now.tv_nsec - from.tv_nsec) / 1000 < us);
}

NOINLINE long deeper(long n, long us) {
    busy(us);
    long r = n ? deeper(n - 1, us) + 1 : 0;
    __asm__ volatile("" ::: "memory");
    return r;
}

/* IPA-RA (gcc -O2 -fipa-ra): a caller keeps values in call-clobbered registers across a call to
   a function it knows does not touch them. ipa_check does so by hand around ipa_leaf and returns
   a bit per register found changed after the call (rcx rdx rsi rdi r8 r9 r10 r11): 0 if none. */
long ipa_leaf(long x);
long ipa_check(long x);
__asm__(".text\n.globl ipa_leaf\n.type ipa_leaf,@function\nipa_leaf:\n"
        "  push %rbp\n  mov %rsp, %rbp\n  lea 1(%rdi), %rax\n  pop %rbp\n  ret\n"
        ".size ipa_leaf, .-ipa_leaf\n"
        ".globl ipa_check\n.type ipa_check,@function\nipa_check:\n"
        "  push %rbx\n  push %r12\n  mov %rdi, %r12\n"
        "  mov $0x1111, %rcx\n  mov $0x2222, %rdx\n  mov $0x3333, %rsi\n  mov $0x8888, %r8\n"
        "  mov $0x9999, %r9\n  mov $0xaaaa, %r10\n  mov $0xbbbb, %r11\n"
        "  call ipa_leaf\n"
        "  xor %ebx, %ebx\n"
        "  cmp $0x1111, %rcx\n  je 1f\n  or $1, %ebx\n1:\n"
        "  cmp $0x2222, %rdx\n  je 1f\n  or $2, %ebx\n1:\n"
        "  cmp $0x3333, %rsi\n  je 1f\n  or $4, %ebx\n1:\n"
        "  cmp %r12, %rdi\n  je 1f\n  or $8, %ebx\n1:\n"
        "  cmp $0x8888, %r8\n  je 1f\n  or $16, %ebx\n1:\n"
        "  cmp $0x9999, %r9\n  je 1f\n  or $32, %ebx\n1:\n"
        "  cmp $0xaaaa, %r10\n  je 1f\n  or $64, %ebx\n1:\n"
        "  cmp $0xbbbb, %r11\n  je 1f\n  or $128, %ebx\n1:\n"
        "  mov %rbx, %rax\n  pop %r12\n  pop %rbx\n  ret\n"
        ".size ipa_check, .-ipa_check\n");

/* How a function was entered: its return address minus the word under it. Entered through a
   trampoline entry's call (a hooked return, see codegen.enter_tail), that word is the call's
   address, 4 bytes before the entry point the return address is. */
long peek_leaf(void);
__asm__(".text\n.globl peek_leaf\n.type peek_leaf,@function\npeek_leaf:\n"
        "  mov (%rsp), %rax\n  sub -8(%rsp), %rax\n  ret\n.size peek_leaf, .-peek_leaf\n");

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *mode = argc > 1 ? argv[1] : "loop";
    long n = argc > 2 ? atol(argv[2]) : 10;
    if (!strcmp(mode, "fact")) {
        printf("%lu\n", fact(n));
    } else if (!strcmp(mode, "loop")) {
        long s = 0;
        for (long i = 0; i < n; i++)
            s += add(i, 1);
        printf("%ld\n", s);
    } else if (!strcmp(mode, "wide")) {
        long low = 0, high = 0;
        for (long i = 0; i < n; i++) {
            struct pair p = wide(i);
            low += p.low;
            high += p.high;
        }
        printf("%ld %ld\n", low, high);
    } else if (!strcmp(mode, "threads")) {
        long t = n;
        per_thread = argc > 3 ? atol(argv[3]) : 1000;
        pthread_t th[64];
        long sums[64];
        for (long i = 0; i < t; i++)
            pthread_create(&th[i], NULL, worker, &sums[i]);
        long total = 0;
        for (long i = 0; i < t; i++) {
            pthread_join(th[i], NULL);
            total += sums[i];
        }
        printf("%ld\n", total);
    } else if (!strcmp(mode, "longjmp")) {
        long depth = argc > 3 ? atol(argv[3]) : 5, jumps = 0;
        for (long i = 0; i < n; i++) {
            if (!setjmp(env))
                dive(depth);
            else
                jumps++;
        }
        printf("%ld %lu\n", jumps, fact(5));
    } else if (!strcmp(mode, "signal")) {
        signal(SIGALRM, on_alarm);
        long us = argc > 3 ? atol(argv[3]) : 50;
        struct itimerval it = {{0, us}, {0, us}};
        setitimer(ITIMER_REAL, &it, NULL);
        long s = 0;
        for (long i = 0; i < n; i++)
            s += add(i, 1);
        struct itimerval off = {{0, 0}, {0, 0}};
        setitimer(ITIMER_REAL, &off, NULL);
        printf("%ld %ld %ld\n", s, handler_calls, handler_sum);
    } else if (!strcmp(mode, "exit")) {
        printf("leaving\n");
        leave((int)n);
    } else if (!strcmp(mode, "swap")) {
        static char co_stack[1 << 16];
        getcontext(&co_ctx);
        co_ctx.uc_stack.ss_sp = co_stack;
        co_ctx.uc_stack.ss_size = sizeof co_stack;
        co_ctx.uc_link = NULL;
        makecontext(&co_ctx, coroutine, 0);
        long ping_sum = 0;
        for (rounds = 0; rounds < n; rounds++)
            ping_sum += ping(rounds);
        printf("%ld %ld\n", ping_sum, pong_sum);
    } else if (!strcmp(mode, "move")) {
        ucontext_t back, there;
        getcontext(&there);
        there.uc_stack.ss_sp = stack_a;
        there.uc_stack.ss_size = sizeof stack_a;
        there.uc_link = &back;
        makecontext(&there, run_moving, 0);
        swapcontext(&back, &there);
        printf("%ld\n", moved_result);
    } else if (!strcmp(mode, "backtrace")) {
        printf("%d\n", bt_middle());
    } else if (!strcmp(mode, "fork")) {
        int r = fork_outer(1);
        if (r == 20) {  /* the child */
            printf("child %ld\n", r + add(0, 0));
            fflush(stdout);
            _exit(0);
        }
        wait(NULL);
        printf("parent %d\n", r);
    } else if (!strcmp(mode, "raise")) {
        signal(SIGUSR1, on_usr1);
        printf("%d\n", signaller());
    } else if (!strcmp(mode, "evenodd")) {
        printf("%d\n", is_even(n));
    } else if (!strcmp(mode, "pointer")) {
        long (*volatile through)(long, long) = add;
        long s = 0;
        for (long i = 0; i < n; i++)
            s += through(i, 1);
        printf("%ld\n", s);
    } else if (!strcmp(mode, "ipa")) {
        long changed = 0;
        for (long i = 0; i < n; i++)
            changed |= ipa_check(i);
        printf("%#lx\n", changed);
    } else if (!strcmp(mode, "peek")) {
        printf("%ld\n", peek_leaf());
    } else if (!strcmp(mode, "mixed")) {
        long s = 0;
        for (long i = 0; i < n; i++)
            s += i % 10 == 9 ? slow(i) : add(i, 1);
        printf("%ld\n", s);
    } else if (!strcmp(mode, "spike")) {
        long s = 0, spike_at = atol(argv[3]);
        for (long i = 0; i < n; i++) {
            s += add(i, 1);
            if (i == spike_at)
                nap(atol(argv[4]));
        }
        printf("%ld\n", s);
    } else if (!strcmp(mode, "deep")) {
        begin();
        printf("%ld\n", deeper(n, atol(argv[3])));
    } else if (!strcmp(mode, "sleep")) {
        printf("ready\n");
        for (long i = 0;; i++)
            printf("%ld\n", nap(20) + i);
    }
    return 0;
}
