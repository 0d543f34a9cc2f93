/* kvtierd._native: the daemon's per-entry state in flat arrays (native/README.md). */
#include "native.h"

static PyMethodDef functions[] = {
    {"key_hashes", (PyCFunction)(void (*)(void))key_hashes, METH_FASTCALL,
     "key_hashes(records, slots, record_bytes, key_len_at, key_at, max_key) -> uint64 hash of each slot's key"},
    {"record_sums", (PyCFunction)(void (*)(void))record_sums, METH_FASTCALL,
     "record_sums(records, slots, chains, counts, identities, mask) -> uint64 record sum of each slot"},
    {"judge_ready", (PyCFunction)(void (*)(void))judge_ready, METH_FASTCALL,
     "judge_ready(records, chain, layout, ns_pages, ns_identity, ns_checksums, mask, limits) -> every READY "
     "record's columns and verdict"},
    {"judge_related", (PyCFunction)(void (*)(void))judge_related, METH_FASTCALL,
     "judge_related(records, key_layout, columns, width, ns_checksums, num_pages, verify) -> the candidates "
     "judged oldest first against each other: the kept, each page's holder, the problems"},
    {"fill", (PyCFunction)(void (*)(void))fill, METH_FASTCALL,
     "fill(records, record_bytes, slots, offset, width, value): one field of each slot's record set"},
    {"seal_records", (PyCFunction)(void (*)(void))seal_records, METH_FASTCALL,
     "seal_records(records, slots, chains, identity, mask, tick_at, sum_at, state_at, tick, state): a "
     "write's records made whole: tick, record sum, then state"},
    {"new_records", (PyCFunction)(void (*)(void))new_records, METH_FASTCALL,
     "new_records(records, slots, template, pages, first_page_at, tick_at, tick): fresh records at slots"},
    {"any_held", (PyCFunction)(void (*)(void))any_held, METH_FASTCALL,
     "any_held(pins, leases, slots) -> whether any of the slots is pinned or leased"},
    {"count_state", (PyCFunction)(void (*)(void))count_state, METH_FASTCALL,
     "count_state(records, record_bytes, slots, state_at, state) -> how many of the slots' records hold state"},
    {"hold", (PyCFunction)(void (*)(void))hold, METH_FASTCALL,
     "hold(mine, other, slots, step) -> (changed, int32 slots that leave or re-enter the policy)"},
    {"keys_ok", (PyCFunction)(void (*)(void))keys_ok, METH_FASTCALL,
     "keys_ok(keys, max_len, max_count) -> whether keys are distinct bytes of 1..max_len, at most max_count"},
    {"kv_events", (PyCFunction)(void (*)(void))kv_events, METH_FASTCALL,
     "kv_events(head, parts, tail, int_hash, stored, removed) -> (vLLM KV cache events of key blobs, events)"},
    {"copy_keys", (PyCFunction)(void (*)(void))copy_keys, METH_FASTCALL,
     "copy_keys(records, slots, record_bytes, key_len_at, key_at, max_key, rows, lengths) -> (key_len, keys) or None: "
     "each slot's key field into its row of rows and its length into lengths, and the keys as one blob"},
    {"copied_keys", (PyCFunction)(void (*)(void))copied_keys, METH_FASTCALL,
     "copied_keys(rows, lengths, slots) -> (key_len, keys) of the rows copy_keys kept, or None when not one length"},
    {"xxh64", (PyCFunction)(void (*)(void))xxh64, METH_FASTCALL, "xxh64(data, seed=0) -> XXH64 of the bytes"},
    {"block_sums", (PyCFunction)(void (*)(void))block_sums, METH_FASTCALL,
     "block_sums(memory, head, keys, blocks, indices, shards) -> uint64 XXH64 of each bound block (GIL released)"},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvtierd._native",
    .m_methods = functions,
    .m_doc = "The daemon's compiled core: the key table, the eviction policies and their sketch.",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyTypeObject *types[] = {&KeyTableType, &PolicyType, &SketchType, &BlockType, &RequestsType};
    const char *names[] = {"KeyTable", "Policy", "Sketch", "Block", "Requests"};
    for (int i = 0; i < 5; i++)
        if (PyType_Ready(types[i]) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    for (int i = 0; i < 5; i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
