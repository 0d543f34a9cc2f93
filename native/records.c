/* Compiled passes over the region's entry records (kvtierd/records.py binds them to the format):
 * the keys' hashes and the record sums of region_format, for a whole table at recovery or a job's
 * records at once, one pass each instead of NumPy's ten. */
#include "native.h"

#include <string.h>

static const uint64_t GOLDEN = 0x9E3779B97F4A7C15ULL, MIX = 0x94D049BB133111EBULL;

/* key_hashes(records, slots, record_bytes, key_len_at, key_at, max_key) -> bytes: Python's hash of
 * each slot's key (uint64), read from its record; 0 for a record whose key length is out of range. */
PyObject *key_hashes(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    KeyRows k;
    if (key_rows_get(args, nargs, "key_hashes(records, slots, record_bytes, key_len_at, key_at, max_key)", &k) < 0)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, k.slots.n * 8);
    if (out) {
        uint64_t *h = (uint64_t *)PyBytes_AS_STRING(out);
        for (Py_ssize_t i = 0; i < k.slots.n; i++) {
            const uint8_t *rec = key_row(&k, i);
            Py_ssize_t len = rec[k.at_len];
            h[i] = len >= 1 && len <= k.max_key ? (uint64_t)_Py_HashBytes(rec + k.at_key, len) : 0;
        }
    }
    key_rows_release(&k);
    return out;
}

static inline uint64_t mixed(uint64_t word, Py_ssize_t position) {
    uint64_t x = word * (((uint64_t)(position + 1) * GOLDEN) | 1);
    x ^= x >> 32;
    return x * MIX;
}

/* region_format's entry_record_sum of one record: its words ANDed with ``mask``, its namespace's
 * identity, and its ``n`` chain links plus one, each word mixed with its position; never 0. */
static uint64_t record_sum(const uint8_t *rec, const uint64_t *mask, Py_ssize_t rec_words, uint64_t identity,
                           const uint32_t *links, Py_ssize_t n) {
    uint64_t sum = 0, word;
    for (Py_ssize_t k = 0; k < rec_words; k++) {
        memcpy(&word, rec + 8 * k, 8);
        sum += mixed(word & mask[k], k);
    }
    sum += mixed(identity, rec_words);
    for (Py_ssize_t j = 0; j < n; j++)
        sum += mixed((uint64_t)links[j] + 1, rec_words + 1 + j);
    return sum ? sum : 1;
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
        Py_ssize_t links_here = counts.v ? counts.v[i] : width;
        sums[i] = record_sum(rec, mask.v, rec_words, per_slot_id ? ids.v[i] : one_id, links + i * width,
                             links_here < width ? links_here : width);
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

/* The reasons judge_ready gives a READY record (0: sound), in kvtierd/recovery.py's _REASONS order. */
enum { SOUND, BAD_KEY, BAD_NS, BAD_COUNT, CHAIN_OUT, CHAIN_LONG, BAD_TICK, BAD_SUM, NO_CHECKSUM };

typedef struct {              /* where judge_ready reads a record's fields (region_format.ENTRY_DTYPE) */
    Py_ssize_t bytes, state, key_len, ns, page_count, first_page, tick, checksum, key, record_sum;
} Layout;

static inline uint64_t read_u(const uint8_t *at, int width) {
    uint64_t v = 0;
    memcpy(&v, at, (size_t)width);          /* the format is little-endian, as is every host we build for */
    return v;
}

/* judge_ready(records, chain, layout, ns_pages, ns_identity, ns_checksums, mask, limits) ->
 * (slots, counts, ns, chains, width, checksum, fps, why, tick, states): every READY record of the
 * entry table judged on its own, in slot order, in one walk over the table (recovery.scan's first
 * stage; NumPy took ten gathers of a column each over the 128-byte records), and every record's
 * state byte as one contiguous column (NumPy's passes over the strided column read a cache line
 * per record: ~13 ms each for a million, and recovery made six).
 *
 * ``layout``: (record bytes, then the offsets of state, key_len, ns, page_count, first_page, tick,
 * checksum, key, record_sum); ``ns_pages`` (int64), ``ns_identity`` (uint64), ``ns_checksums``
 * (uint8): one per namespace slot, all 2**16; ``mask``: ENTRY_SUMMED; ``limits``: (READY,
 * MAX_KEY_BYTES, TICK_LIMIT, CHAIN_END, require_checksums). The checks, in order, each only of a
 * record still sound: key length, page count against its namespace's (none: BAD_NS), tick, the
 * chain walked ``count`` links (leaving the data area: CHAIN_OUT; not ending there: CHAIN_LONG),
 * the record sum, a data checksum where one is required. ``chains``: one row of ``width`` uint32
 * per record (the longest sound count), padded with CHAIN_END; ``fps``: each sound key's Python
 * hash (0 for the rest). Nothing in the tables' bytes can make it read out of bounds. */
PyObject *judge_ready(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "judge_ready(records, chain, layout, ns_pages, ns_identity, ns_checksums, "
                                         "mask, limits)");
        return NULL;
    }
    Layout L;
    long long lim[5];
    if (!PyArg_ParseTuple(args[2], "nnnnnnnnnn", &L.bytes, &L.state, &L.key_len, &L.ns, &L.page_count, &L.first_page,
                          &L.tick, &L.checksum, &L.key, &L.record_sum) ||
        !PyArg_ParseTuple(args[7], "LLLLL", &lim[0], &lim[1], &lim[2], &lim[3], &lim[4]))
        return NULL;
    uint8_t ready_state = (uint8_t)lim[0];
    Py_ssize_t max_key = (Py_ssize_t)lim[1];
    uint64_t tick_limit = (uint64_t)lim[2];
    uint32_t chain_end = (uint32_t)lim[3];
    bool require = lim[4] != 0;
    Py_buffer records = {0}, chain = {0}, pages = {0}, ids = {0}, flags = {0};
    Words mask = {0};
    PyObject *result = NULL, *out[9] = {NULL};
    if (PyObject_GetBuffer(args[0], &records, PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(args[1], &chain, PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(args[3], &pages, PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(args[4], &ids, PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(args[5], &flags, PyBUF_C_CONTIGUOUS) < 0 || words_get(args[6], &mask) < 0)
        goto done;
    Py_ssize_t fields[] = {L.state, L.key_len, L.ns + 1, L.page_count + 3, L.first_page + 3, L.tick + 7,
                           L.checksum + 7, L.record_sum + 7, L.key + max_key - 1};
    bool fits = L.bytes >= 1 && mask.n * 8 == L.bytes && max_key >= 0;
    for (size_t f = 0; f < sizeof fields / sizeof fields[0]; f++)
        fits = fits && fields[f] >= 0 && fields[f] < L.bytes;
    if (!fits || pages.len < (1 << 16) * 8 || ids.len < (1 << 16) * 8 || flags.len < (1 << 16)) {
        PyErr_SetString(PyExc_ValueError, "judge_ready: the layout does not fit its record, or a namespace table is "
                                          "shorter than 2**16");
        goto done;
    }
    const uint8_t *base = records.buf, *ns_flags = flags.buf;
    const int64_t *ns_pages = pages.buf;
    const uint64_t *ns_ids = ids.buf;
    const uint32_t *next = chain.buf;
    Py_ssize_t count = records.len / L.bytes, num_pages = chain.len / 4, n = 0, width = 0;
    uint8_t *states;
    if (!(out[8] = new_block(count, (void **)&states))) goto done;
    for (Py_ssize_t s = 0; s < count; s++) {
        states[s] = base[s * L.bytes + L.state];
        n += states[s] == ready_state;
    }
    int64_t *slots, *counts, *ns_of;
    uint64_t *checksum, *fps, *tick;
    int8_t *why;
    if (!(out[0] = new_block(n * 8, (void **)&slots)) || !(out[1] = new_block(n * 8, (void **)&counts)) ||
        !(out[2] = new_block(n * 8, (void **)&ns_of)) || !(out[4] = new_block(n * 8, (void **)&checksum)) ||
        !(out[5] = new_block(n * 8, (void **)&fps)) || !(out[6] = new_block(n, (void **)&why)) ||
        !(out[7] = new_block(n * 8, (void **)&tick)))
        goto done;
    for (Py_ssize_t s = 0, i = 0; s < count; s++) {     /* the checks before any chain walk */
        const uint8_t *rec = base + s * L.bytes;
        if (rec[L.state] != ready_state) continue;
        Py_ssize_t key_len = rec[L.key_len];
        slots[i] = s;
        ns_of[i] = (int64_t)read_u(rec + L.ns, 2);
        counts[i] = (int64_t)read_u(rec + L.page_count, 4);
        tick[i] = read_u(rec + L.tick, 8);
        checksum[i] = read_u(rec + L.checksum, 8);
        if (key_len == 0 || key_len > max_key) why[i] = BAD_KEY;
        else if (counts[i] != ns_pages[ns_of[i]]) why[i] = ns_pages[ns_of[i]] < 0 ? BAD_NS : BAD_COUNT;
        else if (tick[i] >= tick_limit) why[i] = BAD_TICK;
        else why[i] = SOUND;
        if (why[i] == SOUND && counts[i] > width) width = (Py_ssize_t)counts[i];
        i++;
    }
    uint32_t *rows;
    if (!(out[3] = new_block(n * width * 4, (void **)&rows))) goto done;
    for (Py_ssize_t k = 0; k < n * width; k++) rows[k] = chain_end;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *rec = base + (Py_ssize_t)slots[i] * L.bytes;
        fps[i] = 0;
        if (why[i] != SOUND) continue;
        uint32_t *row = rows + i * width;
        uint64_t cur = read_u(rec + L.first_page, 4);
        for (Py_ssize_t step = 0; step < counts[i]; step++) {
            if (cur >= (uint64_t)num_pages) { why[i] = CHAIN_OUT; break; }
            row[step] = (uint32_t)cur;
            cur = next[cur];
        }
        if (why[i] != SOUND) continue;
        if (cur != chain_end) { why[i] = CHAIN_LONG; continue; }
        if (record_sum(rec, mask.v, mask.n, ns_ids[ns_of[i]], row, counts[i]) != read_u(rec + L.record_sum, 8)) {
            why[i] = BAD_SUM;
            continue;
        }
        if (checksum[i] == 0 && (ns_flags[ns_of[i]] || require)) { why[i] = NO_CHECKSUM; continue; }
        fps[i] = (uint64_t)_Py_HashBytes(rec + L.key, rec[L.key_len]);
    }
    result = Py_BuildValue("(OOOOnOOOOO)", out[0], out[1], out[2], out[3], width, out[4], out[5], out[6], out[7],
                           out[8]);
done:
    for (int k = 0; k < 9; k++) Py_XDECREF(out[k]);
    Py_buffer *held[] = {&records, &chain, &pages, &ids, &flags};
    for (int k = 0; k < 5; k++)
        if (held[k]->obj) PyBuffer_Release(held[k]);
    words_release(&mask);
    return result;
}

/* The records at ``slots`` of a writable table of ``rec_bytes``-byte records, checked in range. */
static int rows_get(PyObject *records_obj, PyObject *slots_obj, Py_ssize_t rec_bytes, Py_buffer *records, Slots *s) {
    if (rec_bytes < 1) { PyErr_SetString(PyExc_ValueError, "record size must be positive"); return -1; }
    if (PyObject_GetBuffer(records_obj, records, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return -1;
    if (slots_get(slots_obj, s) < 0) { PyBuffer_Release(records); return -1; }
    Py_ssize_t count = records->len / rec_bytes;
    for (Py_ssize_t i = 0; i < s->n; i++)
        if (s->v[i] < 0 || s->v[i] >= count) {
            PyErr_Format(PyExc_ValueError, "slot %d out of range", s->v[i]);
            slots_release(s);
            PyBuffer_Release(records);
            return -1;
        }
    return 0;
}

/* fill(records, record_bytes, slots, offset, width, value): the field of ``width`` bytes (1, 2, 4
 * or 8) at ``offset`` of each slot's record set to ``value`` (a column write that NumPy does as a
 * strided scatter: ~4x the time for a job's 1,024 records). */
PyObject *fill(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) { PyErr_SetString(PyExc_TypeError, "fill(records, record_bytes, slots, offset, width, value)"); return NULL; }
    Py_ssize_t rec_bytes = PyLong_AsSsize_t(args[1]), offset = PyLong_AsSsize_t(args[3]), width = PyLong_AsSsize_t(args[4]);
    uint64_t value = PyLong_AsUnsignedLongLongMask(args[5]);
    if (PyErr_Occurred()) return NULL;
    if ((width != 1 && width != 2 && width != 4 && width != 8) || offset < 0 || offset + width > rec_bytes) {
        PyErr_SetString(PyExc_ValueError, "fill: the field does not fit its record");
        return NULL;
    }
    Py_buffer records;
    Slots s;
    if (rows_get(args[0], args[2], rec_bytes, &records, &s) < 0) return NULL;
    uint8_t *base = records.buf;
    for (Py_ssize_t i = 0; i < s.n; i++)
        memcpy(base + (Py_ssize_t)s.v[i] * rec_bytes + offset, &value, (size_t)width);   /* little-endian */
    slots_release(&s);
    PyBuffer_Release(&records);
    Py_RETURN_NONE;
}

/* new_records(records, slots, template, pages, first_page_at, tick_at, tick): each slot's record
 * becomes ``template`` (one record's bytes) with its first page (row i of ``pages``: uint32, one
 * row per slot, its first link) and ``tick`` written in (one pass instead of NumPy's repeat,
 * field writes and row scatter: ~1/4 of a 1,024-key store's index work). */
PyObject *new_records(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "new_records(records, slots, template, pages, first_page_at, tick_at, tick)");
        return NULL;
    }
    Py_ssize_t first_at = PyLong_AsSsize_t(args[4]), tick_at = PyLong_AsSsize_t(args[5]);
    uint64_t tick = PyLong_AsUnsignedLongLongMask(args[6]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer template = {0}, pages = {0}, records = {0};
    Slots s = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(args[2], &template, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t rec_bytes = template.len;
    if (PyObject_GetBuffer(args[3], &pages, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (rows_get(args[0], args[1], rec_bytes, &records, &s) < 0) goto done;
    Py_ssize_t width = s.n ? pages.len / 4 / s.n : 0;
    if ((s.n && (width < 1 || pages.len != s.n * width * 4)) || first_at < 0 || first_at + 4 > rec_bytes ||
        tick_at < 0 || tick_at + 8 > rec_bytes) {
        PyErr_SetString(PyExc_ValueError, "new_records: one uint32 row of pages per slot, fields within the record");
        goto done;
    }
    const uint32_t *rows = pages.buf;
    uint8_t *base = records.buf;
    for (Py_ssize_t i = 0; i < s.n; i++) {
        uint8_t *rec = base + (Py_ssize_t)s.v[i] * rec_bytes;
        memcpy(rec, template.buf, (size_t)rec_bytes);
        memcpy(rec + first_at, &rows[i * width], 4);
        memcpy(rec + tick_at, &tick, 8);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    if (records.obj) { slots_release(&s); PyBuffer_Release(&records); }
    if (pages.obj) PyBuffer_Release(&pages);
    PyBuffer_Release(&template);
    return result;
}

/* seal_records(records, slots, chains, identity, mask, tick_at, sum_at, state_at, tick, state): a
 * write's records made whole in one pass, record by record: ``tick``, then the record sum (as
 * record_sums gives it, with namespace ``identity`` and chain row i: n rows of uint32), then the
 * one-byte ``state``, last (a record says READY only once it is complete). Replaces a column
 * fill, record_sums, NumPy's scatter of the sums and a second fill: each of a 1,024-key job's
 * records is read from memory once, not three times. */
PyObject *seal_records(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "seal_records(records, slots, chains, identity, mask, tick_at, sum_at, state_at, tick, state)");
        return NULL;
    }
    uint64_t identity = PyLong_AsUnsignedLongLongMask(args[3]);
    Py_ssize_t tick_at = PyLong_AsSsize_t(args[5]), sum_at = PyLong_AsSsize_t(args[6]),
               state_at = PyLong_AsSsize_t(args[7]);
    uint64_t tick = PyLong_AsUnsignedLongLongMask(args[8]);
    long state = PyLong_AsLong(args[9]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer records = {0}, chains = {0};
    Slots s = {0};
    Words mask = {0};
    PyObject *result = NULL;
    if (words_get(args[4], &mask) < 0) return NULL;
    Py_ssize_t rec_words = mask.n, rec_bytes = rec_words * 8;
    if (PyObject_GetBuffer(args[2], &chains, PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0) goto done;
    if (rows_get(args[0], args[1], rec_bytes, &records, &s) < 0) goto done;
    Py_ssize_t n = s.n, width = chains.ndim == 2 ? chains.shape[1] : (n ? chains.len / 4 / n : 0);
    if (chains.itemsize != 4 || (n && chains.len != n * width * 4) || tick_at < 0 || tick_at + 8 > rec_bytes ||
        sum_at < 0 || sum_at + 8 > rec_bytes || state_at < 0 || state_at >= rec_bytes || state < 0 || state > 255) {
        PyErr_SetString(PyExc_ValueError, "seal_records: one uint32 chain row per slot, fields within the record");
        goto done;
    }
    uint8_t *base = records.buf, state_byte = (uint8_t)state;
    const uint32_t *links = chains.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t *rec = base + (Py_ssize_t)s.v[i] * rec_bytes;
        memcpy(rec + tick_at, &tick, 8);
        uint64_t sum = record_sum(rec, mask.v, rec_words, identity, links + i * width, width);
        memcpy(rec + sum_at, &sum, 8);
        __atomic_signal_fence(__ATOMIC_RELEASE);     /* the state byte is written after the rest */
        rec[state_at] = state_byte;
    }
    result = Py_NewRef(Py_None);
done:
    if (records.obj) { slots_release(&s); PyBuffer_Release(&records); }
    if (chains.obj) PyBuffer_Release(&chains);
    words_release(&mask);
    return result;
}

/* count_state(records, record_bytes, slots, state_at, state) -> int: how many of the slots'
 * records hold the one-byte ``state`` (NumPy's gather of the strided column, compare and count: ~6
 * µs for a job's 1,024 records, against one pass here). */
PyObject *count_state(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "count_state(records, record_bytes, slots, state_at, state)");
        return NULL;
    }
    Py_ssize_t rec_bytes = PyLong_AsSsize_t(args[1]), state_at = PyLong_AsSsize_t(args[3]);
    long state = PyLong_AsLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (state_at < 0 || state_at >= rec_bytes) {
        PyErr_SetString(PyExc_ValueError, "count_state: the state field does not fit its record");
        return NULL;
    }
    Py_buffer records;
    Slots s;
    if (rows_get(args[0], args[2], rec_bytes, &records, &s) < 0) return NULL;
    const uint8_t *base = records.buf;
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < s.n; i++)
        count += base[(Py_ssize_t)s.v[i] * rec_bytes + state_at] == state;
    slots_release(&s);
    PyBuffer_Release(&records);
    return PyLong_FromSsize_t(count);
}
