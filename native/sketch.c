/* The frequency sketch of the segmented policies (native.h), and a Python type over it (tests). */
#include "native.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static const uint64_t ODD[SKETCH_ROWS] = {0x9E3779B97F4A7C15ULL, 0xC2B2AE3D27D4EB4FULL, 0x165667B19E3779F9ULL,
                                          0xD6E8FEB86659FD93ULL};

/* The counters, in transparent huge pages where the kernel gives them: every stored key reads and
 * writes four counters at random in tens of MiB, a TLB miss each on 4 KiB pages. */
static uint8_t *counters(int bits) {
    size_t bytes = (size_t)SKETCH_ROWS << bits;
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) { PyErr_NoMemory(); return NULL; }
#ifdef MADV_HUGEPAGE
    if (bytes >= (2u << 20)) madvise(p, bytes, MADV_HUGEPAGE);
#endif
    return p;
}

static void release_counters(uint8_t *table, int bits) {
    if (table) munmap(table, (size_t)SKETCH_ROWS << bits);
}

static size_t table_bytes(int bits) { return (size_t)SKETCH_ROWS << bits; }

static size_t blocks(int bits) {
    return (table_bytes(bits) + ((size_t)1 << SKETCH_BLOCK_BITS) - 1) >> SKETCH_BLOCK_BITS;
}

/* Per-block halving marks for a table of ``bits``, every block settled at ``halvings``. */
static uint32_t *settled_marks(int bits, uint32_t halvings) {
    size_t n = blocks(bits);
    uint32_t *m = PyMem_Malloc(n * sizeof(uint32_t));
    if (m == NULL) { PyErr_NoMemory(); return NULL; }
    for (size_t b = 0; b < n; b++) m[b] = halvings;
    return m;
}

/* Apply the halvings block ``b`` missed: k halvings of an 8-bit counter are one shift by k. */
static void settle_block(Sketch *s, size_t b) {
    uint32_t lag = s->halvings - s->settled[b];
    if (lag == 0) return;
    size_t start = b << SKETCH_BLOCK_BITS, end = start + ((size_t)1 << SKETCH_BLOCK_BITS);
    if (end > table_bytes(s->bits)) end = table_bytes(s->bits);
    if (lag >= 8) {
        memset(s->table + start, 0, end - start);
    } else {
        const uint64_t keep = 0x0101010101010101ULL * (uint64_t)(0xFFu >> lag);
        size_t c = start;
        for (; c + 8 <= end; c += 8) {
            uint64_t w;
            memcpy(&w, s->table + c, 8);
            w = (w >> lag) & keep;
            memcpy(s->table + c, &w, 8);
        }
        for (; c < end; c++) s->table[c] >>= lag;
    }
    s->settled[b] = s->halvings;
}

static inline void settle(Sketch *s, uint64_t at) { settle_block(s, (size_t)(at >> SKETCH_BLOCK_BITS)); }

/* Every block settled: the table as the eager halvings would have left it. */
static void settle_all(Sketch *s) {
    size_t n = blocks(s->bits);
    for (size_t b = 0; b < n; b++) settle_block(s, b);
}

int sketch_init(Sketch *s) {
    memset(s, 0, sizeof(*s));
    s->bits = SKETCH_MIN_BITS;
    s->pristine = true;
    s->table = counters(s->bits);
    if (s->table == NULL) return -1;
    s->settled = settled_marks(s->bits, 0);
    return s->settled ? 0 : -1;
}

void sketch_free(Sketch *s) {
    release_counters(s->table, s->bits);
    PyMem_Free(s->settled);
    PyMem_Free(s->at);
    PyMem_Free(s->before);
    memset(s, 0, sizeof(*s));
}

/* Widen (never narrow) to at least SKETCH_WIDTH_PER_ENTRY counters per entry; each counter is
 * repeated into the two the next hash bit chooses between (NumPy's repeat along the row). */
int sketch_fit(Sketch *s, Py_ssize_t entries) {
    int bits = s->bits;
    while ((int64_t)SKETCH_WIDTH_PER_ENTRY * entries > ((int64_t)1 << bits)) bits++;
    if (bits == s->bits) return 0;
    size_t old_width = (size_t)1 << s->bits, width = (size_t)1 << bits, factor = width / old_width;
    uint8_t *table = counters(bits);
    if (table == NULL) return -1;
    uint32_t *marks = settled_marks(bits, s->halvings);
    if (marks == NULL) { release_counters(table, bits); return -1; }
    settle_all(s);
    for (size_t r = 0; r < SKETCH_ROWS; r++) {
        const uint8_t *src = s->table + r * old_width;
        uint8_t *dst = table + r * width;
        for (size_t i = 0; i < old_width; i++) memset(dst + i * factor, src[i], factor);
    }
    release_counters(s->table, s->bits);
    PyMem_Free(s->settled);
    s->table = table;
    s->settled = marks;
    s->bits = bits;
    return 0;
}

static int reserve(Sketch *s, Py_ssize_t n) {
    if (n <= s->scratch) return 0;
    Py_ssize_t cap = s->scratch ? s->scratch : 256;
    while (cap < n) cap *= 2;
    uint64_t *at = PyMem_Realloc(s->at, sizeof(uint64_t) * SKETCH_ROWS * (size_t)cap);
    if (at == NULL) { PyErr_NoMemory(); return -1; }
    s->at = at;
    uint8_t *before = PyMem_Realloc(s->before, SKETCH_ROWS * (size_t)cap);
    if (before == NULL) { PyErr_NoMemory(); return -1; }
    s->before = before;
    s->scratch = cap;
    return 0;
}

static void locate(const Sketch *s, const uint64_t *fps, Py_ssize_t n, uint64_t *at) {
    unsigned shift = (unsigned)(64 - s->bits);
    for (int r = 0; r < SKETCH_ROWS; r++) {
        uint64_t row = (uint64_t)r << s->bits;
        for (Py_ssize_t i = 0; i < n; i++) at[r * n + i] = ((fps[i] * ODD[r]) >> shift) + row;
    }
}

/* A batch counted as one step: every counter read before any is written, so a key repeated in the
 * batch (or two sharing a counter) counts once. */
static int count_batch(Sketch *s, const uint64_t *fps, Py_ssize_t n, bool *seen, uint8_t *least) {
    if (reserve(s, n) < 0) return -1;
    uint64_t *at = s->at;
    uint8_t *before = s->before, *table = s->table;
    Py_ssize_t cells = SKETCH_ROWS * n;
    locate(s, fps, n, at);
    for (Py_ssize_t c = 0; c < cells; c++) {      /* every read before any write */
        if (c + 16 < cells) __builtin_prefetch(&table[at[c + 16]], 1);
        settle(s, at[c]);
        before[c] = table[at[c]];
    }
    for (Py_ssize_t c = 0; c < cells; c++) {
        uint8_t v = before[c] < SKETCH_MAX - 1 ? before[c] : SKETCH_MAX - 1;
        table[at[c]] = (uint8_t)(v + 1);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t low = before[i];
        for (int r = 1; r < SKETCH_ROWS; r++) low = before[r * n + i] < low ? before[r * n + i] : low;
        if (seen) seen[i] = low > 0;
        if (least) least[i] = low;
    }
    return 0;
}

/* count_batch of a pristine sketch, no answers asked: every counter the batch touches becomes 1
 * (0 + 1, however often it is touched), no halving is pending, so one pass of writes does it, with
 * no scratch (a restart's million keys: ~25 ms instead of ~80 for the read pass, the scratch
 * and the write pass). */
#define FIRST_AHEAD 8         /* keys whose counters are prefetched ahead: each is a cache miss */
static void first_count(Sketch *s, const uint64_t *fps, Py_ssize_t n) {
    unsigned shift = (unsigned)(64 - s->bits);
    uint8_t *table = s->table;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + FIRST_AHEAD < n)
            for (int r = 0; r < SKETCH_ROWS; r++)
                __builtin_prefetch(&table[((fps[i + FIRST_AHEAD] * ODD[r]) >> shift) + ((uint64_t)r << s->bits)], 1);
        for (int r = 0; r < SKETCH_ROWS; r++) table[((fps[i] * ODD[r]) >> shift) + ((uint64_t)r << s->bits)] = 1;
    }
}

int sketch_count(Sketch *s, const uint64_t *fps, Py_ssize_t n, bool *seen, uint8_t *least) {
    if (n == 0) return 0;
    if (s->pristine && seen == NULL && least == NULL) first_count(s, fps, n);
    else if (count_batch(s, fps, n, seen, least) < 0) return -1;
    s->pristine = false;
    s->added += n;
    if (s->added >= sketch_width(s) / 4) {
        s->halvings++;                            /* applied to each block when next touched */
        s->added = 0;
    }
    return 0;
}

int sketch_estimate(Sketch *s, const uint64_t *fps, Py_ssize_t n, uint8_t *out) {
    if (n == 0) return 0;
    if (reserve(s, n) < 0) return -1;
    locate(s, fps, n, s->at);
    for (Py_ssize_t c = 0; c < SKETCH_ROWS * n; c++) settle(s, s->at[c]);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t low = s->table[s->at[i]];
        for (int r = 1; r < SKETCH_ROWS; r++) {
            uint8_t v = s->table[s->at[r * n + i]];
            low = v < low ? v : low;
        }
        out[i] = low;
    }
    return 0;
}

/* ---------------------------------------------------------------------------- Python type */
typedef struct {
    PyObject_HEAD
    Sketch sketch;
} SketchObject;

static int Sketch_init(SketchObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "", kwlist)) return -1;
    sketch_free(&self->sketch);
    return sketch_init(&self->sketch);
}

static void Sketch_dealloc(SketchObject *self) {
    sketch_free(&self->sketch);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Sketch_fit(SketchObject *self, PyObject *arg) {
    Py_ssize_t entries = PyLong_AsSsize_t(arg);
    if (entries == -1 && PyErr_Occurred()) return NULL;
    if (sketch_fit(&self->sketch, entries) < 0) return NULL;
    Py_RETURN_NONE;
}

/* count(fps) -> bytes: each key's estimate before it was counted. */
static PyObject *Sketch_count(SketchObject *self, PyObject *arg) {
    Words w;
    if (words_get(arg, &w) < 0) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, w.n);
    if (out && sketch_count(&self->sketch, w.v, w.n, NULL, (uint8_t *)PyBytes_AS_STRING(out)) < 0) Py_CLEAR(out);
    words_release(&w);
    return out;
}

/* learn(fps): count each key, no answers (a restart's: one pass of writes into a pristine sketch). */
static PyObject *Sketch_learn(SketchObject *self, PyObject *arg) {
    Words w;
    if (words_get(arg, &w) < 0) return NULL;
    int rc = sketch_count(&self->sketch, w.v, w.n, NULL, NULL);
    words_release(&w);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* seen(fps) -> list[bool]: count each key; whether it had been counted before. */
static PyObject *Sketch_seen(SketchObject *self, PyObject *arg) {
    Words w;
    if (words_get(arg, &w) < 0) return NULL;
    bool *seen = PyMem_Malloc((size_t)(w.n ? w.n : 1));
    PyObject *out = NULL;
    if (seen == NULL) PyErr_NoMemory();
    else if (sketch_count(&self->sketch, w.v, w.n, seen, NULL) == 0 && (out = PyList_New(w.n)) != NULL) {
        for (Py_ssize_t i = 0; i < w.n; i++) PyList_SET_ITEM(out, i, PyBool_FromLong(seen[i]));
    }
    PyMem_Free(seen);
    words_release(&w);
    return out;
}

static PyObject *Sketch_estimate(SketchObject *self, PyObject *arg) {
    Words w;
    if (words_get(arg, &w) < 0) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, w.n);
    if (out && sketch_estimate(&self->sketch, w.v, w.n, (uint8_t *)PyBytes_AS_STRING(out)) < 0) Py_CLEAR(out);
    words_release(&w);
    return out;
}

static PyObject *Sketch_table(SketchObject *self, PyObject *unused) {
    settle_all(&self->sketch);
    return PyBytes_FromStringAndSize((const char *)self->sketch.table, (Py_ssize_t)SKETCH_ROWS << self->sketch.bits);
}

static PyObject *Sketch_get_width(SketchObject *self, void *closure) {
    return PyLong_FromSsize_t(sketch_width(&self->sketch));
}

static PyObject *Sketch_get_nbytes(SketchObject *self, void *closure) {
    return PyLong_FromSsize_t(SKETCH_ROWS * sketch_width(&self->sketch));
}

static PyMethodDef Sketch_methods[] = {
    {"fit", (PyCFunction)Sketch_fit, METH_O, "Widen to at least 16 counters per entry."},
    {"count", (PyCFunction)Sketch_count, METH_O, "Count each fingerprint; bytes of the estimates before."},
    {"learn", (PyCFunction)Sketch_learn, METH_O, "Count each fingerprint, no answers (a restart's)."},
    {"seen", (PyCFunction)Sketch_seen, METH_O, "Count each fingerprint; whether each was counted before."},
    {"estimate", (PyCFunction)Sketch_estimate, METH_O, "Each fingerprint's estimate (bytes), uncounted."},
    {"table", (PyCFunction)Sketch_table, METH_NOARGS, "The counters, row after row (bytes)."},
    {NULL},
};

static PyGetSetDef Sketch_getset[] = {
    {"width", (getter)Sketch_get_width, NULL, "counters per row", NULL},
    {"nbytes", (getter)Sketch_get_nbytes, NULL, "bytes of counters", NULL},
    {NULL},
};

PyTypeObject SketchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtierd._native.Sketch",
    .tp_doc = "The segmented policies' count-min sketch of key fingerprints (kvtierd/policy/sketch.py's rules).",
    .tp_basicsize = sizeof(SketchObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Sketch_init,
    .tp_dealloc = (destructor)Sketch_dealloc,
    .tp_methods = Sketch_methods,
    .tp_getset = Sketch_getset,
};
