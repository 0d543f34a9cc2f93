/* The disk tier's block checksums: XXH64 (Yann Collet's xxHash, 64-bit variant, written here from
 * its published specification, doc/xxhash_spec.md) of each block bound to its namespace, key,
 * length and shards, a run of blocks per call with the GIL released (kvtierd/tier/seal.py). */
#include "native.h"

#include <string.h>

#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL
#define P3 0x165667B19E3779F9ULL
#define P4 0x85EBCA77C2B2AE63ULL
#define P5 0x27D4EB2F165667C5ULL

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t le64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint32_t le32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline uint64_t lane_round(uint64_t acc, uint64_t lane) {
    acc += lane * P2;
    return rotl(acc, 31) * P1;
}

/* A hash in progress: the four lanes' accumulators, the bytes seen, and an unfinished stripe. */
typedef struct {
    uint64_t acc[4];
    uint64_t total;
    uint8_t stripe[32];
    size_t held;
} Xxh64;

static void xxh64_init(Xxh64 *h, uint64_t seed) {
    h->acc[0] = seed + P1 + P2;
    h->acc[1] = seed + P2;
    h->acc[2] = seed;
    h->acc[3] = seed - P1;
    h->total = 0;
    h->held = 0;
}

static inline void stripe(uint64_t acc[4], const uint8_t *p) {
    acc[0] = lane_round(acc[0], le64(p));
    acc[1] = lane_round(acc[1], le64(p + 8));
    acc[2] = lane_round(acc[2], le64(p + 16));
    acc[3] = lane_round(acc[3], le64(p + 24));
}

static void xxh64_update(Xxh64 *h, const uint8_t *p, size_t n) {
    h->total += n;
    if (h->held) {
        size_t take = 32 - h->held < n ? 32 - h->held : n;
        memcpy(h->stripe + h->held, p, take);
        h->held += take;
        p += take;
        n -= take;
        if (h->held < 32) return;
        stripe(h->acc, h->stripe);
        h->held = 0;
    }
    uint64_t a0 = h->acc[0], a1 = h->acc[1], a2 = h->acc[2], a3 = h->acc[3];
    for (; n >= 32; p += 32, n -= 32) {         /* the lanes in locals: four independent chains */
        a0 = lane_round(a0, le64(p));
        a1 = lane_round(a1, le64(p + 8));
        a2 = lane_round(a2, le64(p + 16));
        a3 = lane_round(a3, le64(p + 24));
    }
    h->acc[0] = a0, h->acc[1] = a1, h->acc[2] = a2, h->acc[3] = a3;
    memcpy(h->stripe, p, n);
    h->held = n;
}

static inline uint64_t merge(uint64_t acc, uint64_t lane) {
    acc ^= lane_round(0, lane);
    return acc * P1 + P4;
}

static uint64_t xxh64_digest(const Xxh64 *h, uint64_t seed) {
    uint64_t acc;
    if (h->total >= 32) {
        acc = rotl(h->acc[0], 1) + rotl(h->acc[1], 7) + rotl(h->acc[2], 12) + rotl(h->acc[3], 18);
        for (int i = 0; i < 4; i++) acc = merge(acc, h->acc[i]);
    } else {
        acc = seed + P5;
    }
    acc += h->total;
    const uint8_t *p = h->stripe;
    size_t n = h->held;
    for (; n >= 8; p += 8, n -= 8) {
        acc ^= lane_round(0, le64(p));
        acc = rotl(acc, 27) * P1 + P4;
    }
    if (n >= 4) {
        acc ^= (uint64_t)le32(p) * P1;
        acc = rotl(acc, 23) * P2 + P3;
        p += 4, n -= 4;
    }
    for (; n; p++, n--) {
        acc ^= (uint64_t)*p * P5;
        acc = rotl(acc, 11) * P1;
    }
    acc ^= acc >> 33;
    acc *= P2;
    acc ^= acc >> 29;
    acc *= P3;
    acc ^= acc >> 32;
    return acc;
}

/* xxh64(data, seed=0) -> int: the plain hash (for the known-answer tests and callers of one buffer). */
PyObject *xxh64(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) { PyErr_SetString(PyExc_TypeError, "xxh64(data, seed=0)"); return NULL; }
    uint64_t seed = 0;
    if (nargs == 2) {
        seed = PyLong_AsUnsignedLongLongMask(args[1]);
        if (seed == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    }
    Py_buffer data;
    if (PyObject_GetBuffer(args[0], &data, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Xxh64 h;
    xxh64_init(&h, seed);
    Py_BEGIN_ALLOW_THREADS
    xxh64_update(&h, data.buf, (size_t)data.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(xxh64_digest(&h, seed));
}

/* One block of a call: where its key and extents are (into the call's arrays). */
typedef struct {
    PyObject *key_obj;          /* a reference held while the GIL is released */
    const uint8_t *key;
    Py_ssize_t key_len, first, count;
    uint64_t bytes;
} SumBlock;

/* Parse block ``i``'s extents (a sequence of (offset, length) pairs) into ext[at...], each checked
 * to lie inside ``size`` bytes. The number of extents, or -1 with an exception set. */
static Py_ssize_t extents_of(PyObject *block, uint64_t *ext, Py_ssize_t room, Py_ssize_t size) {
    PyObject *seq = PySequence_Fast(block, "a block is a sequence of (offset, length) extents");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > room) { Py_DECREF(seq); return n; }     /* the caller grows ext and calls again */
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(seq, j);
        long long off, len;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "an extent is an (offset, length) tuple");
            Py_DECREF(seq);
            return -1;
        }
        off = PyLong_AsLongLong(PyTuple_GET_ITEM(pair, 0));
        len = PyLong_AsLongLong(PyTuple_GET_ITEM(pair, 1));
        if (PyErr_Occurred()) { Py_DECREF(seq); return -1; }
        if (off < 0 || len < 0 || off > size || len > size - off) {
            PyErr_Format(PyExc_ValueError, "extent (%lld, %lld) lies outside the memory's %zd bytes", off, len, size);
            Py_DECREF(seq);
            return -1;
        }
        ext[2 * j] = (uint64_t)off;
        ext[2 * j + 1] = (uint64_t)len;
    }
    Py_DECREF(seq);
    return n;
}

/* block_sums(memory, head, keys, blocks, indices, shards) -> bytes: for each i of ``indices``
 * the little-endian uint64 XXH64 (seed 0) of
 *     head | u16 len(keys[i]) | keys[i] | u64 bytes | u16 shards | the bytes of blocks[i]
 * where blocks[i] is a sequence of (offset, length) extents of ``memory`` and ``bytes`` their
 * total. The hashing runs with the GIL released. */
PyObject *block_sums(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "block_sums(memory, head, keys, blocks, indices, shards)");
        return NULL;
    }
    long shards = PyLong_AsLong(args[5]);
    if (shards == -1 && PyErr_Occurred()) return NULL;
    if (shards < 1 || shards > 0xFFFF) { PyErr_SetString(PyExc_ValueError, "shards is 1..65535"); return NULL; }
    Py_buffer mem, head;
    if (PyObject_GetBuffer(args[0], &mem, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &head, PyBUF_C_CONTIGUOUS) < 0) { PyBuffer_Release(&mem); return NULL; }
    PyObject *result = NULL, *idx = NULL;
    SumBlock *sb = NULL;
    uint64_t *ext = NULL;
    Py_ssize_t ext_cap = 0, used = 0, n = 0;
    idx = PySequence_Fast(args[4], "indices is a sequence of integers");
    if (idx == NULL) goto done;
    n = PySequence_Fast_GET_SIZE(idx);
    Py_ssize_t nkeys = PySequence_Length(args[2]), nblocks = PySequence_Length(args[3]);
    if (nkeys < 0 || nblocks < 0) goto done;
    sb = PyMem_Calloc(n ? n : 1, sizeof *sb);
    if (sb == NULL) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t i = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(idx, k));
        if (i == -1 && PyErr_Occurred()) goto done;
        if (i < 0 || i >= nkeys || i >= nblocks) {
            PyErr_Format(PyExc_IndexError, "block %zd of %zd keys and %zd blocks", i, nkeys, nblocks);
            goto done;
        }
        PyObject *key = PySequence_GetItem(args[2], i);
        if (key == NULL) goto done;
        sb[k].key_obj = key;
        if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) > 0xFFFF) {
            PyErr_SetString(PyExc_TypeError, "a key is bytes of at most 65535");
            goto done;
        }
        sb[k].key = (const uint8_t *)PyBytes_AS_STRING(key);
        sb[k].key_len = PyBytes_GET_SIZE(key);
        PyObject *block = PySequence_GetItem(args[3], i);
        if (block == NULL) goto done;
        Py_ssize_t got;
        while ((got = extents_of(block, ext + 2 * used, ext_cap - used, mem.len)) > ext_cap - used) {
            Py_ssize_t cap = (ext_cap + got) * 2;
            uint64_t *grown = PyMem_Realloc(ext, (size_t)cap * 2 * sizeof *ext);
            if (grown == NULL) { Py_DECREF(block); PyErr_NoMemory(); goto done; }
            ext = grown, ext_cap = cap;
        }
        Py_DECREF(block);
        if (got < 0) goto done;
        sb[k].first = used, sb[k].count = got;
        for (Py_ssize_t j = 0; j < got; j++) sb[k].bytes += ext[2 * (used + j) + 1];
        used += got;
    }
    result = PyBytes_FromStringAndSize(NULL, n * 8);
    if (result == NULL) goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    const uint8_t *base = mem.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < n; k++) {
        Xxh64 h;
        uint8_t pre[2], post[10];
        uint16_t kl = (uint16_t)sb[k].key_len, sh = (uint16_t)shards;
        uint64_t bytes = sb[k].bytes;
        pre[0] = kl & 0xFF, pre[1] = kl >> 8;
        for (int b = 0; b < 8; b++) post[b] = (uint8_t)(bytes >> (8 * b));
        post[8] = sh & 0xFF, post[9] = sh >> 8;
        xxh64_init(&h, 0);
        xxh64_update(&h, head.buf, (size_t)head.len);
        xxh64_update(&h, pre, 2);
        xxh64_update(&h, sb[k].key, (size_t)sb[k].key_len);
        xxh64_update(&h, post, 10);
        for (Py_ssize_t j = sb[k].first; j < sb[k].first + sb[k].count; j++)
            xxh64_update(&h, base + ext[2 * j], (size_t)ext[2 * j + 1]);
        uint64_t d = xxh64_digest(&h, 0);
        for (int b = 0; b < 8; b++) out[8 * k + b] = (uint8_t)(d >> (8 * b));
    }
    Py_END_ALLOW_THREADS
done:
    Py_XDECREF(idx);
    for (Py_ssize_t k = 0; sb != NULL && k < n; k++) Py_XDECREF(sb[k].key_obj);
    PyMem_Free(sb);
    PyMem_Free(ext);
    PyBuffer_Release(&head);
    PyBuffer_Release(&mem);
    return result;
}
