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


def all_reduce(backend, arrays, op, dtype):
    """Sum (``op`` "sum") or average ("avg") ``arrays`` over the ranks in 16-bit transport.

    Every rank calls it with arrays of the same shapes; returns new arrays of
    the inputs' dtypes.
    """
    n = backend.n_parallel
    small = small_dtype(dtype)
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if n == 1:
        return [np.array(a.astype(small).astype(a.dtype)) for a in arrays]
    peaks = [np.array([np.max(np.abs(a), initial=0.0)], dtype=np.float64) for a in arrays]
    peaks = backend.all_reduce(peaks, "max")
    scales = [_scale(float(p[0]), n, dtype) for p in peaks]
    sent = [(a.reshape(-1) * s).astype(small).view(np.uint16) for a, s in zip(arrays, scales)]
    plan = parts.plan([np.empty(a.size, small) for a in arrays], n)
    me = backend.rank
    # Reduce-scatter: every rank sums its own part of every array in float32.
    got = backend.all_gather(sent)
    mine = []
    for i, lo, hi in plan[me]:
        acc = np.zeros(hi - lo, np.float32)
        for q in range(n):
            acc += got[q][i][lo:hi].view(small).astype(np.float32)
        mine.append(acc.astype(small).view(np.uint16))
    # All-gather of the reduced parts, still 16-bit.
    got = backend.all_gather(mine)
    out = [np.empty(a.size, a.dtype) for a in arrays]
    for q in range(n):
        for (i, lo, hi), part in zip(plan[q], got[q]):
            value = part.view(small).astype(np.float32)
            factor = (1.0 / n if op == "avg" else 1.0) / scales[i]
            np.multiply(value, factor, out=out[i][lo:hi], casting="unsafe")
    return [o.reshape(a.shape) for o, a in zip(out, arrays)]


def _scale(peak, n, dtype):
    """A power of two putting the sum of n scaled values at most at the target."""
    if not math.isfinite(peak) or peak == 0.0:
        return 1.0
    return 2.0 ** math.floor(math.log2(_TARGET[dtype] / (n * peak)))
