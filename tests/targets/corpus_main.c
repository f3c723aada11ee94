/* Runs every case of corpus.S (or those named in argv) and prints one snapshot line each. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

extern uint64_t init_regs[17], out_regs[22], ripdata2[2];

#define CASES(X) X(push_rbp) X(push_r12) X(push_rsp) X(pop_rsp) X(pop_rbx) X(push_imm) X(push_riprel) \
    X(nop) X(nopl) X(nop66) X(endbr64) X(mov_rbp_rsp) X(mov32) X(mov8_high) X(lea_sib) X(lea_rip) X(jmp8) \
    X(jmp32) X(jz_taken) X(jnz_not_taken) X(call_rel32) X(call_mem) X(jmp_mem) X(ret) X(ret_imm16) X(pushf) \
    X(popf) X(load_riprel) X(store_riprel) X(vex_load_riprel) X(vex_andn_riprel) X(div) X(cmpxchg16b) X(mulx) \
    X(sub_rsp) X(rep_movsb) X(lock_xadd) X(xchg) X(cmovz) X(adc) X(bswap) X(imul3) X(xor32) X(movzx) \
    X(syscall_getuid) X(stosq) X(shld) X(loop_taken) X(loope_taken) X(loopne_not_taken) X(loop_ecx) \
    X(jrcxz_not_taken)
#define DECLARE(n) void case_##n(void);
CASES(DECLARE)
#define ENTRY(n) {#n, case_##n},
static struct { const char *name; void (*fn)(void); } cases[] = {CASES(ENTRY)};

#define REGION ((uint64_t *)0x20000000)
#define REGION_SIZE 0x10000
/* The cases run on a stack at 0x20008000. Below its 128-byte red zone, memory is anyone's to
 * clobber (signal handlers, an optimized probe's detour): it is left out of the hash. */
#define SCRATCH_START (0x8000 - 128 - 1024)
#define SCRATCH_END (0x8000 - 128)

static uint64_t fnv(const void *p, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)p)[i]) * 1099511628211ULL;
    return h;
}

int main(int argc, char **argv) {
    if (mmap(REGION, REGION_SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != REGION)
        return 99;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        if (argc > 1) {
            int wanted = 0;
            for (int i = 1; i < argc; i++) wanted |= !strcmp(argv[i], cases[c].name);
            if (!wanted) continue;
        }
        for (size_t i = 0; i < REGION_SIZE / 8; i++) REGION[i] = (i + 1) * 0x9E3779B97F4A7C15ULL;
        uint64_t init[17] = {0x1111111111111111, 5, 0x1, 0x123456789, 0, 0x5555555555555555,
                             0x20001000, 0x20002000, 0x8888888888888888, 0x9999999999999999,
                             0xaaaaaaaaaaaaaaaa, 0xbbbbbbbbbbbbbbbb, 0xcccccccccccccccc, 0xdddddddddddddddd,
                             0xeeeeeeeeeeeeeeee, 0xf0f0f0f0f0f0f0f0, 0x247};
        if (!strcmp(cases[c].name, "syscall_getuid")) init[0] = 102;
        memcpy(init_regs, init, sizeof init);
        memset(ripdata2, 0, 16);
        cases[c].fn();
        printf("%-16s", cases[c].name);
        for (int i = 0; i < 22; i++) printf(" %016llx", (unsigned long long)out_regs[i]);
        uint64_t mem = fnv(REGION, SCRATCH_START) ^
                       fnv((char *)REGION + SCRATCH_END, REGION_SIZE - SCRATCH_END) * 31;
        printf(" mem=%016llx rip2=%016llx\n", (unsigned long long)mem, (unsigned long long)ripdata2[0]);
    }
    return 0;
}
