"""Reductions between machines: each machine's partial, then MPI's all-reduce among the leaders.

A leader first reduces its machine's contributions to one partial per array.
Where MPI reduces the array's dtype exactly as NumPy does (``mpi_leaders.
mpi_reduces``), the partials go through ``Iallreduce``: small arrays of one
(op, dtype) packed into one message, large ones each as they are; ``avg``
travels as a weighted sum with the machines' masses beside it and is divided
after, so every leader computes the same bytes from the same sums.  The rest
(float16, bool, complex, float max/min) is exchanged with ``Iallgather`` and
combined here in machine order, as on one machine.
"""

import numpy as np

from . import reduce_ops as reducers
from . import parts
from .mpi_leaders import PACK_BYTES, c_order, mpi_reduces


def reduce_across(leaders, vals, ops, weights, out, check, into=None):
    """Reduce this machine's contributions with every other machine's; the same result on every leader.

    Args:
        leaders: the ``mpi_leaders.Leaders``.
        vals: per local contributor, its list of arrays.
        ops: one op per array.
        weights: per contributor, its weight for ``avg``; None: one each.
        out: per array, a buffer for the result, or None.
        check: the liveness check.
        into: per array, None or a buffer the caller keeps for MPI to write the
            result into (then it is the result: no copy); it must not be given
            again after the leaders' communicator was renewed.
    """
    n = len(vals[0])
    mass = float(sum(weights)) if weights is not None else float(len(vals))
    result = [None] * n
    direct = [i for i in range(n)
              if mpi_reduces(ops[i], reducers.result_dtype(ops[i], vals[0][i].dtype))]
    if direct:
        _by_mpi(leaders, vals, ops, weights, mass, direct, out, into, result, check)
    rest = [i for i in range(n) if result[i] is None]
    if rest:
        _by_exchange(leaders, vals, ops, weights, mass, rest, out, result, check)
    return result


def _weighted_sum(vals, i, weights, dtype):
    """Sum of ``weights[c] * vals[c][i]`` in ``dtype`` (no copy for one plain contribution)."""
    first = vals[0][i]
    if len(vals) == 1 and weights is None and first.dtype == dtype:
        return first
    acc = np.zeros(first.shape, dtype)
    for c, v in enumerate(vals):
        if weights is None:
            np.add(acc, v[i], out=acc, casting="unsafe")
        else:
            acc += np.multiply(v[i], weights[c], dtype=dtype)
    return acc


def _partial(vals, i, op, weights, dtype):
    if op == "avg":
        return _weighted_sum(vals, i, weights, dtype)
    if len(vals) == 1:
        return vals[0][i]
    return reducers.combine(op, [v[i] for v in vals])


def _by_mpi(leaders, vals, ops, weights, mass, idx, out, into, result, check):
    partials = {}
    groups = {}   # (op, dtype) -> indices of small arrays, packed in one message
    large = []
    for i in idx:
        dtype = reducers.result_dtype(ops[i], vals[0][i].dtype)
        p = c_order(_partial(vals, i, ops[i], weights, dtype))
        partials[i] = p
        if p.nbytes < PACK_BYTES:
            groups.setdefault((ops[i], dtype.str), []).append(i)
        else:
            large.append(i)
    sends, places = [], []
    mass_at = None   # where the sum of the masses comes back: (send index, element)
    for j, ((op, dstr), members) in enumerate(groups.items()):
        dtype = np.dtype(dstr)
        count = sum(partials[i].size for i in members) + (op == "avg")
        buf = leaders.buffer(("r", len(sends)), count * dtype.itemsize).view(dtype)
        at = 0
        for i in members:
            k = partials[i].size
            buf[at:at + k] = partials[i].reshape(-1)
            places.append((i, len(sends), at))
            at += k
        if op == "avg" and mass_at is None:
            buf[at] = mass
            mass_at = (len(sends), at)
        elif op == "avg":
            buf[at] = 0  # the masses travel once
        sends.append((buf, op, None))
    for i in large:
        p = partials[i]
        dst = parts.out_entry(into, i)
        if dst is not None and (dst.shape != p.shape or dst.dtype != p.dtype):
            dst = None
        places.append((i, len(sends), 0))
        sends.append((p.reshape(-1), ops[i], dst))
    if mass_at is None and any(ops[i] == "avg" for i in idx):
        buf = leaders.buffer(("r", len(sends)), 8).view(np.float64)
        buf[0] = mass
        mass_at = (len(sends), 0)
        sends.append((buf, "sum", None))
    got = leaders.all_reduce(sends, check)
    total = None if mass_at is None else \
        float(got[mass_at[0]].view(sends[mass_at[0]][0].dtype)[mass_at[1]])
    for i, s, at in places:
        p = partials[i]
        dst = sends[s][2]
        if dst is not None:
            if ops[i] == "avg":
                np.multiply(dst, 1.0 / total, out=dst)
            result[i] = dst
            continue
        v = got[s].view(p.dtype)[at:at + p.size].reshape(p.shape)
        dst = parts.result_buffer(p, parts.out_entry(out, i))
        if ops[i] == "avg":
            np.multiply(v, 1.0 / total, out=dst)
        else:
            np.copyto(dst, v)
        result[i] = dst


def _by_exchange(leaders, vals, ops, weights, mass, idx, out, result, check):
    # What MPI cannot reduce as NumPy does: every leader gets every partial (Iallgather)
    # and combines them in machine order, so all hold the same bytes.
    partials = [c_order(reducers.combine(ops[i], [v[i] for v in vals], weights)
                                     if len(vals) > 1 or ops[i] == "avg"
                                     else vals[0][i]) for i in idx]
    sizes = [p.nbytes for p in partials]
    mine = np.empty(8 + sum(sizes), np.uint8)
    mine[:8].view(np.float64)[0] = mass
    at = 8
    for p in partials:
        mine[at:at + p.nbytes] = p.reshape(-1).view(np.uint8)
        at += p.nbytes
    every = leaders.all_gather_fixed(mine, check)
    masses = [float(row[:8].view(np.float64)[0]) for row in every]
    at = 8
    for i, p in zip(idx, partials):
        got = [row[at:at + p.nbytes].view(p.dtype).reshape(p.shape) for row in every]
        at += p.nbytes
        result[i] = reducers.combine(ops[i], got, masses if ops[i] == "avg" else None,
                                     _fits(parts.out_entry(out, i), ops[i], p))


def _fits(out, op, p):
    if out is not None and out.shape == p.shape \
            and out.dtype == reducers.result_dtype(op, p.dtype):
        return out
    return None

