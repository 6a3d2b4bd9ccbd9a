"""Reduced-precision all-reduce: send 16-bit floats, accumulate in float32.

Built on any backend's ``all_reduce`` and ``all_gather``, so every backend
gets it: a tiny all-reduce of each array's largest magnitude picks a power
of two that scales the values before they are cast down (no overflow in
the sum, fewer float16 underflows: the failure modes of Horovod #278); then a
reduce-scatter and an all-gather move 2-byte values only.  Each rank casts
the others' scaled values of its part up to float32, sums them, casts its
part of the result down again, and every rank reads every part: the result
has the small type's precision (rounded twice: before and after the sum).
16-bit values travel as uint16 bit patterns, so backends need no knowledge of
bfloat16.
"""

import math

import numpy as np

from . import parts

DTYPES = ("bfloat16", "float16")

# The largest magnitude of a scaled sum: far from float16's limit (65504),
# high enough that float16 keeps small gradients out of its subnormals.
_TARGET = {"float16": 2.0 ** 13, "bfloat16": 1.0}


def small_dtype(name):
    """Return the NumPy dtype for "bfloat16" (from ml_dtypes) or "float16"."""
    if name == "float16":
        return np.dtype(np.float16)
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def check(dtype, op, arrays_dtypes, where):
    """Raise ValueError or TypeError unless a compressed all-reduce can do this."""
    if dtype not in DTYPES:
        raise ValueError(f"{where}: dtype must be None, 'bfloat16' or 'float16'; got {dtype!r}")
    if op not in ("sum", "avg"):
        raise ValueError(f"{where}: dtype={dtype!r} needs op 'sum' or 'avg'; got {op!r}")
    for name, dt in arrays_dtypes:
        if np.dtype(dt).kind != "f":
            raise TypeError(f"{where}: dtype={dtype!r} compresses floats; {name} is {dt}")


def all_reduce(backend, arrays, op, dtype, out=None):
    """Sum (``op`` "sum") or average ("avg") ``arrays`` over the ranks in 16-bit transport.

    Every rank calls it with arrays of the same shapes.  Returns arrays of
    the inputs' dtypes: the ``out`` entries that fit (one array or None per
    input; an input itself may be its own ``out``), else new ones.
    """
    n = backend.n_parallel
    small = small_dtype(dtype)
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if n == 1:
        return [np.array(a.astype(small).astype(a.dtype)) for a in arrays]
    peaks = [np.array([max(float(a.max(initial=0.0)), -float(a.min(initial=0.0)))])
             for a in arrays]
    peaks = backend.all_reduce(peaks, "max")
    scales = [_scale(float(p[0]), n, dtype) for p in peaks]
    conv = _Bf16() if dtype == "bfloat16" else _NumpyCasts(small)
    sent = [conv.down(a.reshape(-1), s, _buffer(("sent", i), a.size))
            for i, (a, s) in enumerate(zip(arrays, scales))]
    plan = parts.plan([np.empty(a.size, small) for a in arrays], n)
    me = backend.rank
    # Reduce-scatter: every rank sums its own part of every array in float32.
    got = backend.all_gather(sent)
    mine = []
    for i, lo, hi in plan[me]:
        acc = np.zeros(hi - lo, np.float32)
        for q in range(n):
            conv.accumulate(acc, got[q][i][lo:hi])
        mine.append(conv.down(acc, 1.0, np.empty(acc.size, np.uint16)))
    # All-gather of the reduced parts, still 16-bit.
    got = backend.all_gather(mine)
    # This rank's inputs were read (cast down) above: they may be the outputs now.
    res = [parts.result_buffer(a, parts.out_entry(out, i)) for i, a in enumerate(arrays)]
    flats = [r.reshape(-1) for r in res]
    for q in range(n):
        for (i, lo, hi), part in zip(plan[q], got[q]):
            factor = (1.0 / n if op == "avg" else 1.0) / scales[i]
            conv.up(part, factor, flats[i][lo:hi])
    return res


_buffers = {}


def _buffer(key, size):
    """A uint16 buffer kept per process and key: fresh pages are slow to first touch."""
    buf = _buffers.get(key)
    if buf is None or buf.size != size:
        buf = _buffers[key] = np.empty(size, np.uint16)
    return buf


class _NumpyCasts:
    """Conversions through NumPy's casts (float16; bfloat16 through ml_dtypes)."""

    def __init__(self, small):
        self.small = small

    def down(self, a, scale, dst):
        small = (a * scale if scale != 1.0 else a).astype(self.small)
        np.copyto(dst, small.view(np.uint16))
        return dst

    def accumulate(self, acc, bits):
        acc += bits.view(self.small).astype(np.float32)

    def up(self, bits, factor, out):
        np.multiply(bits.view(self.small).astype(np.float32), factor, out=out, casting="unsafe")


class _Bf16:
    """bfloat16 conversions as bit operations in one compiled pass each (Numba).

    NumPy has no bfloat16 and ml_dtypes' casts run an element at a time; a
    bfloat16 is the top half of a float32, rounded to nearest even.
    """

    def __init__(self):
        self.k = _bf16_kernels()

    def down(self, a, scale, dst):
        self.k[0](np.ascontiguousarray(a, dtype=np.float32), np.float32(scale), dst)
        return dst

    def accumulate(self, acc, bits):
        self.k[1](acc, np.ascontiguousarray(bits))

    def up(self, bits, factor, out):
        if out.dtype == np.float32:
            self.k[2](np.ascontiguousarray(bits), np.float32(factor), out)
            return
        tmp = np.empty(bits.size, np.float32)
        self.k[2](np.ascontiguousarray(bits), np.float32(factor), tmp)
        np.copyto(out, tmp, casting="unsafe")


_kernels = {}


def _bf16_kernels():
    """Compile (once per process) the three bfloat16 kernels."""
    if "bf16" not in _kernels:
        import numba

        @numba.njit(nogil=True, cache=True)
        def down(src, scale, dst):
            f = np.empty(1, np.float32)
            u = f.view(np.uint32)
            for i in range(src.size):
                f[0] = src[i] * scale
                b = u[0]
                b += np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))
                dst[i] = np.uint16(b >> np.uint32(16))

        @numba.njit(nogil=True, cache=True)
        def accumulate(acc, bits):
            u = np.empty(1, np.uint32)
            f = u.view(np.float32)
            for i in range(acc.size):
                u[0] = np.uint32(bits[i]) << np.uint32(16)
                acc[i] += f[0]

        @numba.njit(nogil=True, cache=True)
        def up(bits, factor, dst):
            u = np.empty(1, np.uint32)
            f = u.view(np.float32)
            for i in range(dst.size):
                u[0] = np.uint32(bits[i]) << np.uint32(16)
                dst[i] = f[0] * factor

        _kernels["bf16"] = (down, accumulate, up)
    return _kernels["bf16"]


def _scale(peak, n, dtype):
    """A power of two putting the sum of n scaled values at most at the target."""
    if not math.isfinite(peak) or peak == 0.0:
        return 1.0
    return 2.0 ** math.floor(math.log2(_TARGET[dtype] / (n * peak)))
