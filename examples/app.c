/* The program the README's examples probe: it reads its input in blocks, parses it into words,
 * counts them, and compresses each block (run-length), so there are functions with integer,
 * string and return values to probe, a few calls deep.
 *
 *   app [FILE | TEXT]...   each argument that names a file is read, any other is text;
 *                          with none, a built-in text. Prints a summary line.
 *   app --serve            handles a request every 10 ms until killed (for -p PID examples)
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define SMALL_BLOCK 512
#define LARGE_BLOCK 65536

struct entry { char *word; int count; struct entry *next; };
static struct entry *table[256];
static long words_seen;
static long compressed_bytes;

__attribute__((noinline)) unsigned hash(const char *word) {
    unsigned h = 5381;
    for (const char *p = word; *p; p++) h = h * 33 + (unsigned char)*p;
    return h % 256;
}

__attribute__((noinline)) int add_word(const char *word, int len) {
    unsigned h = hash(word);
    words_seen++;
    for (struct entry *e = table[h]; e; e = e->next)
        if (strcmp(e->word, word) == 0) return ++e->count;
    struct entry *e = malloc(sizeof *e);
    e->word = strndup(word, len);
    e->count = 1;
    e->next = table[h];
    table[h] = e;
    return 1;
}

/* A word's value if it is a number, else -1. */
__attribute__((noinline)) long parse_number(const char *word) {
    char *end;
    long value = strtol(word, &end, 10);
    return *word && !*end ? value : -1;
}

__attribute__((noinline)) void parse_debug_dump(const char *word, long number) {
    fprintf(stderr, "app: word %s number %ld\n", word, number);
}

__attribute__((noinline)) int parse_word(char *word) {
    long number = parse_number(word);
    if (getenv("APP_DEBUG")) parse_debug_dump(word, number);
    return add_word(word, (int)strlen(word));
}

/* Splits `text` (modified) into words; returns how many. */
__attribute__((noinline)) int parse_line(char *text) {
    int words = 0;
    char *rest = text;
    for (char *w = strtok_r(text, " ,.;:\t\n", &rest); w; w = strtok_r(NULL, " ,.;:\t\n", &rest)) {
        parse_word(w);
        words++;
    }
    return words;
}

/* Run-length encodes `n` bytes of `in` into `out` (2 bytes a run); returns the size written. */
__attribute__((noinline)) size_t compress(const char *in, size_t n, char *out) {
    size_t written = 0;
    for (size_t i = 0; i < n;) {
        size_t run = 1;
        while (i + run < n && in[i + run] == in[i] && run < 255) run++;
        out[written++] = (char)run;
        out[written++] = in[i];
        i += run;
    }
    return written;
}

/* Reads up to `n` bytes of `fd` into `buf`; returns how many (0 at the end, -1 on error). */
__attribute__((noinline)) ssize_t read_block(int fd, size_t n, char *buf) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r <= 0) return got ? (ssize_t)got : r;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

__attribute__((noinline)) void work_on(char *text, size_t n) {
    char *packed = malloc(2 * n + 2);
    compressed_bytes += (long)compress(text, n, packed);
    free(packed);
    text[n] = '\0';
    parse_line(text);
}

/* The first block is small (a header's worth), the rest large. */
static void work_on_file(int fd) {
    char *buf = malloc(LARGE_BLOCK + 1);
    size_t want = SMALL_BLOCK;
    ssize_t got;
    while ((got = read_block(fd, want, buf)) > 0) {
        work_on(buf, (size_t)got);
        want = LARGE_BLOCK;
    }
    free(buf);
}

__attribute__((noinline)) int handle_request(int id) {
    char text[64];
    snprintf(text, sizeof text, "request %d from client %d", id, id % 7);
    work_on(text, strlen(text));
    return id % 7;
}

static void serve(void) {
    struct timespec pause = {0, 10 * 1000 * 1000};
    for (int id = 0;; id++) {
        handle_request(id);
        nanosleep(&pause, NULL);
    }
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "--serve") == 0) serve();
    char builtin[] = "the quick brown fox jumps over the lazy dog, 3 times: the end.";
    if (argc == 1) work_on(builtin, strlen(builtin));
    for (int i = 1; i < argc; i++) {
        int fd = open(argv[i], O_RDONLY);
        if (fd >= 0) {
            work_on_file(fd);
            close(fd);
        } else {
            char *text = strdup(argv[i]);
            work_on(text, strlen(text));
            free(text);
        }
    }
    int distinct = 0;
    for (int i = 0; i < 256; i++)
        for (struct entry *e = table[i]; e; e = e->next) distinct++;
    printf("%ld words, %d distinct, %ld bytes compressed\n", words_seen, distinct, compressed_bytes);
    return 0;
}
