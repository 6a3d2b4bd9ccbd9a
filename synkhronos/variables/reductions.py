"""reduce and all_reduce: shared variables reduced by op over the ranks, and their commands.

Part of the collectives (re-exported by ``collectives``).  ``all_reduce_local``
also runs inside the CALL command, as the middle of a fused training step.
"""

import logging
from typing import NamedTuple

import numpy as np
from pytensor.tensor.sharedvar import TensorSharedVariable

from ..inputs import conditioning
from ..comm import reduce_ops
from . import access
from ..comm import compressed
from ..runtime import trace
from ..runtime.commands import Command, handler
from ..runtime.run import run_command
from ..errors import SynkStateError
from ..runtime.state import get_runtime, require_distributed, serialized
from .access import backend_values, transport

_trace = trace.ON
_ALL_REDUCE = Command.ALL_REDUCE  # a module global is read faster than an enum member

logger = logging.getLogger(__name__)

__all__ = ["reduce", "all_reduce"]


def require_collective(what):
    """Return the Runtime where collective ``what`` may start: the master, outside a call.

    A graph Op calling one while its call runs would wait for ranks that are
    busy in that very call (in-graph collectives: ``synkhronos.ingraph``).

    Raises:
        SynkStateError: before distribute(), inside a call, or in a worker.
    """
    rt = get_runtime()
    if (rt is not None and not rt.closed and rt.registry.distributed and not rt.in_call
            and rt.is_master):
        return rt  # the common case, checked at every call
    rt = require_distributed(what)
    if rt.in_call or not rt.is_master:
        raise SynkStateError(
            f"{what}: no collective inside a call; collectives run from the master's program, "
            f"between calls (called in rank {rt.place.rank}{' while it ran a call' if rt.in_call else ''}"
            "); inside a graph use synkhronos.ingraph")
    return rt


def check_flags(where, **flags):
    """Raise TypeError unless each flag is a bool ("no" would otherwise count as True)."""
    for name, value in flags.items():
        conditioning.check_bool(value, f"{where}: {name}")


def _check_reduce(rt, shared_vars, op, in_place, where):
    reduce_ops.check_op(op, where)
    idx, single = access.resolve(rt, shared_vars, where, unique=in_place)
    if in_place and op == "avg":
        for i in idx:
            var = rt.registry.shareds[i]
            if np.dtype(var.dtype).kind in "iub":
                raise TypeError(f"{where}: op 'avg' on {var} of dtype {var.dtype} gives "
                                "floats, which the variable cannot hold; use 'sum'")
    return idx, single


@serialized
def reduce(shared_vars, op="avg", in_place=True, nccl=True):
    """Reduce shared variables over all ranks into the master.  Master only.

    Workers' values do not change.

    Args:
        shared_vars: a shared variable, its name, or a list/tuple of either.
        op: "avg", "sum", "prod", "max" or "min" ("avg" is sum, then scale).
        in_place: True overwrites the master's values; False returns the
            results and changes nothing.
        nccl: use NCCL where available (GPU mode only).

    Returns:
        None if ``in_place``, else one array, or a tuple of arrays for a
        list/tuple of variables.

    Raises:
        SynkStateError: before distribute(), or inside a call.
        TypeError: ``op="avg"`` in place on an integer variable, or a flag
            that is not a bool.
        ValueError: unknown op, a variable no distributed function uses, or
            values whose shapes differ between ranks (nothing changes then).
        WorkerError: a rank failed while reducing.
    """
    rt = require_collective("reduce()")
    check_flags("reduce", in_place=in_place, nccl=nccl)
    idx, single = _check_reduce(rt, shared_vars, op, in_place, "reduce")
    msg = ReduceMsg(idx, op, bool(in_place), bool(nccl))
    result = run_command(rt, Command.REDUCE, msg, lambda seq: _reduce_local(rt, msg))
    return None if in_place else access.ret(result, single)


class ReduceMsg(NamedTuple):
    """REDUCE: reduce by ``op`` into the master (its variables, if ``in_place``)."""

    idx: list
    op: str
    in_place: bool
    nccl: bool


def _reduce_local(rt, msg):
    shareds = [rt.registry.shareds[i] for i in msg.idx]
    be = transport(rt, msg.nccl)
    arrays = backend_values(be, shareds)
    root = rt.place.master_rank
    outs = None
    if msg.in_place and rt.place.rank == root and not be.device_arrays:
        outs = [access.writable_out(rt, v, reduce_ops.result_dtype(msg.op, a.dtype))
                for v, a in zip(shareds, arrays)]
    result = be.reduce(arrays, msg.op, root, out=outs)
    if rt.place.rank != root:
        return None
    if not msg.in_place:
        return [access.like(rt, var, value) for var, value in zip(shareds, result)] \
            if be.device_arrays else result
    for var, value, out in zip(shareds, result, outs or [None] * len(shareds)):
        access.store(rt, var, value, out)


@handler(Command.REDUCE, ReduceMsg)
def _reduce_worker(rt, msg):
    _reduce_local(rt, msg)


@serialized
def all_reduce(shared_vars, op="avg", nccl=True, dtype=None):
    """Reduce shared variables over all ranks; every rank keeps the result.  Master only.

    Args:
        shared_vars: a shared variable, its name, or a list/tuple of either.
        op: "avg", "sum", "prod", "max" or "min" ("avg" is sum, then scale).
        nccl: use NCCL where available (GPU mode only).
        dtype: None, or "bfloat16" / "float16" to send float values in that
            16-bit type (scaled first, summed in float32; op "sum" or "avg"
            only; see ``synkhronos.comm.compressed``).  Results keep the
            variables' dtypes, at the small type's precision.

    Raises:
        SynkStateError: before distribute(), or inside a call.
        TypeError: ``op="avg"`` on an integer variable, or ``nccl`` not a bool.
        ValueError: unknown op, a variable no distributed function uses, or
            values whose shapes differ between ranks (nothing changes then).
        WorkerError: a rank failed while reducing.
    """
    rt = require_collective("all_reduce()")
    # A loop all-reducing one variable sends the same message each time: it
    # is checked and pickled once (the arguments are the key).
    key = None
    if (type(shared_vars) is TensorSharedVariable and type(op) is str and type(nccl) is bool
            and (dtype is None or type(dtype) is str)):
        key = (_ALL_REDUCE, shared_vars, op, nccl, dtype)
        hit = rt.registry.wire.get(key)
        if hit is not None:
            if _trace:
                trace.stamp(trace.CHECKED)
            run_command(rt, _ALL_REDUCE, hit[0], hit[1], kept=hit[2])
            return
    check_flags("all_reduce", nccl=nccl)
    idx, _ = _check_reduce(rt, shared_vars, op, True, "all_reduce")
    if dtype is not None:
        shareds = rt.registry.shareds
        compressed.check_16bit(dtype, op, [(shareds[i], shareds[i].dtype) for i in idx],
                               "all_reduce")
    msg = AllReduceMsg(idx, op, bool(nccl), dtype)
    if key is None:
        run_command(rt, Command.ALL_REDUCE, msg, lambda seq: all_reduce_local(rt, msg))
        return
    # Kept: the message pickled once, its repeats prepared here and in every worker.
    kept = rt.control.keep(Command.ALL_REDUCE, msg)
    local = KeptAllReduce(rt, msg)
    run_command(rt, Command.ALL_REDUCE, msg, local, kept=kept)
    rt.registry.wire[key] = (msg, local, kept)


class AllReduceMsg(NamedTuple):
    """ALL_REDUCE: reduce by ``op``; every rank keeps the result."""

    idx: list
    op: str
    nccl: bool
    dtype: object = None    # a 16-bit transport type, or None


def all_reduce_local(rt, msg):
    """Every rank, inside a command: all-reduce the variables an ``AllReduceMsg`` names.

    Also the second part of a fused training step (``Function`` calls with
    ``then``), inside the CALL command.
    """
    if trace.ON:
        trace.stamp(trace.SHARE_START)
    shareds = [rt.registry.shareds[i] for i in msg.idx]
    small = rt.backend.small_all_reduce
    if small is not None and msg.dtype is None:
        # Host variables' own arrays, reduced in place on the backend's latency path.
        arrays = [v.container.storage[0] for v in shareds]
        device = rt.registry.device_shareds
        if (all(type(a) is np.ndarray for a in arrays)
                and not (device and any(id(v) in device for v in shareds))
                and small(msg.idx, arrays, msg.op)):
            if trace.ON:
                trace.stamp(trace.SHARE_DONE)
            return
    if msg.dtype is not None:
        host = rt.backend.host
        arrays = backend_values(host, shareds)
        result = compressed.all_reduce_16bit(host, arrays, msg.op, msg.dtype,
                                       out=[access.out_of(a) for a in arrays])
        for var, value in zip(shareds, result):
            access.adopt(rt, var, value)
        return
    be = transport(rt, msg.nccl)
    arrays = backend_values(be, shareds)
    outs = None if be.device_arrays else [access.out_of(a) for a in arrays]
    result = be.all_reduce(arrays, msg.op, out=outs, keys=msg.idx)
    for var, value in zip(shareds, result):
        access.adopt(rt, var, value)


class KeptAllReduce:
    """``all_reduce_local`` of one ``AllReduceMsg`` sent again and again, prepared once.

    What every rank runs for a kept ALL_REDUCE (the master, and each worker
    from ``_all_reduce_prepare``): the variables' containers and the
    backend's small plan are looked up once; each run reads the variables'
    current arrays, so an update that replaced them is followed.
    """

    __slots__ = ("rt", "msg", "containers", "plan")

    def __init__(self, rt, msg):
        self.rt = rt
        self.msg = msg
        shareds = [rt.registry.shareds[i] for i in msg.idx]
        self.containers = [v.container for v in shareds]
        device = rt.registry.device_shareds
        self.plan = None
        if (msg.dtype is None and rt.backend.small_all_reduce is not None
                and not (device and any(id(v) in device for v in shareds))):
            self.plan = rt.backend.small_plan(msg.idx, msg.op,
                                              [c.storage[0] for c in self.containers])

    def __call__(self, seq=None):
        plan = self.plan
        if plan is not None:
            if _trace:
                trace.stamp(trace.SHARE_START)
            containers = self.containers
            if plan.run((containers[0].storage[0],) if len(containers) == 1
                        else tuple([c.storage[0] for c in containers])):
                if _trace:
                    trace.stamp(trace.SHARE_DONE)
                return
        all_reduce_local(self.rt, self.msg)


def _all_reduce_prepare(rt, msg):
    """What a worker runs for a kept ALL_REDUCE message."""
    return KeptAllReduce(rt, msg)


@handler(Command.ALL_REDUCE, AllReduceMsg, prepare=_all_reduce_prepare)
def _all_reduce_worker(rt, msg):
    all_reduce_local(rt, msg)
