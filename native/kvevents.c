/* vLLM's KV cache events written from key blobs (kvtierd/kvevents_wire.py binds them to the wire
 * format): a KVEventBatch's BlockStored and BlockRemoved events in one pass over a batch's keys,
 * and a job's keys gathered from the entry records as one blob. The msgpack around each hash and
 * group comes from Python as templates (msgpack's own bytes for the same maps); here each hash and
 * group is written in msgpack's shortest form, as msgpack-python packs it. */
#include "native.h"

#include <string.h>

#define GROUP_BYTES 4

typedef struct {
    const uint8_t *before, *middle, *after;       /* around the hash array, then the group */
    Py_ssize_t before_n, middle_n, after_n;
} Template;

typedef struct {
    Template stored, removed;
    bool int_hash;                                /* the hash's last 8 bytes as an unsigned int */
} Form;

static inline Py_ssize_t uint_size(uint64_t v) {
    return v < 128 ? 1 : v < 1ULL << 8 ? 2 : v < 1ULL << 16 ? 3 : v < 1ULL << 32 ? 5 : 9;
}

static inline uint8_t *put_be(uint8_t *p, uint64_t v, int bytes) {
    for (int i = bytes - 1; i >= 0; i--) *p++ = (uint8_t)(v >> (8 * i));
    return p;
}

static inline uint8_t *put_uint(uint8_t *p, uint64_t v) {
    switch (uint_size(v)) {
    case 1: *p++ = (uint8_t)v; return p;
    case 2: *p++ = 0xcc; return put_be(p, v, 1);
    case 3: *p++ = 0xcd; return put_be(p, v, 2);
    case 5: *p++ = 0xce; return put_be(p, v, 4);
    default: *p++ = 0xcf; return put_be(p, v, 8);
    }
}

static inline uint64_t be_value(const uint8_t *p, Py_ssize_t n) {
    uint64_t v = 0;
    for (Py_ssize_t i = 0; i < n; i++) v = v << 8 | p[i];
    return v;
}

static inline uint64_t int_hash(const uint8_t *key, Py_ssize_t hash_len) {
    if (hash_len >= 8) {
        uint64_t v;
        memcpy(&v, key + hash_len - 8, 8);
        return __builtin_bswap64(v);
    }
    return be_value(key, hash_len);
}

static inline uint8_t *put_hash(const Form *f, uint8_t *p, const uint8_t *key, Py_ssize_t hash_len) {
    if (f->int_hash) return put_uint(p, int_hash(key, hash_len));
    if (hash_len < 256) { *p++ = 0xc4; *p++ = (uint8_t)hash_len; }
    else { *p++ = 0xc5; p = put_be(p, (uint64_t)hash_len, 2); }
    memcpy(p, key, (size_t)hash_len);
    return p + hash_len;
}

/* The hashes of a run of keys, each in msgpack's shortest form; ``order``: the keys' positions in
 * the blob, NULL for the blob's keys in order. The usual int hash (from 2**32 up) is a uint64's 9
 * bytes written at once. */
static uint8_t *put_hashes(const Form *f, uint8_t *p, const uint8_t *blob, Py_ssize_t key_len,
                           const Py_ssize_t *order, Py_ssize_t n) {
    Py_ssize_t hash_len = key_len - GROUP_BYTES;
    bool wide = f->int_hash && hash_len >= 8;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *key = blob + (order ? order[i] : i) * key_len;
        uint64_t h = wide ? int_hash(key, hash_len) : 0;
        if (h >> 32) {
            uint64_t be = __builtin_bswap64(h);
            *p = 0xcf;
            memcpy(p + 1, &be, 8);
            p += 9;
        } else {
            p = put_hash(f, p, key, hash_len);
        }
    }
    return p;
}

static inline Py_ssize_t array_header_size(Py_ssize_t n) { return n < 16 ? 1 : n < 1 << 16 ? 3 : 5; }

static inline uint8_t *put_array_header(uint8_t *p, Py_ssize_t n) {
    if (n < 16) { *p++ = (uint8_t)(0x90 | n); return p; }
    if (n < 1 << 16) { *p++ = 0xdc; return put_be(p, (uint64_t)n, 2); }
    *p++ = 0xdd;
    return put_be(p, (uint64_t)n, 4);
}

static inline uint64_t group_of(const uint8_t *key, Py_ssize_t key_len) {
    uint32_t v;
    memcpy(&v, key + key_len - GROUP_BYTES, GROUP_BYTES);
    return __builtin_bswap32(v);
}

/* How many of a blob's first keys share the first key's group: all of them in the usual blob, one
 * vLLM engine's keys of one KV-cache group, which then needs no map (group_runs' map and a probe
 * per key were ~12 µs of a 1,024-key removal's ~20). */
static Py_ssize_t same_group(const uint8_t *blob, Py_ssize_t key_len, Py_ssize_t n, uint64_t *first) {
    Py_ssize_t same = 0;
    *first = n ? group_of(blob, key_len) : 0;
    while (same < n && group_of(blob + same * key_len, key_len) == *first) same++;
    return same;
}

/* The distinct groups of a blob's keys of several groups (``same_group`` said they are not one),
 * in the order they first come, and each key's position in its group's run: ``order`` lists the
 * keys group by group (each group's keys in blob order). A small open-addressing map of groups
 * keeps it one pass whatever the keys (a namespace's keys need not be vLLM's: every key may have
 * a group of its own). Returns the group count, -1 on no memory. ``groups``, ``counts`` and
 * ``order`` hold n entries each. */
static Py_ssize_t group_runs(const uint8_t *blob, Py_ssize_t key_len, Py_ssize_t n, uint64_t *groups,
                             Py_ssize_t *counts, Py_ssize_t *order) {
    Py_ssize_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    Py_ssize_t *table = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)cap), *which = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    if (table == NULL || which == NULL) { PyMem_Free(table); PyMem_Free(which); return -1; }
    memset(table, 0xff, sizeof(Py_ssize_t) * (size_t)cap);
    Py_ssize_t distinct = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t g = group_of(blob + i * key_len, key_len);
        Py_ssize_t at = (Py_ssize_t)((g * 0x9E3779B97F4A7C15ULL) >> 40) & (cap - 1);
        while (table[at] >= 0 && groups[table[at]] != g) at = (at + 1) & (cap - 1);
        if (table[at] < 0) { table[at] = distinct; groups[distinct] = g; counts[distinct++] = 0; }
        which[i] = table[at];
        counts[which[i]]++;
    }
    /* counts → start of each group's run in ``order`` (table reused as the running position) */
    for (Py_ssize_t g = 0, start = 0; g < distinct; g++) { table[g] = start; start += counts[g]; }
    for (Py_ssize_t i = 0; i < n; i++) order[table[which[i]]++] = i;
    PyMem_Free(table);
    PyMem_Free(which);
    return distinct;
}

typedef struct {
    int kind;                 /* 0: BlockStored, 1: BlockRemoved, per group; 2: bytes as they are (one event) */
    Py_ssize_t key_len, n;
    Py_ssize_t events;        /* kinds 0 and 1: its groups; kind 2: 1 */
    uint64_t *groups;         /* kinds 0 and 1: the group runs: ``one_group`` and ``one_count`` when */
    Py_ssize_t *counts;       /* the keys are one group (``order`` unused: the blob's order), else */
    Py_ssize_t *order;        /* n entries each in kv_events' arrays (group_runs) */
    uint64_t one_group;
    Py_ssize_t one_count;
    Py_buffer blob;
} Part;

/* At most how many bytes a part's events take (written, the bytes object is cut to its length). */
static Py_ssize_t part_bound(const Form *f, const Part *part) {
    if (part->kind == 2) return part->blob.len;
    const Template *t = part->kind == 0 ? &f->stored : &f->removed;
    Py_ssize_t hash_most = f->int_hash ? 9 : part->key_len - GROUP_BYTES + 3;
    /* per key its hash; per event the template, an array header and a group */
    return part->n * hash_most + part->events * (t->before_n + t->middle_n + t->after_n + 10);
}

static uint8_t *put_part(const Form *f, uint8_t *p, const Part *part) {
    const uint8_t *blob = part->blob.buf;
    if (part->kind == 2) {
        memcpy(p, blob, (size_t)part->blob.len);
        return p + part->blob.len;
    }
    const Template *t = part->kind == 0 ? &f->stored : &f->removed;
    for (Py_ssize_t g = 0, at = 0; g < part->events; g++) {
        memcpy(p, t->before, (size_t)t->before_n);
        p = put_array_header(p + t->before_n, part->counts[g]);
        p = put_hashes(f, p, blob, part->key_len, part->events == 1 ? NULL : part->order + at, part->counts[g]);
        at += part->counts[g];
        memcpy(p, t->middle, (size_t)t->middle_n);
        p = put_uint(p + t->middle_n, part->groups[g]);
        memcpy(p, t->after, (size_t)t->after_n);
        p += t->after_n;
    }
    return p;
}

static int template_get(PyObject *obj, Template *t) {
    PyObject *b, *m, *a;
    if (!PyArg_ParseTuple(obj, "SSS", &b, &m, &a)) return -1;
    t->before = (const uint8_t *)PyBytes_AS_STRING(b);
    t->before_n = PyBytes_GET_SIZE(b);
    t->middle = (const uint8_t *)PyBytes_AS_STRING(m);
    t->middle_n = PyBytes_GET_SIZE(m);
    t->after = (const uint8_t *)PyBytes_AS_STRING(a);
    t->after_n = PyBytes_GET_SIZE(a);
    return 0;
}

/* kv_events(head, parts, tail, int_hash, stored, removed) -> (bytes, events): head, an array
 * header for the events, each part's events, then tail. A part is bytes (one event, written as
 * it is) or (kind, key_len, blob): kind 0 one BlockStored, kind 1 one BlockRemoved, per group of
 * the keys (groups in the order they first come, a group's hashes in blob order). The groups are
 * counted first (the array header says how many events follow), then the bytes written.
 * ``stored``/``removed``: (before, middle, after) templates around the hash array and the
 * group. Keys are longer than their 4-byte group (the caller skips others). */
PyObject *kv_events(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "kv_events(head, parts, tail, int_hash, stored, removed)");
        return NULL;
    }
    Form f;
    if (!PyBytes_Check(args[0]) || !PyList_Check(args[1]) || !PyBytes_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "kv_events: head and tail must be bytes, parts a list");
        return NULL;
    }
    f.int_hash = PyObject_IsTrue(args[3]);
    if (template_get(args[4], &f.stored) < 0 || template_get(args[5], &f.removed) < 0) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(args[1]), held = 0, mixed = 0, events = 0;
    Py_ssize_t head_n = PyBytes_GET_SIZE(args[0]), tail_n = PyBytes_GET_SIZE(args[2]);
    Part *parts = PyMem_Calloc((size_t)(count ? count : 1), sizeof(Part));
    PyObject *out = NULL;
    uint64_t *groups = NULL;
    Py_ssize_t *counts = NULL, *order = NULL;
    if (parts == NULL) return PyErr_NoMemory();
    for (; held < count; held++) {
        PyObject *item = PyList_GET_ITEM(args[1], held), *blob;
        Part *part = &parts[held];
        part->events = 1;
        if (PyBytes_Check(item)) {
            part->kind = 2;
            blob = item;
        } else if (!PyArg_ParseTuple(item, "inO", &part->kind, &part->key_len, &blob)) {
            goto done;
        }
        if (PyObject_GetBuffer(blob, &part->blob, PyBUF_SIMPLE) < 0) goto done;
        if (part->kind == 2) continue;
        if ((part->kind != 0 && part->kind != 1) || part->key_len <= GROUP_BYTES || part->blob.len % part->key_len) {
            PyBuffer_Release(&part->blob);
            PyErr_SetString(PyExc_ValueError, "kv_events: a part is (0 or 1, key length > 4, whole keys)");
            goto done;
        }
        part->n = part->blob.len / part->key_len;
        part->groups = &part->one_group;
        part->counts = &part->one_count;
        part->one_count = part->n;
        part->events = part->n ? 1 : 0;
        if (same_group(part->blob.buf, part->key_len, part->n, &part->one_group) < part->n) {
            part->one_count = -1;                  /* several groups: group_runs below */
            mixed += part->n;
        }
    }
    /* Per-key scratch only for the parts of several groups: a flush's usual parts are one group
     * each, and three arrays of 8 bytes a key, allocated and freed at every flush, made glibc give
     * the heap's top back to the kernel and fault it in again (a flush of ~6,000 keys took 145 µs
     * of the daemon's thread against ~30 µs in-process, most of it page faults; 2-vCPU VM). */
    if (mixed) {
        groups = PyMem_Malloc(sizeof(uint64_t) * (size_t)mixed);
        counts = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)mixed);
        order = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)mixed);
        if (!groups || !counts || !order) { PyErr_NoMemory(); goto done; }
    }
    Py_ssize_t size = head_n + 5 + tail_n;
    for (Py_ssize_t i = 0, at = 0; i < count; i++) {
        Part *part = &parts[i];
        if (part->kind != 2 && part->one_count < 0) {
            part->groups = groups + at;
            part->counts = counts + at;
            part->order = order + at;
            at += part->n;
            part->events = group_runs(part->blob.buf, part->key_len, part->n, part->groups, part->counts, part->order);
            if (part->events < 0) { PyErr_NoMemory(); goto done; }
        }
        events += part->events;
        size += part_bound(&f, part);
    }
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, size);
    if (bytes == NULL) goto done;
    uint8_t *start = (uint8_t *)PyBytes_AS_STRING(bytes), *p = start;
    memcpy(p, PyBytes_AS_STRING(args[0]), (size_t)head_n);
    p = put_array_header(p + head_n, events);
    for (Py_ssize_t i = 0; i < count; i++) p = put_part(&f, p, &parts[i]);
    memcpy(p, PyBytes_AS_STRING(args[2]), (size_t)tail_n);
    p += tail_n;
    if (_PyBytes_Resize(&bytes, p - start) == 0)       /* shrinks in place; on failure bytes is NULL, the error set */
        out = Py_BuildValue("Nn", bytes, events);
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&parts[i].blob);
    PyMem_Free(parts);
    PyMem_Free(groups);
    PyMem_Free(counts);
    PyMem_Free(order);
    return out;
}

/* How many rows ahead a pass over cold rows asks for (copied_keys). */
#define PREFETCH_AHEAD 8

/* copy_keys(records, slots, record_bytes, key_len_at, key_at, max_key, rows, lengths) -> (key_len,
 * bytes) | None: each slot's key field (all max_key bytes) into row ``slot`` of ``rows`` (max_key
 * bytes a row) and its length into ``lengths[slot]`` (the KV events log's copies of the keys it
 * follows, kvtierd.keycopies, taken from records in cache and read back after the records are
 * reused); and the keys one after another, as copied_keys gives them, in the same pass. A slot
 * without a row, or a key length over max_key (a scribbled record), is an error and nothing is
 * written. */
PyObject *copy_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    static const char usage[] = "copy_keys(records, slots, record_bytes, key_len_at, key_at, max_key, rows, lengths)";
    if (nargs != 8) { PyErr_SetString(PyExc_TypeError, usage); return NULL; }
    KeyRows k;
    if (key_rows_get(args, 6, usage, &k) < 0) return NULL;
    Py_buffer rows = {0}, lengths = {0};
    PyObject *out = NULL, *blob = NULL;
    if (PyObject_GetBuffer(args[6], &rows, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (PyObject_GetBuffer(args[7], &lengths, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (k.max_key < 1 || rows.len != lengths.len * k.max_key) {
        PyErr_SetString(PyExc_ValueError, "copy_keys: one row of max_key bytes and one length byte per slot");
        goto done;
    }
    for (Py_ssize_t i = 0; i < k.slots.n; i++) {      /* refused before anything is written */
        if (k.slots.v[i] >= lengths.len) {
            PyErr_Format(PyExc_ValueError, "copy_keys: slot %d has no row", k.slots.v[i]);
            goto done;
        }
        if (key_row(&k, i)[k.at_len] > k.max_key) {
            PyErr_Format(PyExc_ValueError, "copy_keys: slot %d: key length %d out of range", k.slots.v[i],
                         (int)key_row(&k, i)[k.at_len]);
            goto done;
        }
    }
    uint8_t *to = rows.buf, *len = lengths.buf, *keys = NULL;
    Py_ssize_t n = k.slots.n, key_len = n ? key_row(&k, 0)[k.at_len] : 0, words = key_words(key_len, k.max_key);
    if (n) {
        blob = PyBytes_FromStringAndSize(NULL, n * key_len);
        if (blob == NULL) goto done;
        keys = (uint8_t *)PyBytes_AS_STRING(blob);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *rec = key_row(&k, i);
        uint8_t *row = to + (Py_ssize_t)k.slots.v[i] * k.max_key;
        if (k.max_key == 64) memcpy(row, rec + k.at_key, 64);     /* the protocol's: a few wide moves */
        else memcpy(row, rec + k.at_key, (size_t)k.max_key);
        len[k.slots.v[i]] = rec[k.at_len];
        if (keys != NULL) {
            if (rec[k.at_len] == key_len) key_put(keys, i, n, row, key_len, words);
            else keys = NULL;
        }
    }
    out = keys != NULL ? Py_BuildValue("nO", key_len, blob) : Py_NewRef(Py_None);
done:
    Py_XDECREF(blob);
    if (rows.obj) PyBuffer_Release(&rows);
    if (lengths.obj) PyBuffer_Release(&lengths);
    key_rows_release(&k);
    return out;
}

/* copied_keys(rows, lengths, slots) -> (key_len, bytes) | None: the keys kept by copy_keys at
 * ``slots``, one after another, when they all have one length (None when they do not, or for no
 * slots: the caller splits them). The rows are cold when a removal is taken (its entries were
 * copied when they became READY), so each is asked for a few ahead. */
PyObject *copied_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "copied_keys(rows, lengths, slots)"); return NULL; }
    Py_buffer rows = {0}, lengths = {0};
    Slots s = {0};
    PyObject *out = NULL, *blob = NULL;
    if (PyObject_GetBuffer(args[0], &rows, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &lengths, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (slots_get(args[2], &s) < 0) goto done;
    if (lengths.len < 1 || rows.len % lengths.len) {
        PyErr_SetString(PyExc_ValueError, "copied_keys: one row and one length byte per slot");
        goto done;
    }
    Py_ssize_t row_bytes = rows.len / lengths.len;
    const uint8_t *from = rows.buf, *len = lengths.buf;
    for (Py_ssize_t i = 0; i < s.n; i++)
        if (s.v[i] < 0 || s.v[i] >= lengths.len) {
            PyErr_Format(PyExc_ValueError, "copied_keys: slot %d has no row", s.v[i]);
            goto done;
        }
    Py_ssize_t n = s.n, key_len = n ? len[s.v[0]] : 0, words = key_words(key_len, row_bytes);
    if (n == 0 || key_len > row_bytes) { out = Py_NewRef(Py_None); goto done; }
    blob = PyBytes_FromStringAndSize(NULL, n * key_len);
    if (blob == NULL) goto done;
    uint8_t *keys = (uint8_t *)PyBytes_AS_STRING(blob);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) __builtin_prefetch(from + (Py_ssize_t)s.v[i + PREFETCH_AHEAD] * row_bytes);
        if (len[s.v[i]] != key_len) { out = Py_NewRef(Py_None); goto done; }
        key_put(keys, i, n, from + (Py_ssize_t)s.v[i] * row_bytes, key_len, words);
    }
    out = Py_BuildValue("nO", key_len, blob);
done:
    Py_XDECREF(blob);
    slots_release(&s);
    if (lengths.obj) PyBuffer_Release(&lengths);
    PyBuffer_Release(&rows);
    return out;
}
