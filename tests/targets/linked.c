/* A program linked with a library its loader finds through RUNPATH ($ORIGIN) or LD_LIBRARY_PATH. */
#include <stdio.h>

int lib_func(int x);

int main(void) {
    int s = 0;
    for (int i = 0; i < 3; i++) s += lib_func(i);
    printf("sum=%d\n", s);
    return 0;
}
