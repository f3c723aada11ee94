/* Patches its own code: an int3 over a function it never calls (a debugger's breakpoint), and a
 * 2-byte nop rewritten as two 1-byte nops (harmless, but not the file's bytes). Then waits. */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

void never_called(void);
void changed(void);
__asm__(".text\n .globl never_called\n .type never_called,@function\n never_called: nop\n ret\n"
        " .size never_called, .-never_called\n"
        " .globl changed\n .type changed,@function\n changed: .byte 0x66, 0x90\n ret\n"
        " .size changed, .-changed\n");

static volatile int stop;
static void on_term(int sig) { (void)sig; stop = 1; }

static void poke(void *where, uint8_t byte) {
    uintptr_t page = (uintptr_t)where & ~(uintptr_t)4095;
    mprotect((void *)page, 8192, PROT_READ | PROT_WRITE | PROT_EXEC);
    *(volatile uint8_t *)where = byte;
    mprotect((void *)page, 8192, PROT_READ | PROT_EXEC);
}

int main(void) {
    signal(SIGTERM, on_term);
    poke((void *)never_called, 0xcc);
    poke((void *)changed, 0x90);
    changed();
    printf("ready\n");
    fflush(stdout);
    while (!stop) usleep(1000);
    changed();
    printf("done\n");
    return 0;
}
