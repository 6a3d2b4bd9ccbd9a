"""Reduce operations by name: the single table of ops and the NumPy code behind them."""

import math

import numpy as np

COLLECTIVE_OPS = ("avg", "sum", "prod", "max", "min")
OUTPUT_OPS = COLLECTIVE_OPS + (None, "gather")
# How the compiled reductions (comm/_reduce.c) name the ops.
OP_CODES = {"avg": 0, "sum": 1, "prod": 2, "max": 3, "min": 4}

UFUNCS = {
    "avg": np.add,
    "sum": np.add,
    "prod": np.multiply,
    "max": np.maximum,
    "min": np.minimum,
}


def check_op(op, where, allowed=COLLECTIVE_OPS):
    """Return ``op`` if it is in ``allowed``; raise ValueError naming ``where`` otherwise."""
    if isinstance(op, str) or op is None:
        if op in allowed:
            return op
    names = ", ".join("None" if o is None else o for o in allowed)
    raise ValueError(f"{where}: op must be one of {names}; got {op!r}")


def result_dtype(op, dtype):
    """Averaging integers gives float64, as ``numpy.mean`` does."""
    dtype = np.dtype(dtype)
    if op == "avg" and dtype.kind in "iub":
        return np.dtype(np.float64)
    return dtype


def combine(op, parts, weights=None, out=None):
    """Reduce a list of same-shape arrays with ``op``; ``avg`` is weighted by ``weights``.

    Args:
        op: "avg", "sum", "prod", "max" or "min".
        parts: the arrays, one per contributor.
        weights: row counts (or any non-negative weights) for ``avg``; None
            weighs every part equally (sum, then scale by 1/n).
        out: optional output array of the result's shape and dtype.
    """
    first = parts[0]
    if first.ndim == 0 and out is None and first.dtype.kind == "f":
        return _combine_scalars(op, parts, weights, first.dtype)
    if op == "avg" and weights is not None and _all_equal(parts):
        # Equal parts (an in-graph psum, say) average to themselves exactly;
        # the weighted sum below could be an ulp off.
        return _place(first, out, result_dtype(op, first.dtype))
    if op == "avg":
        if weights is None:
            acc = parts[0].astype(result_dtype(op, parts[0].dtype))
            for p in parts[1:]:
                acc += p
            acc *= 1.0 / len(parts)
        else:
            total = float(sum(weights))
            acc = parts[0] * (weights[0] / total)
            for p, w in zip(parts[1:], weights[1:]):
                acc += p * (w / total)
    else:
        ufunc = UFUNCS[op]
        if out is not None and out.dtype == first.dtype and out.shape == first.shape:
            # Straight into ``out``: a fresh accumulator of a large array costs its
            # page faults again at every call.
            if not any(np.may_share_memory(out, p) for p in parts[1:]):
                if out is not first:
                    np.copyto(out, first)
                for p in parts[1:]:
                    ufunc(out, p, out=out)
                return out
            if len(parts) == 2 and out is parts[1]:
                ufunc(out, first, out=out)  # these ufuncs commute exactly for two operands
                return out
        acc = np.array(parts[0])
        for p in parts[1:]:
            ufunc(acc, p, out=acc)
    if out is not None:
        np.copyto(out, acc, casting="unsafe")
        return out
    return np.asarray(acc)


def _all_equal(parts):
    first = parts[0]
    return all(p is first or (p.shape == first.shape and np.array_equal(p, first))
               for p in parts[1:])


def _place(value, out, dtype):
    if out is not None:
        np.copyto(out, value, casting="unsafe")
        return out
    return np.array(value, dtype=dtype)


def _combine_scalars(op, parts, weights, dtype):
    # 0-d float outputs (losses, accuracies) are the common case; Python floats
    # reduce them several times faster than NumPy scalar arithmetic.
    return combine_floats(op, [float(p) for p in parts], weights, dtype)


def _added(values):
    # Left to right, as the C code adds: Python 3.12+'s sum() of floats compensates
    # (Neumaier), which can differ in the last bit.
    total = 0.0
    for v in values:
        total += v
    return total


def combine_floats(op, values, weights, dtype):
    """``combine`` of 0-d float parts given as Python floats; returns a 0-d array of ``dtype``."""
    if op == "avg":
        if weights is not None and values.count(values[0]) == len(values):
            result = values[0]  # equal values (an in-graph psum) stay exact
        elif weights is None:
            result = _added(values) / len(values)
        else:
            result = _added(v * w for v, w in zip(values, weights)) / _added(weights)
    elif op == "sum":
        result = _added(values)
    elif op == "prod":
        result = math.prod(values)
    elif op == "max":
        result = max(values)
    else:
        result = min(values)
    return np.array(result, dtype=dtype)


def accumulate(op, acc, value, w_acc=None, w_value=None):
    """Fold ``value`` into the running result ``acc`` (slices within one rank).

    ``avg`` keeps a running weighted mean: the caller passes the weight behind
    ``acc`` so far and that of ``value``.
    """
    if op in ("gather", None):
        raise ValueError("accumulate: gather and None are concatenated, not folded")
    value = np.asarray(value)
    if acc is None:
        return np.array(value, dtype=result_dtype(op, value.dtype))
    if op == "avg":
        total = w_acc + w_value
        if total == 0:
            return acc
        return (acc * (w_acc / total) + value * (w_value / total)).astype(acc.dtype, copy=False)
    return UFUNCS[op](acc, value).astype(acc.dtype, copy=False)
