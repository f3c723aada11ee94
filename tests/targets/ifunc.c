/* Indirect functions of libc (strlen, memcpy: STT_GNU_IFUNC), called through pointers so that the
 * compiler cannot inline them, and malloc: N calls of each. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 1000;
    size_t (*volatile my_strlen)(const char *) = strlen;
    void *(*volatile my_memcpy)(void *, const void *, size_t) = memcpy;
    char buf[256]; size_t total = 0;
    for (int i = 0; i < n; i++) {
        total += my_strlen(argv[0]);
        my_memcpy(buf, argv[0], (size_t)(i % 100));
        void *p = malloc(16 + i % 7); free(p);
    }
    printf("%zu\n", total);
    return 0;
}
