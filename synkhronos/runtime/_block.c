/* The control path in compiled code: waits, wake-ups and small reductions on a shared block.
 *
 * A Block wraps a writable buffer of int64 slots in shared memory (the control
 * block, a backend's block).  Python keeps the layout; this code only knows
 * slot indices.  Why C: a wait that spins in Python costs a microsecond per
 * look and holds the GIL; a futex wake-up on the critical path costs 5-70 us,
 * so waits spin a bounded time (without the GIL) and only then block.
 *
 * Protocol for a waitable slot: each slot that someone may block on has a
 * "waiters" slot (in the writer's own cache line).  A waiter increments it,
 * looks at the slot again, and sleeps on the slot's futex only if it still
 * has its old value; a writer stores (sequentially consistent), then wakes
 * the futex only if the waiters slot is non-zero.  Both sides order their
 * store before their load (seq_cst), so a wake-up is never lost.
 *
 * Every wait is bounded (block_ns): Python runs its liveness checks between
 * two calls, so a dead or stalled peer is always noticed.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <errno.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

enum { EQ = 0, NE = 1, GE = 2 };

/* Spin this long holding the GIL before releasing it: most waits of a tight
 * loop end within a few microseconds, and dropping and taking the GIL costs
 * a good part of one. */
#define SPIN_WITH_GIL_NS 20000LL

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

static inline long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline int64_t load(int64_t *p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }

static inline int64_t load_acquire(int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

static inline int holds(int64_t v, int mode, int64_t target) {
    switch (mode) {
    case EQ: return v == target;
    case NE: return v != target;
    default: return v >= target;
    }
}

/* Sleep until the slot changes from ``seen``, a wake-up, a signal or ``ns``; 0 on a signal. */
static int futex_wait(int64_t *p, int64_t seen, long long ns) {
#ifdef __linux__
    struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
    /* The low half of the slot on little-endian machines (the project's targets);
     * any change of a slot we wait on changes its low half within a wait. */
    if (syscall(SYS_futex, (uint32_t *)p, FUTEX_WAIT, (uint32_t)seen, &ts, NULL, 0) < 0 &&
        errno == EINTR)
        return 0;
    return 1;
#else
    struct timespec ts = {0, 50000};
    (void)p; (void)seen; (void)ns;
    return nanosleep(&ts, NULL) == 0;
#endif
}

static void futex_wake(int64_t *p) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)p, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
#else
    (void)p;
#endif
}

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int64_t *slots;
    Py_ssize_t n;
    int held;
} Block;

static int Block_init(Block *self, PyObject *args, PyObject *kw) {
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "O", &obj))
        return -1;
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    if (PyObject_GetBuffer(obj, &self->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    self->held = 1;
    if (((uintptr_t)self->view.buf) % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "Block: buffer not aligned to 8 bytes");
        return -1;
    }
    self->slots = (int64_t *)self->view.buf;
    self->n = self->view.len / 8;
    return 0;
}

static void Block_dealloc(Block *self) {
    if (self->held)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check_index(Block *self, Py_ssize_t i) {
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "Block: released");
        return -1;
    }
    if (i < 0 || i >= self->n) {
        PyErr_Format(PyExc_IndexError, "Block: slot %zd out of range (%zd slots)", i, self->n);
        return -1;
    }
    return 0;
}

/* Wait until every slot in idx[] satisfies (mode, target), spinning up to
 * spin_ns, then blocking up to block_ns in total.  Returns 1 when satisfied.
 * waiters of slot i is slot i + woff (woff < 0: nobody wakes it; poll). */
static int wait_slots(Block *self, Py_ssize_t *idx, int k, int mode, int64_t target,
                      Py_ssize_t woff, long long spin_ns, long long block_ns) {
    int64_t *s = self->slots;
    int next = 0;
    /* First look, GIL held. */
    while (next < k && holds(load_acquire(&s[idx[next]]), mode, target))
        next++;
    if (next == k)
        return 1;
    long long start = now_ns();
    long long gil_end = start + (spin_ns < SPIN_WITH_GIL_NS ? spin_ns : SPIN_WITH_GIL_NS);
    unsigned it = 0;
    while (spin_ns > 0) {
        cpu_relax();
        if (holds(load_acquire(&s[idx[next]]), mode, target)) {
            if (++next == k)
                return 1;
            continue;
        }
        if ((++it & 63) == 0 && now_ns() >= gil_end)
            break;
    }
    int done = 0;
    Py_BEGIN_ALLOW_THREADS
    long long spin_end = start + spin_ns;
    while (!done && spin_ns > SPIN_WITH_GIL_NS) {
        cpu_relax();
        if (holds(load_acquire(&s[idx[next]]), mode, target)) {
            if (++next == k)
                done = 1;
            continue;
        }
        if ((++it & 63) == 0 && now_ns() >= spin_end)
            break;
    }
    if (!done && block_ns > 0) {
        long long end = now_ns() + block_ns;
        for (;;) {
            while (next < k && holds(load_acquire(&s[idx[next]]), mode, target))
                next++;
            if (next == k) {
                done = 1;
                break;
            }
            long long left = end - now_ns();
            if (left <= 0)
                break;
            int64_t *slot = &s[idx[next]];
            if (woff >= 0 && idx[next] + woff < self->n) {
                int64_t *w = &s[idx[next] + woff];
                __atomic_add_fetch(w, 1, __ATOMIC_SEQ_CST);
                int64_t seen = load(slot);
                int slept = holds(seen, mode, target) || futex_wait(slot, seen, left);
                __atomic_sub_fetch(w, 1, __ATOMIC_SEQ_CST);
                if (!slept)
                    break;  /* a signal (Ctrl-C): back to Python, which handles it */
            } else {
                struct timespec ts = {0, left < 50000 ? (long)left : 50000};
                nanosleep(&ts, NULL);
            }
        }
    }
    Py_END_ALLOW_THREADS
    return done;
}

static PyObject *Block_wait(Block *self, PyObject *const *args, Py_ssize_t nargs) {
    /* wait(index, mode, target, waiters_offset, spin_ns, block_ns) -> bool */
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "wait(index, mode, target, waiters_offset, spin_ns, block_ns)");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[0]);
    int mode = (int)PyLong_AsLong(args[1]);
    long long target = PyLong_AsLongLong(args[2]);
    Py_ssize_t woff = PyLong_AsSsize_t(args[3]);
    long long spin = PyLong_AsLongLong(args[4]);
    long long block = PyLong_AsLongLong(args[5]);
    if (PyErr_Occurred() || check_index(self, i) < 0)
        return NULL;
    if (wait_slots(self, &i, 1, mode, target, woff, spin, block))
        Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

#define MAX_WAIT 4096

static PyObject *Block_wait_all(Block *self, PyObject *const *args, Py_ssize_t nargs) {
    /* wait_all(indices, mode, target, waiters_offset, spin_ns, block_ns) -> bool */
    if (nargs != 6 || !PyTuple_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError,
                        "wait_all(indices: tuple, mode, target, waiters_offset, spin_ns, block_ns)");
        return NULL;
    }
    Py_ssize_t k = PyTuple_GET_SIZE(args[0]);
    if (k > MAX_WAIT) {
        PyErr_Format(PyExc_ValueError, "wait_all: at most %d slots", MAX_WAIT);
        return NULL;
    }
    Py_ssize_t idx[MAX_WAIT];
    for (Py_ssize_t j = 0; j < k; j++) {
        idx[j] = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[0], j));
        if (idx[j] == -1 && PyErr_Occurred())
            return NULL;
        if (check_index(self, idx[j]) < 0)
            return NULL;
    }
    int mode = (int)PyLong_AsLong(args[1]);
    long long target = PyLong_AsLongLong(args[2]);
    Py_ssize_t woff = PyLong_AsSsize_t(args[3]);
    long long spin = PyLong_AsLongLong(args[4]);
    long long block = PyLong_AsLongLong(args[5]);
    if (PyErr_Occurred())
        return NULL;
    if (k == 0 || wait_slots(self, idx, (int)k, mode, target, woff, spin, block))
        Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

static PyObject *Block_publish(Block *self, PyObject *const *args, Py_ssize_t nargs) {
    /* publish(index, value, waiters_index): store (after every earlier write
     * of this process), then wake whoever sleeps on the slot. */
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "publish(index, value, waiters_index)");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[0]);
    long long v = PyLong_AsLongLong(args[1]);
    Py_ssize_t w = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred() || check_index(self, i) < 0 || check_index(self, w) < 0)
        return NULL;
    __atomic_store_n(&self->slots[i], (int64_t)v, __ATOMIC_SEQ_CST);
    if (load(&self->slots[w]) > 0)
        futex_wake(&self->slots[i]);
    Py_RETURN_NONE;
}

static PyObject *Block_finish(Block *self, PyObject *const *args, Py_ssize_t nargs) {
    /* finish(status_index, done_index, waiters_index, status, seq): a rank's
     * end of a command: its status, then its done slot (which the leader waits on). */
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "finish(status_index, done_index, waiters_index, status, seq)");
        return NULL;
    }
    Py_ssize_t si = PyLong_AsSsize_t(args[0]);
    Py_ssize_t di = PyLong_AsSsize_t(args[1]);
    Py_ssize_t w = PyLong_AsSsize_t(args[2]);
    long long st = PyLong_AsLongLong(args[3]);
    long long seq = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred() || check_index(self, si) < 0 || check_index(self, di) < 0 ||
        check_index(self, w) < 0)
        return NULL;
    __atomic_store_n(&self->slots[si], (int64_t)st, __ATOMIC_RELAXED);
    __atomic_store_n(&self->slots[di], (int64_t)seq, __ATOMIC_SEQ_CST);
    if (load(&self->slots[w]) > 0)
        futex_wake(&self->slots[di]);
    Py_RETURN_NONE;
}

static PyObject *Block_count_ne(Block *self, PyObject *const *args, Py_ssize_t nargs) {
    /* count_ne(indices: tuple, value) -> how many of the slots differ from value */
    if (nargs != 2 || !PyTuple_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "count_ne(indices: tuple, value)");
        return NULL;
    }
    long long v = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    Py_ssize_t k = PyTuple_GET_SIZE(args[0]), count = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[0], j));
        if ((i == -1 && PyErr_Occurred()) || check_index(self, i) < 0)
            return NULL;
        if (load_acquire(&self->slots[i]) != v)
            count++;
    }
    return PyLong_FromSsize_t(count);
}

/* Reduce ops, numbered as reduce_ops.OP_CODES. */
enum { OP_AVG = 0, OP_SUM = 1, OP_PROD = 2, OP_MAX = 3, OP_MIN = 4 };

/* A rank's float scalar contribution: its slots seq, value (float64), weight
 * (float64), dtype code, from seq_index on.  The seq is stored last. */
static PyObject *Block_put_scalar(Block *self, PyObject *const *args, Py_ssize_t nargs) {
    /* put_scalar(seq_index, seq, value, weight, code) */
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "put_scalar(seq_index, seq, value, weight, code)");
        return NULL;
    }
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

static PyObject *Block_put_scalar_array(Block *self, PyObject *const *args, Py_ssize_t nargs) {
    /* put_scalar_array(seq_index, seq, array, weight) -> bool: put_scalar of a 0-d float32
     * or float64 array; False (nothing written) for anything else. */
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "put_scalar_array(seq_index, seq, array, weight)");
        return NULL;
    }
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

static PyObject *Block_combine_scalar_array(Block *self, PyObject *const *args, Py_ssize_t nargs) {
    /* combine_scalar_array(first, stride, n, me, seq, op, array, weight) -> float or None:
     * combine_scalars with this rank's value and dtype code read from a 0-d float32 or
     * float64 array (None for anything else). */
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "combine_scalar_array(first, stride, n, me, seq, op, array, weight)");
        return NULL;
    }
    Py_ssize_t first = PyLong_AsSsize_t(args[0]);
    Py_ssize_t stride = PyLong_AsSsize_t(args[1]);
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    Py_ssize_t me = PyLong_AsSsize_t(args[3]);
    long long seq = PyLong_AsLongLong(args[4]);
    int op = (int)PyLong_AsLong(args[5]);
    double my_w = PyFloat_AsDouble(args[7]);
    if (PyErr_Occurred())
        return NULL;
    double v;
    long long code;
    if (!scalar_of(args[6], &v, &code))
        Py_RETURN_NONE;
    return combine(self, first, stride, n, me, seq, code, op, v, my_w);
}

static PyObject *Block_combine_scalars(Block *self, PyObject *const *args, Py_ssize_t nargs) {
    /* combine_scalars(first, stride, n, me, seq, code, op, value, weight) -> float or None:
     * every other rank's scalar contribution to command seq (slots from first + q * stride),
     * with this rank's value and weight, combined by op; None if a rank gave none
     * (or one of another dtype code). */
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError,
                        "combine_scalars(first, stride, n, me, seq, code, op, value, weight)");
        return NULL;
    }
    Py_ssize_t first = PyLong_AsSsize_t(args[0]);
    Py_ssize_t stride = PyLong_AsSsize_t(args[1]);
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    Py_ssize_t me = PyLong_AsSsize_t(args[3]);
    long long seq = PyLong_AsLongLong(args[4]);
    long long code = PyLong_AsLongLong(args[5]);
    int op = (int)PyLong_AsLong(args[6]);
    double mine = PyFloat_AsDouble(args[7]);
    double my_w = PyFloat_AsDouble(args[8]);
    if (PyErr_Occurred())
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

static PyObject *Block_release(Block *self, PyObject *unused) {
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
        self->slots = NULL;
        self->n = 0;
    }
    Py_RETURN_NONE;
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

static PyTypeObject BlockType;

static int SmallReduce_init(SmallReduce *self, PyObject *args, PyObject *kw) {
    /* SmallReduce(block, me, n, stride, epoch_off, waiters_off, gen_off, header, offsets,
     *             codes, op, scale) */
    PyObject *block, *header, *offsets, *codes, *scale;
    Py_ssize_t me, n, stride, eoff, woff, goff;
    int op;
    if (!PyArg_ParseTuple(args, "O!nnnnnnSO!SiO", &BlockType, &block, &me, &n, &stride, &eoff,
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
        self->codes[j] = PyBytes_AS_STRING(codes)[j];
        if (itemsize_of(self->codes[j]) == 0) {
            PyErr_Format(PyExc_ValueError, "SmallReduce: dtype code %c not compiled", self->codes[j]);
            return -1;
        }
    }
    if (PyErr_Occurred())
        return -1;
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
    int stage = (int)PyLong_AsLong(args[6]);
    if (PyErr_Occurred())
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
    if (get_buffers(args[1], outs, k, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    static Py_buffer slabs[MAX_WAIT];
    if (get_buffers(args[2], slabs, n, stage == 0 ? PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE
                                                   : PyBUF_C_CONTIGUOUS) < 0) {
        /* Only this rank's own slab needs to be writable: ask again without. */
        PyErr_Clear();
        if (get_buffers(args[2], slabs, n, PyBUF_C_CONTIGUOUS) < 0) {
            release_buffers(outs, k);
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
        if (!wait_slots(b, self->others, (int)(n - 1), GE, target, self->waiters - self->mine,
                        spin, blk)) {
            result = 0;
            goto out;
        }
    }
    for (Py_ssize_t q = 0; q < n; q++) {
        if (q == me)
            continue;
        long long g = PyLong_AsLongLong(PyTuple_GET_ITEM(args[3], q));
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
    .tp_name = "synkhronos.runtime._block.SmallReduce",
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
    if (nargs != 12 || !PyObject_TypeCheck(args[0], &BlockType) || !PyTuple_Check(args[3]) ||
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
    int op = (int)PyLong_AsLong(args[10]);
    if (PyErr_Occurred())
        return NULL;
    if (n < 1 || n > MAX_WAIT || me < 0 || me >= n || PyTuple_GET_SIZE(args[3]) != n ||
        check_index(b, (n - 1) * stride + goff) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "combine_outputs: bad ranks or generations");
        return NULL;
    }
    for (Py_ssize_t q = 0; q < n; q++) {
        if (q == me)
            continue;
        long long g = PyLong_AsLongLong(PyTuple_GET_ITEM(args[3], q));
        if (load_acquire(&b->slots[q * stride + goff]) != g)
            return PyLong_FromLong(-2);
    }
    Py_buffer head, mine, outb;
    static Py_buffer slabs[MAX_WAIT];
    if (PyObject_GetBuffer(args[6], &head, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[7], &mine, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&head);
        return NULL;
    }
    if (PyObject_GetBuffer(args[11], &outb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&mine);
        PyBuffer_Release(&head);
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
    PyBuffer_Release(&outb);
    PyBuffer_Release(&mine);
    PyBuffer_Release(&head);
    if (result == -9)
        return NULL;
    return PyLong_FromLong(result);
}

static PyMethodDef module_methods[] = {
    {"pack_one", (PyCFunction)(void (*)(void))pack_one, METH_FASTCALL,
     "pack_one(slab, header, weight, array, offset): a call's one small output in a\n"
     "worker's slab, as comm/slabs.py packs it."},
    {"combine_outputs", (PyCFunction)(void (*)(void))combine_outputs, METH_FASTCALL,
     "combine_outputs(block, stride, gen_off, gens, slabs, me, header, array, weight, offset,\n"
     "op, out) -> int: every rank's one packed output combined by op (0 avg, weighted;\n"
     "1 sum; 2 prod; 3 max; 4 min) in rank order into ``out``, as reduce_ops.combine\n"
     "does; 1 done, 0 use the general path, -2 map a newer slab first."},
    {NULL, NULL, 0, NULL}};

static PyMethodDef Block_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))Block_wait, METH_FASTCALL,
     "wait(index, mode, target, waiters_offset, spin_ns, block_ns) -> bool\n\n"
     "Wait until slot ``index`` holds a value that is == (mode 0), != (1) or >= (2)\n"
     "``target``: spin up to spin_ns, then sleep on its futex up to block_ns.\n"
     "``waiters_offset``: where its waiters count lies, relative to it (-1: poll)."},
    {"wait_all", (PyCFunction)(void (*)(void))Block_wait_all, METH_FASTCALL,
     "wait_all(indices, mode, target, waiters_offset, spin_ns, block_ns) -> bool\n\n"
     "``wait`` for every slot of the tuple ``indices`` in turn, within one bound."},
    {"publish", (PyCFunction)(void (*)(void))Block_publish, METH_FASTCALL,
     "publish(index, value, waiters_index): store ``value`` after every earlier write,\n"
     "then wake the sleepers on the slot if its waiters count says there are any."},
    {"finish", (PyCFunction)(void (*)(void))Block_finish, METH_FASTCALL,
     "finish(status_index, done_index, waiters_index, status, seq): write a status,\n"
     "then publish ``seq`` in the done slot."},
    {"count_ne", (PyCFunction)(void (*)(void))Block_count_ne, METH_FASTCALL,
     "count_ne(indices, value) -> int: how many of the slots hold another value."},
    {"put_scalar", (PyCFunction)(void (*)(void))Block_put_scalar, METH_FASTCALL,
     "put_scalar(seq_index, seq, value, weight, code): a float scalar contribution, seq last."},
    {"put_scalar_array", (PyCFunction)(void (*)(void))Block_put_scalar_array, METH_FASTCALL,
     "put_scalar_array(seq_index, seq, array, weight) -> bool: put_scalar of a 0-d float32\n"
     "or float64 array; False, writing nothing, for anything else."},
    {"combine_scalar_array", (PyCFunction)(void (*)(void))Block_combine_scalar_array, METH_FASTCALL,
     "combine_scalar_array(first, stride, n, me, seq, op, array, weight) -> float or None:\n"
     "combine_scalars with this rank's value and dtype read from a 0-d float32/64 array."},
    {"combine_scalars", (PyCFunction)(void (*)(void))Block_combine_scalars, METH_FASTCALL,
     "combine_scalars(first, stride, n, me, seq, code, op, value, weight) -> float or None\n\n"
     "Every rank's float scalar of command ``seq`` combined by op (0 avg, weighted; 1 sum;\n"
     "2 prod; 3 max; 4 min), in rank order as reduce_ops.combine_floats does; None if a\n"
     "rank left none."},
    {"release", (PyCFunction)Block_release, METH_NOARGS,
     "Give the buffer back (the mapping may then close); the Block is unusable after."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "synkhronos.runtime._block.Block",
    .tp_basicsize = sizeof(Block),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Block(buffer): int64 slots in shared memory, with bounded waits and wake-ups.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Block_init,
    .tp_dealloc = (destructor)Block_dealloc,
    .tp_methods = Block_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_block",
    "Bounded waits, wake-ups and small reductions on int64 slots in shared memory.", -1,
    module_methods};

PyMODINIT_FUNC PyInit__block(void) {
    if (PyType_Ready(&BlockType) < 0 || PyType_Ready(&SmallReduceType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&BlockType);
    if (PyModule_AddObject(m, "Block", (PyObject *)&BlockType) < 0) {
        Py_DECREF(&BlockType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&SmallReduceType);
    if (PyModule_AddObject(m, "SmallReduce", (PyObject *)&SmallReduceType) < 0) {
        Py_DECREF(&SmallReduceType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "EQ", EQ);
    PyModule_AddIntConstant(m, "NE", NE);
    PyModule_AddIntConstant(m, "GE", GE);
    PyModule_AddStringConstant(m, "SMALL_CODES", "fdbBhHiIlLqQ");
    return m;
}
