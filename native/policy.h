/* The eviction policies' state and hooks (policies.c), behind the Python type of policy.c. */
#ifndef KVTIERD_POLICY_H
#define KVTIERD_POLICY_H

#include "native.h"

enum { KIND_LRU, KIND_SLRU, KIND_S3FIFO, KIND_TINYLFU };

/* Lists, per kind, in the order of kvtierd.policy's ``segments`` names. */
enum { LRU_LIST = 0 };
enum { SLRU_PROBATION = 0, SLRU_PROTECTED = 1 };
enum { S3_SMALL = 0, S3_MAIN = 1 };
enum { TL_WINDOW = 0, TL_PROBATION = 1, TL_PROTECTED = 2 };

/* Per-slot flags. */
#define F_USED 1             /* s3fifo: used since it came in (or its last round) */
#define F_REUSED 2           /* s3fifo: used twice */
#define F_EXCLUDED 4         /* set while a victim walk runs: the caller's exclude */

typedef struct {
    PyObject_HEAD
    int kind;
    double share_a, share_b;       /* slru: protected; s3fifo: small; tinylfu: window, protected */
    int lists;
    Order o;
    Py_ssize_t pinned;             /* slots WHERE_PINNED */
    uint8_t *flags;                /* per slot (o.cap) */
    int32_t *mark_at;              /* slru: per slot, 1 + its position in ``marks``, 0 unmarked */
    uint64_t *fp;                  /* tinylfu: per slot, its key's fingerprint */
    int32_t *marks;                /* slru: slots used since the last walk, in order of first use */
    Py_ssize_t nmarks, marks_cap, marked;
    Sketch sketch;
    bool has_sketch;
    int64_t admitted, refused, remembered, promoted, window_won, window_lost;
    int64_t evicted[MAX_LISTS];
    int32_t *tmp;                  /* scratch for a hook's slot lists */
    uint64_t *tmp_fp;
    uint8_t *tmp_b;
    Py_ssize_t tmp_cap;
    bool ready;
} Policy;

/* Weights of the victims (pages per entry), by slot: a strided uint32 vector, or none (1 each). */
typedef struct {
    const uint8_t *base;
    Py_ssize_t stride, len;
} Weights;

/* The result of a victim walk (grown as needed). */
typedef struct {
    int32_t *v;
    Py_ssize_t n, cap;
} Out;

int policy_setup(Policy *p, int kind, double share_a, double share_b);
void policy_release(Policy *p);
int policy_grow(Policy *p, Py_ssize_t slots);
Py_ssize_t policy_len(const Policy *p);

int policy_inserted(Policy *p, const int32_t *slots, const uint64_t *fps, Py_ssize_t n, bool chain, Py_ssize_t cold);
int policy_accessed(Policy *p, const int32_t *slots, Py_ssize_t n);
int policy_pinned(Policy *p, const int32_t *slots, Py_ssize_t n);
int policy_unpinned(Policy *p, const int32_t *slots, Py_ssize_t n);
int policy_removed(Policy *p, const int32_t *slots, Py_ssize_t n);
int policy_recovered(Policy *p, const int32_t *slots, const uint64_t *fps, Py_ssize_t n);
/* The victims, best first, skipping ``exclude``: until their weights reach ``need`` (need < 0:
 * every one). Leaves the lists as the Python policies' walks left them once closed. */
int policy_victims(Policy *p, int64_t need, const Weights *w, const int32_t *exclude, Py_ssize_t nexclude, Out *out);
const char *policy_check(const Policy *p);     /* NULL, or what is inconsistent */

#endif
