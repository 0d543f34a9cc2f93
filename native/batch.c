/* Whole-request passes that need no table of their own: the holds on entries (pins, leases) and
 * the check of a request's keys. */
#include "native.h"

#include <string.h>

static int counts_arg(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != 4) {
        PyErr_SetString(PyExc_TypeError, "hold counts must be a writable uint32 vector");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* hold(mine, other, slots, step) -> (changed, bytes): one more (step +1) or one less (step -1)
 * hold of one kind (``mine``: a uint32 count per slot, beside ``other``, the other kind's) on each
 * of the (distinct) slots. ``changed``: how many went from 0 to 1 (+1) or 1 to 0 (-1); the bytes
 * (int32) are those of them the other kind does not hold: the slots that leave (+1) or re-enter
 * (-1) the eviction policy's set. */
PyObject *hold(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "hold(mine, other, slots, step)"); return NULL; }
    long step = PyLong_AsLong(args[3]);
    if (step == -1 && PyErr_Occurred()) return NULL;
    if (step != 1 && step != -1) { PyErr_SetString(PyExc_ValueError, "step is +1 or -1"); return NULL; }
    Py_buffer mine, other;
    Slots s;
    if (counts_arg(args[0], &mine) < 0) return NULL;
    if (counts_arg(args[1], &other) < 0) { PyBuffer_Release(&mine); return NULL; }
    PyObject *result = NULL, *out = NULL;
    if (slots_get(args[2], &s) < 0) goto done;
    uint32_t *m = mine.buf, *o = other.buf;
    Py_ssize_t n = mine.len / 4;
    for (Py_ssize_t i = 0; i < s.n; i++) {
        if (s.v[i] >= n || other.len / 4 <= s.v[i]) { PyErr_Format(PyExc_ValueError, "slot %d out of range", s.v[i]); goto done; }
        if (step < 0 && m[s.v[i]] == 0) { PyErr_Format(PyExc_ValueError, "slot %d holds nothing to let go", s.v[i]); goto done; }
    }
    out = PyBytes_FromStringAndSize(NULL, s.n * 4);
    if (out == NULL) goto done;
    int32_t *moved = (int32_t *)PyBytes_AS_STRING(out);
    Py_ssize_t changed = 0, k = 0;
    for (Py_ssize_t i = 0; i < s.n; i++) {
        int32_t slot = s.v[i];
        uint32_t before = m[slot];
        m[slot] = before + (uint32_t)step;
        if ((step > 0 && before == 0) || (step < 0 && before == 1)) {
            changed++;
            if (o[slot] == 0) moved[k++] = slot;
        }
    }
    if (_PyBytes_Resize(&out, k * 4) < 0) goto done;
    result = Py_BuildValue("nN", changed, out);
    out = NULL;
done:
    Py_XDECREF(out);
    slots_release(&s);
    PyBuffer_Release(&mine);
    PyBuffer_Release(&other);
    return result;
}

/* any_held(pins, leases, slots) -> bool: whether any of the slots is held (pinned or leased), in
 * one pass (NumPy's two gathers, compares and or: ~12 µs for an eviction's 1,024 victims). */
PyObject *any_held(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "any_held(pins, leases, slots)"); return NULL; }
    Py_buffer pins, leases;
    Slots s;
    if (counts_arg(args[0], &pins) < 0) return NULL;
    if (counts_arg(args[1], &leases) < 0) { PyBuffer_Release(&pins); return NULL; }
    PyObject *result = NULL;
    if (slots_get(args[2], &s) < 0) goto done;
    const uint32_t *p = pins.buf, *l = leases.buf;
    Py_ssize_t n = pins.len / 4 < leases.len / 4 ? pins.len / 4 : leases.len / 4;
    bool held = false;
    for (Py_ssize_t i = 0; i < s.n; i++) {
        if (s.v[i] < 0 || s.v[i] >= n) { PyErr_Format(PyExc_ValueError, "slot %d out of range", s.v[i]); break; }
        held |= (p[s.v[i]] | l[s.v[i]]) != 0;
    }
    if (!PyErr_Occurred()) result = PyBool_FromLong(held);
    slots_release(&s);
done:
    PyBuffer_Release(&pins);
    PyBuffer_Release(&leases);
    return result;
}

/* Whether the ``n`` bytes objects ``items`` are distinct: 1 or 0 (-1 with an exception: out of
 * memory). Each key is hashed on the way, and the bytes object keeps the hash for the key table. */
int keys_distinct(PyObject *const *items, Py_ssize_t n) {
    if (n < 2) return 1;
    Py_ssize_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    int32_t stack[1024];
    int32_t *seen = cap <= 1024 ? stack : PyMem_Malloc(sizeof(int32_t) * (size_t)cap);
    if (seen == NULL) { PyErr_NoMemory(); return -1; }
    memset(seen, 0xFF, sizeof(int32_t) * (size_t)cap);     /* -1: empty */
    int distinct = 1;
    for (Py_ssize_t i = 0; i < n && distinct; i++) {
        Py_hash_t h = PyObject_Hash(items[i]);
        size_t at = (size_t)h & (size_t)(cap - 1);
        for (; seen[at] >= 0; at = (at + 1) & (size_t)(cap - 1)) {
            PyObject *other = items[seen[at]];
            if (PyBytes_GET_SIZE(other) == PyBytes_GET_SIZE(items[i]) && PyObject_Hash(other) == h &&
                memcmp(PyBytes_AS_STRING(other), PyBytes_AS_STRING(items[i]), (size_t)PyBytes_GET_SIZE(other)) == 0) {
                distinct = 0;
                break;
            }
        }
        seen[at] = (int32_t)i;
    }
    if (seen != stack) PyMem_Free(seen);
    return distinct;
}

/* keys_ok(keys, max_len, max_count) -> bool: whether ``keys`` is a list of at most ``max_count``
 * distinct bytes objects of 1..max_len bytes, in one pass (hashing each key, which the bytes object
 * then keeps for the key table's lookup). False says nothing of why: the protocol's own check
 * names the fault. */
PyObject *keys_ok(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "keys_ok(keys, max_len, max_count)"); return NULL; }
    Py_ssize_t max_len = PyLong_AsSsize_t(args[1]), max_count = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) return NULL;
    PyObject *keys = args[0];
    if (!PyList_CheckExact(keys) || PyList_GET_SIZE(keys) > max_count) Py_RETURN_FALSE;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_CheckExact(items[i]) || PyBytes_GET_SIZE(items[i]) < 1 || PyBytes_GET_SIZE(items[i]) > max_len)
            Py_RETURN_FALSE;
    }
    int distinct = keys_distinct(items, n);
    if (distinct < 0) return NULL;
    return PyBool_FromLong(distinct);
}
