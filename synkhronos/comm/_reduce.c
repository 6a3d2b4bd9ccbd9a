/* The small reductions in compiled code: float scalars and small arrays combined in
 * rank order, over the byte layout of comm/slabs.py, so every rank computes NumPy's bits.
 *
 * A rank's scalar contribution lies in its own slots of the backend's Block (slabs.py's
 * SCALAR_SEQ on: seq, value, weight, dtype code); a small array lies in its slab, after
 * the header Slabs.pack writes.  The waits these reductions meet on are the runtime's
 * (synkhronos/runtime/_block.c), reached through the capsule _block exports: this module
 * knows the layout, _block the slots.
 *
 * Built with -ffp-contract=off (setup.py): no fused multiply-adds, or the bits differ
 * from NumPy's.
 */

#include "../runtime/_block.h"
#include <string.h>

#include "../_c/atomics.h"

/* The version of this module's Python functions and types: bump it with any change to
 * one (a signature, a return code), and REDUCE_ABI in synkhronos/comm/__init__.py with it. */
#define SYNK_REDUCE_ABI 1

/* The runtime's Block (its type and waits), set at import. */
static BlockAPI *block_api;

/* A function's Block, its first argument, before the ``want`` others (read from
 * args + 1); NULL with a TypeError giving ``usage`` otherwise. */
static Block *block_first(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want,
                          const char *usage) {
    if (nargs != want + 1 || !PyObject_TypeCheck(args[0], block_api->type)) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    return (Block *)args[0];
}

/* Reduce ops, numbered as reduce_ops.OP_CODES. */
enum { OP_AVG = 0, OP_SUM = 1, OP_PROD = 2, OP_MAX = 3, OP_MIN = 4 };

/* A rank's float scalar contribution: its slots seq, value (float64), weight
 * (float64), dtype code, from seq_index on.  The seq is stored last. */
static PyObject *put_scalar(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    /* put_scalar(block, seq_index, seq, value, weight, code) */
    Block *self = block_first(args, nargs, 5,
                              "put_scalar(block, seq_index, seq, value, weight, code)");
    if (self == NULL)
        return NULL;
    args++;
    Py_ssize_t i = PyLong_AsSsize_t(args[0]);
    long long seq = PyLong_AsLongLong(args[1]);
    double v = PyFloat_AsDouble(args[2]);
    double w = PyFloat_AsDouble(args[3]);
    long long code = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred() || check_index(self, i) < 0 || check_index(self, i + 3) < 0)
        return NULL;
    int64_t *s = self->slots;
    memcpy(&s[i + 1], &v, 8);
    memcpy(&s[i + 2], &w, 8);
    s[i + 3] = code;
    __atomic_store_n(&s[i], (int64_t)seq, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* Combine float values in rank order exactly as reduce_ops.combine_floats does
 * in Python (same operations, same order, so the same bits). */
static double combine_values(int op, const double *v, const double *w, Py_ssize_t n) {
    double r;
    Py_ssize_t j;
    switch (op) {
    case OP_AVG: {
        int equal = 1;
        for (j = 1; j < n; j++)
            if (!(v[j] == v[0])) { equal = 0; break; }
        if (equal)
            return v[0];  /* equal values (an in-graph psum) stay exact */
        double num = 0.0, den = 0.0;
        for (j = 0; j < n; j++) {
            num += v[j] * w[j];
            den += w[j];
        }
        return num / den;
    }
    case OP_SUM:
        r = 0.0;
        for (j = 0; j < n; j++) r += v[j];
        return r;
    case OP_PROD:
        r = 1.0;
        for (j = 0; j < n; j++) r *= v[j];
        return r;
    case OP_MAX:  /* Python's max(): the first, replaced by each later value greater */
        r = v[0];
        for (j = 1; j < n; j++) if (v[j] > r) r = v[j];
        return r;
    default:
        r = v[0];
        for (j = 1; j < n; j++) if (v[j] < r) r = v[j];
        return r;
    }
}

#define MAX_SCALARS 4096

/* The value of a 0-d float32 or float64 array (any object exporting a 0-d buffer
 * of format f or d), and its format's code; 0 if it is not one. */
static int scalar_of(PyObject *obj, double *value, long long *code) {
    Py_buffer b;
    if (PyObject_GetBuffer(obj, &b, PyBUF_FORMAT | PyBUF_ND) < 0) {
        PyErr_Clear();
        return 0;
    }
    int ok = 0;
    const char *f = b.format ? b.format : "B";
    if (*f == '=' || *f == '<' || *f == '@')
        f++;
    if (b.ndim == 0 && f[1] == 0) {
        if (f[0] == 'd' && b.len == 8) {
            memcpy(value, b.buf, 8);
            *code = 'd';
            ok = 1;
        } else if (f[0] == 'f' && b.len == 4) {
            float v;
            memcpy(&v, b.buf, 4);
            *value = v;
            *code = 'f';
            ok = 1;
        }
    }
    PyBuffer_Release(&b);
    return ok;
}

static PyObject *put_scalar_array(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    /* put_scalar_array(block, seq_index, seq, array, weight) -> bool: put_scalar of a 0-d float32
     * or float64 array; False (nothing written) for anything else. */
    Block *self = block_first(args, nargs, 4,
                              "put_scalar_array(block, seq_index, seq, array, weight)");
    if (self == NULL)
        return NULL;
    args++;
    Py_ssize_t i = PyLong_AsSsize_t(args[0]);
    long long seq = PyLong_AsLongLong(args[1]);
    double w = PyFloat_AsDouble(args[3]);
    if (PyErr_Occurred() || check_index(self, i) < 0 || check_index(self, i + 3) < 0)
        return NULL;
    double v;
    long long code;
    if (!scalar_of(args[2], &v, &code))
        Py_RETURN_FALSE;
    int64_t *s = self->slots;
    memcpy(&s[i + 1], &v, 8);
    memcpy(&s[i + 2], &w, 8);
    s[i + 3] = code;
    __atomic_store_n(&s[i], (int64_t)seq, __ATOMIC_RELEASE);
    Py_RETURN_TRUE;
}

static PyObject *combine(Block *self, Py_ssize_t first, Py_ssize_t stride, Py_ssize_t n,
                         Py_ssize_t me, long long seq, long long code, int op, double mine,
                         double my_w);

static PyObject *combine_scalar_array(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    /* combine_scalar_array(block, first, stride, n, me, seq, op, array, weight) -> float or None:
     * combine_scalars with this rank's value and dtype code read from a 0-d float32 or
     * float64 array (None for anything else). */
    Block *self = block_first(
        args, nargs, 8, "combine_scalar_array(block, first, stride, n, me, seq, op, array, weight)");
    if (self == NULL)
        return NULL;
    args++;
    Py_ssize_t first = PyLong_AsSsize_t(args[0]);
    Py_ssize_t stride = PyLong_AsSsize_t(args[1]);
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    Py_ssize_t me = PyLong_AsSsize_t(args[3]);
    long long seq = PyLong_AsLongLong(args[4]);
    double my_w = PyFloat_AsDouble(args[7]);
    int op = 0;
    if (PyErr_Occurred() || int_arg(args[5], &op) < 0)
        return NULL;
    double v;
    long long code;
    if (!scalar_of(args[6], &v, &code))
        Py_RETURN_NONE;
    return combine(self, first, stride, n, me, seq, code, op, v, my_w);
}

static PyObject *combine_scalars(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    /* combine_scalars(block, first, stride, n, me, seq, code, op, value, weight) -> float or None:
     * every other rank's scalar contribution to command seq (slots from first + q * stride),
     * with this rank's value and weight, combined by op; None if a rank gave none
     * (or one of another dtype code). */
    Block *self = block_first(
        args, nargs, 9, "combine_scalars(block, first, stride, n, me, seq, code, op, value, weight)");
    if (self == NULL)
        return NULL;
    args++;
    Py_ssize_t first = PyLong_AsSsize_t(args[0]);
    Py_ssize_t stride = PyLong_AsSsize_t(args[1]);
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    Py_ssize_t me = PyLong_AsSsize_t(args[3]);
    long long seq = PyLong_AsLongLong(args[4]);
    long long code = PyLong_AsLongLong(args[5]);
    double mine = PyFloat_AsDouble(args[7]);
    double my_w = PyFloat_AsDouble(args[8]);
    int op = 0;
    if (PyErr_Occurred() || int_arg(args[6], &op) < 0)
        return NULL;
    return combine(self, first, stride, n, me, seq, code, op, mine, my_w);
}

static PyObject *combine(Block *self, Py_ssize_t first, Py_ssize_t stride, Py_ssize_t n,
                         Py_ssize_t me, long long seq, long long code, int op, double mine,
                         double my_w) {
    if (n < 1 || n > MAX_SCALARS || check_index(self, first) < 0 ||
        check_index(self, first + (n - 1) * stride + 3) < 0)
        return NULL;
    double v[MAX_SCALARS], w[MAX_SCALARS];
    int64_t *s = self->slots;
    for (Py_ssize_t q = 0; q < n; q++) {
        if (q == me) {
            v[q] = mine;
            w[q] = my_w;
            continue;
        }
        int64_t *b = &s[first + q * stride];
        if (__atomic_load_n(&b[0], __ATOMIC_ACQUIRE) != seq || b[3] != code)
            Py_RETURN_NONE;
        memcpy(&v[q], &b[1], 8);
        memcpy(&w[q], &b[2], 8);
    }
    return PyFloat_FromDouble(combine_values(op, v, w, n));
}

/* Small all-reduces: every rank packs its arrays into its own slab (a header,
 * then the data at the offsets the header gives); after a barrier, each rank
 * reduces every rank's copy in rank order into its own arrays, so every rank
 * computes the same bits.  The Python side (comm/shm_reduce.py) lays the slab
 * out exactly as its general path would (SmallReduce below). */

static int get_buffers(PyObject *seq, Py_buffer *views, Py_ssize_t k, int flags) {
    for (Py_ssize_t j = 0; j < k; j++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(seq, j), &views[j], flags) < 0) {
            for (Py_ssize_t i = 0; i < j; i++)
                PyBuffer_Release(&views[i]);
            return -1;
        }
    }
    return 0;
}

static void release_buffers(Py_buffer *views, Py_ssize_t k) {
    for (Py_ssize_t j = 0; j < k; j++)
        PyBuffer_Release(&views[j]);
}

/* Every rank's slab view lives in its call's own frame: on the stack up to SLABS_HERE
 * ranks (no allocation on the hot path), on the heap past that.  Never in a static
 * array: SmallReduce.run holds these views while it waits without the GIL, and a second
 * thread's call would overwrite them (and release them twice). */
#define SLABS_HERE 64

/* ``*views``: room for n views, ``here`` (SLABS_HERE of them) if that is enough; -1 with
 * an error set if out of memory. */
static int slabs_of(Py_ssize_t n, Py_buffer *here, Py_buffer **views) {
    *views = n <= SLABS_HERE ? here : PyMem_Malloc(sizeof(Py_buffer) * n);
    if (*views == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void free_slabs(Py_buffer *views, Py_buffer *here) {
    if (views != here)
        PyMem_Free(views);
}

#define MAX_SMALL 64

/* NumPy's elementwise semantics: integers wrap (computed unsigned), max/min
 * keep a NaN from either side, the first operand when equal. */
#define FLOAT_MAX(x, y) (((x) >= (y) || (x) != (x)) ? (x) : (y))
#define FLOAT_MIN(x, y) (((x) <= (y) || (x) != (x)) ? (x) : (y))
#define INT_MAX_(x, y) ((x) >= (y) ? (x) : (y))
#define INT_MIN_(x, y) ((x) <= (y) ? (x) : (y))

#define REDUCE_FLOAT(T)                                                              \
    {                                                                                \
        T *o = (T *)out;                                                             \
        const T *a = (const T *)srcs[0], *b = (const T *)srcs[1];                     \
        for (Py_ssize_t e = 0; e < count; e++) {                                      \
            T x = a[e], y = b[e];                                                     \
            o[e] = op == OP_PROD ? x * y : op == OP_MAX ? FLOAT_MAX(x, y)                \
                 : op == OP_MIN ? FLOAT_MIN(x, y) : x + y;                            \
        }                                                                            \
        for (Py_ssize_t q = 2; q < n; q++) {                                          \
            const T *c = (const T *)srcs[q];                                          \
            for (Py_ssize_t e = 0; e < count; e++) {                                  \
                T x = o[e], y = c[e];                                                 \
                o[e] = op == OP_PROD ? x * y : op == OP_MAX ? FLOAT_MAX(x, y)            \
                     : op == OP_MIN ? FLOAT_MIN(x, y) : x + y;                        \
            }                                                                        \
        }                                                                            \
        if (scaled) {                                                                \
            T f = (T)scale;                                                           \
            for (Py_ssize_t e = 0; e < count; e++) o[e] = o[e] * f;                  \
        }                                                                            \
    }

#define REDUCE_INT(T, U)                                                             \
    {                                                                                \
        T *o = (T *)out;                                                             \
        for (Py_ssize_t q = 0; q < n; q++) {                                          \
            const T *c = (const T *)srcs[q];                                          \
            for (Py_ssize_t e = 0; e < count; e++) {                                  \
                T x = q == 0 ? c[e] : o[e], y = c[e];                                   \
                if (q == 0) { o[e] = x; continue; }                                    \
                o[e] = op == OP_PROD ? (T)((U)x * (U)y) : op == OP_MAX ? INT_MAX_(x, y)  \
                     : op == OP_MIN ? INT_MIN_(x, y) : (T)((U)x + (U)y);                \
            }                                                                        \
        }                                                                            \
    }

static int reduce_typed(char code, int op, char *out, const char **srcs, Py_ssize_t n,
                        Py_ssize_t count, int scaled, double scale) {
    switch (code) {
    case 'f': REDUCE_FLOAT(float) return 0;
    case 'd': REDUCE_FLOAT(double) return 0;
    case 'b': REDUCE_INT(int8_t, uint8_t) return 0;
    case 'B': REDUCE_INT(uint8_t, uint8_t) return 0;
    case 'h': REDUCE_INT(int16_t, uint16_t) return 0;
    case 'H': REDUCE_INT(uint16_t, uint16_t) return 0;
    case 'i': REDUCE_INT(int32_t, uint32_t) return 0;
    case 'I': REDUCE_INT(uint32_t, uint32_t) return 0;
    case 'l': case 'q': REDUCE_INT(int64_t, uint64_t) return 0;
    case 'L': case 'Q': REDUCE_INT(uint64_t, uint64_t) return 0;
    default: return -1;
    }
}

static Py_ssize_t itemsize_of(char code) {
    switch (code) {
    case 'f': case 'i': case 'I': return 4;
    case 'd': case 'l': case 'q': case 'L': case 'Q': return 8;
    case 'b': case 'B': return 1;
    case 'h': case 'H': return 2;
    default: return 0;
    }
}

/* A small all-reduce of fixed arrays, prepared once: pack this rank's arrays into
 * its slab, publish its epoch, wait for the others' (bounded), check that their
 * slabs are the generations this process maps, compare headers, reduce.
 * run() returns 1 done, 0 still waiting (Python checks liveness, then calls
 * again from stage 1), -2 a slab of another generation (Python maps it, then
 * calls again from stage 2), -1 headers differ (nothing written). */
typedef struct {
    PyObject_HEAD
    Block *block;
    Py_ssize_t mine, waiters, stride, gen_off, me, n, k;
    Py_ssize_t *others;       /* the other ranks' epoch slots */
    Py_ssize_t *offsets;
    char *codes;
    PyObject *header;         /* bytes */
    int op, scaled;
    double scale;
} SmallReduce;

static void SmallReduce_dealloc(SmallReduce *self) {
    Py_XDECREF(self->block);
    Py_XDECREF(self->header);
    PyMem_Free(self->others);
    PyMem_Free(self->offsets);
    PyMem_Free(self->codes);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int SmallReduce_init(SmallReduce *self, PyObject *args, PyObject *kw) {
    /* SmallReduce(block, me, n, stride, epoch_off, waiters_off, gen_off, header, offsets,
     *             codes, op, scale) */
    PyObject *block, *header, *offsets, *codes, *scale;
    Py_ssize_t me, n, stride, eoff, woff, goff;
    int op;
    if (!PyArg_ParseTuple(args, "O!nnnnnnSO!SiO", block_api->type, &block, &me, &n, &stride, &eoff,
                          &woff, &goff, &header, &PyTuple_Type, &offsets, &codes, &op, &scale))
        return -1;
    Py_ssize_t k = PyTuple_GET_SIZE(offsets);
    if (n < 2 || n > MAX_WAIT || me < 0 || me >= n || k < 1 || k > MAX_SMALL ||
        PyBytes_GET_SIZE(codes) != k) {
        PyErr_SetString(PyExc_ValueError, "SmallReduce: bad ranks, offsets or codes");
        return -1;
    }
    Block *b = (Block *)block;
    if (check_index(b, (n - 1) * stride + eoff) < 0 || check_index(b, (n - 1) * stride + woff) < 0 ||
        check_index(b, (n - 1) * stride + goff) < 0)
        return -1;
    self->others = PyMem_Malloc(sizeof(Py_ssize_t) * n);
    self->offsets = PyMem_Malloc(sizeof(Py_ssize_t) * k);
    self->codes = PyMem_Malloc(k);
    if (!self->others || !self->offsets || !self->codes) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t j = 0;
    for (Py_ssize_t q = 0; q < n; q++)
        if (q != me)
            self->others[j++] = q * stride + eoff;
    for (j = 0; j < k; j++) {
        self->offsets[j] = PyLong_AsSsize_t(PyTuple_GET_ITEM(offsets, j));
        if (self->offsets[j] == -1 && PyErr_Occurred())
            return -1;
        if (self->offsets[j] < 0) {
            PyErr_SetString(PyExc_ValueError, "SmallReduce: a negative offset");
            return -1;
        }
        self->codes[j] = PyBytes_AS_STRING(codes)[j];
        if (itemsize_of(self->codes[j]) == 0) {
            PyErr_Format(PyExc_ValueError, "SmallReduce: dtype code %c not compiled", self->codes[j]);
            return -1;
        }
    }
    Py_INCREF(block);
    Py_XSETREF(self->block, b);
    Py_INCREF(header);
    Py_XSETREF(self->header, header);
    self->me = me;
    self->n = n;
    self->k = k;
    self->stride = stride;
    self->mine = me * stride + eoff;
    self->waiters = me * stride + woff;
    self->gen_off = goff;
    self->op = op;
    self->scaled = scale != Py_None;
    self->scale = self->scaled ? PyFloat_AsDouble(scale) : 1.0;
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *SmallReduce_run(SmallReduce *self, PyObject *const *args, Py_ssize_t nargs) {
    /* run(target, arrays, slabs, gens, spin_ns, block_ns, stage) -> int */
    if (nargs != 7 || !PyTuple_Check(args[1]) || !PyTuple_Check(args[2]) || !PyTuple_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "run(target, arrays: tuple, slabs: tuple, gens: tuple, spin_ns, block_ns, stage)");
        return NULL;
    }
    long long target = PyLong_AsLongLong(args[0]);
    long long spin = PyLong_AsLongLong(args[4]);
    long long blk = PyLong_AsLongLong(args[5]);
    int stage = 0;
    if (PyErr_Occurred() || int_arg(args[6], &stage) < 0)
        return NULL;
    Py_ssize_t n = self->n, k = self->k, me = self->me;
    if (PyTuple_GET_SIZE(args[1]) != k || PyTuple_GET_SIZE(args[2]) != n ||
        PyTuple_GET_SIZE(args[3]) != n) {
        PyErr_SetString(PyExc_ValueError, "SmallReduce.run: one array per offset, one slab per rank");
        return NULL;
    }
    Block *b = self->block;
    if (!b->held) {
        PyErr_SetString(PyExc_ValueError, "SmallReduce.run: block released");
        return NULL;
    }
    int64_t *s = b->slots;
    Py_buffer outs[MAX_SMALL];
    Py_buffer slabs_here[SLABS_HERE];
    Py_buffer *slabs;
    if (slabs_of(n, slabs_here, &slabs) < 0)
        return NULL;
    if (get_buffers(args[1], outs, k, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        free_slabs(slabs, slabs_here);
        return NULL;
    }
    if (get_buffers(args[2], slabs, n, stage == 0 ? PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE
                                                   : PyBUF_C_CONTIGUOUS) < 0) {
        /* Only this rank's own slab needs to be writable: ask again without. */
        PyErr_Clear();
        if (get_buffers(args[2], slabs, n, PyBUF_C_CONTIGUOUS) < 0) {
            release_buffers(outs, k);
            free_slabs(slabs, slabs_here);
            return NULL;
        }
    }
    const char *head = PyBytes_AS_STRING(self->header);
    Py_ssize_t hlen = PyBytes_GET_SIZE(self->header);
    long result = 1;
    int bad = 0;
    for (Py_ssize_t q = 0; q < n && !bad; q++)
        if (slabs[q].len < hlen)
            bad = 1;
    for (Py_ssize_t j = 0; j < k && !bad; j++) {
        Py_ssize_t size = itemsize_of(self->codes[j]);
        if (outs[j].len % size != 0)
            bad = 1;
        for (Py_ssize_t q = 0; q < n && !bad; q++)
            if (self->offsets[j] + outs[j].len > slabs[q].len)
                bad = 1;
    }
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "SmallReduce.run: arrays do not fit the slabs");
        result = -9;
        goto out;
    }
    if (stage == 0) {
        if (slabs[me].readonly) {
            PyErr_SetString(PyExc_ValueError, "SmallReduce.run: this rank's slab is read-only");
            result = -9;
            goto out;
        }
        char *dst = (char *)slabs[me].buf;
        memcpy(dst, head, hlen);
        for (Py_ssize_t j = 0; j < k; j++)
            memcpy(dst + self->offsets[j], outs[j].buf, outs[j].len);
        __atomic_store_n(&s[self->mine], (int64_t)target, __ATOMIC_SEQ_CST);
        if (load(&s[self->waiters]) > 0)
            futex_wake(&s[self->mine]);
    }
    if (stage <= 1) {
        if (!block_api->wait_slots(b, self->others, (int)(n - 1), GE, target,
                                   self->waiters - self->mine, spin, blk)) {
            result = 0;
            goto out;
        }
    }
    for (Py_ssize_t q = 0; q < n; q++) {
        if (q == me)
            continue;
        long long g = PyLong_AsLongLong(PyTuple_GET_ITEM(args[3], q));
        if (g == -1 && PyErr_Occurred()) {
            result = -9;
            goto out;
        }
        if (load_acquire(&s[q * self->stride + self->gen_off]) != g) {
            result = -2;
            goto out;
        }
    }
    for (Py_ssize_t q = 0; q < n; q++) {
        if (q != me && memcmp(slabs[q].buf, slabs[me].buf, hlen) != 0) {
            result = -1;
            goto out;
        }
    }
    {
        const char *srcs[MAX_WAIT];
        for (Py_ssize_t j = 0; j < k; j++) {
            for (Py_ssize_t q = 0; q < n; q++)
                srcs[q] = (const char *)slabs[q].buf + self->offsets[j];
            reduce_typed(self->codes[j], self->op, (char *)outs[j].buf, srcs, n,
                         outs[j].len / itemsize_of(self->codes[j]), self->scaled, self->scale);
        }
    }
out:
    release_buffers(slabs, n);
    free_slabs(slabs, slabs_here);
    release_buffers(outs, k);
    if (result == -9)
        return NULL;
    return PyLong_FromLong(result);
}

static PyMethodDef SmallReduce_methods[] = {
    {"run", (PyCFunction)(void (*)(void))SmallReduce_run, METH_FASTCALL,
     "run(target, arrays, slabs, gens, spin_ns, block_ns, stage) -> int\n\n"
     "Stage 0: pack ``arrays`` into this rank's slab and publish epoch ``target``; stage <= 1:\n"
     "wait (bounded) for every other rank's epoch; then check the slabs' generations\n"
     "against ``gens``, compare headers and reduce every rank's copy, in rank order, into\n"
     "``arrays``.  Returns 1 done, 0 still waiting, -2 a slab of another generation,\n"
     "-1 headers differ."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject SmallReduceType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "synkhronos.comm._reduce.SmallReduce",
    .tp_basicsize = sizeof(SmallReduce),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SmallReduce(block, me, n, stride, epoch_off, waiters_off, gen_off, header, offsets,\n"
              "codes, op, scale): a small all-reduce of fixed arrays over every rank's slab.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)SmallReduce_init,
    .tp_dealloc = (destructor)SmallReduce_dealloc,
    .tp_methods = SmallReduce_methods,
};

/* A call's small output: each worker packs its one array into its slab as the
 * general path would (comm/slabs.py: a header with the count, the weight, a flag,
 * then the array's dtype code, ndim, offset, size and shape; the data at its
 * offset); after the end barrier the leader combines every rank's copy in rank
 * order, with the operations of reduce_ops.combine (so the same bits). */

#define WEIGHT_AT 8  /* the weight's bytes in a slab header: [8, 16) */

static PyObject *pack_one(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    /* pack_one(slab, header, weight, array, offset): the header (its weight field set),
     * then the array's bytes at offset. */
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "pack_one(slab, header, weight, array, offset)");
        return NULL;
    }
    double w = PyFloat_AsDouble(args[2]);
    Py_ssize_t off = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer dst, head, src;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &head, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (PyObject_GetBuffer(args[3], &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&head);
        PyBuffer_Release(&dst);
        return NULL;
    }
    int ok = head.len >= WEIGHT_AT + 8 && head.len <= dst.len && off >= head.len &&
             off + src.len <= dst.len;
    if (ok) {
        memcpy(dst.buf, head.buf, head.len);
        memcpy((char *)dst.buf + WEIGHT_AT, &w, 8);
        memcpy((char *)dst.buf + off, src.buf, src.len);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&head);
    PyBuffer_Release(&dst);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "pack_one: the header and array do not fit the slab");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* avg as reduce_ops.combine does it: the first part if every part equals it
 * (==, so NaN never does), else sum(part * (w / total)) in rank order, each
 * factor in the parts' type (NumPy's weak Python float). */
#define AVERAGE(T)                                                                   \
    {                                                                                \
        T *o = (T *)out;                                                             \
        int equal = 1;                                                               \
        for (Py_ssize_t q = 1; q < n && equal; q++)                                    \
            for (Py_ssize_t e = 0; e < count; e++)                                    \
                if (!(((const T *)srcs[q])[e] == ((const T *)srcs[0])[e])) {           \
                    equal = 0;                                                       \
                    break;                                                           \
                }                                                                    \
        if (equal) {                                                                 \
            memcpy(o, srcs[0], count * sizeof(T));                                   \
        } else {                                                                     \
            double total = 0.0;                                                      \
            for (Py_ssize_t q = 0; q < n; q++) total += w[q];                          \
            T f0 = (T)(w[0] / total);                                                \
            for (Py_ssize_t e = 0; e < count; e++) o[e] = ((const T *)srcs[0])[e] * f0; \
            for (Py_ssize_t q = 1; q < n; q++) {                                      \
                T f = (T)(w[q] / total);                                             \
                const T *c = (const T *)srcs[q];                                      \
                for (Py_ssize_t e = 0; e < count; e++) {                              \
                    T p = c[e] * f;                                                   \
                    o[e] = o[e] + p;                                                  \
                }                                                                    \
            }                                                                        \
        }                                                                            \
    }

static PyObject *combine_outputs(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    /* combine_outputs(block, stride, gen_off, gens, slabs, me, header, array, weight, offset,
     *                 op, out) -> int
     * Every rank's one packed array (this rank's is ``array``, weight ``weight``) combined
     * by op into ``out``: 1 done; 0 a rank packed something else (another header, or
     * nothing): nothing written, use the general path; -2 a slab of another generation
     * than ``gens`` says (map it, then call again). */
    if (nargs != 12 || !PyObject_TypeCheck(args[0], block_api->type) || !PyTuple_Check(args[3]) ||
        !PyTuple_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "combine_outputs(block, stride, gen_off, gens: tuple, slabs: tuple, me, "
                        "header, array, weight, offset, op, out)");
        return NULL;
    }
    Block *b = (Block *)args[0];
    Py_ssize_t stride = PyLong_AsSsize_t(args[1]);
    Py_ssize_t goff = PyLong_AsSsize_t(args[2]);
    Py_ssize_t n = PyTuple_GET_SIZE(args[4]);
    Py_ssize_t me = PyLong_AsSsize_t(args[5]);
    double my_w = PyFloat_AsDouble(args[8]);
    Py_ssize_t off = PyLong_AsSsize_t(args[9]);
    int op = 0;
    if (PyErr_Occurred() || int_arg(args[10], &op) < 0)
        return NULL;
    if (n < 1 || n > MAX_WAIT || me < 0 || me >= n || off < 0 || PyTuple_GET_SIZE(args[3]) != n ||
        check_index(b, (n - 1) * stride + goff) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "combine_outputs: bad ranks, generations or offset");
        return NULL;
    }
    for (Py_ssize_t q = 0; q < n; q++) {
        if (q == me)
            continue;
        long long g = PyLong_AsLongLong(PyTuple_GET_ITEM(args[3], q));
        if (g == -1 && PyErr_Occurred())
            return NULL;
        if (load_acquire(&b->slots[q * stride + goff]) != g)
            return PyLong_FromLong(-2);
    }
    Py_buffer head, mine, outb;
    Py_buffer slabs_here[SLABS_HERE];
    Py_buffer *slabs;
    if (slabs_of(n, slabs_here, &slabs) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[6], &head, PyBUF_C_CONTIGUOUS) < 0) {
        free_slabs(slabs, slabs_here);
        return NULL;
    }
    if (PyObject_GetBuffer(args[7], &mine, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&head);
        free_slabs(slabs, slabs_here);
        return NULL;
    }
    if (PyObject_GetBuffer(args[11], &outb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&mine);
        PyBuffer_Release(&head);
        free_slabs(slabs, slabs_here);
        return NULL;
    }
    long result = 1;
    int have = 0;
    const char *f = mine.format ? mine.format : "B";
    if (*f == '=' || *f == '<' || *f == '@')
        f++;
    char code = f[0];
    Py_ssize_t size = itemsize_of(code);
    if (f[1] != 0 || size == 0 || size != mine.itemsize || outb.len != mine.len ||
        head.len < WEIGHT_AT + 8 || (op == OP_AVG && code != 'f' && code != 'd')) {
        result = 0;
        goto out;
    }
    if (get_buffers(args[4], slabs, n, PyBUF_C_CONTIGUOUS) < 0) {
        result = -9;
        goto out;
    }
    have = 1;
    {
        const char *srcs[MAX_WAIT];
        double w[MAX_WAIT];
        const char *h = (const char *)head.buf;
        for (Py_ssize_t q = 0; q < n; q++) {
            if (q == me) {
                srcs[q] = (const char *)mine.buf;
                w[q] = my_w;
                continue;
            }
            const char *s = (const char *)slabs[q].buf;
            if (slabs[q].len < off + mine.len || memcmp(s, h, WEIGHT_AT) != 0 ||
                memcmp(s + WEIGHT_AT + 8, h + WEIGHT_AT + 8, head.len - WEIGHT_AT - 8) != 0) {
                result = 0;
                goto out;
            }
            memcpy(&w[q], s + WEIGHT_AT, 8);
            srcs[q] = s + off;
        }
        Py_ssize_t count = mine.len / size;
        char *out = (char *)outb.buf;
        if (op == OP_AVG) {
            if (code == 'f')
                AVERAGE(float)
            else
                AVERAGE(double)
        } else if (n == 1) {
            memcpy(out, srcs[0], mine.len);
        } else {
            reduce_typed(code, op, out, srcs, n, count, 0, 1.0);
        }
    }
out:
    if (have)
        release_buffers(slabs, n);
    free_slabs(slabs, slabs_here);
    PyBuffer_Release(&outb);
    PyBuffer_Release(&mine);
    PyBuffer_Release(&head);
    if (result == -9)
        return NULL;
    return PyLong_FromLong(result);
}

static PyMethodDef module_methods[] = {
    {"put_scalar", (PyCFunction)(void (*)(void))put_scalar, METH_FASTCALL,
     "put_scalar(block, seq_index, seq, value, weight, code): a float scalar contribution in\n"
     "``block``'s slots, seq last."},
    {"put_scalar_array", (PyCFunction)(void (*)(void))put_scalar_array, METH_FASTCALL,
     "put_scalar_array(block, seq_index, seq, array, weight) -> bool: put_scalar of a 0-d\n"
     "float32 or float64 array; False, writing nothing, for anything else."},
    {"combine_scalar_array", (PyCFunction)(void (*)(void))combine_scalar_array, METH_FASTCALL,
     "combine_scalar_array(block, first, stride, n, me, seq, op, array, weight) -> float or None:\n"
     "combine_scalars with this rank's value and dtype read from a 0-d float32/64 array."},
    {"combine_scalars", (PyCFunction)(void (*)(void))combine_scalars, METH_FASTCALL,
     "combine_scalars(block, first, stride, n, me, seq, code, op, value, weight) -> float or None\n\n"
     "Every rank's float scalar of command ``seq`` in ``block``'s slots combined by op (0 avg,\n"
     "weighted; 1 sum; 2 prod; 3 max; 4 min), in rank order as reduce_ops.combine_floats\n"
     "does; None if a rank left none."},
    {"pack_one", (PyCFunction)(void (*)(void))pack_one, METH_FASTCALL,
     "pack_one(slab, header, weight, array, offset): a call's one small output in a\n"
     "worker's slab, as comm/slabs.py packs it."},
    {"combine_outputs", (PyCFunction)(void (*)(void))combine_outputs, METH_FASTCALL,
     "combine_outputs(block, stride, gen_off, gens, slabs, me, header, array, weight, offset,\n"
     "op, out) -> int: every rank's one packed output combined by op (0 avg, weighted;\n"
     "1 sum; 2 prod; 3 max; 4 min) in rank order into ``out``, as reduce_ops.combine\n"
     "does; 1 done, 0 use the general path, -2 map a newer slab first."},
    {NULL, NULL, 0, NULL}};


static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_reduce",
    "Float scalars and small arrays combined in rank order over comm/slabs.py's layout.", -1,
    module_methods};

PyMODINIT_FUNC PyInit__reduce(void) {
    /* The Block and its waits, from the runtime's extension (imported here if need be). */
    block_api = (BlockAPI *)PyCapsule_Import(BLOCK_API_CAPSULE, 0);
    if (block_api == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_ImportError)) {  /* a _block without the capsule */
            PyErr_Clear();
            PyErr_SetString(PyExc_ImportError,
                            "synkhronos.runtime._block exports no " BLOCK_API_CAPSULE
                            ": it was built from older sources; rebuild with `pip install -e .`");
        }
        return NULL;
    }
    if (block_api->abi != SYNK_BLOCK_ABI) {
        PyErr_Format(PyExc_ImportError,
                     "synkhronos.comm._reduce was built against synkhronos.runtime._block ABI %d, "
                     "but the installed _block is ABI %d: rebuild both with `pip install -e .`",
                     SYNK_BLOCK_ABI, block_api->abi);
        block_api = NULL;
        return NULL;
    }
    if (PyType_Ready(&SmallReduceType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&SmallReduceType);
    if (PyModule_AddObject(m, "SmallReduce", (PyObject *)&SmallReduceType) < 0) {
        Py_DECREF(&SmallReduceType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "ABI", SYNK_REDUCE_ABI) < 0 ||
        PyModule_AddStringConstant(m, "SMALL_CODES", "fdbBhHiIlLqQ") < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
