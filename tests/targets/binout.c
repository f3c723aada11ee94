/* Writes binary data on stdout (every byte value, 256 KiB in all) through a function that is
 * called once a block, for the test that dynprobe's results never reach a program's output. */
#include <stdio.h>
#include <stdlib.h>

__attribute__((noinline)) size_t emit(const unsigned char *block, size_t n) {
    return fwrite(block, 1, n, stdout);
}

int main(void) {
    unsigned char *block = malloc(4096);
    for (int b = 0; b < 64; b++) {
        for (int i = 0; i < 4096; i++) block[i] = (unsigned char)(i * 7 + b);
        emit(block, 4096);
    }
    free(block);
    return 0;
}
