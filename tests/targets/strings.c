/* glibc's string functions over strings at every alignment: a checksum of what they return
   and write, printed. ./strings ROUNDS. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

int main(int argc, char **argv) {
    long rounds = argc > 1 ? atol(argv[1]) : 1;
    static char a[256], b[256], out[512];
    unsigned long sum = 0;
    for (long r = 0; r < rounds; r++) {
        int x = (int)(r % 16), y = (int)((r / 16) % 16), n = 1 + (int)(r % 61);
        for (int i = 0; i < 100; i++) {
            a[x + i] = (char)('a' + (i * 7 + r) % 26);
            b[y + i] = (char)('A' + (i * 7 + r) % 26);
        }
        a[x + n] = 0;
        b[y + n + (int)(r % 3) - 1] = 0;
        sum += (unsigned)strcmp(a + x, b + y) + 3u * (unsigned)strncmp(a + x, b + y, (size_t)n / 2);
        sum += (unsigned)strcasecmp(a + x, b + y) + 5u * (unsigned)strncasecmp(a + x, b + y, (size_t)n);
        sum += (unsigned long)(stpcpy(out + y, a + x) - out);
        sum += (unsigned)strlen(strcpy(out + x, b + y));
        sum += (unsigned)strlen(strcat(out + x, a + x));
        sum += (unsigned)strlen(strncat(out + x, b + y, (size_t)n / 3));
        sum += (unsigned long)(stpncpy(out + y, a + x, (size_t)n + 7) - out);
        sum += (unsigned char)strncpy(out + x, b + y, (size_t)n + 9)[n / 2];
        for (int i = 0; i < 512; i++) sum = sum * 31 + (unsigned char)out[i];
        a[x + n] = 'z';
        b[y + n + (int)(r % 3) - 1] = 'Z';
    }
    printf("%lu\n", sum);
    return 0;
}
