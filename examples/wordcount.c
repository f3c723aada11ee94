/* The bundled example: counts words of its arguments (or of a built-in text) with a small hash
 * table, so there are functions with integer and string arguments to probe. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct entry { char *word; int count; struct entry *next; };
static struct entry *table[64];

__attribute__((noinline)) unsigned hash(const char *word) {
    unsigned h = 5381;
    for (const char *p = word; *p; p++) h = h * 33 + (unsigned char)*p;
    return h % 64;
}

__attribute__((noinline)) int add_word(const char *word, int len) {
    unsigned h = hash(word);
    for (struct entry *e = table[h]; e; e = e->next)
        if (strcmp(e->word, word) == 0) return ++e->count;
    struct entry *e = malloc(sizeof *e);
    e->word = strndup(word, len);
    e->count = 1;
    e->next = table[h];
    table[h] = e;
    return 1;
}

static void count_text(char *text) {
    for (char *w = strtok(text, " ,.\n"); w; w = strtok(NULL, " ,.\n")) add_word(w, (int)strlen(w));
}

int main(int argc, char **argv) {
    char builtin[] = "the quick brown fox jumps over the lazy dog, the end.";
    if (argc > 1) {
        for (int i = 1; i < argc; i++) count_text(argv[i]);
    } else {
        count_text(builtin);
    }
    int distinct = 0;
    for (int i = 0; i < 64; i++)
        for (struct entry *e = table[i]; e; e = e->next) distinct++;
    printf("%d distinct words\n", distinct);
    return 0;
}
