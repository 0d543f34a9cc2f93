/* The hot requests' decoder: a frame of one of the ops it was given (lookup, store, commit, load,
 * release, ...) read and checked in one pass into the very map the protocol's decoder returns.
 *
 * ``Requests(ops, limits)`` takes the ops' field specs from kvtierd.contract.protocol (REQUESTS),
 * so the checks are the protocol's and are written down once. ``decode(frame)`` returns the map,
 * or None whenever it cannot prove the frame is a well-formed request of those ops: anything
 * unusual — another op, an unknown or repeated field, a value of another type or out of range, a
 * bad key, trailing bytes, a msgpack form it does not read — goes to the protocol's decoder, which
 * decodes it again and names the fault. So it may only ever say None or the protocol's answer; a
 * hypothesis test holds it to that on random and damaged frames.
 *
 * Why: msgpack's generic decode, the field checks and the keys' check were ~half of a 256-key
 * lookup's time in the daemon (docs/design.md, Performance). */
#include "native.h"

#include <string.h>

enum { KIND_INT, KIND_BOOL, KIND_KEYS, KIND_INTS };
#define MAX_OPS 16
#define MAX_FIELDS 8

typedef struct {
    PyObject *name;            /* the field's name (a str, the map's key) */
    const char *bytes;         /* its UTF-8 bytes */
    Py_ssize_t len;
    int kind, required, nullable;
    uint64_t lo, hi;           /* bounds of an int (of each item of ints); lo >= 0 */
    Py_ssize_t max_items;      /* of ints */
} FieldSpec;

typedef struct {
    PyObject *name;            /* the op's name (the value of "op") */
    const char *bytes;
    Py_ssize_t len;
    int nfields;
    FieldSpec fields[MAX_FIELDS];
} OpSpec;

typedef struct {
    PyObject_HEAD
    int nops;
    OpSpec ops[MAX_OPS];
    PyObject *op_key, *rid_key;    /* "op", "rid" */
    Py_ssize_t max_frame, max_key, max_keys, max_map;
    uint64_t max_rid;
} Requests;

/* ---------------------------------------------------------------------------- the reader */
typedef struct {
    const uint8_t *p, *end;
} Reader;

static inline int need(Reader *r, Py_ssize_t n) { return r->end - r->p >= n; }

static inline uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* A length-prefixed item's length for the msgpack forms of one family: ``fixmask`` the fixed form's
 * length bits (0: the family has none) under the first byte ``fix``; ``f8``/``f16``/``f32`` the
 * first bytes of the 1/2/4-byte length forms (0: none). -1: another type, or cut short. */
static Py_ssize_t header(Reader *r, uint8_t fix, uint8_t fixmask, uint8_t f8, uint8_t f16, uint8_t f32) {
    if (!need(r, 1)) return -1;
    uint8_t b = *r->p;
    int n;
    if (fixmask && (b & (uint8_t)~fixmask) == fix) { r->p++; return b & fixmask; }
    if (f8 && b == f8) n = 1;
    else if (b == f16) n = 2;
    else if (b == f32) n = 4;
    else return -1;
    if (!need(r, 1 + n)) return -1;
    Py_ssize_t len = (Py_ssize_t)be(r->p + 1, n);
    r->p += 1 + n;
    return len;
}

static inline Py_ssize_t str_header(Reader *r) { return header(r, 0xa0, 0x1f, 0xd9, 0xda, 0xdb); }
static inline Py_ssize_t bin_header(Reader *r) { return header(r, 0x00, 0x00, 0xc4, 0xc5, 0xc6); }
static inline Py_ssize_t array_header(Reader *r) { return header(r, 0x90, 0x0f, 0, 0xdc, 0xdd); }
static inline Py_ssize_t map_header(Reader *r) { return header(r, 0x80, 0x0f, 0, 0xde, 0xdf); }

/* A non-negative integer of any msgpack int form (a negative one, or another type: 0). */
static int read_uint(Reader *r, uint64_t *out) {
    if (!need(r, 1)) return 0;
    uint8_t b = *r->p;
    if (b <= 0x7f) { *out = b; r->p++; return 1; }
    int n, sign;
    switch (b) {
    case 0xcc: n = 1; sign = 0; break;
    case 0xcd: n = 2; sign = 0; break;
    case 0xce: n = 4; sign = 0; break;
    case 0xcf: n = 8; sign = 0; break;
    case 0xd0: n = 1; sign = 1; break;
    case 0xd1: n = 2; sign = 1; break;
    case 0xd2: n = 4; sign = 1; break;
    case 0xd3: n = 8; sign = 1; break;
    default: return 0;
    }
    if (!need(r, 1 + n)) return 0;
    uint64_t v = be(r->p + 1, n);
    if (sign && (v >> (8 * n - 1)) & 1) return 0;        /* negative */
    *out = v;
    r->p += 1 + n;
    return 1;
}

/* ---------------------------------------------------------------------------- the values */
static PyObject *read_int(Reader *r, const FieldSpec *f) {
    uint64_t v;
    if (!read_uint(r, &v) || v < f->lo || v > f->hi) return NULL;
    return PyLong_FromUnsignedLongLong(v);
}

static PyObject *read_ints(Reader *r, const FieldSpec *f) {
    Py_ssize_t n = array_header(r);
    if (n < 0 || n > f->max_items) return NULL;
    PyObject *list = PyList_New(n);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = read_int(r, f);
        if (item == NULL) { Py_DECREF(list); return NULL; }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

static PyObject *read_keys(Reader *r, const Requests *self) {
    Py_ssize_t n = array_header(r);
    if (n < 0 || n > self->max_keys) return NULL;
    PyObject *list = PyList_New(n);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len = bin_header(r);
        if (len < 1 || len > self->max_key || !need(r, len)) { Py_DECREF(list); return NULL; }
        PyObject *key = PyBytes_FromStringAndSize((const char *)r->p, len);
        if (key == NULL) { Py_DECREF(list); return NULL; }
        r->p += len;
        PyList_SET_ITEM(list, i, key);
    }
    /* Distinct, each key hashed on the way (the bytes keep the hash for the key table). */
    int distinct = keys_distinct(PySequence_Fast_ITEMS(list), n);
    if (distinct <= 0) { Py_DECREF(list); return NULL; }
    return list;
}

/* The value of field ``f``: a new reference, or NULL (an exception set only when out of memory). */
static PyObject *read_value(Reader *r, const Requests *self, const FieldSpec *f) {
    if (!need(r, 1)) return NULL;
    if (*r->p == 0xc0) {
        if (!f->nullable) return NULL;
        r->p++;
        Py_RETURN_NONE;
    }
    switch (f->kind) {
    case KIND_INT: return read_int(r, f);
    case KIND_BOOL:
        if (*r->p != 0xc2 && *r->p != 0xc3) return NULL;
        return PyBool_FromLong(*r->p++ == 0xc3);
    case KIND_KEYS: return read_keys(r, self);
    default: return read_ints(r, f);
    }
}

/* The op named by a str at ``r`` (its index), or -1. */
static int read_op(Reader *r, const Requests *self) {
    Py_ssize_t len = str_header(r);
    if (len < 0 || !need(r, len)) return -1;
    for (int i = 0; i < self->nops; i++) {
        if (self->ops[i].len == len && memcmp(self->ops[i].bytes, r->p, (size_t)len) == 0) {
            r->p += len;
            return i;
        }
    }
    return -1;
}

/* ---------------------------------------------------------------------------- decode */
static PyObject *Requests_decode(Requests *self, PyObject *frame) {
    Py_buffer view;
    if (PyObject_GetBuffer(frame, &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *msg = NULL;
    if (view.len > self->max_frame) goto none;
    Reader r = {(const uint8_t *)view.buf, (const uint8_t *)view.buf + view.len};
    Py_ssize_t entries = map_header(&r);
    if (entries < 1 || entries > self->max_map) goto none;
    msg = PyDict_New();
    if (msg == NULL) goto done;
    /* A value is read by its field's kind, which its op tells: a client sends "op" first (and
     * "rid" anywhere); any other field before the op leaves the frame to the protocol's decoder. */
    const OpSpec *op = NULL;
    uint32_t seen = 0;                /* bit i: field i of the op; bit 31: rid */
    for (Py_ssize_t e = 0; e < entries; e++) {
        Py_ssize_t len = str_header(&r);
        if (len < 0 || !need(&r, len)) goto none;
        const uint8_t *name = r.p;
        r.p += len;
        if (len == 2 && memcmp(name, "op", 2) == 0) {
            if (op != NULL) goto none;
            int i = read_op(&r, self);
            if (i < 0) goto none;
            op = &self->ops[i];
            if (PyDict_SetItem(msg, self->op_key, op->name) < 0) goto done;
            continue;
        }
        if (len == 3 && memcmp(name, "rid", 3) == 0) {
            uint64_t rid;
            if (seen & (1u << 31) || !read_uint(&r, &rid) || rid > self->max_rid) goto none;
            seen |= 1u << 31;
            PyObject *v = PyLong_FromUnsignedLongLong(rid);
            if (v == NULL || PyDict_SetItem(msg, self->rid_key, v) < 0) { Py_XDECREF(v); goto done; }
            Py_DECREF(v);
            continue;
        }
        if (op == NULL) goto none;
        int fi = -1;
        for (int i = 0; i < op->nfields; i++)
            if (op->fields[i].len == len && memcmp(op->fields[i].bytes, name, (size_t)len) == 0) { fi = i; break; }
        if (fi < 0 || seen & (1u << fi)) goto none;          /* unknown or repeated */
        seen |= 1u << fi;
        PyObject *v = read_value(&r, self, &op->fields[fi]);
        if (v == NULL) { if (PyErr_Occurred()) goto done; goto none; }
        int rc = PyDict_SetItem(msg, op->fields[fi].name, v);
        Py_DECREF(v);
        if (rc < 0) goto done;
    }
    if (op == NULL || r.p != r.end) goto none;
    for (int i = 0; i < op->nfields; i++)
        if (op->fields[i].required && !(seen & (1u << i))) goto none;
    goto done;
none:
    Py_XDECREF(msg);
    msg = Py_None;
    Py_INCREF(msg);
done:
    PyBuffer_Release(&view);
    return msg;
}

/* ---------------------------------------------------------------------------- construction */
static int int_attr(PyObject *obj, const char *name, uint64_t *out, int *is_none) {
    PyObject *v = PyObject_GetAttrString(obj, name);
    if (v == NULL) return -1;
    *is_none = v == Py_None;
    if (!*is_none) {
        *out = PyLong_AsUnsignedLongLong(v);
        if (PyErr_Occurred()) { Py_DECREF(v); return -1; }
    }
    Py_DECREF(v);
    return 0;
}

static int bool_attr(PyObject *obj, const char *name) {
    PyObject *v = PyObject_GetAttrString(obj, name);
    if (v == NULL) return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

static int name_of(PyObject *name, PyObject **keep, const char **bytes, Py_ssize_t *len) {
    if (!PyUnicode_Check(name)) { PyErr_SetString(PyExc_TypeError, "names must be str"); return -1; }
    *bytes = PyUnicode_AsUTF8AndSize(name, len);
    if (*bytes == NULL) return -1;
    Py_INCREF(name);
    PyUnicode_InternInPlace(&name);
    *keep = name;
    return 0;
}

/* One field from a protocol.Field (kind, lo, hi, required, nullable, max_items). */
static int field_spec(PyObject *name, PyObject *field, FieldSpec *f) {
    PyObject *kind = PyObject_GetAttrString(field, "kind");
    if (kind == NULL) return -1;
    const char *k = PyUnicode_Check(kind) ? PyUnicode_AsUTF8(kind) : NULL;
    f->kind = k == NULL ? -1 : strcmp(k, "int") == 0 ? KIND_INT : strcmp(k, "bool") == 0 ? KIND_BOOL
            : strcmp(k, "keys") == 0 ? KIND_KEYS : strcmp(k, "ints") == 0 ? KIND_INTS : -1;
    Py_DECREF(kind);
    if (f->kind < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a field of a kind Requests does not read");
        return -1;
    }
    int none_lo = 1, none_hi = 1;
    uint64_t items = 0;
    int none_items;
    f->lo = 0;
    f->hi = UINT64_MAX;
    if (int_attr(field, "lo", &f->lo, &none_lo) < 0 || int_attr(field, "hi", &f->hi, &none_hi) < 0 ||
        int_attr(field, "max_items", &items, &none_items) < 0)
        return -1;
    if (none_lo) f->lo = 0;
    if (none_hi) f->hi = UINT64_MAX;
    if ((f->kind == KIND_INT || f->kind == KIND_INTS) && (none_lo || none_hi)) {
        PyErr_SetString(PyExc_ValueError, "an int field without both bounds");
        return -1;
    }
    f->max_items = none_items ? 0 : (Py_ssize_t)items;
    if ((f->required = bool_attr(field, "required")) < 0 || (f->nullable = bool_attr(field, "nullable")) < 0)
        return -1;
    return name_of(name, &f->name, &f->bytes, &f->len);
}

static void Requests_dealloc(Requests *self) {
    for (int i = 0; i < self->nops; i++) {
        Py_XDECREF(self->ops[i].name);
        for (int j = 0; j < self->ops[i].nfields; j++) Py_XDECREF(self->ops[i].fields[j].name);
    }
    Py_XDECREF(self->op_key);
    Py_XDECREF(self->rid_key);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Requests(ops, max_frame, max_key, max_keys, max_map, max_rid): ``ops`` maps each op to its
 * fields ({name: protocol.Field}), of the kinds int, bool, keys and ints (a negative bound, or
 * another kind, is refused: such an op stays with the protocol's decoder). */
static int Requests_init(Requests *self, PyObject *args, PyObject *kwds) {
    PyObject *ops;
    Py_ssize_t max_frame, max_key, max_keys, max_map;
    unsigned long long max_rid;
    if (!PyArg_ParseTuple(args, "O!nnnnK", &PyDict_Type, &ops, &max_frame, &max_key, &max_keys, &max_map, &max_rid))
        return -1;
    if (self->nops || self->op_key) { PyErr_SetString(PyExc_RuntimeError, "Requests is set once"); return -1; }
    if (PyDict_Size(ops) > MAX_OPS) { PyErr_SetString(PyExc_ValueError, "too many ops"); return -1; }
    self->max_frame = max_frame;
    self->max_key = max_key;
    self->max_keys = max_keys;
    self->max_map = max_map;
    self->max_rid = max_rid;
    if ((self->op_key = PyUnicode_InternFromString("op")) == NULL) return -1;
    if ((self->rid_key = PyUnicode_InternFromString("rid")) == NULL) return -1;
    PyObject *name, *fields;
    Py_ssize_t pos = 0;
    while (PyDict_Next(ops, &pos, &name, &fields)) {
        OpSpec *op = &self->ops[self->nops];
        if (!PyDict_Check(fields) || PyDict_Size(fields) > MAX_FIELDS) {
            PyErr_SetString(PyExc_ValueError, "each op's fields: a dict of at most 8");
            return -1;
        }
        if (name_of(name, &op->name, &op->bytes, &op->len) < 0) return -1;
        self->nops++;
        PyObject *fname, *field;
        Py_ssize_t fpos = 0;
        while (PyDict_Next(fields, &fpos, &fname, &field)) {
            if (field_spec(fname, field, &op->fields[op->nfields]) < 0) return -1;
            op->nfields++;
        }
    }
    return 0;
}

static PyMethodDef Requests_methods[] = {
    {"decode", (PyCFunction)Requests_decode, METH_O,
     "decode(frame) -> the request's map, as protocol.decode_request gives it, or None: let it decode"},
    {NULL},
};

PyTypeObject RequestsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtierd._native.Requests",
    .tp_basicsize = sizeof(Requests),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Requests(ops, max_frame, max_key, max_keys, max_map, max_rid): the hot requests' decoder",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Requests_init,
    .tp_dealloc = (destructor)Requests_dealloc,
    .tp_methods = Requests_methods,
};
