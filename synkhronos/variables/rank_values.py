"""set_value, get_value, get_lengths, get_shapes: shared variables' values in single ranks.

Part of the collectives (re-exported by ``collectives``), split off for size.
"""

from typing import NamedTuple

import numpy as np

from . import access
from ..runtime.commands import Command, handler
from ..runtime.run import run_command
from ..inputs.data_object import Data
from .reductions import require_collective
from ..runtime.state import serialized
from ..inputs import rank_rows


@serialized
def set_value(rank, shared_vars, values, batch=None):
    """Set shared variables' values in one rank.  Master only.

    Args:
        rank: the rank to write to.
        shared_vars: a shared variable, its name, or a list/tuple of either.
        values: one NumPy array or Data per variable.
        batch: rows of each value to use (as in ``scatter``).

    Raises:
        SynkStateError: before distribute(), or inside a call.
        TypeError: a value of the wrong dtype, a non-int rank, or a malformed
            ``batch``.
        ValueError: a rank out of range, a variable no distributed function
            uses, a value of the wrong ndim, or ``batch`` selecting rows a
            value does not have (or given for a 0-d value).
        WorkerError: the rank failed while storing.
    """
    rt = require_collective("set_value()")
    rank = access.check_rank(rt, rank, "set_value")
    idx, single = access.resolve(rt, shared_vars, "set_value")
    values = access.value_list(values, len(idx), single, "set_value")
    sel = None if batch is None else rank_rows.normalize_batch(batch, "set_value: batch")
    items, sels = [], []
    for i, value in zip(idx, values):
        var = rt.registry.shareds[i]
        item = access.condition_value(rt, var, value, "set_value", whole=sel is None)
        arr = item.data if isinstance(item, Data) else item
        s = None
        if sel is not None:
            if arr.ndim == 0:
                raise ValueError(f"set_value: batch needs values with rows; {var} is 0-d")
            s = access.select(sel, len(arr), var, "set_value")
            n_rows = rank_rows.selection_length(s, len(arr))
            access.check_static_shape(var, (n_rows,) + arr.shape[1:], "set_value")
            if not isinstance(item, Data):
                item = rank_rows.take(arr, s, 0, n_rows)
                s = None
        items.append(item)
        sels.append(s)
    if rank == rt.place.rank:
        for i, item, s in zip(idx, items, sels):
            arr = item.data if isinstance(item, Data) else item
            if s is not None:
                arr = rank_rows.take(arr, s, 0, rank_rows.selection_length(s, len(arr)))
            access.store(rt, rt.registry.shareds[i], arr)
        return
    placeholder = np.empty(0, np.uint8)
    pieces = [v for v in items if not isinstance(v, Data)]
    per_rank = [pieces if r == rank else [placeholder] * len(pieces)
                for r in range(rt.place.n_parallel)]
    msg = SetValueMsg(rank, idx, access.descs(items), sels)
    run_command(rt, Command.SET_VALUE, msg, lambda seq: _set_value_local(rt, msg, per_rank))


class SetValueMsg(NamedTuple):
    """SET_VALUE: rank ``rank`` stores each value: a Data (DataDesc and rows) or a sent array."""

    rank: int
    idx: list
    descs: list
    sels: list


def _set_value_local(rt, msg, per_rank=None):
    root = rt.place.master_rank
    via = [k for k, d in enumerate(msg.descs) if d is None]
    got = None
    if via:
        got = rt.backend.scatter(per_rank if rt.place.rank == root else None, root)
    if rt.place.rank != msg.rank:
        return
    shareds = [rt.registry.shareds[i] for i in msg.idx]
    for k, value in zip(via, got):
        access.store(rt, shareds[k], value)
    for var, desc, s in zip(shareds, msg.descs, msg.sels):
        if desc is not None:
            view = access.data_view(rt, desc)
            if s is not None:
                view = rank_rows.take(view, s, 0, rank_rows.selection_length(s, len(view)))
            access.store(rt, var, view)


@handler(Command.SET_VALUE, SetValueMsg)
def _set_value_worker(rt, msg):
    _set_value_local(rt, msg)


@serialized
def get_value(rank, shared_vars):
    """Return shared variables' values in one rank (copies).  Master only.

    Args:
        rank: the rank to read from.
        shared_vars: a shared variable, its name, or a list/tuple of either.

    Returns:
        One array, or a tuple of arrays for a list/tuple of variables.

    Raises:
        SynkStateError: before distribute(), or inside a call.
        TypeError: a non-int rank.
        ValueError: a rank out of range, or a variable no distributed
            function uses.
        WorkerError: the rank failed while sending.
    """
    rt = require_collective("get_value()")
    rank = access.check_rank(rt, rank, "get_value")
    idx, single = access.resolve(rt, shared_vars, "get_value", unique=False)
    if rank == rt.place.rank:
        return access.ret([np.array(access.get_array(rt.registry.shareds[i])) for i in idx], single)

    def after(_):
        arrays, _weight = rt.backend.collect()[rank]
        return access.ret([np.array(a) for a in arrays], single)
    return run_command(rt, Command.GET_VALUE, GetValueMsg(rank, idx), after=after)


class GetValueMsg(NamedTuple):
    """GET_VALUE: rank ``rank`` sends its values of the variables to the master."""

    rank: int
    idx: list


@handler(Command.GET_VALUE, GetValueMsg, collected=True)
def _get_value_worker(rt, msg):
    mine = [access.get_array(rt.registry.shareds[i]) for i in msg.idx] if rt.place.rank == msg.rank else None
    rt.backend.contribute(mine)


@serialized
def get_shapes(shared_vars):
    """Return the shape of shared variables in every rank.  Master only.

    Args:
        shared_vars: a shared variable, its name, or a list/tuple of either.

    Returns:
        For one variable, a list with one shape tuple per rank; for a
        list/tuple of variables, a tuple of such lists.

    Raises:
        SynkStateError: before distribute(), or inside a call.
        ValueError: a variable no distributed function uses.
        WorkerError: a rank failed.
    """
    rt = require_collective("get_shapes()")
    idx, single = access.resolve(rt, shared_vars, "get_shapes", unique=False)
    return access.ret(shapes_in_ranks(rt, idx), single)


@serialized
def get_lengths(shared_vars):
    """Return the length (size of axis 0) of shared variables in every rank.  Master only.

    Args:
        shared_vars: a shared variable, its name, or a list/tuple of either.

    Returns:
        For one variable, a list with one int per rank; for a list/tuple of
        variables, a tuple of such lists.

    Raises:
        SynkStateError: before distribute(), or inside a call.
        ValueError: a variable no distributed function uses, or a 0-d one.
        WorkerError: a rank failed.
    """
    rt = require_collective("get_lengths()")
    idx, single = access.resolve(rt, shared_vars, "get_lengths", unique=False)
    for i in idx:
        if rt.registry.shareds[i].ndim == 0:
            raise ValueError(f"get_lengths: {rt.registry.shareds[i]} is 0-d and has no length")
    return access.ret([[s[0] for s in shapes] for shapes in shapes_in_ranks(rt, idx)], single)


def shapes_in_ranks(rt, idx):
    """Return, per variable, the list of its shape in each rank."""
    mine = [tuple(access.raw(rt.registry.shareds[i]).shape) for i in idx]  # no device-to-host copy

    def after(_):
        parts = rt.backend.collect()
        per_rank = [mine if q == rt.place.rank else [tuple(int(x) for x in a) for a in parts[q][0]]
                    for q in range(rt.place.n_parallel)]
        return [[per_rank[q][k] for q in range(rt.place.n_parallel)] for k in range(len(idx))]
    return run_command(rt, Command.GET_SHAPES, GetShapesMsg(idx), after=after)


class GetShapesMsg(NamedTuple):
    """GET_SHAPES: every rank sends the shapes of its values of the variables."""

    idx: list


@handler(Command.GET_SHAPES, GetShapesMsg, collected=True)
def _get_shapes_worker(rt, msg):
    rt.backend.contribute([np.array(access.raw(rt.registry.shareds[i]).shape, dtype=np.int64)
                           for i in msg.idx])
