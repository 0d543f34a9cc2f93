/* The policies' hooks: lru, slru, s3fifo and tinylfu, decision for decision those of the Python
 * OrderedDict policies they replace (native/README.md; tests/unit/test_native_policy.py
 * replays the bundled traces through both and compares every victim). */
#include "policy.h"

#include <stdlib.h>
#include <string.h>

#define LISTED(p, s) order_listed(&(p)->o, (s))
#define IN(p, s, l) order_in(&(p)->o, (s), (l))

static int used_into(const Policy *p) {
    return p->kind == KIND_TINYLFU ? TL_PROTECTED : 1;   /* slru protected, s3fifo main */
}

Py_ssize_t policy_len(const Policy *p) {
    Py_ssize_t n = 0;
    for (int l = 0; l < p->lists; l++) n += p->o.lists[l].size;
    return n;
}

static Py_ssize_t tracked(const Policy *p) { return policy_len(p) + p->pinned; }

static int grow_bytes(void **arr, Py_ssize_t old, Py_ssize_t cap, size_t item) {
    void *a = PyMem_Realloc(*arr, item * (size_t)cap);
    if (a == NULL) { PyErr_NoMemory(); return -1; }
    memset((char *)a + item * (size_t)old, 0, item * (size_t)(cap - old));
    *arr = a;
    return 0;
}

int policy_grow(Policy *p, Py_ssize_t slots) {
    Py_ssize_t old = p->o.cap;
    if (slots <= old) return 0;
    if (order_reserve(&p->o, slots) < 0) return -1;
    if (grow_bytes((void **)&p->flags, old, p->o.cap, 1) < 0) return -1;
    if (p->kind == KIND_SLRU && grow_bytes((void **)&p->mark_at, old, p->o.cap, sizeof(int32_t)) < 0) return -1;
    if (p->kind == KIND_TINYLFU && grow_bytes((void **)&p->fp, old, p->o.cap, sizeof(uint64_t)) < 0) return -1;
    return 0;
}

static int grow_for(Policy *p, const int32_t *slots, Py_ssize_t n) {
    int32_t top = -1;
    for (Py_ssize_t i = 0; i < n; i++) top = slots[i] > top ? slots[i] : top;
    return policy_grow(p, (Py_ssize_t)top + 1);
}

static int scratch(Policy *p, Py_ssize_t n) {
    if (n <= p->tmp_cap) return 0;
    Py_ssize_t cap = p->tmp_cap ? p->tmp_cap : 256;
    while (cap < n) cap *= 2;
    int32_t *t = PyMem_Realloc(p->tmp, sizeof(int32_t) * (size_t)cap);
    if (t == NULL) { PyErr_NoMemory(); return -1; }
    p->tmp = t;
    uint64_t *f = PyMem_Realloc(p->tmp_fp, sizeof(uint64_t) * (size_t)cap);
    if (f == NULL) { PyErr_NoMemory(); return -1; }
    p->tmp_fp = f;
    uint8_t *b = PyMem_Realloc(p->tmp_b, (size_t)cap);
    if (b == NULL) { PyErr_NoMemory(); return -1; }
    p->tmp_b = b;
    p->tmp_cap = cap;
    return 0;
}

int policy_setup(Policy *p, int kind, double share_a, double share_b) {
    p->kind = kind;
    p->share_a = share_a;
    p->share_b = share_b;
    p->lists = kind == KIND_LRU ? 1 : kind == KIND_TINYLFU ? 3 : 2;
    for (int l = 0; l < MAX_LISTS; l++) p->o.lists[l] = (List){NO_SLOT, NO_SLOT, 0};
    if (kind != KIND_LRU) {
        if (sketch_init(&p->sketch) < 0) return -1;
        p->has_sketch = true;
    }
    return policy_grow(p, 1024);
}

void policy_release(Policy *p) {
    order_free(&p->o);
    PyMem_Free(p->flags);
    PyMem_Free(p->mark_at);
    PyMem_Free(p->fp);
    PyMem_Free(p->marks);
    PyMem_Free(p->tmp);
    PyMem_Free(p->tmp_fp);
    PyMem_Free(p->tmp_b);
    if (p->has_sketch) sketch_free(&p->sketch);
    p->flags = NULL;
    p->mark_at = p->marks = p->tmp = NULL;
    p->fp = p->tmp_fp = NULL;
    p->tmp_b = NULL;
    p->has_sketch = false;
}

/* Move the ``count`` oldest of list ``from`` to the young end of ``to``, in order. */
static void spill(Policy *p, int from, int to, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count && p->o.lists[from].head != NO_SLOT; i++) {
        int32_t s = p->o.lists[from].head;
        order_unlink(&p->o, s);
        order_push_tail(&p->o, to, s);
    }
}

/* ---------------------------------------------------------------------------- shares */
static void fit_slru(Policy *p) {
    Py_ssize_t over = p->o.lists[SLRU_PROTECTED].size - (Py_ssize_t)(p->share_a * (double)tracked(p));
    if (over > 0) spill(p, SLRU_PROTECTED, SLRU_PROBATION, over);
}

/* The window's overflow meets probation's oldest, one against one, by the sketch's estimates: the
 * more frequent goes to probation's young end, the loser to its old end (first in line). */
static int fit_tinylfu(Policy *p) {
    List *window = &p->o.lists[TL_WINDOW], *probation = &p->o.lists[TL_PROBATION];
    Py_ssize_t all = tracked(p);
    Py_ssize_t over = window->size - (Py_ssize_t)(p->share_a * (double)all);
    if (over > 0) {
        if (scratch(p, 2 * over) < 0) return -1;
        int32_t *cand = p->tmp;
        uint64_t *fps = p->tmp_fp;
        uint8_t *mine = p->tmp_b, *theirs = p->tmp_b + over;
        for (Py_ssize_t i = 0; i < over; i++) {
            cand[i] = window->head;
            order_unlink(&p->o, cand[i]);
            fps[i] = p->fp[cand[i]];
        }
        Py_ssize_t rivals = 0;
        for (int32_t s = probation->head; s != NO_SLOT && rivals < over; s = p->o.next[s]) fps[over + rivals++] = p->fp[s];
        if (sketch_estimate(&p->sketch, fps + over, rivals, theirs) < 0) return -1;
        if (sketch_estimate(&p->sketch, fps, over, mine) < 0) return -1;
        Py_ssize_t lost = 0;
        for (Py_ssize_t i = 0; i < over; i++) {
            bool beats = i >= rivals || mine[i] > theirs[i];
            if (beats) order_push_tail(&p->o, TL_PROBATION, cand[i]);
            else cand[lost++] = cand[i];             /* losers, in order, at the front of cand */
        }
        for (Py_ssize_t i = 0; i < lost; i++) order_push_tail(&p->o, TL_PROBATION, cand[i]);
        for (Py_ssize_t i = lost; i-- > 0;) order_to_head(&p->o, TL_PROBATION, cand[i]);
        p->window_lost += lost;
        p->window_won += over - lost;
    }
    over = p->o.lists[TL_PROTECTED].size - (Py_ssize_t)(p->share_b * (double)(all - window->size));
    if (over > 0) spill(p, TL_PROTECTED, TL_PROBATION, over);
    return 0;
}

static int fit(Policy *p) {
    if (p->kind == KIND_SLRU) fit_slru(p);
    else if (p->kind == KIND_TINYLFU) return fit_tinylfu(p);
    return 0;
}

/* ---------------------------------------------------------------------------- stores */
/* Known keys into ``known_into``, the others into ``new_into``, a chain tail first; of the last
 * ``cold``, those never seen go to the old end of ``refused_into`` (the deepest first). Sets
 * *any_known. segments.py's _place. */
static int place(Policy *p, const int32_t *slots, const uint64_t *fps, Py_ssize_t n, bool chain, Py_ssize_t cold,
                 int known_into, int new_into, int refused_into, bool *any_known) {
    if (sketch_fit(&p->sketch, tracked(p) + n) < 0 || scratch(p, n) < 0) return -1;
    bool *seen = (bool *)p->tmp_b;
    if (sketch_count(&p->sketch, fps, n, seen, NULL) < 0) return -1;
    Py_ssize_t remembered = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t i = chain ? n - 1 - j : j;
        remembered += seen[i];
        order_add(&p->o, seen[i] ? known_into : new_into, slots[i]);
    }
    p->remembered += remembered;
    p->admitted += n - remembered;
    *any_known = remembered > 0;
    if (cold > 0) {
        int32_t *refused = p->tmp;
        Py_ssize_t k = 0;
        for (Py_ssize_t i = cold >= n ? 0 : n - cold; i < n; i++)
            if (!seen[i]) refused[k++] = slots[i];
        if (k) {
            int into = refused_into < 0 ? new_into : refused_into;
            if (into != new_into)
                for (Py_ssize_t i = 0; i < k; i++) order_add(&p->o, into, refused[i]);
            for (Py_ssize_t i = 0; i < k; i++) order_to_head(&p->o, into, refused[i]);
            p->refused += k;
            p->admitted -= k;
        }
    }
    return 0;
}

int policy_inserted(Policy *p, const int32_t *slots, const uint64_t *fps, Py_ssize_t n, bool chain, Py_ssize_t cold) {
    if (grow_for(p, slots, n) < 0) return -1;
    bool known = false;
    switch (p->kind) {
    case KIND_LRU:
        p->admitted += n;
        return policy_unpinned(p, slots, n);
    case KIND_SLRU:
        if (n && place(p, slots, fps, n, chain, cold, SLRU_PROTECTED, SLRU_PROBATION, -1, &known) < 0) return -1;
        if (known) fit_slru(p);
        return 0;
    case KIND_S3FIFO:
        return n ? place(p, slots, fps, n, chain, cold, S3_MAIN, S3_SMALL, -1, &known) : 0;
    default:
        if (!n) return 0;
        for (Py_ssize_t i = 0; i < n; i++) p->fp[slots[i]] = fps[i];
        if (place(p, slots, fps, n, chain, cold, TL_PROBATION, TL_WINDOW, TL_PROBATION, &known) < 0) return -1;
        return fit_tinylfu(p);
    }
}

int policy_recovered(Policy *p, const int32_t *slots, const uint64_t *fps, Py_ssize_t n) {
    if (grow_for(p, slots, n) < 0) return -1;
    int into = LRU_LIST;
    if (p->kind != KIND_LRU) {
        if (sketch_fit(&p->sketch, tracked(p) + n) < 0) return -1;
        if (sketch_count(&p->sketch, fps, n, NULL, NULL) < 0) return -1;
        into = p->kind == KIND_S3FIFO ? S3_MAIN : p->kind == KIND_SLRU ? SLRU_PROBATION : TL_PROBATION;
        if (p->kind == KIND_TINYLFU)
            for (Py_ssize_t i = 0; i < n; i++) p->fp[slots[i]] = fps[i];
    }
    for (Py_ssize_t i = 0; i < n; i++) order_add(&p->o, into, slots[i]);
    return 0;
}

/* ---------------------------------------------------------------------------- uses */
static void mark(Policy *p, int32_t s) {
    if (p->mark_at[s]) return;
    if (p->nmarks == p->marks_cap) {              /* mostly stale marks: keep the live ones */
        Py_ssize_t live = 0;
        for (Py_ssize_t i = 0; i < p->nmarks; i++) {
            int32_t m = p->marks[i];
            if (p->mark_at[m] == i + 1) { p->marks[live] = m; p->mark_at[m] = (int32_t)(++live); }
        }
        p->nmarks = live;
    }
    if (p->nmarks == p->marks_cap) {
        Py_ssize_t cap = p->marks_cap ? 2 * p->marks_cap : 1024;
        int32_t *m = PyMem_Realloc(p->marks, sizeof(int32_t) * (size_t)cap);
        if (m == NULL) return;       /* the mark is lost (promotion is a preference): never fails */
        p->marks = m;
        p->marks_cap = cap;
    }
    p->marks[p->nmarks++] = s;
    p->mark_at[s] = (int32_t)p->nmarks;
    p->marked++;
}

int policy_accessed(Policy *p, const int32_t *slots, Py_ssize_t n) {
    if (grow_for(p, slots, n) < 0) return -1;
    switch (p->kind) {
    case KIND_LRU:
        for (Py_ssize_t i = 0; i < n; i++)
            if (IN(p, slots[i], LRU_LIST)) order_to_tail(&p->o, LRU_LIST, slots[i]);
        return 0;
    case KIND_SLRU:        /* protected: LRU's move; elsewhere only marked (the next walk promotes) */
        for (Py_ssize_t i = 0; i < n; i++) {
            if (IN(p, slots[i], SLRU_PROTECTED)) order_to_tail(&p->o, SLRU_PROTECTED, slots[i]);
            else mark(p, slots[i]);
        }
        return 0;
    case KIND_S3FIFO:      /* counts go up to 2: used, reused (as sets: the batch sees them before) */
        for (Py_ssize_t i = 0; i < n; i++)
            if (p->flags[slots[i]] & F_USED) p->flags[slots[i]] |= F_REUSED;
        for (Py_ssize_t i = 0; i < n; i++) p->flags[slots[i]] |= F_USED;
        return 0;
    default: {
        if (scratch(p, n) < 0) return -1;
        for (Py_ssize_t i = 0; i < n; i++) p->tmp_fp[i] = p->fp[slots[i]];
        if (sketch_count(&p->sketch, p->tmp_fp, n, NULL, NULL) < 0) return -1;
        Py_ssize_t promoted = 0;
        int32_t *moved = p->tmp;
        for (Py_ssize_t i = 0; i < n; i++)
            if (IN(p, slots[i], TL_PROBATION)) { order_unlink(&p->o, slots[i]); moved[promoted++] = slots[i]; }
        for (Py_ssize_t i = 0; i < promoted; i++) order_push_tail(&p->o, TL_PROTECTED, moved[i]);
        p->promoted += promoted;
        for (Py_ssize_t i = 0; i < n; i++)
            if (IN(p, slots[i], TL_WINDOW)) order_to_tail(&p->o, TL_WINDOW, slots[i]);
        for (Py_ssize_t i = 0; i < n; i++)
            if (IN(p, slots[i], TL_PROTECTED)) order_to_tail(&p->o, TL_PROTECTED, slots[i]);
        return fit_tinylfu(p);
    }
    }
}

int policy_pinned(Policy *p, const int32_t *slots, Py_ssize_t n) {
    if (grow_for(p, slots, n) < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t s = slots[i];
        if (LISTED(p, s)) order_unlink(&p->o, s);
        if (p->kind != KIND_LRU && p->o.where[s] != WHERE_PINNED) {
            p->o.where[s] = WHERE_PINNED;
            p->pinned++;
        }
    }
    return 0;
}

int policy_unpinned(Policy *p, const int32_t *slots, Py_ssize_t n) {
    if (grow_for(p, slots, n) < 0) return -1;
    if (p->kind == KIND_LRU) {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (IN(p, slots[i], LRU_LIST)) order_to_tail(&p->o, LRU_LIST, slots[i]);
            else order_push_tail(&p->o, LRU_LIST, slots[i]);
        }
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (p->o.where[slots[i]] == WHERE_PINNED) {
            p->o.where[slots[i]] = WHERE_NONE;
            p->pinned--;
        }
    }
    int into = used_into(p);
    for (Py_ssize_t i = 0; i < n; i++) order_add(&p->o, into, slots[i]);
    return fit(p);
}

int policy_removed(Policy *p, const int32_t *slots, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t s = slots[i];
        if (s >= p->o.cap) continue;
        uint8_t w = p->o.where[s];
        if (w == WHERE_PINNED) {
            p->o.where[s] = WHERE_NONE;
            p->pinned--;
        } else if (w != WHERE_NONE) {
            p->evicted[w - 1]++;
            order_unlink(&p->o, s);
        }
        p->flags[s] &= (uint8_t)~(F_USED | F_REUSED);
        if (p->kind == KIND_SLRU && p->mark_at[s]) {
            p->mark_at[s] = 0;
            p->marked--;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------- victims */
static inline int64_t weight(const Weights *w, int32_t s) {
    if (w == NULL || w->base == NULL) return 1;
    if (s >= w->len) return 1;
    uint32_t v;
    memcpy(&v, w->base + (Py_ssize_t)s * w->stride, 4);
    return v;
}

static int out_push(Out *out, int32_t s) {
    if (out->n == out->cap) {
        Py_ssize_t cap = out->cap ? 2 * out->cap : 256;
        int32_t *v = PyMem_Realloc(out->v, sizeof(int32_t) * (size_t)cap);
        if (v == NULL) { PyErr_NoMemory(); return -1; }
        out->v = v;
        out->cap = cap;
    }
    out->v[out->n++] = s;
    return 0;
}

/* Offer ``s`` unless excluded; returns 1 once ``need`` is met, -1 on error. */
static int offer(Policy *p, int32_t s, int64_t *need, const Weights *w, Out *out) {
    if (p->flags[s] & F_EXCLUDED) return 0;
    if (out_push(out, s) < 0) return -1;
    if (*need < 0) return 0;
    *need -= weight(w, s);
    return *need <= 0;
}

/* slru: probation entries used since the last walk move to protected's young end, in the order of
 * their first use; the other marks lapse. */
static void promote(Policy *p) {
    Py_ssize_t promoted = 0;
    for (Py_ssize_t i = 0; i < p->nmarks; i++) {
        int32_t s = p->marks[i];
        if (p->mark_at[s] != i + 1) continue;        /* popped (and maybe marked again later) */
        p->mark_at[s] = 0;
        if (IN(p, s, SLRU_PROBATION)) {
            order_unlink(&p->o, s);
            order_push_tail(&p->o, SLRU_PROTECTED, s);
            promoted++;
        }
    }
    p->nmarks = 0;
    bool any_marked = p->marked > 0;
    p->marked = 0;
    p->promoted += promoted;
    if (any_marked && promoted) fit_slru(p);
}

/* s3fifo's walk: small's oldest goes to main if used, else is a victim; main's oldest gets another
 * round with one use fewer, else is a victim. The entries taken (victims and excluded ones alike)
 * go back to the old ends of their queues, in order, when the walk ends. */
static int walk_s3fifo(Policy *p, int64_t need, const Weights *w, Out *out) {
    List *small = &p->o.lists[S3_SMALL], *main = &p->o.lists[S3_MAIN];
    double bar = p->share_a * (double)tracked(p);
    Out taken = {0};
    int rc = 0;
    while (small->size || main->size) {
        int from;
        int32_t s;
        if (small->size && (!main->size || (double)small->size >= bar)) {
            s = small->head;
            order_unlink(&p->o, s);
            if (p->flags[s] & F_USED) {                  /* used while in small: it earned main */
                p->flags[s] &= (uint8_t)~(F_USED | F_REUSED);
                order_push_tail(&p->o, S3_MAIN, s);
                p->promoted++;
                continue;
            }
            from = S3_SMALL;
        } else {
            s = main->head;
            order_unlink(&p->o, s);
            if (p->flags[s] & F_USED) {                  /* one more round, one use fewer */
                if (p->flags[s] & F_REUSED) p->flags[s] &= (uint8_t)~F_REUSED;
                else p->flags[s] &= (uint8_t)~F_USED;
                order_push_tail(&p->o, S3_MAIN, s);
                continue;
            }
            from = S3_MAIN;
        }
        /* taken: the slot, its queue in the sign bit's place (-1 - slot: main) */
        if ((rc = out_push(&taken, from == S3_SMALL ? s : -1 - s)) < 0) break;
        if ((rc = offer(p, s, &need, w, out)) != 0) break;
    }
    for (Py_ssize_t i = taken.n; i-- > 0;) {
        int32_t t = taken.v[i];
        if (t >= 0) order_push_head(&p->o, S3_SMALL, t);
        else order_push_head(&p->o, S3_MAIN, -1 - t);
    }
    PyMem_Free(taken.v);
    return rc < 0 ? -1 : 0;
}

static int walk_lists(Policy *p, const int *order, int count, int64_t need, const Weights *w, Out *out) {
    for (int k = 0; k < count; k++)
        for (int32_t s = p->o.lists[order[k]].head; s != NO_SLOT; s = p->o.next[s]) {
            int rc = offer(p, s, &need, w, out);
            if (rc) return rc < 0 ? -1 : 0;
        }
    return 0;
}

int policy_victims(Policy *p, int64_t need, const Weights *w, const int32_t *exclude, Py_ssize_t nexclude, Out *out) {
    static const int LRU_ORDER[] = {LRU_LIST}, SLRU_ORDER[] = {SLRU_PROBATION, SLRU_PROTECTED},
                     TL_ORDER[] = {TL_PROBATION, TL_WINDOW, TL_PROTECTED};
    if (need == 0) return 0;                     /* nothing wanted: no walk (and none of its moves) */
    if (grow_for(p, exclude, nexclude) < 0) return -1;
    for (Py_ssize_t i = 0; i < nexclude; i++) p->flags[exclude[i]] |= F_EXCLUDED;
    int rc;
    switch (p->kind) {
    case KIND_LRU: rc = walk_lists(p, LRU_ORDER, 1, need, w, out); break;
    case KIND_SLRU:
        if (p->nmarks) promote(p);
        rc = walk_lists(p, SLRU_ORDER, 2, need, w, out);
        break;
    case KIND_S3FIFO: rc = walk_s3fifo(p, need, w, out); break;
    default: rc = walk_lists(p, TL_ORDER, 3, need, w, out); break;
    }
    for (Py_ssize_t i = 0; i < nexclude; i++) p->flags[exclude[i]] &= (uint8_t)~F_EXCLUDED;
    return rc;
}

/* ---------------------------------------------------------------------------- checks */
const char *policy_check(const Policy *p) {
    Py_ssize_t listed = 0, pinned = 0;
    for (int l = 0; l < p->lists; l++) {
        const List *list = &p->o.lists[l];
        Py_ssize_t n = 0;
        int32_t prev = NO_SLOT;
        for (int32_t s = list->head; s != NO_SLOT; s = p->o.next[s]) {
            if (s < 0 || s >= p->o.cap) return "a list links a slot out of range";
            if (p->o.where[s] != l + 1) return "a listed slot says it is elsewhere";
            if (p->o.prev[s] != prev) return "a list's back link is broken";
            if (p->flags[s] & F_EXCLUDED) return "an exclude mark outlived its walk";
            prev = s;
            if (++n > p->o.cap) return "a list has a cycle";
        }
        if (list->tail != prev) return "a list's young end is wrong";
        if (n != list->size) return "a list's size is wrong";
        listed += n;
    }
    for (Py_ssize_t s = 0; s < p->o.cap; s++) {
        uint8_t w = p->o.where[s];
        if (w == WHERE_PINNED) pinned++;
        else if (w != WHERE_NONE && w > p->lists) return "a slot names a list the policy does not have";
    }
    Py_ssize_t in_lists = 0;
    for (Py_ssize_t s = 0; s < p->o.cap; s++) in_lists += p->o.where[s] != WHERE_NONE && p->o.where[s] != WHERE_PINNED;
    if (in_lists != listed) return "slots say they are listed but are not";
    if (pinned != p->pinned) return "the pinned count is wrong";
    if (p->kind == KIND_SLRU) {
        Py_ssize_t marked = 0;
        for (Py_ssize_t s = 0; s < p->o.cap; s++) {
            if (!p->mark_at[s]) continue;
            marked++;
            if (p->mark_at[s] > p->nmarks || p->marks[p->mark_at[s] - 1] != s) return "a mark is lost";
        }
        if (marked != p->marked) return "the mark count is wrong";
    }
    return NULL;
}
