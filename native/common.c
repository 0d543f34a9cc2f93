/* Arguments from Python (slot and word vectors) and the growth of the ordered lists' arrays. */
#include "native.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static int from_sequence(PyObject *obj, Py_ssize_t *n, PyObject **fast) {
    *fast = PySequence_Fast(obj, "expected a buffer of integers or a sequence of ints");
    if (*fast == NULL) return -1;
    *n = PySequence_Fast_GET_SIZE(*fast);
    return 0;
}

int slots_get(PyObject *obj, Slots *out) {
    memset(out, 0, sizeof(*out));
    if (PyObject_CheckBuffer(obj) && !PyBytes_Check(obj)) {
        if (PyObject_GetBuffer(obj, &out->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
        out->has_view = true;
        Py_ssize_t item = out->view.itemsize;
        const char *f = out->view.format ? out->view.format : "B";
        if (*f == '<' || *f == '=' || *f == '@') f++;
        bool is_signed = (*f == 'i' || *f == 'l' || *f == 'q' || *f == 'n');
        if (!is_signed || (item != 4 && item != 8) || f[1] != '\0') {
            PyErr_Format(PyExc_TypeError, "slots must be int32 or int64, not format '%s'", out->view.format);
            slots_release(out);
            return -1;
        }
        out->n = out->view.len / item;
        if (item == 4) {
            out->v = (const int32_t *)out->view.buf;
        } else {
            const int64_t *src = (const int64_t *)out->view.buf;
            out->owned = PyMem_Malloc(sizeof(int32_t) * (size_t)(out->n ? out->n : 1));
            if (out->owned == NULL) { slots_release(out); PyErr_NoMemory(); return -1; }
            for (Py_ssize_t i = 0; i < out->n; i++) {
                if (src[i] < 0 || src[i] > INT32_MAX - 1) {
                    PyErr_Format(PyExc_ValueError, "slot %lld out of range", (long long)src[i]);
                    slots_release(out);
                    return -1;
                }
                out->owned[i] = (int32_t)src[i];
            }
            out->v = out->owned;
        }
    } else {
        PyObject *fast;
        if (from_sequence(obj, &out->n, &fast) < 0) return -1;
        out->owned = PyMem_Malloc(sizeof(int32_t) * (size_t)(out->n ? out->n : 1));
        if (out->owned == NULL) { Py_DECREF(fast); PyErr_NoMemory(); return -1; }
        PyObject **items = PySequence_Fast_ITEMS(fast);
        for (Py_ssize_t i = 0; i < out->n; i++) {
            long long value = PyLong_AsLongLong(items[i]);
            if (value == -1 && PyErr_Occurred()) { Py_DECREF(fast); slots_release(out); return -1; }
            if (value < 0 || value > INT32_MAX - 1) {
                PyErr_Format(PyExc_ValueError, "slot %lld out of range", value);
                Py_DECREF(fast);
                slots_release(out);
                return -1;
            }
            out->owned[i] = (int32_t)value;
        }
        Py_DECREF(fast);
        out->v = out->owned;
    }
    for (Py_ssize_t i = 0; i < out->n; i++) {
        if (out->v[i] < 0) {
            PyErr_Format(PyExc_ValueError, "slot %d out of range", out->v[i]);
            slots_release(out);
            return -1;
        }
    }
    return 0;
}

void slots_release(Slots *s) {
    if (s->owned) PyMem_Free(s->owned);
    if (s->has_view) PyBuffer_Release(&s->view);
    s->owned = NULL;
    s->has_view = false;
}

PyObject *int32_bytes(const int32_t *v, Py_ssize_t n) {
    return PyBytes_FromStringAndSize((const char *)v, n * (Py_ssize_t)sizeof(int32_t));
}

int words_get(PyObject *obj, Words *out) {
    memset(out, 0, sizeof(*out));
    if (PyObject_CheckBuffer(obj) && !PyBytes_Check(obj)) {
        if (PyObject_GetBuffer(obj, &out->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
        out->has_view = true;
        if (out->view.itemsize != 8) {
            PyErr_SetString(PyExc_TypeError, "expected 8-byte integers (uint64 or int64)");
            words_release(out);
            return -1;
        }
        out->n = out->view.len / 8;
        out->v = (const uint64_t *)out->view.buf;
        return 0;
    }
    PyObject *fast;
    if (from_sequence(obj, &out->n, &fast) < 0) return -1;
    out->owned = PyMem_Malloc(sizeof(uint64_t) * (size_t)(out->n ? out->n : 1));
    if (out->owned == NULL) { Py_DECREF(fast); PyErr_NoMemory(); return -1; }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < out->n; i++) {
        /* Python hashes are signed: take their two's complement bits, as NumPy's view does. */
        unsigned long long value = PyLong_AsUnsignedLongLongMask(items[i]);
        if (value == (unsigned long long)-1 && PyErr_Occurred()) { Py_DECREF(fast); words_release(out); return -1; }
        out->owned[i] = value;
    }
    Py_DECREF(fast);
    out->v = out->owned;
    return 0;
}

void words_release(Words *w) {
    if (w->owned) PyMem_Free(w->owned);
    if (w->has_view) PyBuffer_Release(&w->view);
    w->owned = NULL;
    w->has_view = false;
}

int order_reserve(Order *o, Py_ssize_t slots) {
    if (slots <= o->cap) return 0;
    Py_ssize_t cap = o->cap ? o->cap : 1024;
    while (cap < slots) cap *= 2;
    int32_t *prev = PyMem_Realloc(o->prev, sizeof(int32_t) * (size_t)cap);
    if (prev == NULL) { PyErr_NoMemory(); return -1; }
    o->prev = prev;
    int32_t *next = PyMem_Realloc(o->next, sizeof(int32_t) * (size_t)cap);
    if (next == NULL) { PyErr_NoMemory(); return -1; }
    o->next = next;
    uint8_t *where = PyMem_Realloc(o->where, (size_t)cap);
    if (where == NULL) { PyErr_NoMemory(); return -1; }
    o->where = where;
    memset(o->where + o->cap, WHERE_NONE, (size_t)(cap - o->cap));
    o->cap = cap;
    return 0;
}

void order_free(Order *o) {
    PyMem_Free(o->prev);
    PyMem_Free(o->next);
    PyMem_Free(o->where);
    o->prev = o->next = NULL;
    o->where = NULL;
    o->cap = 0;
}

int key_rows_get(PyObject *const *args, Py_ssize_t nargs, const char *usage, KeyRows *k) {
    if (nargs != 6) { PyErr_SetString(PyExc_TypeError, usage); return -1; }
    k->rec_bytes = PyLong_AsSsize_t(args[2]);
    k->at_len = PyLong_AsSsize_t(args[3]);
    k->at_key = PyLong_AsSsize_t(args[4]);
    k->max_key = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred()) return -1;
    if (k->rec_bytes < 1 || k->at_len < 0 || k->at_len >= k->rec_bytes || k->at_key < 0 || k->max_key < 0 ||
        k->at_key + k->max_key > k->rec_bytes) {
        PyErr_SetString(PyExc_ValueError, "record layout does not fit its record size");
        return -1;
    }
    if (PyObject_GetBuffer(args[0], &k->records, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (slots_get(args[1], &k->slots) < 0) { PyBuffer_Release(&k->records); return -1; }
    Py_ssize_t count = k->records.len / k->rec_bytes;
    for (Py_ssize_t i = 0; i < k->slots.n; i++)
        if (k->slots.v[i] < 0 || k->slots.v[i] >= count) {
            PyErr_Format(PyExc_ValueError, "slot %d out of range", k->slots.v[i]);
            key_rows_release(k);
            return -1;
        }
    return 0;
}

void key_rows_release(KeyRows *k) {
    slots_release(&k->slots);
    PyBuffer_Release(&k->records);
}

/* Zeroed memory for the big arrays, in transparent huge pages where the kernel gives them (random
 * probes then miss the TLB ~500x less often: measured, a key table's 1,024-key batch over a
 * million entries 3x slower when each probe walked page tables). */
void *big_zeroed(size_t bytes) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE);
#endif
    return p;
}

/* A writable buffer over big_zeroed memory, unmapped with its last reference: recovery's
 * million-row columns. As bytes objects (malloc: 4 KiB pages) each first touch was a page fault,
 * ~30 ms of a million-entry restart for judge_ready's and judge_related's ~90 MB. */
typedef struct {
    PyObject_HEAD
    void *at;
    Py_ssize_t bytes;
} Block;

static int Block_getbuffer(Block *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->at, self->bytes, 0, flags);
}

static void Block_dealloc(Block *self) {
    if (self->at) munmap(self->at, (size_t)(self->bytes ? self->bytes : 1));
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyBufferProcs Block_as_buffer = {.bf_getbuffer = (getbufferproc)Block_getbuffer};

PyTypeObject BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtierd._native.Block",
    .tp_doc = "Zeroed memory in huge pages where the kernel gives them, as a writable buffer.",
    .tp_basicsize = sizeof(Block),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Block_dealloc,
    .tp_as_buffer = &Block_as_buffer,
};

PyObject *new_block(Py_ssize_t bytes, void **at) {
    Block *b = PyObject_New(Block, &BlockType);
    if (b == NULL) return NULL;
    b->bytes = bytes;
    b->at = big_zeroed((size_t)(bytes ? bytes : 1));
    if (b->at == NULL) {
        Py_DECREF(b);
        return PyErr_NoMemory();
    }
    *at = b->at;
    return (PyObject *)b;
}
