"""Helpers the backends share: splitting arrays into per-rank parts and reducing them."""

import numpy as np

from . import reduce_ops

# Above this many elements, a part reduced from three or more sources is
# processed in blocks, so the partial result stays in cache between sources.
BLOCK = 1 << 15


def out_entry(out, i):
    """The ``out`` buffer given for array ``i``, or None."""
    return None if out is None else out[i]


def byte_parts(arrays, n):
    """Split all arrays' bytes into n parts; return per rank a list of (array, lo, hi).

    Parts follow byte counts, so many small arrays cost one ufunc call each on
    one rank only, not a call per array on every rank.
    """
    sizes = [a.nbytes for a in arrays]
    total = sum(sizes)
    bounds = [total * q // n for q in range(n + 1)]
    per_rank = [[] for _ in range(n)]
    start = 0
    for i, a in enumerate(arrays):
        isz = a.itemsize or 1
        # The same rounding for both ends of neighbouring parts: a partition.
        cuts = [min(max(-(-(b - start) // isz), 0), a.size) for b in bounds]
        for q in range(n):
            if cuts[q + 1] > cuts[q]:
                per_rank[q].append((i, cuts[q], cuts[q + 1]))
        start += sizes[i]
    return per_rank


def skips(plan_q, n_arrays):
    """Per array, the element range [lo, hi) of one rank's part ((0, 0) if none)."""
    out = [(0, 0)] * n_arrays
    for i, lo, hi in plan_q:
        out[i] = (lo, hi)
    return out


def op_list(op, n):
    """One op per array from one op name or a list of them."""
    return [op] * n if op is None or isinstance(op, str) else list(op)


def result_buffer(a, out):
    """Return ``out`` if a reduction of ``a`` can land there, else a new array."""
    if out is not None and out.shape == a.shape and out.dtype == a.dtype \
            and out.flags.c_contiguous:
        return out
    return np.empty(a.shape, a.dtype)


def finish(op, src, dst, n):
    """Copy a reduced part to its destination; an unweighted ``avg`` is scaled here."""
    if op == "avg":
        np.multiply(src, 1.0 / n, out=dst, casting="unsafe")
    else:
        np.copyto(dst, src)


def reduce_into(op, srcs, out, scale=None):
    """Reduce ``srcs`` (equal-length flat arrays) into ``out``, then multiply by ``scale``.

    ``out`` may be ``srcs[0]``.  With three or more sources or a scale, long
    arrays go in blocks, so each block stays in cache between passes.
    """
    ufunc = reduce_ops.UFUNCS[op]
    if (len(srcs) == 2 and scale is None) or len(out) <= 2 * BLOCK:
        ufunc(srcs[0], srcs[1], out=out)
        for s in srcs[2:]:
            ufunc(out, s, out=out)
        if scale is not None:
            np.multiply(out, scale, out=out, casting="unsafe")
        return
    reduce_to_all(op, srcs, [out], scale)


def reduce_to_all(op, srcs, outs, scale=None):
    """Reduce ``srcs`` into ``outs[0]`` and copy the result into every other of ``outs``.

    Equal-length flat arrays; ``outs[k]`` may be ``srcs[k]`` (a rank's buffer
    read, then overwritten with the result).  In blocks, so the copies read
    the result from cache and write lines the reduction just read.
    """
    ufunc = reduce_ops.UFUNCS[op]
    first = outs[0]
    for lo in range(0, len(first), BLOCK):
        hi = lo + BLOCK
        o = first[lo:hi]
        ufunc(srcs[0][lo:hi], srcs[1][lo:hi], out=o)
        for s in srcs[2:]:
            ufunc(o, s[lo:hi], out=o)
        if scale is not None:
            np.multiply(o, scale, out=o, casting="unsafe")
        for other in outs[1:]:
            np.copyto(other[lo:hi], o)


def combine_whole(op, parts, weights, out):
    """Reduce whole arrays (the small-message path), into ``out`` when it fits.

    ``out`` may be one of ``parts`` (this rank's own array), not a partial
    overlap of one.
    """
    a = parts[0]
    if weights is not None or len(parts) == 1 or (op == "avg" and a.dtype.kind not in "fc"):
        dtype = reduce_ops.result_dtype(op, a.dtype)
        if out is not None and (out.shape != a.shape or out.dtype != dtype):
            out = None
        return reduce_ops.combine(op, parts, weights, out)
    if out is None or out.shape != a.shape or out.dtype != a.dtype:
        out = np.empty(a.shape, a.dtype)
    elif out is not a:
        # Read ``out`` first when it is an input: nothing is written before.
        for j in range(1, len(parts)):
            if parts[j] is out:
                parts = [out] + parts[:j] + parts[j + 1:]
                a = out
                break
    ufunc = reduce_ops.UFUNCS[op]
    ufunc(a, parts[1], out=out)
    for p in parts[2:]:
        ufunc(out, p, out=out)
    if op == "avg":
        out *= 1.0 / len(parts)
    return out


def local_result(op, a, out):
    """The result of reducing one rank's array with itself alone."""
    dtype = reduce_ops.result_dtype(op, a.dtype)
    if out is not None and out.shape == a.shape and out.dtype == dtype:
        if out is not a:
            np.copyto(out, a, casting="unsafe")
        return out
    return np.array(a, dtype=dtype)


def check_alike(parts, ranks, flags):
    """Raise ValueError unless every contributing rank sent alike arrays (and split flags)."""
    first = parts[ranks[0]]
    for q, flag in zip(ranks[1:], flags[1:]):
        other = parts[q]
        if flag != flags[0] or len(other) != len(first) or any(
                a.shape != b.shape or a.dtype != b.dtype for a, b in zip(first, other)):
            desc = "; ".join(
                f"rank {r}: " + ", ".join(f"{a.dtype}{list(a.shape)}" for a in parts[r])
                for r in ranks)
            raise ValueError(f"cannot reduce arrays whose shapes or dtypes differ across ranks ({desc})")
