/* Library functions that return twice or never, for the function tracer over libc: setjmp and
 * longjmp, sigsetjmp and siglongjmp, getcontext resumed by setcontext, swapcontext coroutines,
 * vfork, and a thread that ends with pthread_exit. Prints what it saw; exits 0. */
#include <pthread.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <ucontext.h>
#include <unistd.h>

static jmp_buf env;
static sigjmp_buf senv;
static ucontext_t main_ctx, co_ctx;
static char co_stack[1 << 16];

__attribute__((noinline)) void dive(int n) {
    if (n == 0) longjmp(env, 1);
    dive(n - 1);
}

__attribute__((noinline)) void coroutine(void) {
    for (int i = 0; i < 3; i++) swapcontext(&co_ctx, &main_ctx);
}

static void *ending(void *arg) {
    (void)arg;
    pthread_exit((void *)7);
}

int main(void) {
    int jumps = 0, resumed = 0, switches = 0;
    for (int i = 0; i < 3; i++) {
        if (setjmp(env) == 0) dive(4);
        else jumps++;
    }
    if (sigsetjmp(senv, 1) == 0) siglongjmp(senv, 1);
    else jumps++;
    volatile int again = 0;
    getcontext(&main_ctx);
    if (!again) { again = 1; setcontext(&main_ctx); }
    resumed = again;
    getcontext(&co_ctx);
    co_ctx.uc_stack.ss_sp = co_stack;
    co_ctx.uc_stack.ss_size = sizeof co_stack;
    co_ctx.uc_link = &main_ctx;
    makecontext(&co_ctx, coroutine, 0);
    for (int i = 0; i < 4; i++) { swapcontext(&main_ctx, &co_ctx); switches++; }
    pid_t child = vfork();
    if (child == 0) _exit(3);
    int status = 0;
    waitpid(child, &status, 0);
    pthread_t thread;
    void *ended = NULL;
    pthread_create(&thread, NULL, ending, NULL);
    pthread_join(thread, &ended);
    printf("jumps=%d resumed=%d switches=%d child=%d thread=%ld\n", jumps, resumed, switches,
           WEXITSTATUS(status), (long)ended);
    return 0;
}
