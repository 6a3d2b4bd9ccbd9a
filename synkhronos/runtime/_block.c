/* The control path in compiled code: bounded waits and wake-ups on a shared block.
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
 *
 * The Block's layout and the waits are also the comm extension's (synkhronos/comm/_reduce.c
 * reduces over its ranks' slots): _block.h declares them, a capsule exports them.
 */

#include "_block.h"
#include <string.h>

#include "../_c/atomics.h"

/* Spin this long holding the GIL before releasing it: most waits of a tight
 * loop end within a few microseconds, and dropping and taking the GIL costs
 * a good part of one. */
#define SPIN_WITH_GIL_NS 20000LL

/* A claim word (claim()): a tag above, the next ticket in the low CLAIM_BITS. */
#define CLAIM_BITS 20

/* Two looks of a spinning wait this far apart (64 pauses take a few microseconds): the
 * thread was off its core for a time slice: another thread or program shares the core
 * (Block.preempted).  Shorter gaps (interrupts, the hypervisor) do not count. */
#define PREEMPT_GAP_NS 1000000LL
#define CLAIM_MASK ((1LL << CLAIM_BITS) - 1)

static inline int holds(int64_t v, int mode, int64_t target) {
    switch (mode) {
    case EQ: return v == target;
    case NE: return v != target;
    default: return v >= target;
    }
}

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
    long long last = start;
    long long gaps = 0;  /* looks PREEMPT_GAP_NS or more apart: this thread was off its core */
    while (spin_ns > 0) {
        cpu_relax();
        if (holds(load_acquire(&s[idx[next]]), mode, target)) {
            if (++next == k) {
                self->preempted += gaps;
                return 1;
            }
            continue;
        }
        if ((++it & 63) == 0) {
            long long t = now_ns();
            gaps += t - last >= PREEMPT_GAP_NS;
            last = t;
            if (t >= gil_end)
                break;
        }
    }
    int done = 0;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    long long spin_end = start + spin_ns;
    while (!done && spin_ns > SPIN_WITH_GIL_NS) {
        cpu_relax();
        if (holds(load_acquire(&s[idx[next]]), mode, target)) {
            if (++next == k)
                done = 1;
            continue;
        }
        if ((++it & 63) == 0) {
            long long t = now_ns();
            gaps += t - last >= PREEMPT_GAP_NS;
            last = t;
            if (t >= spin_end)
                break;
        }
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
    self->busy--;
    self->preempted += gaps;
    return done;
}

static PyObject *Block_wait(Block *self, PyObject *const *args, Py_ssize_t nargs) {
    /* wait(index, mode, target, waiters_offset, spin_ns, block_ns) -> bool */
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "wait(index, mode, target, waiters_offset, spin_ns, block_ns)");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[0]);
    int mode = 0;
    if (i == -1 && PyErr_Occurred())
        return NULL;
    if (int_arg(args[1], &mode) < 0)
        return NULL;
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
    int mode = 0;
    if (int_arg(args[1], &mode) < 0)
        return NULL;
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

static PyObject *Block_claim(Block *self, PyObject *const *args, Py_ssize_t nargs) {
    /* claim(index, tag, n) -> int: take the next ticket of the word at ``index``, which holds
     * (tag << CLAIM_BITS) | next; -1 once the word holds another tag (a later call's) or
     * every ticket below ``n`` is taken.  One compare-and-swap per ticket: whoever takes
     * ticket t, no one else does, and a rank still in an older call takes none. */
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "claim(index, tag, n)");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[0]);
    long long tag = PyLong_AsLongLong(args[1]);
    long long n = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred() || check_index(self, i) < 0)
        return NULL;
    if (n < 0 || n > CLAIM_MASK || tag < 0 || tag > (INT64_MAX >> CLAIM_BITS)) {
        PyErr_SetString(PyExc_ValueError, "claim: tag or n out of range");
        return NULL;
    }
    int64_t *p = &self->slots[i];
    int64_t v = load(p);
    for (;;) {
        if ((v >> CLAIM_BITS) != tag || (v & CLAIM_MASK) >= n)
            return PyLong_FromLong(-1);
        if (__atomic_compare_exchange_n(p, &v, v + 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            return PyLong_FromLongLong(v & CLAIM_MASK);
    }
}

static PyObject *Block_preempted(Block *self, PyObject *unused) {
    return PyLong_FromLongLong(self->preempted);
}

static PyObject *Block_release(Block *self, PyObject *unused) {
    if (self->busy) {
        PyErr_Format(PyExc_BufferError, "Block.release: %d wait(s) in other threads still "
                     "read this block", self->busy);
        return NULL;
    }
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
        self->slots = NULL;
        self->n = 0;
    }
    Py_RETURN_NONE;
}

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
    {"claim", (PyCFunction)(void (*)(void))Block_claim, METH_FASTCALL,
     "claim(index, tag, n) -> int: the next ticket below ``n`` of the claim word at\n"
     "``index`` ((tag << CLAIM_BITS) | next), or -1 once all are taken or the word\n"
     "holds another tag."},
    {"preempted", (PyCFunction)Block_preempted, METH_NOARGS,
     "preempted() -> int: how often this process's spinning waits on the Block saw\n"
     "themselves taken off their core (two looks 1 ms or more apart), since it was made."},
    {"release", (PyCFunction)Block_release, METH_NOARGS,
     "Give the buffer back (the mapping may then close); the Block is unusable after.\n"
     "BufferError while a wait in another thread still reads it."},
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
    "Bounded waits and wake-ups on int64 slots in shared memory.", -1, NULL};

/* What _reduce.c uses of this module; static, so it lives as long as the process. */
static BlockAPI api = {SYNK_BLOCK_ABI, &BlockType, wait_slots};

PyMODINIT_FUNC PyInit__block(void) {
    if (PyType_Ready(&BlockType) < 0)
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
    PyObject *capsule = PyCapsule_New(&api, BLOCK_API_CAPSULE, NULL);
    if (capsule == NULL || PyModule_AddObject(m, "API", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "ABI", SYNK_BLOCK_ABI) < 0 ||
        PyModule_AddIntConstant(m, "CLAIM_BITS", CLAIM_BITS) < 0 ||
        PyModule_AddIntConstant(m, "EQ", EQ) < 0 || PyModule_AddIntConstant(m, "NE", NE) < 0 ||
        PyModule_AddIntConstant(m, "GE", GE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
