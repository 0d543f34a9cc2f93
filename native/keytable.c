/* KeyTable: (namespace, key) -> entry slot, an open-addressing hash table over the region's entry
 * table, whose records hold the keys. Compared key by key, byte for byte: a lookup can never return
 * another key's entry, whatever the hashes do (tests force them to collide: ``hash_mask``). */
#include "native.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

typedef struct {
    PyObject_HEAD
    Py_buffer records;          /* the entry table: slots x rec_bytes */
    uint8_t *base;
    Py_ssize_t slots, rec_bytes;
    Py_ssize_t at_state, at_key_len, at_ns, at_key, at_first_page, at_page_count, max_key;
    uint64_t *buckets;          /* 0: empty; else (tag << 32) | (slot + 1) */
    uint64_t mask;              /* buckets - 1 */
    uint64_t *fp;               /* per slot: its key's fingerprint (Python's hash of the bytes) */
    uint16_t *ns;               /* per slot: its namespace (a removal finds its bucket from these two) */
    uint64_t hash_mask;         /* all ones; tests narrow it to force collisions */
    Py_ssize_t count;
    uint64_t *hashes;           /* scratch: a batch's hashes */
    int32_t *found;             /* scratch: a batch's slots */
    Py_ssize_t scratch;
    bool ready;
} KeyTable;

static inline uint64_t mix(uint64_t fp, uint64_t ns) {
    uint64_t h = fp ^ (ns * 0x9E3779B97F4A7C15ULL);
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDULL;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ULL;
    h ^= h >> 33;
    return h;
}

static inline uint8_t *record(const KeyTable *t, Py_ssize_t slot) { return t->base + slot * t->rec_bytes; }

static inline uint16_t record_ns(const KeyTable *t, const uint8_t *rec) {
    return (uint16_t)(rec[t->at_ns] | (rec[t->at_ns + 1] << 8));
}

static inline uint64_t table_hash(const KeyTable *t, uint64_t fp, uint64_t ns) { return mix(fp & t->hash_mask, ns); }

static inline bool same_key(const KeyTable *t, const uint8_t *rec, uint16_t ns, const char *key, Py_ssize_t len) {
    return record_ns(t, rec) == ns && rec[t->at_key_len] == len && memcmp(rec + t->at_key, key, (size_t)len) == 0;
}

/* The bucket holding (ns, key), or the empty bucket where it would go. */
static inline uint64_t probe(const KeyTable *t, uint64_t h, uint16_t ns, const char *key, Py_ssize_t len) {
    uint64_t tag = h >> 32, i = tag & t->mask;
    for (;;) {
        uint64_t b = t->buckets[i];
        if (b == 0) return i;
        if ((b >> 32) == tag && same_key(t, record(t, (Py_ssize_t)(b & 0xFFFFFFFFu) - 1), ns, key, len)) return i;
        i = (i + 1) & t->mask;
    }
}

/* Prefetch the record the home bucket of key i names (its bucket was prefetched by hash_keys): the
 * probes run a few keys behind, so that a batch's cache misses overlap instead of adding up. */
#define AHEAD 16
static inline void prefetch_record(const KeyTable *t, Py_ssize_t i, Py_ssize_t n) {
    if (i >= n) return;
    uint64_t b = t->buckets[(t->hashes[i] >> 32) & t->mask];
    if (b) __builtin_prefetch(record(t, (Py_ssize_t)(b & 0xFFFFFFFFu) - 1) + t->at_key);
}

static int reserve(KeyTable *t, Py_ssize_t n) {
    if (n <= t->scratch) return 0;
    Py_ssize_t cap = t->scratch ? t->scratch : 1024;
    while (cap < n) cap *= 2;
    uint64_t *h = PyMem_Realloc(t->hashes, sizeof(uint64_t) * (size_t)cap);
    if (h == NULL) { PyErr_NoMemory(); return -1; }
    t->hashes = h;
    int32_t *f = PyMem_Realloc(t->found, sizeof(int32_t) * (size_t)cap);
    if (f == NULL) { PyErr_NoMemory(); return -1; }
    t->found = f;
    t->scratch = cap;
    return 0;
}

/* The keys' hashes into t->hashes (each key checked: bytes of 1..max_key), prefetching their home
 * buckets so that the probes that follow find them in cache. Sets *items to the list's items;
 * returns 0, or -1 with an exception set. */
static int hash_keys(KeyTable *t, PyObject *keys, uint16_t ns, Py_ssize_t *n, PyObject ***out) {
    if (!PyList_Check(keys)) { PyErr_SetString(PyExc_TypeError, "keys must be a list of bytes"); return -1; }
    *n = PyList_GET_SIZE(keys);
    if (reserve(t, *n) < 0) return -1;
    PyObject **items = PySequence_Fast_ITEMS(keys);
    *out = items;
    for (Py_ssize_t i = 0; i < *n; i++) {
        PyObject *k = items[i];
        if (!PyBytes_Check(k) || PyBytes_GET_SIZE(k) < 1 || PyBytes_GET_SIZE(k) > t->max_key) {
            PyErr_Format(PyExc_ValueError, "key %zd: keys are bytes of 1..%zd bytes", i, t->max_key);
            return -1;
        }
        Py_hash_t fp = PyObject_Hash(k);       /* cached on the bytes object (the decoder's checks made it) */
        uint64_t h = table_hash(t, (uint64_t)fp, ns);
        t->hashes[i] = h;
        __builtin_prefetch(&t->buckets[(h >> 32) & t->mask]);
    }
    return 0;
}

static int parse_ns(PyObject *obj, uint16_t *ns) {
    long v = PyLong_AsLong(obj);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || v > 0xFFFF) { PyErr_SetString(PyExc_ValueError, "namespace slot out of range"); return -1; }
    *ns = (uint16_t)v;
    return 0;
}

/* ---------------------------------------------------------------------------- construction */
static PyObject *KeyTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    KeyTable *self = (KeyTable *)type->tp_alloc(type, 0);
    return (PyObject *)self;
}

static int KeyTable_init(KeyTable *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"records", "record_bytes", "state_at", "key_len_at", "ns_at", "key_at", "max_key",
                             "first_page_at", "page_count_at", "hash_mask", NULL};
    PyObject *records;
    unsigned long long hash_mask = ~0ULL;
    if (self->ready) { PyErr_SetString(PyExc_RuntimeError, "KeyTable is initialised once"); return -1; }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Onnnnnnnn|K", kwlist, &records, &self->rec_bytes, &self->at_state,
                                     &self->at_key_len, &self->at_ns, &self->at_key, &self->max_key,
                                     &self->at_first_page, &self->at_page_count, &hash_mask))
        return -1;
    if (self->max_key < 1 || self->max_key > 255 || self->at_key + self->max_key > self->rec_bytes ||
        self->at_ns + 2 > self->rec_bytes || self->at_first_page + 4 > self->rec_bytes ||
        self->at_page_count + 4 > self->rec_bytes || self->rec_bytes < 1) {
        PyErr_SetString(PyExc_ValueError, "record layout does not fit its record size");
        return -1;
    }
    if (PyObject_GetBuffer(records, &self->records, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return -1;
    self->base = self->records.buf;
    self->slots = self->records.len / self->rec_bytes;
    if (self->slots > INT32_MAX - 1) {
        PyErr_SetString(PyExc_ValueError, "more than 2**31 - 2 entry slots");
        return -1;
    }
    Py_ssize_t cap = 16;
    while (cap < 2 * self->slots) cap *= 2;
    self->mask = (uint64_t)cap - 1;
    self->hash_mask = hash_mask;
    self->buckets = big_zeroed((size_t)cap * sizeof(uint64_t));
    self->fp = big_zeroed((size_t)(self->slots ? self->slots : 1) * sizeof(uint64_t));
    self->ns = big_zeroed((size_t)(self->slots ? self->slots : 1) * sizeof(uint16_t));
    if (self->buckets == NULL || self->fp == NULL || self->ns == NULL) { PyErr_NoMemory(); return -1; }
    self->ready = true;
    return 0;
}

static void KeyTable_dealloc(KeyTable *self) {
    if (self->records.obj) PyBuffer_Release(&self->records);
    if (self->buckets) munmap(self->buckets, (size_t)(self->mask + 1) * sizeof(uint64_t));
    if (self->fp) munmap(self->fp, (size_t)(self->slots ? self->slots : 1) * sizeof(uint64_t));
    if (self->ns) munmap(self->ns, (size_t)(self->slots ? self->slots : 1) * sizeof(uint16_t));
    PyMem_Free(self->hashes);
    PyMem_Free(self->found);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define NEED_READY(t, ret) \
    if (!(t)->ready) { PyErr_SetString(PyExc_RuntimeError, "KeyTable not initialised"); return ret; }

/* ---------------------------------------------------------------------------- lookups */
/* find(ns, keys) -> bytes: each key's slot as int32, -1 when absent. */
static PyObject *KeyTable_find(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    NEED_READY(t, NULL)
    uint16_t ns;
    Py_ssize_t n;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "find(ns, keys)"); return NULL; }
    if (parse_ns(args[0], &ns) < 0) return NULL;
    PyObject **items;
    if (hash_keys(t, args[1], ns, &n, &items) < 0) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) return NULL;
    int32_t *slots = (int32_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < AHEAD && i < n; i++) prefetch_record(t, i, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        prefetch_record(t, i + AHEAD, n);
        uint64_t b = t->buckets[probe(t, t->hashes[i], ns, PyBytes_AS_STRING(items[i]), PyBytes_GET_SIZE(items[i]))];
        slots[i] = b ? (int32_t)(b & 0xFFFFFFFFu) - 1 : -1;
    }
    return out;
}

/* prefix(ns, keys, state) -> bytes: the slots (int32) of the leading keys present whose record is
 * in ``state``: a lookup's hits. */
static PyObject *KeyTable_prefix(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    NEED_READY(t, NULL)
    uint16_t ns;
    Py_ssize_t n, hits = 0;
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "prefix(ns, keys, state)"); return NULL; }
    if (parse_ns(args[0], &ns) < 0) return NULL;
    long state = PyLong_AsLong(args[2]);
    if (state == -1 && PyErr_Occurred()) return NULL;
    PyObject **items;
    if (hash_keys(t, args[1], ns, &n, &items) < 0) return NULL;
    int32_t *slots = t->found;
    for (Py_ssize_t i = 0; i < AHEAD && i < n; i++) prefetch_record(t, i, n);
    for (; hits < n; hits++) {
        prefetch_record(t, hits + AHEAD, n);
        uint64_t b = t->buckets[probe(t, t->hashes[hits], ns, PyBytes_AS_STRING(items[hits]),
                                      PyBytes_GET_SIZE(items[hits]))];
        if (b == 0) break;
        int32_t slot = (int32_t)(b & 0xFFFFFFFFu) - 1;
        if (record(t, slot)[t->at_state] != state) break;
        slots[hits] = slot;
    }
    return int32_bytes(slots, hits);
}

/* ---------------------------------------------------------------------------- changes */
/* insert(ns, keys, slots): index the (distinct, absent) keys at the slots, writing each key (its
 * length and bytes) into its record; the caller wrote the rest of the record (zeros past the key).
 * KeyError (nothing changed) when a key is present already. */
static PyObject *KeyTable_insert(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    NEED_READY(t, NULL)
    uint16_t ns;
    Py_ssize_t n;
    Slots s;
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "insert(ns, keys, slots)"); return NULL; }
    if (parse_ns(args[0], &ns) < 0) return NULL;
    PyObject **items;
    if (hash_keys(t, args[1], ns, &n, &items) < 0) return NULL;
    if (slots_get(args[2], &s) < 0) return NULL;
    PyObject *result = NULL;
    if (s.n != n) { PyErr_SetString(PyExc_ValueError, "one slot per key"); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s.v[i] >= t->slots) { PyErr_Format(PyExc_ValueError, "slot %d out of range", s.v[i]); goto done; }
        if (t->buckets[probe(t, t->hashes[i], ns, PyBytes_AS_STRING(items[i]), PyBytes_GET_SIZE(items[i]))]) {
            PyErr_Format(PyExc_KeyError, "key %zd is indexed already", i);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len = PyBytes_GET_SIZE(items[i]);
        uint8_t *rec = record(t, s.v[i]);
        rec[t->at_key_len] = (uint8_t)len;
        memcpy(rec + t->at_key, PyBytes_AS_STRING(items[i]), (size_t)len);
        uint64_t at = probe(t, t->hashes[i], ns, PyBytes_AS_STRING(items[i]), len);
        if (t->buckets[at]) {      /* the caller broke its promise of distinct keys */
            PyErr_Format(PyExc_KeyError, "key %zd given twice (%zd keys before it were indexed)", i, i);
            t->count += i;
            goto done;
        }
        t->buckets[at] = (t->hashes[i] >> 32 << 32) | (uint64_t)(s.v[i] + 1);
        t->fp[s.v[i]] = (uint64_t)PyObject_Hash(items[i]);
        t->ns[s.v[i]] = ns;
    }
    t->count += n;
    result = Py_NewRef(Py_None);
done:
    slots_release(&s);
    return result;
}

/* The bucket indexing ``slot`` (h: its hash), or -1 if none. */
static int64_t bucket_of(const KeyTable *t, int32_t slot, uint64_t h) {
    uint64_t tag = h >> 32, i = tag & t->mask, want = (tag << 32) | (uint64_t)(slot + 1);
    for (;;) {
        uint64_t b = t->buckets[i];
        if (b == 0) return -1;
        if (b == want) return (int64_t)i;
        i = (i + 1) & t->mask;
    }
}

/* Empty bucket i, shifting back the run after it (linear probing's deletion: no tombstones). */
static void delete_at(KeyTable *t, uint64_t i) {
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & t->mask;
        uint64_t b = t->buckets[j];
        if (b == 0) break;
        uint64_t home = (b >> 32) & t->mask;
        if (((j - home) & t->mask) >= ((j - i) & t->mask)) {   /* its home is not in (i, j]: it may move */
            t->buckets[i] = b;
            i = j;
        }
    }
    t->buckets[i] = 0;
}

/* remove(slots): unindex the (distinct) slots' keys. KeyError (nothing removed) when a slot is not
 * indexed. Their buckets are found from the fingerprint and namespace kept per slot: no record is
 * read (the victims of an eviction are scattered over the table: a record read each was a cache
 * and TLB miss each). */
static PyObject *KeyTable_remove(KeyTable *t, PyObject *arg) {
    NEED_READY(t, NULL)
    Slots s;
    if (slots_get(arg, &s) < 0) return NULL;
    PyObject *result = NULL;
    if (reserve(t, s.n) < 0) goto done;
    for (Py_ssize_t i = 0; i < s.n; i++) {
        if (s.v[i] >= t->slots) { PyErr_Format(PyExc_KeyError, "slot %d is not indexed", s.v[i]); goto done; }
        t->hashes[i] = table_hash(t, t->fp[s.v[i]], t->ns[s.v[i]]);
        __builtin_prefetch(&t->buckets[(t->hashes[i] >> 32) & t->mask]);
    }
    for (Py_ssize_t i = 0; i < s.n; i++) {
        if (bucket_of(t, s.v[i], t->hashes[i]) < 0) {
            PyErr_Format(PyExc_KeyError, "slot %d is not indexed", s.v[i]);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < s.n; i++) {
        int64_t at = bucket_of(t, s.v[i], t->hashes[i]);
        if (at < 0) { PyErr_Format(PyExc_KeyError, "slot %d given twice", s.v[i]); goto done; }
        delete_at(t, (uint64_t)at);
        t->count--;
    }
    result = Py_NewRef(Py_None);
done:
    slots_release(&s);
    return result;
}

/* rebuild(slots, fingerprints=None, namespaces=None): index exactly these slots (a restart), their
 * keys' fingerprints and namespace slots given when the caller has them (recovery's scan: then no
 * record is read but on a hash collision), else read from the records. Their keys must be distinct
 * per namespace (the scan saw to it): KeyError otherwise, nothing indexed. */
static PyObject *KeyTable_rebuild(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    NEED_READY(t, NULL)
    Slots s, nss = {0};
    Words fps = {0};
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "rebuild(slots, fingerprints=None, namespaces=None)");
        return NULL;
    }
    if (slots_get(args[0], &s) < 0) return NULL;
    bool given = nargs == 3 && args[1] != Py_None && args[2] != Py_None;
    PyObject *result = NULL;
    memset(t->buckets, 0, sizeof(uint64_t) * (size_t)(t->mask + 1));
    t->count = 0;
    if (given && (words_get(args[1], &fps) < 0 || slots_get(args[2], &nss) < 0)) goto done;
    if (given && (fps.n != s.n || nss.n != s.n)) {
        PyErr_SetString(PyExc_ValueError, "one fingerprint and namespace per slot");
        goto done;
    }
    if (reserve(t, s.n) < 0) goto done;
    for (Py_ssize_t i = 0; i < s.n; i++) {     /* the hashes first, prefetching their buckets */
        int32_t slot = s.v[i];
        if (slot >= t->slots) { PyErr_Format(PyExc_ValueError, "slot %d out of range", slot); goto done; }
        uint64_t fp, ns;
        if (given) {
            fp = fps.v[i];
            ns = (uint64_t)nss.v[i];
        } else {
            const uint8_t *rec = record(t, slot);
            Py_ssize_t len = rec[t->at_key_len];
            if (len < 1 || len > t->max_key) { PyErr_Format(PyExc_ValueError, "slot %d: bad key length", slot); goto done; }
            fp = (uint64_t)_Py_HashBytes(rec + t->at_key, len);     /* == hash(bytes(key)) */
            ns = record_ns(t, rec);
        }
        t->fp[slot] = fp;
        t->ns[slot] = (uint16_t)ns;
        t->hashes[i] = table_hash(t, fp, ns);
        if (i >= 8) __builtin_prefetch(&t->buckets[(t->hashes[i - 8] >> 32) & t->mask], 1);
    }
    for (Py_ssize_t i = 0; i < s.n; i++) {
        if (i + 8 < s.n) __builtin_prefetch(&t->buckets[(t->hashes[i + 8] >> 32) & t->mask], 1);
        int32_t slot = s.v[i];
        uint64_t h = t->hashes[i], tag = h >> 32, at = tag & t->mask;
        for (;; at = (at + 1) & t->mask) {       /* a key compare only where the tags meet */
            uint64_t b = t->buckets[at];
            if (b == 0) break;
            if ((b >> 32) != tag) continue;
            const uint8_t *rec = record(t, slot), *other = record(t, (Py_ssize_t)(b & 0xFFFFFFFFu) - 1);
            if (same_key(t, other, record_ns(t, rec), (const char *)rec + t->at_key, rec[t->at_key_len])) {
                PyErr_Format(PyExc_KeyError, "slot %d: its key is indexed already", slot);
                goto done;
            }
        }
        t->buckets[at] = (tag << 32) | (uint64_t)(slot + 1);
        t->count++;
    }
    result = Py_NewRef(Py_None);
done:
    if (result == NULL) {
        memset(t->buckets, 0, sizeof(uint64_t) * (size_t)(t->mask + 1));
        t->count = 0;
    }
    words_release(&fps);
    slots_release(&nss);
    slots_release(&s);
    return result;
}

/* ---------------------------------------------------------------------------- per-slot reads */
/* fingerprints(slots) -> bytes: each slot's key fingerprint (uint64: Python's hash of the key). */
static PyObject *KeyTable_fingerprints(KeyTable *t, PyObject *arg) {
    NEED_READY(t, NULL)
    Slots s;
    if (slots_get(arg, &s) < 0) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, s.n * 8);
    if (out) {
        uint64_t *fp = (uint64_t *)PyBytes_AS_STRING(out);
        for (Py_ssize_t i = 0; i < s.n; i++) {
            if (s.v[i] >= t->slots) { PyErr_Format(PyExc_ValueError, "slot %d out of range", s.v[i]); Py_CLEAR(out); break; }
            fp[i] = t->fp[s.v[i]];
        }
    }
    slots_release(&s);
    return out;
}

/* pages(chain, slots, count=-1, lo=0, hi=count) -> bytes: links lo..hi-1 (uint32) of each slot's
 * chain of ``count`` pages (first_page in its record, then ``chain``): a rank's shard of each entry,
 * in order; count < 0: each record's whole chain (its page_count). ValueError on a chain that leaves
 * the table. */
static PyObject *KeyTable_pages(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    NEED_READY(t, NULL)
    Py_buffer chain;
    Slots s;
    Py_ssize_t count = -1, lo = 0, hi = -1;
    if (nargs < 2 || nargs > 5) { PyErr_SetString(PyExc_TypeError, "pages(chain, slots, count=-1, lo=0, hi=count)"); return NULL; }
    if (nargs > 2) count = PyLong_AsSsize_t(args[2]);
    if (nargs > 3) lo = PyLong_AsSsize_t(args[3]);
    if (nargs > 4) hi = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (count >= 0) {
        if (hi < 0) hi = count;
        if (lo < 0 || hi > count || lo > hi) { PyErr_SetString(PyExc_ValueError, "need 0 <= lo <= hi <= count"); return NULL; }
    }
    if (PyObject_GetBuffer(args[0], &chain, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (slots_get(args[1], &s) < 0) { PyBuffer_Release(&chain); return NULL; }
    const uint32_t *links = chain.buf;
    Py_ssize_t pages = chain.len / 4, total = 0;
    PyObject *out = NULL;
    for (Py_ssize_t i = 0; i < s.n; i++) {
        if (s.v[i] >= t->slots) { PyErr_Format(PyExc_ValueError, "slot %d out of range", s.v[i]); goto done; }
        if (count < 0) {
            uint32_t c;
            memcpy(&c, record(t, s.v[i]) + t->at_page_count, 4);
            total += c;
        }
    }
    if (count >= 0) total = s.n * (hi - lo);
    out = PyBytes_FromStringAndSize(NULL, total * 4);
    if (out == NULL) goto done;
    uint32_t *dst = (uint32_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < s.n; i++) {
        const uint8_t *rec = record(t, s.v[i]);
        uint32_t page, own;
        Py_ssize_t from = lo, to = hi;
        memcpy(&page, rec + t->at_first_page, 4);
        if (count < 0) {
            memcpy(&own, rec + t->at_page_count, 4);
            from = 0;
            to = own;
        }
        for (Py_ssize_t link = 0; link < to; link++) {
            if ((Py_ssize_t)page >= pages) {
                PyErr_Format(PyExc_ValueError, "slot %d: chain leaves the data area", s.v[i]);
                Py_CLEAR(out);
                goto done;
            }
            if (link >= from) *dst++ = page;
            page = links[page];
        }
    }
done:
    slots_release(&s);
    PyBuffer_Release(&chain);
    return out;
}

/* verify(): every bucket names a distinct slot whose record's key hashes to it and is found from
 * its home; the count matches (tests). AssertionError otherwise. */
static PyObject *KeyTable_verify(KeyTable *t, PyObject *unused) {
    NEED_READY(t, NULL)
    Py_ssize_t found = 0;
    uint8_t *seen = PyMem_Calloc((size_t)(t->slots ? t->slots : 1), 1);
    if (seen == NULL) return PyErr_NoMemory();
    const char *problem = NULL;
    for (uint64_t i = 0; i <= t->mask && !problem; i++) {
        uint64_t b = t->buckets[i];
        if (b == 0) continue;
        int64_t slot = (int64_t)(b & 0xFFFFFFFFu) - 1;
        if (slot < 0 || slot >= t->slots) { problem = "a bucket names a slot out of range"; break; }
        if (seen[slot]++) { problem = "a slot is indexed twice"; break; }
        const uint8_t *rec = record(t, slot);
        Py_ssize_t len = rec[t->at_key_len];
        if (len < 1 || len > t->max_key) { problem = "an indexed record has a bad key length"; break; }
        if ((uint64_t)_Py_HashBytes(rec + t->at_key, len) != t->fp[slot]) { problem = "a fingerprint is stale"; break; }
        if (t->ns[slot] != record_ns(t, rec)) { problem = "a slot's namespace is stale"; break; }
        uint64_t h = table_hash(t, t->fp[slot], record_ns(t, rec));
        if (t->buckets[probe(t, h, record_ns(t, rec), (const char *)rec + t->at_key, len)] != b)
            problem = "a key is not found from its home bucket";
        found++;
    }
    PyMem_Free(seen);
    if (!problem && found != t->count) problem = "the count differs from the buckets";
    if (problem) { PyErr_SetString(PyExc_AssertionError, problem); return NULL; }
    Py_RETURN_NONE;
}

static Py_ssize_t KeyTable_len(KeyTable *t) { return t->count; }

static PyObject *KeyTable_get_nbytes(KeyTable *t, void *closure) {
    return PyLong_FromSsize_t((Py_ssize_t)((t->mask + 1) * 8 + (uint64_t)t->slots * 10));
}

static PyMethodDef KeyTable_methods[] = {
    {"find", (PyCFunction)(void (*)(void))KeyTable_find, METH_FASTCALL, "find(ns, keys) -> int32 slots (-1: absent)"},
    {"prefix", (PyCFunction)(void (*)(void))KeyTable_prefix, METH_FASTCALL,
     "prefix(ns, keys, state) -> int32 slots of the leading keys present in that state"},
    {"insert", (PyCFunction)(void (*)(void))KeyTable_insert, METH_FASTCALL, "insert(ns, keys, slots)"},
    {"remove", (PyCFunction)KeyTable_remove, METH_O, "remove(slots)"},
    {"rebuild", (PyCFunction)(void (*)(void))KeyTable_rebuild, METH_FASTCALL,
     "rebuild(slots, fingerprints=None, namespaces=None): index these slots' records"},
    {"fingerprints", (PyCFunction)KeyTable_fingerprints, METH_O, "fingerprints(slots) -> uint64 per slot"},
    {"pages", (PyCFunction)(void (*)(void))KeyTable_pages, METH_FASTCALL,
     "pages(chain, slots, count=-1, lo=0, hi=count) -> uint32 links lo..hi-1 of each slot's chain"},
    {"verify", (PyCFunction)KeyTable_verify, METH_NOARGS, "check the table against the records"},
    {NULL},
};

static PyGetSetDef KeyTable_getset[] = {
    {"nbytes", (getter)KeyTable_get_nbytes, NULL, "bytes of buckets and fingerprints", NULL},
    {NULL},
};

static PySequenceMethods KeyTable_as_sequence = {.sq_length = (lenfunc)KeyTable_len};

PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtierd._native.KeyTable",
    .tp_doc = "(namespace, key) -> entry slot over the region's entry table (native/README.md).",
    .tp_basicsize = sizeof(KeyTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = KeyTable_new,
    .tp_init = (initproc)KeyTable_init,
    .tp_dealloc = (destructor)KeyTable_dealloc,
    .tp_methods = KeyTable_methods,
    .tp_getset = KeyTable_getset,
    .tp_as_sequence = &KeyTable_as_sequence,
};

