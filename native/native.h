/* What the compiled core's parts share: slot arguments, the ordered lists the policies keep over
 * per-slot arrays, and the frequency sketch. native/README.md has the design. */
#ifndef KVTIERD_NATIVE_H
#define KVTIERD_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>
#include <stdint.h>

/* ---------------------------------------------------------------------------- slot arguments */
/* A sequence of slots given by Python: a contiguous buffer of 4- or 8-byte signed integers (NumPy
 * int32/int64) used in place when it is int32, or copied (another width, a list, a tuple). */
typedef struct {
    const int32_t *v;
    Py_ssize_t n;
    int32_t *owned;          /* a copy made here (freed by slots_release) */
    Py_buffer view;
    bool has_view;
} Slots;

int slots_get(PyObject *obj, Slots *out);      /* 0, or -1 with an exception set */
void slots_release(Slots *s);
PyObject *int32_bytes(const int32_t *v, Py_ssize_t n);

/* A vector of uint64 given by Python (a contiguous buffer of 8-byte integers, or a list). */
typedef struct {
    const uint64_t *v;
    Py_ssize_t n;
    uint64_t *owned;
    Py_buffer view;
    bool has_view;
} Words;

int words_get(PyObject *obj, Words *out);
void words_release(Words *w);

/* The arguments of a pass over the keys of entry records: (records, slots, record_bytes, key_len_at,
 * key_at, max_key), the layout checked to fit its record and every slot checked in range. */
typedef struct {
    Py_buffer records;
    Slots slots;
    Py_ssize_t rec_bytes, at_len, at_key, max_key;
} KeyRows;

int key_rows_get(PyObject *const *args, Py_ssize_t nargs, const char *usage, KeyRows *out);
void key_rows_release(KeyRows *k);
static inline const uint8_t *key_row(const KeyRows *k, Py_ssize_t i) {
    return (const uint8_t *)k->records.buf + (Py_ssize_t)k->slots.v[i] * k->rec_bytes;
}

/* How many whole 8-byte words copy a key of ``len`` bytes from a field of ``max_key``: from 8 bytes a
 * key, and only where the field holds the excess (0: copy it exactly). A shorter key's word would
 * write past its blob's end (key n-2's word ends at (n-1)*len + 7, inside the blob only when
 * len >= 7). */
static inline Py_ssize_t key_words(Py_ssize_t len, Py_ssize_t max_key) {
    return len >= 8 && len + 7 <= max_key ? (len + 7) / 8 : 0;
}

/* Key i of n (``len`` bytes) to its place in a blob of keys: ``words`` whole words (key_words)
 * but for the last key, which is copied exactly (the next key overwrites the excess): a few moves
 * instead of a call to memcpy of a length it cannot know (1,024 keys of 36 bytes in cache: 2.7 µs
 * against 6). */
static inline void key_put(uint8_t *blob, Py_ssize_t i, Py_ssize_t n, const uint8_t *from, Py_ssize_t len,
                           Py_ssize_t words) {
    uint8_t *to = blob + i * len;
    if (words && i + 1 < n) {
        for (Py_ssize_t w = 0; w < words; w++) memcpy(to + 8 * w, from + 8 * w, 8);
    } else {
        memcpy(to, from, (size_t)len);
    }
}

/* Zeroed anonymous memory for a big array, advised for transparent huge pages (common.c); munmap
 * releases it. NULL without an exception when the kernel refuses. */
void *big_zeroed(size_t bytes);
/* A new Block (a writable buffer type) of ``bytes`` of big_zeroed memory; ``*at``: its first byte. */
PyObject *new_block(Py_ssize_t bytes, void **at);

/* ---------------------------------------------------------------------------- ordered lists */
/* Each tracked slot is in at most one list at a time (``where``), so one prev/next pair per slot
 * holds every list: the OrderedDict operations the Python policies used (append at the young
 * end, move to either end, pop, walk from the old end), each O(1). */
#define NO_SLOT (-1)
#define MAX_LISTS 3
#define WHERE_NONE 0          /* untracked */
#define WHERE_PINNED 0x80     /* held by a load or lease: out of every list */

typedef struct {
    int32_t head, tail;       /* old end, young end */
    Py_ssize_t size;
} List;

typedef struct {
    List lists[MAX_LISTS];
    int32_t *prev, *next;
    uint8_t *where;           /* WHERE_NONE, list index + 1, or WHERE_PINNED */
    Py_ssize_t cap;           /* length of the per-slot arrays */
} Order;

int order_reserve(Order *o, Py_ssize_t slots);   /* grow the per-slot arrays to cover ``slots`` */
void order_free(Order *o);

static inline void order_unlink(Order *o, int32_t s) {
    List *l = &o->lists[o->where[s] - 1];
    int32_t p = o->prev[s], n = o->next[s];
    if (p == NO_SLOT) l->head = n; else o->next[p] = n;
    if (n == NO_SLOT) l->tail = p; else o->prev[n] = p;
    l->size--;
    o->where[s] = WHERE_NONE;
}

static inline bool order_in(const Order *o, int32_t s, int list) {
    return s < o->cap && o->where[s] == list + 1;
}

static inline bool order_listed(const Order *o, int32_t s) {
    return s < o->cap && o->where[s] != WHERE_NONE && o->where[s] != WHERE_PINNED;
}

static inline void order_push_tail(Order *o, int list, int32_t s) {
    List *l = &o->lists[list];
    o->prev[s] = l->tail;
    o->next[s] = NO_SLOT;
    if (l->tail == NO_SLOT) l->head = s; else o->next[l->tail] = s;
    l->tail = s;
    l->size++;
    o->where[s] = (uint8_t)(list + 1);
}

static inline void order_push_head(Order *o, int list, int32_t s) {
    List *l = &o->lists[list];
    o->next[s] = l->head;
    o->prev[s] = NO_SLOT;
    if (l->head == NO_SLOT) l->tail = s; else o->prev[l->head] = s;
    l->head = s;
    l->size++;
    o->where[s] = (uint8_t)(list + 1);
}

/* OrderedDict ``d[s] = None``: at the young end unless already in the list (then it stays). */
static inline void order_add(Order *o, int list, int32_t s) {
    if (o->where[s] == list + 1) return;
    if (order_listed(o, s)) order_unlink(o, s);
    order_push_tail(o, list, s);
}

/* ``move_to_end(s)`` / ``move_to_end(s, last=False)`` of a slot in the list. */
static inline void order_to_tail(Order *o, int list, int32_t s) {
    if (o->lists[list].tail == s) return;
    order_unlink(o, s);
    order_push_tail(o, list, s);
}

static inline void order_to_head(Order *o, int list, int32_t s) {
    if (o->lists[list].head == s) return;
    order_unlink(o, s);
    order_push_head(o, list, s);
}

/* ---------------------------------------------------------------------------- frequency sketch */
/* kvtierd/policy/sketch.py's count-min sketch, counter for counter: ROWS rows of 2**bits 8-bit
 * counters, multiply-shift hashing of each key's 64-bit fingerprint, a batch counted as one step
 * (all counters read before any is written), halving every width/4 counted keys. */
#define SKETCH_ROWS 4
#define SKETCH_MAX 15
#define SKETCH_WIDTH_PER_ENTRY 16
#define SKETCH_MIN_BITS 10

/* The halvings are applied a block of counters at a time, when a count or an estimate first
 * touches the block after them (``settle``): every counter read is what the eager halving of the
 * whole table would have left, and a halving costs nothing at once (eager, it was one pass over
 * the table: ~30 ms for the 64 MiB of a million entries, a pause of the daemon's loop). */
#define SKETCH_BLOCK_BITS 12

typedef struct {
    uint8_t *table;           /* ROWS x width, row-major */
    int bits;
    int64_t added;            /* keys counted since the last halving */
    uint32_t halvings;        /* since the start */
    bool pristine;            /* never counted: every counter 0 */
    uint32_t *settled;        /* per block of 2**SKETCH_BLOCK_BITS counters: the halvings applied to it */
    uint64_t *at;             /* scratch: ROWS x n counter positions */
    uint8_t *before;          /* scratch: ROWS x n counters before a count */
    Py_ssize_t scratch;
} Sketch;

int sketch_init(Sketch *s);
void sketch_free(Sketch *s);
int sketch_fit(Sketch *s, Py_ssize_t entries);
/* Count each fingerprint once more; ``seen[i]`` (when given) says whether key i had been counted
 * before in every row, ``least[i]`` (when given) its estimate before. A batch counted with
 * neither into a pristine sketch (a restart's) is one pass of writes. */
int sketch_count(Sketch *s, const uint64_t *fps, Py_ssize_t n, bool *seen, uint8_t *least);
int sketch_estimate(Sketch *s, const uint64_t *fps, Py_ssize_t n, uint8_t *out);

static inline Py_ssize_t sketch_width(const Sketch *s) { return (Py_ssize_t)1 << s->bits; }

/* ---------------------------------------------------------------------------- module functions */
PyObject *key_hashes(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *record_sums(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *judge_ready(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *judge_related(PyObject *module, PyObject *const *args, Py_ssize_t nargs);      /* related.c */
PyObject *fill(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *new_records(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *seal_records(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *count_state(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *any_held(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *hold(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *keys_ok(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
int keys_distinct(PyObject *const *items, Py_ssize_t n);    /* 1, 0, or -1 with an exception */
PyObject *kv_events(PyObject *module, PyObject *const *args, Py_ssize_t nargs);   /* kvevents.c */
PyObject *copy_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *copied_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *xxh64(PyObject *module, PyObject *const *args, Py_ssize_t nargs);        /* checksum.c */
PyObject *block_sums(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

/* ---------------------------------------------------------------------------- types */
extern PyTypeObject KeyTableType;
extern PyTypeObject PolicyType;
extern PyTypeObject SketchType;
extern PyTypeObject BlockType;
extern PyTypeObject RequestsType;      /* requests.c: the hot requests' decoder */

#endif
