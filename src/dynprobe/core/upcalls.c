/* The upcall server's steps that run on every request (core/upcalls.py): waiting for a
 * doorbell to ring, writing back the registers a handler changed, and answering a thread. Each
 * is a few loads and stores on shared memory; in Python each costs what a whole request may
 * cost, and the wait would hold the GIL the tracing thread needs. Handlers, and everything else
 * about a request, stay Python.
 *
 * The word offsets are layout.py's, given once (`set_layout`). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static Py_ssize_t state_word = -1, sleeping_word, cpu_word, words_needed;
static uint64_t request_value, answered_value;

static PyObject *set_layout(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "set_layout(state, sleeping, cpu, request, answered): word indexes, values");
        return NULL;
    }
    Py_ssize_t state = PyLong_AsSsize_t(args[0]), sleeping = PyLong_AsSsize_t(args[1]);
    Py_ssize_t cpu = PyLong_AsSsize_t(args[2]);
    unsigned long long request = PyLong_AsUnsignedLongLong(args[3]), answered = PyLong_AsUnsignedLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (state < 0 || sleeping < 0 || cpu < 0) {
        PyErr_SetString(PyExc_ValueError, "word indexes are not negative");
        return NULL;
    }
    state_word = state, sleeping_word = sleeping, cpu_word = cpu;
    request_value = request, answered_value = answered;
    words_needed = 1 + (state > sleeping ? (state > cpu ? state : cpu) : (sleeping > cpu ? sleeping : cpu));
    Py_RETURN_NONE;
}

static int64_t now_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

/* Whether a doorbell's ring no longer holds the value seen. */
static int rung(const uint64_t *rings, const uint32_t *seen, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++)
        if (__atomic_load_n((const uint32_t *)(uintptr_t)rings[i], __ATOMIC_ACQUIRE) != seen[i])
            return 1;
    return 0;
}

/* The first of `askers` (thread areas, as buffers of u64s), from `start` round, whose state is
 * REQUEST, or -1; -2 with an exception set (an area let go: a buffer no longer to be had). */
static Py_ssize_t asking(PyObject *askers, Py_ssize_t start) {
    Py_ssize_t count = PyList_GET_SIZE(askers);
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t at = (start + i) % count;
        Py_buffer area;
        if (PyObject_GetBuffer(PyList_GET_ITEM(askers, at), &area, PyBUF_SIMPLE) < 0)
            return -2;
        int asks = area.len >= words_needed * 8 &&
                   (__atomic_load_n(&((const uint64_t *)area.buf)[state_word], __ATOMIC_ACQUIRE) & 0xFFFFFFFF) ==
                       request_value;
        PyBuffer_Release(&area);
        if (asks)
            return at;
    }
    return -1;
}

/* next_request(rings, seen, askers, start, budget_ns) -> int: the index in `askers` (a list of
 * the thread areas that may ask, as u64 buffers) of one that asks, looked for from `start` round
 * (each thread in turn); else, once a doorbell rings (`rings`, an array('Q') of our addresses of
 * their RING words, which the caller keeps mapped throughout; `seen`, an array('I') of the
 * values last read, updated before each look at the areas: a request after the look rings
 * again), looked for again, and -2 if none of `askers` asks (a thread the caller does not know
 * of yet may have rung); -1 if no doorbell rings within `budget_ns`. The GIL is let go while it
 * waits; the areas are read only with it held (they may be let go meanwhile: ValueError). */
static PyObject *next_request(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5 || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "next_request(rings, seen, askers: list, start, budget_ns)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[3]);
    long long budget = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (state_word < 0 || start < 0) {
        PyErr_SetString(PyExc_ValueError, "next_request: set_layout first, and a start not negative");
        return NULL;
    }
    Py_buffer rings, seen;
    if (PyObject_GetBuffer(args[0], &rings, PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &seen, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&rings);
        return NULL;
    }
    Py_ssize_t count = rings.len / 8, found = -1;
    if (rings.len % 8 || seen.len != count * 4) {
        PyErr_SetString(PyExc_ValueError, "next_request: an address (u64) and a value seen (u32) per doorbell");
        found = -3;
    }
    const uint64_t *addresses = rings.buf;
    uint32_t *values = seen.buf;
    for (int after_ring = 0; found == -1; after_ring = 1) {
        found = asking(args[2], start);
        if (found != -1)
            break;
        if (after_ring) {
            found = -2;
            break;
        }
        int rang = rung(addresses, values, count);
        if (!rang) {
            Py_BEGIN_ALLOW_THREADS
            int64_t until = now_ns() + budget;
            while (!rang) {
                for (int i = 0; i < 64 && !rang; i++) {
                    _mm_pause();
                    rang = rung(addresses, values, count);
                }
                if (!rang && now_ns() >= until)
                    break;
            }
            Py_END_ALLOW_THREADS
        }
        if (!rang)
            break; /* -1 */
        for (Py_ssize_t j = 0; j < count; j++)
            values[j] = __atomic_load_n((const uint32_t *)(uintptr_t)addresses[j], __ATOMIC_ACQUIRE);
    }
    PyBuffer_Release(&rings);
    PyBuffer_Release(&seen);
    if (found == -3 || (found == -2 && PyErr_Occurred()))
        return NULL;
    return PyLong_FromSsize_t(found);
}

/* write_back(area, at, regs): the words of the frame at byte `at` of `area` that `regs` (a copy
 * of it a handler may have changed) no longer holds, written: the thread's CPU keeps the cache
 * lines of the others. */
static PyObject *write_back(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "write_back(area, at, regs)");
        return NULL;
    }
    Py_ssize_t at = PyLong_AsSsize_t(args[1]);
    if (at == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer area, regs;
    if (PyObject_GetBuffer(args[0], &area, PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[2], &regs, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&area);
        return NULL;
    }
    if (at < 0 || at % 8 || regs.len % 8 || at > area.len - regs.len) {
        PyBuffer_Release(&area);
        PyBuffer_Release(&regs);
        PyErr_SetString(PyExc_ValueError, "write_back: the frame is not words inside the area");
        return NULL;
    }
    uint64_t *frame = (uint64_t *)((char *)area.buf + at);
    const uint64_t *changed = regs.buf;
    for (Py_ssize_t i = 0; i < regs.len / 8; i++)
        if (frame[i] != changed[i])
            frame[i] = changed[i];
    PyBuffer_Release(&area);
    PyBuffer_Release(&regs);
    Py_RETURN_NONE;
}

/* answer(cells, cpu) -> bool: answer the thread whose area `cells` is (its state ANSWERED,
 * then, past a full barrier, woken if it said it sleeps: the detour sets SLEEPING and looks at
 * the state again past one of its own, so one of the two sees the other's store); whether it
 * asked on CPU `cpu` (read only if it sleeps: one that asks there sleeps at once, and the word
 * is not in the cache line the server reads anyway). */
static PyObject *answer(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "answer(cells, cpu)");
        return NULL;
    }
    long long cpu = PyLong_AsLongLong(args[1]);
    if (cpu == -1 && PyErr_Occurred())
        return NULL;
    if (state_word < 0) {
        PyErr_SetString(PyExc_RuntimeError, "answer: set_layout first");
        return NULL;
    }
    Py_buffer area;
    if (PyObject_GetBuffer(args[0], &area, PyBUF_WRITABLE) < 0)
        return NULL;
    if (area.len < words_needed * 8) {
        PyBuffer_Release(&area);
        PyErr_SetString(PyExc_ValueError, "answer: not a whole thread area");
        return NULL;
    }
    uint64_t *words = area.buf;
    __atomic_store_n(&words[state_word], answered_value, __ATOMIC_SEQ_CST);
    int sleeps = __atomic_load_n(&words[sleeping_word], __ATOMIC_SEQ_CST) != 0;
    if (sleeps)
        syscall(SYS_futex, &words[state_word], FUTEX_WAKE, 1, NULL, NULL, 0);
    /* (one that asks on the server's CPU sleeps at once: one that spun did not ask there) */
    int here = sleeps && __atomic_load_n(&words[cpu_word], __ATOMIC_RELAXED) == (uint64_t)cpu;
    PyBuffer_Release(&area);
    return PyBool_FromLong(here);
}

static PyMethodDef methods[] = {
    {"set_layout", (PyCFunction)(void (*)(void))set_layout, METH_FASTCALL, "The area's word indexes."},
    {"next_request", (PyCFunction)(void (*)(void))next_request, METH_FASTCALL, "A thread that asks."},
    {"write_back", (PyCFunction)(void (*)(void))write_back, METH_FASTCALL, "A frame's changed words."},
    {"answer", (PyCFunction)(void (*)(void))answer, METH_FASTCALL, "Answer a thread."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_upcalls", "See core/upcalls.py.", 0, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__upcalls(void) { return PyModule_Create(&module); }
