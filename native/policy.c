/* The Python type of the eviction policies (policies.c has the hooks). Hooks take a job's slots at
 * once: an int32/int64 buffer (NumPy) or a sequence of ints; fingerprints likewise as uint64. */
#include "policy.h"

#include <string.h>

static const char *KINDS[] = {"lru", "slru", "s3fifo", "tinylfu"};

static PyObject *Policy_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    return type->tp_alloc(type, 0);
}

static int Policy_init(Policy *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"kind", "share_a", "share_b", NULL};
    const char *kind;
    double a = 0.0, b = 0.0;
    if (self->ready) { PyErr_SetString(PyExc_RuntimeError, "a policy is initialised once"); return -1; }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "s|dd", kwlist, &kind, &a, &b)) return -1;
    for (int k = 0; k < 4; k++) {
        if (strcmp(kind, KINDS[k]) == 0) {
            if (policy_setup(self, k, a, b) < 0) return -1;
            self->ready = true;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError, "no policy kind %s", kind);
    return -1;
}

static void Policy_dealloc(Policy *self) {
    policy_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define NEED_READY(p) \
    if (!(p)->ready) { PyErr_SetString(PyExc_RuntimeError, "policy not initialised"); return NULL; }

typedef int (*SlotsHook)(Policy *, const int32_t *, Py_ssize_t);

static PyObject *slots_hook(Policy *self, PyObject *arg, SlotsHook hook) {
    NEED_READY(self)
    Slots s;
    if (slots_get(arg, &s) < 0) return NULL;
    int rc = hook(self, s.v, s.n);
    slots_release(&s);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Policy_accessed(Policy *self, PyObject *arg) { return slots_hook(self, arg, policy_accessed); }
static PyObject *Policy_pinned(Policy *self, PyObject *arg) { return slots_hook(self, arg, policy_pinned); }
static PyObject *Policy_unpinned(Policy *self, PyObject *arg) { return slots_hook(self, arg, policy_unpinned); }
static PyObject *Policy_removed(Policy *self, PyObject *arg) { return slots_hook(self, arg, policy_removed); }

/* inserted(slots, fingerprints, chain=True, cold=0) */
static PyObject *Policy_inserted(Policy *self, PyObject *args, PyObject *kwds) {
    NEED_READY(self)
    static char *kwlist[] = {"slots", "fingerprints", "chain", "cold", NULL};
    PyObject *slots_obj, *fps_obj;
    int chain = 1;
    Py_ssize_t cold = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|pn", kwlist, &slots_obj, &fps_obj, &chain, &cold)) return NULL;
    Slots s;
    Words w;
    if (slots_get(slots_obj, &s) < 0) return NULL;
    if (words_get(fps_obj, &w) < 0) { slots_release(&s); return NULL; }
    int rc = -1;
    if (w.n != s.n && self->kind != KIND_LRU) PyErr_SetString(PyExc_ValueError, "one fingerprint per slot");
    else rc = policy_inserted(self, s.v, w.v, s.n, chain, cold);
    words_release(&w);
    slots_release(&s);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* recovered(slots_oldest_first, fingerprints) */
static PyObject *Policy_recovered(Policy *self, PyObject *const *args, Py_ssize_t nargs) {
    NEED_READY(self)
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "recovered(slots_oldest_first, fingerprints)"); return NULL; }
    Slots s;
    Words w;
    if (slots_get(args[0], &s) < 0) return NULL;
    if (words_get(args[1], &w) < 0) { slots_release(&s); return NULL; }
    int rc = -1;
    if (w.n != s.n && self->kind != KIND_LRU) PyErr_SetString(PyExc_ValueError, "one fingerprint per slot");
    else rc = policy_recovered(self, s.v, w.v, s.n);
    words_release(&w);
    slots_release(&s);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* victims(need=-1, exclude=(), weights=None) -> bytes of int32 slots, best victim first, until
 * their weights (weights[slot], a uint32 vector, maybe strided; 1 each without) reach ``need``
 * (< 0: every evictable slot not excluded). Choosing frees nothing: the caller frees the victims
 * it takes, then calls ``removed``. */
static PyObject *Policy_victims(Policy *self, PyObject *args, PyObject *kwds) {
    NEED_READY(self)
    static char *kwlist[] = {"need", "exclude", "weights", NULL};
    long long need = -1;
    PyObject *exclude_obj = NULL, *weights_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|LOO", kwlist, &need, &exclude_obj, &weights_obj)) return NULL;
    Slots ex = {0};
    Py_buffer wbuf = {0};
    Weights weights = {0};
    PyObject *result = NULL;
    Out out = {0};
    if (exclude_obj != NULL && slots_get(exclude_obj, &ex) < 0) return NULL;
    if (weights_obj != Py_None) {
        if (PyObject_GetBuffer(weights_obj, &wbuf, PyBUF_STRIDED_RO | PyBUF_FORMAT) < 0) goto done;
        if (wbuf.ndim != 1 || wbuf.itemsize != 4) {
            PyErr_SetString(PyExc_TypeError, "weights must be a 1-d vector of uint32");
            goto done;
        }
        weights = (Weights){wbuf.buf, wbuf.strides ? wbuf.strides[0] : 4, wbuf.shape ? wbuf.shape[0] : wbuf.len / 4};
    }
    if (policy_victims(self, need, &weights, ex.v, ex.n, &out) == 0) result = int32_bytes(out.v, out.n);
done:
    PyMem_Free(out.v);
    if (wbuf.obj) PyBuffer_Release(&wbuf);
    slots_release(&ex);
    return result;
}

/* counts() -> (admitted, refused, remembered, promoted, window_won, window_lost, pinned,
 * sketch_bytes, sizes per list, evicted per list) */
static PyObject *Policy_counts(Policy *self, PyObject *unused) {
    NEED_READY(self)
    PyObject *sizes = PyTuple_New(self->lists), *evicted = PyTuple_New(self->lists);
    if (!sizes || !evicted) { Py_XDECREF(sizes); Py_XDECREF(evicted); return NULL; }
    for (int l = 0; l < self->lists; l++) {
        PyTuple_SET_ITEM(sizes, l, PyLong_FromSsize_t(self->o.lists[l].size));
        PyTuple_SET_ITEM(evicted, l, PyLong_FromLongLong(self->evicted[l]));
    }
    Py_ssize_t sketch = self->has_sketch ? SKETCH_ROWS * sketch_width(&self->sketch) : 0;
    return Py_BuildValue("LLLLLLnnNN", (long long)self->admitted, (long long)self->refused,
                         (long long)self->remembered, (long long)self->promoted, (long long)self->window_won,
                         (long long)self->window_lost, self->pinned, sketch, sizes, evicted);
}

/* order(list) -> bytes of int32: a list's slots, oldest first (tests, kvtierctl). */
static PyObject *Policy_order(Policy *self, PyObject *arg) {
    NEED_READY(self)
    long l = PyLong_AsLong(arg);
    if (l == -1 && PyErr_Occurred()) return NULL;
    if (l < 0 || l >= self->lists) { PyErr_SetString(PyExc_IndexError, "no such list"); return NULL; }
    Out out = {0};
    for (int32_t s = self->o.lists[l].head; s != NO_SLOT; s = self->o.next[s]) {
        if (out.n == out.cap) {
            Py_ssize_t cap = out.cap ? 2 * out.cap : 256;
            int32_t *v = PyMem_Realloc(out.v, sizeof(int32_t) * (size_t)cap);
            if (v == NULL) { PyMem_Free(out.v); return PyErr_NoMemory(); }
            out.v = v;
            out.cap = cap;
        }
        out.v[out.n++] = s;
    }
    PyObject *r = int32_bytes(out.v, out.n);
    PyMem_Free(out.v);
    return r;
}

static PyObject *Policy_verify(Policy *self, PyObject *unused) {
    NEED_READY(self)
    const char *problem = policy_check(self);
    if (problem) { PyErr_SetString(PyExc_AssertionError, problem); return NULL; }
    Py_RETURN_NONE;
}

static PyObject *Policy_nbytes(Policy *self, void *closure) {
    Py_ssize_t per_slot = 2 * sizeof(int32_t) + 2 + (self->kind == KIND_SLRU ? 4 : 0) + (self->kind == KIND_TINYLFU ? 8 : 0);
    Py_ssize_t sketch = self->has_sketch ? SKETCH_ROWS * sketch_width(&self->sketch) : 0;
    return PyLong_FromSsize_t(self->o.cap * per_slot + sketch + self->marks_cap * 4);
}

static Py_ssize_t Policy_len(Policy *self) { return self->ready ? policy_len(self) : 0; }

static int Policy_contains(Policy *self, PyObject *arg) {
    long long s = PyLong_AsLongLong(arg);
    if (s == -1 && PyErr_Occurred()) return -1;
    return self->ready && s >= 0 && s < self->o.cap && order_listed(&self->o, (int32_t)s);
}

static PyMethodDef Policy_methods[] = {
    {"inserted", (PyCFunction)(void (*)(void))Policy_inserted, METH_VARARGS | METH_KEYWORDS,
     "inserted(slots, fingerprints, chain=True, cold=0): the entries became READY"},
    {"accessed", (PyCFunction)Policy_accessed, METH_O, "accessed(slots): looked up, loaded or stored again"},
    {"pinned", (PyCFunction)Policy_pinned, METH_O, "pinned(slots): left the evictable set"},
    {"unpinned", (PyCFunction)Policy_unpinned, METH_O, "unpinned(slots): back in the evictable set"},
    {"removed", (PyCFunction)Policy_removed, METH_O, "removed(slots): freed"},
    {"recovered", (PyCFunction)(void (*)(void))Policy_recovered, METH_FASTCALL,
     "recovered(slots_oldest_first, fingerprints): the set after a restart"},
    {"victims", (PyCFunction)(void (*)(void))Policy_victims, METH_VARARGS | METH_KEYWORDS,
     "victims(need=-1, exclude=(), weights=None) -> int32 slots, best victim first"},
    {"counts", (PyCFunction)Policy_counts, METH_NOARGS, "the counters and list sizes (a tuple)"},
    {"order", (PyCFunction)Policy_order, METH_O, "order(list) -> int32 slots of a list, oldest first"},
    {"verify", (PyCFunction)Policy_verify, METH_NOARGS, "check the lists and counts"},
    {NULL},
};

static PyGetSetDef Policy_getset[] = {
    {"nbytes", (getter)Policy_nbytes, NULL, "bytes of per-slot arrays and sketch", NULL},
    {NULL},
};

static PySequenceMethods Policy_as_sequence = {
    .sq_length = (lenfunc)Policy_len,
    .sq_contains = (objobjproc)Policy_contains,
};

PyTypeObject PolicyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtierd._native.Policy",
    .tp_doc = "An eviction policy over entry slots: lru, slru, s3fifo or tinylfu (kvtierd.policy).",
    .tp_basicsize = sizeof(Policy),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = Policy_new,
    .tp_init = (initproc)Policy_init,
    .tp_dealloc = (destructor)Policy_dealloc,
    .tp_methods = Policy_methods,
    .tp_getset = Policy_getset,
    .tp_as_sequence = &Policy_as_sequence,
};
