"""Reductions between machines: each machine's partial, then the leaders' all-reduce (MPI or gloo).

A leader's partial is its machine's contributions reduced already (by the
shared-memory backend, every local rank reducing its part of large arrays),
with its mass: the sum of its contributors' weights.  Where MPI reduces the
array's dtype exactly as NumPy does (``mpi_leaders.mpi_reduces``), the
partials go through ``Iallreduce``: small arrays of one (op, dtype) packed
into one message, large ones each as they are; ``avg`` travels as a
weighted sum (partial times mass) with the masses beside it and is divided
after, so every leader computes the same bytes from the same sums.  The rest
(float16, bool, complex, float max/min) is exchanged with ``Iallgather`` and
combined here in machine order, as on one machine.
"""

import numpy as np

from . import reduce_ops
from . import parts
from .leaders import PACK_BYTES, c_order


def reduce_across(leaders, partials, ops, mass, out, check, into=None, ballot=None):
    """Reduce this machine's partials with every other machine's; the same result on every leader.

    Args:
        leaders: the leaders' collectives (a ``leaders.Leaders``: MPI's or gloo's).
        partials: per array, this machine's reduction of it (for ``avg``, the
            weighted mean of its contributors).
        ops: one op per array.
        mass: the sum of this machine's contributors' weights (``avg``).
        out: per array, a buffer for the result, or None.
        check: the liveness check.
        into: per array, None or a buffer the caller keeps for MPI to write the
            result into (then it is the result: no copy); it must not be given
            again after the leaders' communicator was renewed.
        ballot: an ``mpi_small.Ballot`` whose vote rides at the end of the first
            packed message (the arrays are all small and of one op), or None.
    """
    n = len(partials)
    result = [None] * n
    direct = [i for i in range(n)
              if leaders.reduces(ops[i], reduce_ops.result_dtype(ops[i], partials[i].dtype))]
    if direct:
        _by_mpi(leaders, partials, ops, mass, direct, out, into, result, check, ballot)
    rest = [i for i in range(n) if result[i] is None]
    if rest:
        _by_exchange(leaders, partials, ops, mass, rest, out, result, check)
    return result


def _by_mpi(leaders, partials, ops, mass, idx, out, into, result, check, ballot=None):
    sent = {}
    groups = {}   # (op, dtype) -> indices of small arrays, packed in one message
    large = []
    for i in idx:
        dtype = reduce_ops.result_dtype(ops[i], partials[i].dtype)
        p = partials[i]
        if ops[i] == "avg" and mass != 1.0:
            p = np.multiply(p, mass, dtype=dtype)  # a weighted sum: the masses divide it after
        p = c_order(p.astype(dtype, copy=False))
        sent[i] = p
        if p.nbytes < PACK_BYTES:
            groups.setdefault((ops[i], dtype.str), []).append(i)
        else:
            large.append(i)
    sends, places = [], []
    mass_at = None   # where the sum of the masses comes back: (send index, element)
    for j, ((op, dstr), members) in enumerate(groups.items()):
        dtype = np.dtype(dstr)
        voted = ballot is not None and j == 0
        count = sum(sent[i].size for i in members) + (op == "avg") + voted
        buf = leaders.buffer(("r", len(sends)), count * dtype.itemsize).view(dtype)
        at = 0
        for i in members:
            k = sent[i].size
            buf[at:at + k] = sent[i].reshape(-1)
            places.append((i, len(sends), at))
            at += k
        if op == "avg" and mass_at is None:
            buf[at] = mass
            mass_at = (len(sends), at)
        elif op == "avg":
            buf[at] = 0  # the masses travel once
        if voted:
            buf[-1] = ballot.vote
        sends.append((buf, op, None))
    for i in large:
        p = sent[i]
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
    if ballot is not None:
        ballot.count(got[0].view(sends[0][0].dtype)[-1])
    total = None if mass_at is None else \
        float(got[mass_at[0]].view(sends[mass_at[0]][0].dtype)[mass_at[1]])
    for i, s, at in places:
        p = sent[i]
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


def _by_exchange(leaders, partials, ops, mass, idx, out, result, check):
    # What MPI cannot reduce as NumPy does: every leader gets every partial (Iallgather)
    # and combines them in machine order, so all hold the same bytes.
    partials = [c_order(partials[i]) for i in idx]
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
        result[i] = reduce_ops.combine(ops[i], got, masses if ops[i] == "avg" else None,
                                     _fits(parts.out_entry(out, i), ops[i], p))


def _fits(out, op, p):
    if out is not None and out.shape == p.shape \
            and out.dtype == reduce_ops.result_dtype(op, p.dtype):
        return out
    return None

