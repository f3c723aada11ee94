/* The upcall server's steps that run on every request (core/upcalls.py): waiting for a
 * doorbell to ring and finding the thread that asks, writing back the registers a handler
 * changed, and answering the thread. Each is a few loads and stores on shared memory; in
 * Python each costs what a whole request may cost, and the wait would hold the GIL the tracing
 * thread needs. Handlers, and everything else about a request, stay Python.
 *
 * The words' offsets and values are layout.py's, given once (`set_layout`). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static Py_ssize_t state_word = -1, sleeping_word, cpu_word, words_needed, frame_byte, prefetch_to;
static uint64_t request_value, answered_value;
static long long spin_ns;

static PyObject *set_layout(PyObject *module, PyObject *args, PyObject *kwargs) {
    (void)module;
    static char *names[] = {"state", "sleeping", "cpu", "request", "answered", "frame", "prefetch_to", "spin_ns",
                            NULL};
    Py_ssize_t state, sleeping, cpu, from, to;
    unsigned long long request, answered;
    long long spin;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|$nnnKKnnL", names, &state, &sleeping, &cpu, &request,
                                     &answered, &from, &to, &spin))
        return NULL;
    if (PyTuple_GET_SIZE(args) || !kwargs || PyDict_GET_SIZE(kwargs) != 8) {
        PyErr_SetString(PyExc_TypeError, "set_layout: every value, by name");
        return NULL;
    }
    if (state < 0 || sleeping < 0 || cpu < 0 || from < 0 || from % 8 || to < from || spin < 0) {
        PyErr_SetString(PyExc_ValueError, "set_layout: offsets and a time that are not negative");
        return NULL;
    }
    state_word = state, sleeping_word = sleeping, cpu_word = cpu;
    Py_ssize_t last = state > sleeping ? state : sleeping;
    words_needed = 1 + (last > cpu ? last : cpu);
    request_value = request, answered_value = answered;
    frame_byte = from, prefetch_to = to, spin_ns = spin;
    Py_RETURN_NONE;
}

static int64_t now_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

/* `bells`: per doorbell, our address of its RING word and the value last seen there. */
static uint32_t ring_of(const uint64_t *bells, Py_ssize_t i) {
    return __atomic_load_n((const uint32_t *)(uintptr_t)bells[2 * i], __ATOMIC_ACQUIRE);
}

static int rung(const uint64_t *bells, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++)
        if (ring_of(bells, i) != bells[2 * i + 1])
            return 1;
    return 0;
}

/* The first of `askers` (thread areas, as buffers of u64s), from `start` round, whose state is
 * REQUEST (the lines its answer reads first sent for: they come while the caller gets there),
 * or -1; -2 with an exception set (an area let go: its buffer no longer to be had). */
static Py_ssize_t asking(PyObject *askers, Py_ssize_t start) {
    Py_ssize_t count = PyList_GET_SIZE(askers);
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t at = (start + i) % count;
        Py_buffer area;
        if (PyObject_GetBuffer(PyList_GET_ITEM(askers, at), &area, PyBUF_SIMPLE) < 0)
            return -2;
        const uint64_t *words = area.buf;
        int asks = area.len >= words_needed * 8 &&
                   (__atomic_load_n(&words[state_word], __ATOMIC_ACQUIRE) & 0xFFFFFFFF) == request_value;
        if (asks)
            for (Py_ssize_t line = frame_byte; line < prefetch_to && line < area.len; line += 64)
                __builtin_prefetch((const char *)area.buf + line, 0, 3);
        PyBuffer_Release(&area);
        if (asks)
            return at;
    }
    return -1;
}

/* next_request(bells, askers, start) -> int: the index in `askers` (a list of the thread areas
 * that may ask, as u64 buffers) of one that asks, looked for from `start` round (each thread in
 * turn); else, once a doorbell rings, looked for again, and -2 if none of `askers` asks (a thread
 * the caller does not know of yet may have rung); -1 if no doorbell rings within the spin time.
 * `bells`: an array('Q'), per doorbell our address of its RING word (the caller keeps it mapped
 * throughout) and the value last seen there, read again before each look at the areas (a
 * request after the look rings again). The GIL is let go while it waits; the areas are read only
 * with it held (they may be let go meanwhile: ValueError). */
static PyObject *next_request(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3 || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "next_request(bells, askers: list, start)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    if (start == -1 && PyErr_Occurred())
        return NULL;
    if (state_word < 0 || start < 0) {
        PyErr_SetString(PyExc_ValueError, "next_request: set_layout first, and a start not negative");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    if (view.len % 16) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "next_request: an address and a value seen per doorbell");
        return NULL;
    }
    uint64_t *bells = view.buf;
    Py_ssize_t count = view.len / 16, found;
    for (int after_ring = 0;; after_ring = 1) {
        found = asking(args[1], start);
        if (found != -1 || after_ring) {
            found = found == -1 ? -2 : found;
            break;
        }
        int rang = rung(bells, count);
        if (!rang) {
            Py_BEGIN_ALLOW_THREADS
            int64_t until = now_ns() + spin_ns;
            while (!rang) {
                for (int i = 0; i < 64 && !rang; i++) {
                    _mm_pause();
                    rang = rung(bells, count);
                }
                if (!rang && now_ns() >= until)
                    break;
            }
            Py_END_ALLOW_THREADS
        }
        if (!rang)
            break; /* -1 */
        for (Py_ssize_t i = 0; i < count; i++)
            bells[2 * i + 1] = ring_of(bells, i);
    }
    PyBuffer_Release(&view);
    if (found == -2 && PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(found);
}

/* The words of `frame` that `changed` (a copy of it a handler may have changed: `count` words)
 * no longer holds, written: the thread's CPU keeps the cache lines of the others. */
static void write_back(uint64_t *frame, const uint64_t *changed, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++)
        if (frame[i] != changed[i])
            frame[i] = changed[i];
}

/* answer(cells, cpu, regs) -> bool: answer the thread whose area `cells` is: first the words
 * of its frame that `regs` (a copy a handler may have changed; None: none) no longer holds
 * written back, then its state ANSWERED, then, past a full barrier, woken if it said it sleeps
 * (the detour sets SLEEPING and looks at the state again past one of its own, so one of the two
 * sees the other's store). Whether it asked on CPU `cpu` (read only if it sleeps: one that asks
 * there sleeps at once, and the word is not in the cache line the server reads anyway). */
static PyObject *answer(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "answer(cells, cpu, regs)");
        return NULL;
    }
    long long cpu = PyLong_AsLongLong(args[1]);
    if (cpu == -1 && PyErr_Occurred())
        return NULL;
    if (state_word < 0) {
        PyErr_SetString(PyExc_RuntimeError, "answer: set_layout first");
        return NULL;
    }
    Py_buffer area, regs;
    int changed = args[2] != Py_None;
    if (PyObject_GetBuffer(args[0], &area, PyBUF_WRITABLE) < 0)
        return NULL;
    if (changed && PyObject_GetBuffer(args[2], &regs, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&area);
        return NULL;
    }
    int whole = area.len >= words_needed * 8 &&
                (!changed || (regs.len % 8 == 0 && regs.len <= area.len - frame_byte));
    int here = 0;
    if (whole) {
        uint64_t *words = area.buf;
        if (changed)
            write_back((uint64_t *)((char *)area.buf + frame_byte), regs.buf, regs.len / 8);
        __atomic_store_n(&words[state_word], answered_value, __ATOMIC_SEQ_CST);
        int sleeps = __atomic_load_n(&words[sleeping_word], __ATOMIC_SEQ_CST) != 0;
        if (sleeps)
            syscall(SYS_futex, &words[state_word], FUTEX_WAKE, 1, NULL, NULL, 0);
        here = sleeps && __atomic_load_n(&words[cpu_word], __ATOMIC_RELAXED) == (uint64_t)cpu;
    }
    if (changed)
        PyBuffer_Release(&regs);
    PyBuffer_Release(&area);
    if (!whole) {
        PyErr_SetString(PyExc_ValueError, "answer: not a whole thread area, or a frame that is not in it");
        return NULL;
    }
    return PyBool_FromLong(here);
}

static PyMethodDef methods[] = {
    {"set_layout", (PyCFunction)(void (*)(void))set_layout, METH_VARARGS | METH_KEYWORDS, "The layout's words."},
    {"next_request", (PyCFunction)(void (*)(void))next_request, METH_FASTCALL, "A thread that asks."},
    {"answer", (PyCFunction)(void (*)(void))answer, METH_FASTCALL, "Answer a thread."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_upcalls", "See core/upcalls.py.", 0, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__upcalls(void) { return PyModule_Create(&module); }
