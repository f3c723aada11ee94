/* The per-event walk of `report` and `dump --flame` (output/callgraph.py's `profile`): each
 * thread's stack of open calls, and per function its calls, total, self and extreme times; with
 * `folded`, the self time of every call path. It is the one loop dynprobe's readers cannot write
 * as a few passes of numpy (each exit needs the stack its entries built), so it is C, called
 * through ctypes (the module itself is empty); it reads only the event columns it is given and
 * allocates what it keeps.
 *
 * The rules are those of callgraph.py's `_OpenCalls`: a frame is reused only once its call is
 * over, so an entry in a frame still open, or an exit of a frame below the top, drops the calls
 * from there up (left by longjmp or an exception); calls without a frame are matched by
 * function; a call adds to its function's total only when no other call of it is open. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

/* An empty module, so that the library imports as the extension module it is named as. */
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_callwalk", "See output/callwalk.py.", 0, NULL};

PyMODINIT_FUNC PyInit__callwalk(void) { return PyModule_Create(&module); }

enum { EXIT = 1, STATS = 8 };
enum { CALLS, TOTAL, SELF, SPENT, SHORTEST, LONGEST, LEAST_SELF, MOST_SELF };

/* A map from non-negative keys to values; keys are never removed (a value says "absent"). */
struct table {
    int64_t *keys, *values; /* keys: -1 where empty */
    int64_t capacity, used;
};

static uint64_t hash_slot(int64_t key, int64_t capacity) {
    return ((uint64_t)key * 0x9E3779B97F4A7C15ull >> 17) & (uint64_t)(capacity - 1);
}

static int table_grow(struct table *t) {
    int64_t capacity = t->capacity ? 2 * t->capacity : 64;
    int64_t *keys = malloc(capacity * sizeof *keys), *values = malloc(capacity * sizeof *values);
    if (!keys || !values) {
        free(keys);
        free(values);
        return -1;
    }
    for (int64_t i = 0; i < capacity; i++)
        keys[i] = -1;
    for (int64_t i = 0; i < t->capacity; i++) {
        if (t->keys[i] < 0)
            continue;
        uint64_t s = hash_slot(t->keys[i], capacity);
        while (keys[s] >= 0)
            s = (s + 1) & (uint64_t)(capacity - 1);
        keys[s] = t->keys[i];
        values[s] = t->values[i];
    }
    free(t->keys);
    free(t->values);
    t->capacity = capacity;
    t->keys = keys;
    t->values = values;
    return 0;
}

/* Where the value of `key` is, NULL when absent: no insertion. */
static int64_t *table_find(const struct table *t, int64_t key) {
    if (!t->capacity)
        return NULL;
    uint64_t s = hash_slot(key, t->capacity);
    while (t->keys[s] >= 0) {
        if (t->keys[s] == key)
            return &t->values[s];
        s = (s + 1) & (uint64_t)(t->capacity - 1);
    }
    return NULL;
}

static int64_t table_get(const struct table *t, int64_t key, int64_t absent) {
    int64_t *value = table_find(t, key);
    return value ? *value : absent;
}

/* Where the value of `key` is, added as `fresh` if absent; NULL when memory runs out. */
static int64_t *table_value(struct table *t, int64_t key, int64_t fresh) {
    int64_t *value = table_find(t, key);
    if (value)
        return value;
    if (2 * (t->used + 1) > t->capacity && table_grow(t))
        return NULL;
    uint64_t s = hash_slot(key, t->capacity);
    while (t->keys[s] >= 0 && t->keys[s] != key)
        s = (s + 1) & (uint64_t)(t->capacity - 1);
    if (t->keys[s] < 0) {
        t->keys[s] = key;
        t->values[s] = fresh;
        t->used++;
    }
    return &t->values[s];
}

static void table_free(struct table *t) {
    free(t->keys);
    free(t->values);
}

struct call {
    int64_t func, entered, frame, callees, node;
};

struct thread {
    struct call *calls;
    int64_t depth, capacity;
    struct table at;     /* frame -> its call's depth, -1 once over */
    struct table opened; /* function -> its open calls */
    struct thread *next;
};

struct walk {
    int64_t functions, threshold;
    int folded;
    int64_t *stats; /* STATS rows of `functions`, the caller's */
    struct table children; /* caller's node << 32 | function -> node */
    int64_t *caller, *func, *own; /* per node; node 0: the root */
    int64_t nodes, node_capacity;
    struct thread *threads;
};

struct walk *walk_new(int64_t functions, int64_t threshold, int folded, int64_t *stats) {
    struct walk *w = calloc(1, sizeof *w);
    if (!w)
        return NULL;
    w->functions = functions > 0 ? functions : 1;
    w->threshold = threshold;
    w->folded = folded;
    w->stats = stats;
    w->nodes = 1;
    return w;
}

struct thread *walk_thread(struct walk *w) {
    struct thread *t = calloc(1, sizeof *t);
    if (!t)
        return NULL;
    t->next = w->threads;
    w->threads = t;
    return t;
}

void walk_free(struct walk *w) {
    if (!w)
        return;
    while (w->threads) {
        struct thread *t = w->threads;
        w->threads = t->next;
        free(t->calls);
        table_free(&t->at);
        table_free(&t->opened);
        free(t);
    }
    table_free(&w->children);
    free(w->caller);
    free(w->func);
    free(w->own);
    free(w);
}

/* The node of the path `caller`'s then `func`: -1 when memory runs out. */
static int64_t child_node(struct walk *w, int64_t caller, int64_t func) {
    int64_t *node = table_value(&w->children, caller << 32 | func, w->nodes);
    if (!node)
        return -1;
    if (*node == w->nodes) {
        if (w->nodes == w->node_capacity || !w->node_capacity) {
            int64_t capacity = w->node_capacity ? 2 * w->node_capacity : 1024;
            int64_t *callers = realloc(w->caller, capacity * sizeof *callers);
            if (callers)
                w->caller = callers;
            int64_t *funcs = realloc(w->func, capacity * sizeof *funcs);
            if (funcs)
                w->func = funcs;
            int64_t *owns = realloc(w->own, capacity * sizeof *owns);
            if (owns)
                w->own = owns;
            if (!callers || !funcs || !owns)
                return -1;
            if (!w->node_capacity) {
                w->caller[0] = -1, w->func[0] = -1, w->own[0] = 0;
            }
            w->node_capacity = capacity;
        }
        w->caller[w->nodes] = caller;
        w->func[w->nodes] = func;
        w->own[w->nodes] = 0;
        w->nodes++;
    }
    return *node;
}

/* Drops the calls from `depth` up. */
static void cut(struct thread *t, int64_t depth) {
    for (int64_t d = depth; d < t->depth; d++) {
        struct call *c = &t->calls[d];
        if (c->frame)
            *table_find(&t->at, c->frame) = -1; /* (each open call's frame and function are there) */
        *table_find(&t->opened, c->func) -= 1;
    }
    if (depth < t->depth)
        t->depth = depth;
}

static int push(struct walk *w, struct thread *t, int64_t func, int64_t entered, int64_t frame) {
    if (frame) {
        int64_t open = table_get(&t->at, frame, -1);
        if (open >= 0)
            cut(t, open);
    }
    if (t->depth == t->capacity) {
        int64_t capacity = t->capacity ? 2 * t->capacity : 64;
        struct call *calls = realloc(t->calls, capacity * sizeof *calls);
        if (!calls)
            return -1;
        t->calls = calls;
        t->capacity = capacity;
    }
    int64_t *opened = table_value(&t->opened, func, 0);
    int64_t *at = frame ? table_value(&t->at, frame, -1) : NULL;
    if (!opened || (frame && !at))
        return -1;
    *opened += 1;
    if (at)
        *at = t->depth;
    int64_t node = 0;
    if (w->folded) {
        node = child_node(w, t->depth ? t->calls[t->depth - 1].node : 0, func);
        if (node < 0)
            return -1;
    }
    t->calls[t->depth++] = (struct call){func, entered, frame, 0, node};
    return 0;
}

/* The depth of the call an exit ends, or -1 when it is not open (entered before the trace
 * began, or its entry was not recorded). */
static int64_t closed_call(struct thread *t, int64_t func, int64_t frame) {
    if (frame)
        return table_get(&t->at, frame, -1);
    int64_t d = t->depth - 1;
    while (d >= 0 && t->calls[d].func != func)
        d--;
    if (d < 0)
        cut(t, 0);
    return d;
}

static void count(struct walk *w, int64_t func, int64_t spent, int64_t own, int outermost) {
    int64_t n = w->functions, *s = w->stats;
    s[CALLS * n + func] += 1;
    s[SPENT * n + func] += spent;
    if (outermost)
        s[TOTAL * n + func] += spent;
    s[SELF * n + func] += own;
    if (spent < s[SHORTEST * n + func])
        s[SHORTEST * n + func] = spent;
    if (spent > s[LONGEST * n + func])
        s[LONGEST * n + func] = spent;
    if (own < s[LEAST_SELF * n + func])
        s[LEAST_SELF * n + func] = own;
    if (own > s[MOST_SELF * n + func])
        s[MOST_SELF * n + func] = own;
}

/* Walks `count` events of one thread (every one an entry when `entries_only`: the calls a
 * forked child began inside). 0, or -1 when memory runs out. */
int walk_events(struct walk *w, struct thread *t, const uint16_t *kind, const uint16_t *frame, const uint32_t *func,
                const int64_t *time, int64_t count_, int entries_only) {
    for (int64_t i = 0; i < count_; i++) {
        int64_t f = func[i], fr = frame[i], now = time[i];
        if (entries_only || kind[i] != EXIT) {
            if (push(w, t, f, now, fr))
                return -1;
            continue;
        }
        struct call call;
        struct call *top = t->depth ? &t->calls[t->depth - 1] : NULL;
        if (top && top->frame == fr && (fr || top->func == f)) {
            call = *top; /* the common case: the exit of the innermost call */
            cut(t, t->depth - 1);
        } else {
            int64_t d = closed_call(t, f, fr);
            if (d < 0)
                continue;
            call = t->calls[d];
            cut(t, d);
        }
        if (f >= w->functions)
            continue;
        int64_t spent = now - call.entered, own = spent - call.callees;
        if (t->depth)
            t->calls[t->depth - 1].callees += spent;
        if (spent < w->threshold)
            continue;
        count(w, f, spent, own, table_get(&t->opened, f, 0) == 0);
        if (w->folded) {
            int64_t node = call.node;
            if (call.func != f) /* (a frame's exit names another function: the path says the exit's) */
                node = child_node(w, t->depth ? t->calls[t->depth - 1].node : 0, f);
            if (node < 0)
                return -1;
            w->own[node] += own;
        }
    }
    return 0;
}

/* Drops every open call of a thread (a flight recorder's snapshot begins after a gap). */
void walk_forget(struct thread *t) { cut(t, 0); }

/* The call paths: how many nodes, and (when given room for them) each's caller, function and
 * self time. */
int64_t walk_paths(const struct walk *w, int64_t *caller, int64_t *func, int64_t *own) {
    if (caller && w->node_capacity) {
        for (int64_t i = 0; i < w->nodes; i++) {
            caller[i] = w->caller[i];
            func[i] = w->func[i];
            own[i] = w->own[i];
        }
    }
    return w->node_capacity ? w->nodes : 0;
}
