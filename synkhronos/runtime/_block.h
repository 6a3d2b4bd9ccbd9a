/* The Block's C interface: its layout and what synkhronos/runtime/_block.c exports
 * to the other extension (synkhronos/comm/_reduce.c, whose reductions take a Block).
 *
 * _block.c fills a BlockAPI and exports it as the capsule BLOCK_API_CAPSULE; _reduce.c
 * imports it at its own import and refuses a capsule of another SYNK_BLOCK_ABI (one of
 * the two extensions built from older sources).
 */

#ifndef SYNK_BLOCK_H
#define SYNK_BLOCK_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>

/* The version of this interface and of _block's Python functions.  Bump it with any
 * change to either (a signature, Block's layout, BlockAPI), and BLOCK_ABI in
 * synkhronos/runtime/__init__.py with it: a build from older sources then fails to
 * import, its error naming the rebuild, instead of misreading memory. */
#define SYNK_BLOCK_ABI 3

#define BLOCK_API_CAPSULE "synkhronos.runtime._block.API"

enum { EQ = 0, NE = 1, GE = 2 };

/* Bounds of one wait over several slots (wait_all, SmallReduce's other ranks). */
#define MAX_WAIT 4096

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int64_t *slots;
    Py_ssize_t n;
    int held;
    /* Waits now running without the GIL on this Block (changed with the GIL held): while
     * any runs, release() refuses, so the slots they read are never unmapped under them. */
    int busy;
    /* Spinning waits that saw this thread off its core (changed with the GIL held). */
    long long preempted;
} Block;

static inline int check_index(Block *self, Py_ssize_t i) {
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

/* A Python int that must fit a C int (a mode, an op, a stage): -1 with an error set if
 * it is not an int or does not fit, as PyLong_AsLong alone would not say. */
static inline int int_arg(PyObject *obj, int *out) {
    long v = PyLong_AsLong(obj);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < INT_MIN || v > INT_MAX) {
        PyErr_Format(PyExc_OverflowError, "%ld does not fit a C int", v);
        return -1;
    }
    *out = (int)v;
    return 0;
}

typedef struct {
    int abi;  /* SYNK_BLOCK_ABI of the _block.c that filled it */
    PyTypeObject *type;
    /* Wait until every slot in idx[0:k] holds (mode, target): spin up to spin_ns, then
     * sleep (GIL released) up to block_ns; 1 when they hold.  Waiters of slot i are
     * counted in slot i + woff (woff < 0: poll). */
    int (*wait_slots)(Block *self, Py_ssize_t *idx, int k, int mode, int64_t target,
                      Py_ssize_t woff, long long spin_ns, long long block_ns);
} BlockAPI;

#endif
