/* Compiled passes over the region's entry records (kvtierd/records.py binds them to the format):
 * the keys' hashes and the record sums of region_format, for a whole table at recovery or a job's
 * records at once, one pass each instead of NumPy's ten. */
#include "native.h"

#include <string.h>

static const uint64_t GOLDEN = 0x9E3779B97F4A7C15ULL, MIX = 0x94D049BB133111EBULL;

/* key_hashes(records, slots, record_bytes, key_len_at, key_at, max_key) -> bytes: Python's hash of
 * each slot's key (uint64), read from its record; 0 for a record whose key length is out of range. */
PyObject *key_hashes(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "key_hashes(records, slots, record_bytes, key_len_at, key_at, max_key)");
        return NULL;
    }
    Py_ssize_t rec_bytes = PyLong_AsSsize_t(args[2]), at_len = PyLong_AsSsize_t(args[3]),
               at_key = PyLong_AsSsize_t(args[4]), max_key = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (rec_bytes < 1 || at_len < 0 || at_len >= rec_bytes || at_key < 0 || max_key < 0 || at_key + max_key > rec_bytes) {
        PyErr_SetString(PyExc_ValueError, "record layout does not fit its record size");
        return NULL;
    }
    Py_buffer records;
    Slots s;
    if (PyObject_GetBuffer(args[0], &records, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (slots_get(args[1], &s) < 0) { PyBuffer_Release(&records); return NULL; }
    Py_ssize_t count = records.len / rec_bytes;
    PyObject *out = PyBytes_FromStringAndSize(NULL, s.n * 8);
    if (out) {
        uint64_t *h = (uint64_t *)PyBytes_AS_STRING(out);
        const uint8_t *base = records.buf;
        for (Py_ssize_t i = 0; i < s.n; i++) {
            if (s.v[i] >= count) { PyErr_Format(PyExc_ValueError, "slot %d out of range", s.v[i]); Py_CLEAR(out); break; }
            const uint8_t *rec = base + (Py_ssize_t)s.v[i] * rec_bytes;
            Py_ssize_t len = rec[at_len];
            h[i] = len >= 1 && len <= max_key ? (uint64_t)_Py_HashBytes(rec + at_key, len) : 0;
        }
    }
    slots_release(&s);
    PyBuffer_Release(&records);
    return out;
}

static inline uint64_t mixed(uint64_t word, Py_ssize_t position) {
    uint64_t x = word * (((uint64_t)(position + 1) * GOLDEN) | 1);
    x ^= x >> 32;
    return x * MIX;
}

/* record_sums(records, slots, chains, counts, identities, mask) -> bytes: region_format's
 * entry_record_sums of each slot's record (uint64): Σ over the record's words ANDed with ``mask``
 * (one uint64 per word of a record), its namespace's identity (``identities``: one uint64 per
 * slot, or one int for all), and the first ``counts[i]`` links of chain row i plus one (``chains``:
 * n rows of uint32; ``counts`` None: whole rows), each word mixed with its position; never 0. */
PyObject *record_sums(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "record_sums(records, slots, chains, counts, identities, mask)");
        return NULL;
    }
    Py_buffer records = {0}, chains = {0};
    Slots s = {0}, counts = {0};
    Words ids = {0}, mask = {0};
    uint64_t one_id = 0;
    bool per_slot_id = !PyLong_Check(args[4]);
    PyObject *out = NULL;
    if (PyObject_GetBuffer(args[0], &records, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (slots_get(args[1], &s) < 0) goto done;
    if (PyObject_GetBuffer(args[2], &chains, PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0) goto done;
    if (args[3] != Py_None && slots_get(args[3], &counts) < 0) goto done;
    if (per_slot_id) {
        if (words_get(args[4], &ids) < 0) goto done;
    } else {
        one_id = PyLong_AsUnsignedLongLongMask(args[4]);
        if (PyErr_Occurred()) goto done;
    }
    if (words_get(args[5], &mask) < 0) goto done;
    Py_ssize_t rec_words = mask.n, rec_bytes = rec_words * 8, n = s.n;
    Py_ssize_t width = chains.ndim == 2 ? chains.shape[1] : (n ? chains.len / 4 / n : 0);
    if (chains.itemsize != 4 || (n && chains.len != n * width * 4) || (per_slot_id && ids.n != n) ||
        (args[3] != Py_None && counts.n != n) || rec_words < 1) {
        PyErr_SetString(PyExc_ValueError, "record_sums: one chain row, count and identity per slot; uint32 chains");
        goto done;
    }
    Py_ssize_t count = records.len / rec_bytes;
    const uint8_t *base = records.buf;
    const uint32_t *links = chains.buf;
    out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (out == NULL) goto done;
    uint64_t *sums = (uint64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s.v[i] >= count) { PyErr_Format(PyExc_ValueError, "slot %d out of range", s.v[i]); Py_CLEAR(out); break; }
        const uint8_t *rec = base + (Py_ssize_t)s.v[i] * rec_bytes;
        uint64_t sum = 0, word;
        for (Py_ssize_t k = 0; k < rec_words; k++) {
            memcpy(&word, rec + 8 * k, 8);
            sum += mixed(word & mask.v[k], k);
        }
        sum += mixed(per_slot_id ? ids.v[i] : one_id, rec_words);
        Py_ssize_t links_here = counts.v ? counts.v[i] : width;
        for (Py_ssize_t j = 0; j < width && j < links_here; j++)
            sum += mixed((uint64_t)links[i * width + j] + 1, rec_words + 1 + j);
        sums[i] = sum ? sum : 1;
    }
done:
    if (records.obj) PyBuffer_Release(&records);
    if (chains.obj) PyBuffer_Release(&chains);
    slots_release(&s);
    slots_release(&counts);
    words_release(&ids);
    words_release(&mask);
    return out;
}
