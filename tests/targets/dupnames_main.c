#include <stdio.h>
int from_a(int), from_b(int), plain(int);
int main(int argc, char **argv) {
    (void)argv;
    printf("%d\n", from_a(argc) + from_b(argc) + from_b(argc) + plain(argc));
    return 0;
}
