"""Collectives on shared variables: broadcast, scatter, gather, all_gather, and their commands.

Also the home of the whole public set: reduce and all_reduce come from
``reductions``, set_value, get_value, get_lengths and get_shapes from
``rank_values``.

Each collective checks its arguments in the master, posts one command whose
message names the variables by their index in ``rt.registry.shareds``, and runs the
same local function on every rank, the master included.  All variables of
one call go through the backend together: one pack, one set of barriers.

Results for one variable come back as one array; for a list or tuple of
variables, as a tuple (also for a list of one).  The ``nccl`` flags matter in
GPU mode only: there, with one GPU per rank, the run's backend is NCCL, and
``nccl=False`` sends a call through the host backend it wraps instead; gather
and reduce on the NCCL backend return values in each variable's kind (JAX
arrays for variables that live on the device).
"""

import logging
import numbers
from typing import NamedTuple

import numpy as np

from . import access
from ..inputs import rank_rows
from ..runtime.commands import Command, handler
from ..runtime.run import run_command
from ..inputs.data_object import Data
from .rank_values import get_lengths, get_shapes, get_value, set_value  # noqa: F401
from .reductions import all_reduce, check_flags, reduce, require_collective  # noqa: F401
from ..runtime.state import serialized
from .access import backend_values, transport

logger = logging.getLogger(__name__)

__all__ = ["broadcast", "scatter", "gather", "all_gather", "reduce", "all_reduce",
           "set_value", "get_value", "get_lengths", "get_shapes"]


@serialized
def broadcast(shared_vars, values=None, nccl=True):
    """Give every rank the master's value of shared variables (or ``values``).  Master only.

    Args:
        shared_vars: a shared variable, its name, or a list/tuple of either.
        values: None to send the master's current values, else one value per
            variable (NumPy array or Data), which every rank, the master
            included, then holds.  As with PyTensor's ``set_value``, a value
            may have another shape than the variable's current one (a new
            data set, say), unless the variable's type fixes that length;
            functions using it must accept the new shape.
        nccl: use NCCL where available (GPU mode only).

    Raises:
        SynkStateError: before distribute(), or inside a call.
        TypeError: a value of the wrong dtype, or not a shared variable.
        ValueError: a variable no distributed function uses, or a value of
            the wrong ndim.
        WorkerError: a rank failed while receiving.
    """
    rt = require_collective("broadcast()")
    check_flags("broadcast", nccl=nccl)
    idx, single = access.resolve(rt, shared_vars, "broadcast")
    items = None
    if values is not None:
        values = access.value_list(values, len(idx), single, "broadcast")
        items = [access.condition_value(rt, rt.registry.shareds[i], v, "broadcast")
                 for i, v in zip(idx, values)]
    # Given values are host data: only the variables' own values go through NCCL.
    msg = BroadcastMsg(idx, None if items is None else access.descs(items),
                       items is None and bool(nccl))
    run_command(rt, Command.BROADCAST, msg, lambda seq: _broadcast_local(rt, msg, items))


class BroadcastMsg(NamedTuple):
    """BROADCAST: the master's values (``descs`` None) or given ones (a DataDesc or None each)."""

    idx: list
    descs: list
    nccl: bool


def _broadcast_local(rt, msg, items=None):
    shareds = [rt.registry.shareds[i] for i in msg.idx]
    descs = msg.descs or [None] * len(shareds)
    via = [k for k, d in enumerate(descs) if d is None]
    root = rt.place.master_rank
    be = transport(rt, msg.nccl)
    keys = [msg.idx[k] for k in via]
    if rt.place.rank == root:
        if via:
            arrays = (backend_values(be, [shareds[k] for k in via]) if items is None
                      else [items[k] for k in via])
            got = be.broadcast(arrays, root, keys=keys)
            for k, value in zip(via, got):
                if items is None:
                    access.keep(rt, shareds[k], value)
                else:
                    access.adopt(rt, shareds[k], value, items[k])
        if items is not None:
            for var, value in zip(shareds, items):
                if isinstance(value, Data):
                    access.store(rt, var, value.data)
        return
    if via:
        outs = [access.writable_out(rt, shareds[k]) for k in via]
        got = be.broadcast(None, root, out=outs, keys=keys)
        for k, value in zip(via, got):
            access.adopt(rt, shareds[k], value)
    for var, desc in zip(shareds, descs):
        if desc is not None:
            access.store(rt, var, access.data_view(rt, desc))


@handler(Command.BROADCAST, BroadcastMsg)
def _broadcast_worker(rt, msg):
    _broadcast_local(rt, msg)


@serialized
def scatter(shared_vars, values, batch=None):
    """Split values along axis 0 over the ranks into shared variables.  Master only.

    Rows are split as for function inputs: as evenly as possible, the first
    ranks taking one more.  Data values are read by every rank in place.

    Args:
        shared_vars: a shared variable, its name, or a list/tuple of either.
        values: one NumPy array or Data per variable.
        batch: rows to scatter, applied to each value first: an int ``k``
            (rows ``[:k]``), a slice, or a list / 1-d int array of indices.

    Raises:
        SynkStateError: before distribute(), or inside a call.
        TypeError: a value of the wrong dtype, or a malformed ``batch``.
        ValueError: a variable no distributed function uses, a value of the
            wrong ndim (0-d values cannot be split), or ``batch`` selecting
            rows a value does not have.
        WorkerError: a rank failed while receiving.
    """
    rt = require_collective("scatter()")
    idx, single = access.resolve(rt, shared_vars, "scatter")
    values = access.value_list(values, len(idx), single, "scatter")
    sel = None if batch is None else rank_rows.normalize_batch(batch, "scatter: batch")
    n = rt.place.n_parallel
    items, sels = [], []
    per_rank = [[] for _ in range(n)]
    for i, value in zip(idx, values):
        var = rt.registry.shareds[i]
        item = access.condition_value(rt, var, value, "scatter", whole=False)
        arr = item.data if isinstance(item, Data) else item
        if arr.ndim == 0:
            raise ValueError(f"scatter: {var} is 0-d; scatter splits values along axis 0")
        s = access.select(sel, len(arr), var, "scatter")
        n_rows = rank_rows.selection_length(s, len(arr))
        for lo, hi in rank_rows.split_ranges(n_rows, n):
            access.check_static_shape(var, (hi - lo,) + arr.shape[1:], "scatter")
        items.append(item)
        sels.append(s)
        if not isinstance(item, Data):
            for r, (lo, hi) in enumerate(rank_rows.split_ranges(n_rows, n)):
                per_rank[r].append(rank_rows.take(arr, s, lo, hi))
    msg = ScatterMsg(idx, access.descs(items), [s if isinstance(v, Data) else None
                                            for s, v in zip(sels, items)])
    run_command(rt, Command.SCATTER, msg, lambda seq: _scatter_local(rt, msg, per_rank, items))


class ScatterMsg(NamedTuple):
    """SCATTER: per variable a DataDesc and row selection (Data values), or None (sent arrays)."""

    idx: list
    descs: list
    sels: list


def _scatter_local(rt, msg, per_rank=None, items=None):
    """Every rank: store its rows; ``per_rank`` and ``items`` (the values given) in the master."""
    shareds = [rt.registry.shareds[i] for i in msg.idx]
    via = [k for k, d in enumerate(msg.descs) if d is None]
    root = rt.place.master_rank
    if via:
        got = rt.backend.scatter(per_rank if rt.place.rank == root else None, root)
        for k, value in zip(via, got):
            access.store(rt, shareds[k], value)
    for k, (var, desc, s) in enumerate(zip(shareds, msg.descs, msg.sels)):
        if desc is not None:
            view = access.data_view(rt, desc) if items is None else items[k].memory()
            lo, hi = rank_rows.rank_range(rank_rows.selection_length(s, len(view)), rt.place.n_parallel,
                                     rt.place.rank)
            access.store(rt, var, rank_rows.take(view, s, lo, hi))


@handler(Command.SCATTER, ScatterMsg)
def _scatter_worker(rt, msg):
    _scatter_local(rt, msg)


@serialized
def gather(shared_vars, nd_up=1, nccl=True):
    """Return every rank's value of shared variables, in rank order.  Master only.

    The variables keep their values.  Values whose shapes differ between
    ranks are gathered exactly (the original's NCCL path cropped or padded
    them): with ``nd_up=0`` they are concatenated as they are; ``nd_up=1``
    needs equal shapes and raises otherwise.

    Args:
        shared_vars: a shared variable, its name, or a list/tuple of either.
        nd_up: 1 stacks the values on a new leading axis (one entry per
            rank); 0 concatenates them along axis 0.
        nccl: use NCCL where available (GPU mode only).

    Returns:
        One array, or a tuple of arrays for a list/tuple of variables.

    Raises:
        SynkStateError: before distribute(), or inside a call.
        ValueError: a variable no distributed function uses, ``nd_up`` not 0
            or 1, ``nd_up=0`` on a 0-d variable, or shapes across ranks that
            cannot be stacked (``nd_up=1``) or concatenated (``nd_up=0``).
        WorkerError: a rank failed while sending.
    """
    rt = require_collective("gather()")
    check_flags("gather", nccl=nccl)
    idx, single = access.resolve(rt, shared_vars, "gather", unique=False)
    if isinstance(nd_up, bool) or not isinstance(nd_up, numbers.Integral) or nd_up not in (0, 1):
        raise ValueError(f"gather: nd_up must be 0 or 1; got {nd_up!r}")
    if nd_up == 0:
        for i in idx:
            if rt.registry.shareds[i].ndim == 0:
                raise ValueError(f"gather: {rt.registry.shareds[i]} is 0-d and cannot be concatenated; "
                                 "use nd_up=1")
    msg = GatherMsg(idx, int(nd_up), bool(nccl))
    return access.ret(run_command(rt, Command.GATHER, msg, lambda seq: _gather_local(rt, msg)),
                  single)


class GatherMsg(NamedTuple):
    """GATHER: stack (``nd_up`` 1) or concatenate (0) the variables' values at the master."""

    idx: list
    nd_up: int
    nccl: bool


def _gather_local(rt, msg):
    shareds = [rt.registry.shareds[i] for i in msg.idx]
    be = transport(rt, msg.nccl)
    got = be.gather(backend_values(be, shareds), rt.place.master_rank, keys=msg.idx)
    if rt.place.rank != rt.place.master_rank:
        if got is not None:
            for var, value in zip(shareds, got):
                access.keep(rt, var, value)
        return None
    join = np.stack if msg.nd_up else np.concatenate
    out = [_join(join, [got[q][k] for q in range(rt.place.n_parallel)], var, "gather")
           for k, var in enumerate(shareds)]
    if be.device_arrays:
        out = [access.like(rt, var, value) for var, value in zip(shareds, out)]
    return out


def _join(join, parts, var, where):
    """Stack or concatenate per-rank values; name every rank's shape if they don't fit."""
    try:
        if join is np.stack and len({p.shape for p in parts}) > 1:
            raise ValueError("shapes differ")
        return join(parts)
    except ValueError:
        shapes = ", ".join(f"rank {q}: {p.shape}" for q, p in enumerate(parts))
        how = ("stacked (nd_up=1); use nd_up=0 to concatenate along axis 0"
               if join is np.stack else "concatenated along axis 0")
        raise ValueError(f"{where}: the values of {var} ({shapes}) cannot be {how}") from None


@handler(Command.GATHER, GatherMsg)
def _gather_worker(rt, msg):
    _gather_local(rt, msg)


@serialized
def all_gather(shared_vars, nccl=True):
    """Give every rank the concatenation, along axis 0, of all ranks' values.  Master only.

    Each variable's value becomes the rank-ordered concatenation of every
    rank's value (lengths may differ; the other axes must agree).  The ndim
    does not change.

    Args:
        shared_vars: a shared variable, its name, or a list/tuple of either.
        nccl: use NCCL where available (GPU mode only).

    Raises:
        SynkStateError: before distribute(), or inside a call.
        ValueError: a variable no distributed function uses, a 0-d variable,
            one whose type fixes its length, or values whose shapes beyond
            axis 0 differ between ranks (then no rank changes).
        WorkerError: a rank failed.
    """
    rt = require_collective("all_gather()")
    check_flags("all_gather", nccl=nccl)
    idx, single = access.resolve(rt, shared_vars, "all_gather")
    for i in idx:
        var = rt.registry.shareds[i]
        if var.ndim == 0:
            raise ValueError(f"all_gather: {var} is 0-d and cannot be concatenated")
        if rt.place.n_parallel > 1 and var.type.shape[0] is not None:
            raise ValueError(f"all_gather: {var} has a fixed length {var.type.shape[0]}, "
                             "which the concatenation would change")
    msg = AllGatherMsg(idx, bool(nccl))
    run_command(rt, Command.ALL_GATHER, msg, lambda seq: _all_gather_local(rt, msg))


class AllGatherMsg(NamedTuple):
    """ALL_GATHER: every rank's values concatenated along axis 0, in every rank."""

    idx: list
    nccl: bool


def _all_gather_local(rt, msg):
    shareds = [rt.registry.shareds[i] for i in msg.idx]
    be = transport(rt, msg.nccl)
    got = be.all_gather(backend_values(be, shareds))
    joined = [_join(np.concatenate, [got[q][k] for q in range(rt.place.n_parallel)], var, "all_gather")
              for k, var in enumerate(shareds)]
    for var, value in zip(shareds, joined):
        access.adopt(rt, var, value)


@handler(Command.ALL_GATHER, AllGatherMsg)
def _all_gather_worker(rt, msg):
    _all_gather_local(rt, msg)
