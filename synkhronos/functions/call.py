"""The CALL command: its messages, the master's checks that build one, posting it, its handler.

``Function.__call__`` (and a fused step, ``then_all_reduce``) hand their
arguments to ``run_call``; ``prepare_call`` checks them and builds the
``CallMsg`` every rank runs through ``execution.execute``.  A loop calling
with the same Data sends the same message: its checks and pickling are kept
in the Function (``_wire``) and skipped next time.
"""

import logging
import numbers
from typing import NamedTuple

import numpy as np

from ..inputs import (conditioning, data_object as data_module, produced as placed,
                      machine_rows as placement, rank_rows as split)
from . import rank_call as execution
from ..variables import access as sharedvars
from ..comm import compressed
from ..runtime.control import Command, handler, run_command
from ..errors import MachineLostError, SynkStateError
from .arguments import check_lengths, common_length
from ..runtime.state import serialized

logger = logging.getLogger(__name__)


class CallMsg(NamedTuple):
    """CALL: run function ``function_id`` on every rank's share of the inputs.

    ``descs`` name the input Data (scattered ones first, ``n_scattered`` of
    them); ``sel`` selects ``n_rows`` rows of them before the split; ``sel_s``
    is each rank's ``batch_s`` selection; ``subset`` the outputs to return.
    """

    function_id: int
    descs: list
    n_scattered: int
    sel: object
    n_rows: int
    sel_s: object
    num_slices: int
    subset: object
    then: object = None         # a ThenMsg: a fused step's all-reduce and follow-up call
    plan: object = None         # cluster: {first rank of a machine: its placement.MachinePlan}

    def to_wire(self):
        """This message as plain tuples, the cheapest to pickle (every call sends one)."""
        then = self[8]
        return (self[0], [tuple(d) for d in self[1]]) + self[2:8] + (
            None if then is None else tuple(then), self[9])

    @classmethod
    def from_wire(cls, raw):
        """Rebuild a message sent by ``to_wire``."""
        # tuple.__new__ directly: the named tuples' own constructors run Python code.
        new = tuple.__new__
        then = raw[8]
        descs = [new(data_module.DataDesc, d) for d in raw[1]]
        return new(cls, (raw[0], descs) + raw[2:8] + (None if then is None else new(ThenMsg, then),
                                                     raw[9]))


class ThenMsg(NamedTuple):
    """What every rank does after its share of a fused call: all-reduce, then a call."""

    idx: list                   # shared variables to all-reduce, by index in rt.registry.shareds
    op: str
    function_id: int            # the function to call next, without inputs
    dtype: object = None        # a 16-bit transport type ("bfloat16", "float16"), or None


def run_call(f, args, kwargs, output_subset, batch, batch_s, num_slices, then):
    """Run Function ``f`` on every rank as one CALL command; return its reduced outputs.

    Master only.  ``then``, if given, builds the ``ThenMsg`` of a fused step
    (``FusedCall._then``).
    """
    rt = f._rt
    if rt is None or rt.closed:
        raise SynkStateError("this function belongs to a closed synkhronos run; "
                             "build it again after fork()")
    if not rt.registry.distributed:
        raise SynkStateError("call distribute() before calling synkhronos functions")
    if rt.in_call or not rt.is_master:
        # Inside a graph Op of a running call: the ranks are busy in that call.
        raise SynkStateError(f"{f._what}: no call inside a call; synkhronos functions run "
                             f"from the master's program only (called in rank {rt.place.rank}"
                             f"{' while it ran a call' if rt.in_call else ''})")
    prof = rt.profiler
    if prof is not None:
        # Checking the arguments is the master's control overhead too.
        prof.begin(f._what)
    try:
        # A loop calling with the same Data sends the same message: it is
        # checked and pickled once (``_wire``).  Index arrays do not compare
        # as a whole, so calls with ``batch`` lists are not kept.
        last = f._wire
        wire = None
        if (last is not None and last[2] is not None and then is None and not kwargs
                and batch is None and batch_s is None and output_subset is None
                and type(num_slices) is int and num_slices == 1
                and _same_data(args, last[2], last[0].descs)):
            msg, wire = last[0], last[1]
        else:
            try:
                msg = prepare_call(f, rt, args, kwargs, output_subset, batch, batch_s, num_slices)
            except MachineLostError as exc:
                if exc.survived:  # lost while the inputs were sent: the call never began
                    exc.settled(False, "the call did not start: call it again")
                raise
            if then is not None:
                msg = msg._replace(then=then(rt))
            if last is not None and msg.sel is None and msg.sel_s is None and last[0] == msg:
                wire = last[1]
        spec = f.spec
        result = run_command(rt, Command.CALL, msg,
                             lambda seq: execution.execute(spec, rt, msg),
                             lambda mine: execution.collect(spec, rt, mine, msg.subset,
                                                            f._what[len("call of "):]),
                             what=f._what, wire=wire)
        if wire is None and msg.sel is None and msg.sel_s is None \
                and rt.control.last_plain is not None:
            # The ids of the Data given in input order: no reference that
            # would keep a dropped Data's memory alive.
            ids = None
            # Kept only for the call the fast check above stands for: no options.
            if (msg.then is None and msg.subset is None and msg.num_slices == 1
                    and not kwargs and len(args) == len(f._all_inputs)
                    and all(type(a) is data_module.Data for a in args)):
                ids = tuple(id(a) for a in args)
            f._wire = (msg, rt.control.last_plain, ids)
        return result
    finally:
        if prof is not None:
            prof.end("control")


def prepare_call(f, rt, args, kwargs, output_subset, batch, batch_s, num_slices):
    """Check a call of Function ``f`` in the master and build its ``CallMsg``.

    Raises:
        TypeError, ValueError: bad inputs or call options (nothing is posted).
    """
    if kwargs or len(args) != len(f._all_inputs):
        args = f._bind(args, kwargs, f.name or "function")
    datas = []
    n_scattered = len(f.spec.inputs)
    for i, v in enumerate(args):
        # The common case inline: a live Data of the right type with memory.
        if (type(v) is data_module.Data and v._rt is rt and v._data is not None
                and v._dtype == f._dtypes[i] and v._ndim == f._ndims[i]):
            datas.append(v)
        elif rt.cluster is not None and i < n_scattered and not isinstance(v, data_module.Data):
            # Each machine will be sent only the rows its ranks use (``_place``).
            datas.append(_Rows(_as_array(f, i, v)))
        else:
            datas.append(_as_data(f, rt, i, v))
    scattered = datas[:n_scattered]
    sel = None if batch is None else split.normalize_batch(batch)
    n_rows = check_lengths(f.name or "function", f.spec.inputs, scattered, sel)
    if sel is not None:
        sel = split.resolve(sel, common_length(scattered))
    plan = None
    if rt.cluster is not None and any(type(d) is not data_module.Data for d in scattered):
        plan = _place(f, rt, datas, n_scattered, sel, n_rows)
    if type(num_slices) is not int or num_slices != 1:
        if not (isinstance(num_slices, numbers.Integral) and not isinstance(num_slices, bool)
                and num_slices >= 1):
            raise ValueError(f"{f.name or 'function'}: num_slices must be an int >= 1; "
                             f"got {num_slices!r}")
        if num_slices > 1 and f.spec.collective:
            raise ValueError(f"{f.name or 'function'}: num_slices > 1 cannot run a graph "
                             "holding in-graph collectives (ranks would meet them a different "
                             "number of times); use num_slices=1")
        if num_slices > 1 and None in f.spec.output_ops:
            raise ValueError(f"{f.name or 'function'}: num_slices > 1 cannot combine the "
                             "slices of an output with op None; use 'gather' or a reduce op")
    sel_s = None
    if batch_s is not None:
        if not f.spec.sliceable:
            raise ValueError(f"{f.name or 'function'}: batch_s needs sliceable_shareds "
                             "in function()")
        sel_s = split.normalize_batch_s(batch_s, rt.place.n_parallel)
        _check_own_rows(f, rt, sel_s[rt.place.rank])
    subset = None
    if output_subset is not None:
        subset = _check_subset(f, output_subset)
    # tuple.__new__: a named tuple's own constructor runs Python code at every call.
    return tuple.__new__(CallMsg, (f._ID, [d.describe() for d in datas], n_scattered, sel,
                                   n_rows, sel_s, int(num_slices), subset, None, plan))


class _Rows:
    """A NumPy input of a cluster call, as the row checks see it, until it is sent."""

    minibatch = False

    def __init__(self, arr):
        self._data = arr
        self._ndim = self.ndim = arr.ndim

    def __len__(self):
        return len(self._data)


def _place(f, rt, datas, n_scattered, sel, n_rows):
    """Cluster: which machine uses which rows; send each machine its rows of NumPy inputs.

    Returns {first rank of each machine: its placement.MachinePlan}.
    """
    name = f.name or "function"
    layout = rt.cluster.layout
    placed_in = [(d, var) for d, var in zip(datas[:n_scattered], f.spec.inputs)
                 if isinstance(d, placed.PlacedData)]
    for d, var in placed_in:
        d.check_layout(rt, name)
        if d._parts != placed_in[0][0]._parts:
            raise ValueError(f"{name}: inputs {placed_in[0][1]} and {var} are placed on the "
                             f"machines in different parts ({placed_in[0][0].parts} and "
                             f"{d.parts}); a call pairs rows machine by machine")
    if placed_in:
        plans = placement.owner_plan(sel, placed_in[0][0]._parts)
    else:
        plans = placement.even_plan(sel, n_rows, layout.n_local)
    for i, d in enumerate(datas[:n_scattered]):
        if type(d) is _Rows:
            scratch = f._scratch.get(i)
            if (scratch is None or scratch._rt is not rt or type(scratch) is not placed.PlacedData
                    or scratch._layout is not layout):
                scratch = f._scratch[i] = placed.scratch(rt, f._all_inputs[i])
            placed.send_rows(rt, scratch, d._data, plans)
            datas[i] = scratch
    return {layout.offsets[m]: p for m, p in enumerate(plans)}


def _as_array(f, i, value):
    """A NumPy input ``value`` for input ``i`` of ``f``, conditioned, or raise naming it."""
    var = f._all_inputs[i]
    name = f.name or "function"
    if isinstance(value, np.ndarray) or np.isscalar(value) or isinstance(value, (list, tuple)):
        return conditioning.condition(value, var.dtype, var.ndim, name, f"input {var}")
    raise TypeError(f"{name}: input {var} must be a synkhronos Data or a NumPy array; "
                    f"got {type(value).__name__}")


def _check_own_rows(f, rt, sel):
    """Raise IndexError if ``batch_s`` selects rows the master's sliceable shareds lack.

    Only the master's rows are known here; a worker with fewer rows raises in
    that worker (WorkerError) before computing.
    """
    for s in f.spec.sliceable:
        value = s.get_value(borrow=True)
        if not np.ndim(value):
            continue
        n = len(value)
        need = split.rows_needed(split.resolve(sel, n), n)
        if need > n:
            raise IndexError(f"{f.name or 'function'}: batch_s selects row {need - 1} but "
                             f"shared variable {s} has {n} rows in rank {rt.place.rank}")


def _check_subset(f, output_subset):
    name = f.name or "function"
    n = len(f.spec.outputs)
    items = output_subset.tolist() if isinstance(output_subset, np.ndarray) else output_subset
    if not isinstance(items, (list, tuple)) or (isinstance(output_subset, np.ndarray)
                                                and output_subset.ndim != 1):
        raise TypeError(f"{name}: output_subset must be a list of output indices; "
                        f"got {output_subset!r}")
    for i in items:
        # Not int(i): 0.7, "1" and True are no output indices.
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"{name}: output_subset must hold ints (output indices); "
                            f"got {i!r} in {output_subset!r}")
    subset = [int(i) for i in items]
    if any(not 0 <= i < n for i in subset) or len(set(subset)) != len(subset):
        raise ValueError(f"{name}: output_subset must list distinct "
                         f"indices in range({n}); got {output_subset!r}")
    return subset


def _as_data(f, rt, i, value):
    """Return ``value`` as a Data for input ``i`` of ``f``, or raise naming what is wrong."""
    var = f._all_inputs[i]
    name = f.name or "function"
    what = f"input {var}"
    if isinstance(value, data_module.Data):
        data_module.check_data(value, rt, var.dtype, var.ndim, name, what,
                               placed_ok=i < len(f.spec.inputs))
        return value
    if isinstance(value, np.ndarray) or np.isscalar(value) or isinstance(value, (list, tuple)):
        arr = conditioning.condition(value, var.dtype, var.ndim, name, what)
        scratch = f._scratch.get(i)
        if scratch is None or scratch._rt is not rt:
            scratch = data_module.data(value=arr, var=var, oversize=1.5)
            f._scratch[i] = scratch
        else:
            scratch.set_value(arr, oversize=1.5)
        return scratch
    raise TypeError(f"{name}: input {var} must be a synkhronos Data or a NumPy array; "
                    f"got {type(value).__name__}")


def _same_data(args, ids, descs):
    """Whether ``args`` are the Data of the call that sent ``descs``, with the same shapes."""
    if len(args) != len(ids):
        return False
    for a, i, desc in zip(args, ids, descs):
        # A Data's _ID is unique in the run: a new object at a reused id differs.
        if (id(a) != i or type(a) is not data_module.Data or a._ID != desc.data_id
                or a._data is None or a._data.shape != desc.shape):
            return False
    return True


class FusedCall:
    """A function call fused with an all-reduce and a follow-up call (``then_all_reduce``)."""

    def __init__(self, f, shared_vars, op, then, dtype):
        self.f = f
        self.shared_vars = shared_vars
        self.op = op
        self.then = then
        self.dtype = dtype

    def _then(self, rt):
        if self.then._rt is not rt:
            raise ValueError("then_all_reduce: then belongs to another synkhronos run")
        idx, _ = sharedvars.resolve(rt, self.shared_vars, "then_all_reduce")
        if self.dtype is not None:
            compressed.check(self.dtype, self.op,
                             [(rt.registry.shareds[i], rt.registry.shareds[i].dtype) for i in idx],
                             "then_all_reduce")
        return ThenMsg(idx, self.op, self.then._ID, self.dtype)

    @serialized
    def __call__(self, *args, output_subset=None, batch=None, batch_s=None, num_slices=1,
                 **kwargs):
        """Run the fused step; arguments and result as for ``Function.__call__``."""
        return run_call(self.f, args, kwargs, output_subset, batch, batch_s, num_slices,
                        self._then)


@handler(Command.CALL, CallMsg, collected=True,
         label=lambda rt, msg: f"call of {rt.registry.functions[msg.function_id].name or 'function'}")
def _call_worker(rt, msg):
    execution.execute(rt.registry.functions[msg.function_id].spec, rt, msg)
