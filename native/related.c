/* Recovery's second stage (kvtierd/recovery.py's scan, bound by kvtierd/records.py): the READY
 * records that judge_ready (records.c) found sound on their own, judged in relation to each other,
 * oldest first, in one compiled pass (NumPy's sort, bincount and gathers over a million candidates
 * took ~90 ms of CPU, this pass ~50-60 ms: native/README.md, "Recovery"). */
#include "native.h"

#include <string.h>
#include <sys/mman.h>

static const uint64_t GOLDEN = 0x9E3779B97F4A7C15ULL;

/* The reasons judge_related gives (after judge_ready's 1..8), in kvtierd/recovery.py's _REASONS order. */
enum { SHARES_PAGE = 9, DUPLICATE_KEY, CHECKSUM_MISMATCH };

/* order[0..n): the positions of ``tick`` in ascending order, equal ticks in position order (NumPy's
 * stable argsort): an LSD radix sort on 16-bit digits that skips the digits all ticks share (a
 * region's ticks are mostly below 2**32: two passes), or nothing when the ticks are in order. */
static int oldest_first(const uint64_t *tick, Py_ssize_t n, int32_t *order) {
    bool sorted = true;
    for (Py_ssize_t i = 0; i < n; i++) {
        order[i] = (int32_t)i;
        if (i && tick[i] < tick[i - 1]) sorted = false;
    }
    if (sorted) return 0;
    int32_t *other = PyMem_Malloc(sizeof(int32_t) * (size_t)n);
    Py_ssize_t *at = PyMem_Malloc(sizeof(Py_ssize_t) << 16);
    if (other == NULL || at == NULL) {
        PyMem_Free(other);
        PyMem_Free(at);
        PyErr_NoMemory();
        return -1;
    }
    int32_t *from = order, *to = other;
    for (int shift = 0; shift < 64; shift += 16) {
        memset(at, 0, sizeof(Py_ssize_t) << 16);
        for (Py_ssize_t i = 0; i < n; i++) at[(tick[i] >> shift) & 0xFFFF]++;
        if (at[(tick[0] >> shift) & 0xFFFF] == n) continue;        /* one digit for all: order unchanged */
        for (Py_ssize_t d = 0, sum = 0; d < (1 << 16); d++) {
            Py_ssize_t here = at[d];
            at[d] = sum;
            sum += here;
        }
        for (Py_ssize_t i = 0; i < n; i++) to[at[(tick[from[i]] >> shift) & 0xFFFF]++] = from[i];
        int32_t *swap = from;
        from = to;
        to = swap;
    }
    if (from != order) memcpy(order, from, sizeof(int32_t) * (size_t)n);
    PyMem_Free(other);
    PyMem_Free(at);
    return 0;
}

typedef struct {              /* judge_ready's columns, one row per READY record, in slot order */
    Py_ssize_t n, width;
    const int64_t *slots, *counts, *ns;
    const uint32_t *chains;
    const uint64_t *checksum, *fps, *tick;
    const int8_t *why;
} Columns;

enum { INVOLVED = 1, KEPT = 2 };

/* A candidate's key fingerprint within its namespace (NumPy's fps ^ ns * GOLDEN). */
static inline uint64_t fingerprint(const Columns *c, Py_ssize_t i) { return c->fps[i] ^ (uint64_t)c->ns[i] * GOLDEN; }

/* Its bucket in a table of 2**bits; a bucket keeps the top half of its fingerprint as a tag, so
 * that a probe reads another candidate's fingerprint only when the tags match. */
static inline size_t home(uint64_t fingerprint, int bits) { return (size_t)((fingerprint * GOLDEN) >> (64 - bits)); }

#define TAG 0xFFFFFFFF00000000ULL
#define AHEAD 16              /* buckets prefetched this many candidates ahead: each is a cache miss */

/* Mark (``flags``: INVOLVED) every candidate that holds a page another holds or whose fingerprint
 * (its key's hash and its namespace) another has; ``same``: the candidates of one fingerprint, a
 * ring each (singletons point at themselves). */
static int involvement(const Columns *c, Py_ssize_t num_pages, uint8_t *flags, int32_t *same) {
    Py_ssize_t candidates = 0;
    for (Py_ssize_t i = 0; i < c->n; i++) candidates += c->why[i] == 0;
    int bits = 1;
    while (((Py_ssize_t)1 << bits) < 2 * candidates) bits++;
    size_t holder_bytes = sizeof(int32_t) * (size_t)(num_pages ? num_pages : 1);
    size_t bucket_bytes = sizeof(uint64_t) << bits;
    int32_t *holder = big_zeroed(holder_bytes);              /* per page: its first holder + 1 */
    uint64_t *buckets = big_zeroed(bucket_bytes);            /* tag | position + 1 */
    int rc = 0;
    if (holder == NULL || buckets == NULL) {
        PyErr_NoMemory();
        rc = -1;
    }
    size_t mask = ((size_t)1 << bits) - 1;
    for (Py_ssize_t i = 0; i < c->n && rc == 0; i++) {
        same[i] = (int32_t)i;
        if (c->why[i] != 0) continue;
        const uint32_t *pages = c->chains + i * c->width;
        for (int64_t k = 0; k < c->counts[i]; k++) {
            if (pages[k] >= (uint64_t)num_pages) {
                PyErr_SetString(PyExc_ValueError, "judge_related: a candidate's chain leaves the data area");
                rc = -1;
                break;
            }
            int32_t first = holder[pages[k]] - 1;
            if (first < 0) holder[pages[k]] = (int32_t)i + 1;
            else flags[i] = flags[first] = INVOLVED;
        }
        if (i + AHEAD < c->n) __builtin_prefetch(&buckets[home(fingerprint(c, i + AHEAD), bits)], 1);
        uint64_t mine = fingerprint(c, i), tag = mine & TAG;
        for (size_t b = home(mine, bits);; b = (b + 1) & mask) {
            uint64_t held = buckets[b];
            if (held == 0) { buckets[b] = tag | ((uint64_t)i + 1); break; }
            int32_t j = (int32_t)(held & ~TAG) - 1;
            if ((held & TAG) == tag && fingerprint(c, j) == mine) {
                flags[i] = flags[j] = INVOLVED;
                same[i] = same[j];
                same[j] = (int32_t)i;
                break;
            }
        }
    }
    if (holder) munmap(holder, holder_bytes);
    if (buckets) munmap(buckets, bucket_bytes);
    return rc;
}

/* Whether an older candidate of i's fingerprint, kept, has i's namespace and key bytes. */
typedef struct {
    const uint8_t *records;
    Py_ssize_t rec_bytes, key_len_at, key_at, max_key;
} Keys;

static bool key_kept(const Columns *c, const uint8_t *flags, const int32_t *same, Py_ssize_t i, const Keys *k) {
    const uint8_t *mine = k->records + c->slots[i] * k->rec_bytes;
    Py_ssize_t len = mine[k->key_len_at] < k->max_key ? mine[k->key_len_at] : k->max_key;
    for (Py_ssize_t j = same[i]; j != i; j = same[j]) {
        if (!(flags[j] & KEPT) || c->ns[j] != c->ns[i]) continue;
        const uint8_t *theirs = k->records + c->slots[j] * k->rec_bytes;
        if (theirs[k->key_len_at] == mine[k->key_len_at] && !memcmp(theirs + k->key_at, mine + k->key_at, (size_t)len))
            return true;
    }
    return false;
}

typedef struct {              /* the records judged unsound: position, reason, the page's holder */
    int64_t *at, *other;
    int8_t *why;
    Py_ssize_t n, cap;
} Problems;

static int problem(Problems *p, Py_ssize_t at, int why, int64_t other) {
    if (p->n == p->cap) {
        Py_ssize_t cap = p->cap ? 2 * p->cap : 256;
        int64_t *a = PyMem_Realloc(p->at, sizeof(int64_t) * (size_t)cap);
        if (a) p->at = a;
        int64_t *o = a ? PyMem_Realloc(p->other, sizeof(int64_t) * (size_t)cap) : NULL;
        if (o) p->other = o;
        int8_t *w = o ? PyMem_Realloc(p->why, (size_t)cap) : NULL;
        if (w == NULL) { PyErr_NoMemory(); return -1; }
        p->why = w;
        p->cap = cap;
    }
    p->at[p->n] = at;
    p->why[p->n] = (int8_t)why;
    p->other[p->n++] = other;
    return 0;
}

/* Whether ``verify`` (called with the candidate's position) says its data checksum matches. */
static int checksum_matches(PyObject *verify, Py_ssize_t i) {
    PyObject *at = PyLong_FromSsize_t(i);
    if (at == NULL) return -1;
    PyObject *answer = PyObject_CallOneArg(verify, at);
    Py_DECREF(at);
    if (answer == NULL) return -1;
    int yes = PyObject_IsTrue(answer);
    Py_DECREF(answer);
    return yes;
}

typedef struct {              /* what judge_related keeps, oldest first, and each page's holder */
    int64_t *slots, *ns, *counts, *owner;
    uint64_t *fps;
    uint32_t *chains;
    Py_ssize_t n;
} Kept;

/* The records in ``order`` (oldest first), each refused (into ``probs``: its own reason, or how it
 * meets the older kept ones) or kept (into ``kept``: its columns, its pages' holder). -1: an
 * error (``verify`` raised, or no memory). */
static int keep_oldest_first(const Columns *c, const int32_t *order, uint8_t *flags, const int32_t *same,
                             const Keys *keys, const uint8_t *checksums, PyObject *verify, Kept *kept,
                             Problems *probs) {
    for (Py_ssize_t r = 0; r < c->n; r++) {
        Py_ssize_t i = order[r];
        if (c->why[i] != 0) {
            if (problem(probs, i, c->why[i], -1) < 0) return -1;
            continue;
        }
        const uint32_t *pages = c->chains + i * c->width;
        int why = 0;
        int64_t other = -1;
        if (flags[i] & INVOLVED) {
            for (int64_t k = 0; k < c->counts[i] && other < 0; k++) other = kept->owner[pages[k]];
            if (other >= 0) why = SHARES_PAGE;
            else if (key_kept(c, flags, same, i, keys)) why = DUPLICATE_KEY;
        }
        if (why == 0 && verify && checksums[c->ns[i]] && c->checksum[i]) {
            int yes = checksum_matches(verify, i);
            if (yes < 0) return -1;
            if (!yes) why = CHECKSUM_MISMATCH;
        }
        if (why) {
            if (problem(probs, i, why, other) < 0) return -1;
            continue;
        }
        flags[i] |= KEPT;
        for (int64_t k = 0; k < c->counts[i]; k++) kept->owner[pages[k]] = c->slots[i];
        Py_ssize_t at = kept->n++;
        kept->slots[at] = c->slots[i], kept->ns[at] = c->ns[i], kept->fps[at] = c->fps[i];
        kept->counts[at] = c->counts[i];
        memcpy(kept->chains + at * c->width, pages, sizeof(uint32_t) * (size_t)c->width);
    }
    return 0;
}

static int buffer_of(PyObject *obj, Py_buffer *b, Py_ssize_t itemsize, Py_ssize_t items) {
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (b->len != itemsize * items) {
        PyErr_SetString(PyExc_ValueError, "judge_related: the columns are not judge_ready's (one row per record)");
        return -1;
    }
    return 0;
}

/* judge_related(records, key_layout, columns, width, ns_checksums, num_pages, verify) -> (slots,
 * ns, fps, counts, chains, kept, owner, (problem_at, problem_why, problem_other)).
 *
 * ``columns``: judge_ready's (slots int64, counts int64, ns int64, chains uint32 rows of ``width``,
 * checksum, fps, tick uint64, why int8); ``key_layout``: (record bytes, key_len offset, key
 * offset, MAX_KEY_BYTES); ``ns_checksums``: per namespace slot (all 2**16), whether its entries'
 * data checksums count; ``verify``: None, or a callable of a candidate's position that says
 * whether its data checksum matches (asked only of one that carries a checksum that counts and is
 * otherwise kept).
 *
 * The records, oldest tick first (ties in slot order): one judged unsound on its own keeps its
 * reason; a candidate that shares a page with an older kept one is refused (SHARES_PAGE, naming
 * the holder of its first such page), else one whose namespace and key an older kept one has
 * (DUPLICATE_KEY), else one whose checksum ``verify`` refuses (CHECKSUM_MISMATCH). The kept come
 * back oldest first as columns (``kept`` rows of slots, ns, fps, counts, chains), ``owner`` the
 * slot holding each page (-1: none), the problems oldest first. Only the candidates that meet
 * another on a page or a fingerprint are compared with the kept ones. */
PyObject *judge_related(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "judge_related(records, key_layout, columns, width, ns_checksums, num_pages, "
                                         "verify)");
        return NULL;
    }
    Py_ssize_t rec_bytes, key_len_at, key_at, max_key;
    Py_ssize_t width = PyLong_AsSsize_t(args[3]), num_pages = PyLong_AsSsize_t(args[5]);
    PyObject *verify = args[6] == Py_None ? NULL : args[6], *cols[8];
    if (PyErr_Occurred() || !PyArg_ParseTuple(args[1], "nnnn", &rec_bytes, &key_len_at, &key_at, &max_key) ||
        !PyArg_ParseTuple(args[2], "OOOOOOOO", &cols[0], &cols[1], &cols[2], &cols[3], &cols[4], &cols[5], &cols[6],
                          &cols[7]))
        return NULL;
    if (rec_bytes < 1 || key_len_at < 0 || key_len_at >= rec_bytes || key_at < 0 || max_key < 0 ||
        key_at + max_key > rec_bytes || width < 0 || num_pages < 0) {
        PyErr_SetString(PyExc_ValueError, "judge_related: the key layout does not fit its record");
        return NULL;
    }
    Py_buffer records = {0}, ns_flags = {0}, held[8] = {{0}};
    Columns c = {0};
    Problems probs = {0};
    uint8_t *flags = NULL;
    int32_t *same = NULL, *order = NULL;
    PyObject *out[7] = {NULL}, *result = NULL;
    if (PyObject_GetBuffer(args[0], &records, PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(args[4], &ns_flags, PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(cols[0], &held[0], PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    c.n = held[0].len / 8;
    const Py_ssize_t sizes[8] = {8, 8, 8, 4 * width, 8, 8, 8, 1};
    for (int k = 1; k < 8; k++)
        if (buffer_of(cols[k], &held[k], sizes[k], c.n) < 0) goto done;
    if (ns_flags.len < (1 << 16) || held[0].len != 8 * c.n) {
        PyErr_SetString(PyExc_ValueError,
                        "judge_related: the namespace flags are shorter than 2**16, or the slots not int64");
        goto done;
    }
    c.width = width;
    c.slots = held[0].buf, c.counts = held[1].buf, c.ns = held[2].buf, c.chains = held[3].buf;
    c.checksum = held[4].buf, c.fps = held[5].buf, c.tick = held[6].buf, c.why = held[7].buf;
    Py_ssize_t table_rows = records.len / rec_bytes;
    for (Py_ssize_t i = 0; i < c.n; i++)
        if (c.slots[i] < 0 || c.slots[i] >= table_rows || c.ns[i] < 0 || c.ns[i] >= (1 << 16) ||
            c.counts[i] < 0 || (c.why[i] == 0 && c.counts[i] > width)) {
            PyErr_SetString(PyExc_ValueError, "judge_related: a column's value is out of range");
            goto done;
        }
    flags = PyMem_Calloc((size_t)(c.n ? c.n : 1), 1);
    same = PyMem_Malloc(sizeof(int32_t) * (size_t)(c.n ? c.n : 1));
    order = PyMem_Malloc(sizeof(int32_t) * (size_t)(c.n ? c.n : 1));
    if (flags == NULL || same == NULL || order == NULL) { PyErr_NoMemory(); goto done; }
    if (involvement(&c, num_pages, flags, same) < 0 || oldest_first(c.tick, c.n, order) < 0) goto done;

    int64_t *slots_out, *ns_out, *counts_out, *owner;
    uint64_t *fps_out;
    uint32_t *chains_out;
    if (!(out[0] = new_block(8 * c.n, (void **)&slots_out)) || !(out[1] = new_block(8 * c.n, (void **)&ns_out)) ||
        !(out[2] = new_block(8 * c.n, (void **)&fps_out)) || !(out[3] = new_block(8 * c.n, (void **)&counts_out)) ||
        !(out[4] = new_block(4 * width * c.n, (void **)&chains_out)) ||
        !(out[5] = new_block(8 * num_pages, (void **)&owner)))
        goto done;
    memset(owner, 0xFF, sizeof(int64_t) * (size_t)num_pages);
    const Keys keys = {records.buf, rec_bytes, key_len_at, key_at, max_key};
    Kept kept = {slots_out, ns_out, counts_out, owner, fps_out, chains_out, 0};
    if (keep_oldest_first(&c, order, flags, same, &keys, ns_flags.buf, verify, &kept, &probs) < 0) goto done;
    if (!(out[6] = PyTuple_New(3))) goto done;
    PyObject *parts[3] = {PyBytes_FromStringAndSize((const char *)probs.at, 8 * probs.n),
                          PyBytes_FromStringAndSize((const char *)probs.why, probs.n),
                          PyBytes_FromStringAndSize((const char *)probs.other, 8 * probs.n)};
    for (int k = 0; k < 3; k++) PyTuple_SET_ITEM(out[6], k, parts[k]);
    if (!parts[0] || !parts[1] || !parts[2]) goto done;
    result = Py_BuildValue("(OOOOOnOO)", out[0], out[1], out[2], out[3], out[4], kept.n, out[5], out[6]);
done:
    for (int k = 0; k < 7; k++) Py_XDECREF(out[k]);
    for (int k = 0; k < 8; k++)
        if (held[k].obj) PyBuffer_Release(&held[k]);
    if (records.obj) PyBuffer_Release(&records);
    if (ns_flags.obj) PyBuffer_Release(&ns_flags);
    PyMem_Free(flags);
    PyMem_Free(same);
    PyMem_Free(order);
    PyMem_Free(probs.at);
    PyMem_Free(probs.why);
    PyMem_Free(probs.other);
    return result;
}
