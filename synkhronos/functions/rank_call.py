"""The CALL command on every rank: its message, its handler, and running a rank's share.

Every rank runs ``execute`` on the same ``CallMsg`` (the master through
``Function``, the workers through the handler); the master then combines the
results (``outputs.collect``) once the end barrier has passed.  The function
comes from its ``FunctionSpec``, the part of a Function that travels to every rank.
"""

from typing import NamedTuple

import numpy as np

from ..compat import call_subset
from ..inputs import machine_rows, mappings, rank_rows
from ..runtime import devices, trace
from ..runtime.commands import Command, handler
from ..variables import access
from ..variables.reductions import AllReduceMsg, all_reduce_local
from . import chunks, spread
from .chunks import ChunkPlan
from .deferred import Deferred
from .outputs import machine_part
from .slices import run_slices

_trace = trace.ON


class CallMsg(NamedTuple):
    """CALL: run function ``function_id`` on every rank's share of the inputs.

    ``descs`` name the input Data (scattered ones first, ``n_scattered`` of
    them); ``sel`` (a ``rank_rows.RowRange`` or ``RowIndex``, or None: all)
    selects ``n_rows`` rows of them before the split; ``sel_s``
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
    plan: object = None         # cluster: {first rank of a machine: its machine_rows.MachinePlan}
    chunks: object = None       # a chunks.ChunkPlan: rows taken chunk by chunk (chunks.py)

    def to_wire(self):
        """This message as plain tuples, the cheapest to pickle (every call sends one)."""
        then, sel = self[8], self[3]
        return (self[0], [tuple(d) for d in self[1]], self[2],
                None if sel is None else tuple(sel)) + self[4:8] + (
            None if then is None else tuple(then), self[9],
            None if self[10] is None else tuple(self[10]))

    @classmethod
    def from_wire(cls, raw):
        """Rebuild a message sent by ``to_wire``."""
        # tuple.__new__ directly: the named tuples' own constructors run Python code.
        new = tuple.__new__
        then, sel = raw[8], raw[3]
        descs = [new(mappings.DataDesc, d) for d in raw[1]]
        if sel is not None:
            sel = rank_rows.selection_from_wire(sel)
        chunked = raw[10]
        return new(cls, (raw[0], descs, raw[2], sel) + raw[4:8]
                   + (None if then is None else new(ThenMsg, then), raw[9],
                      None if chunked is None else new(ChunkPlan, chunked)))


class ThenMsg(NamedTuple):
    """What every rank does after its share of a fused call: all-reduce, then a call."""

    idx: list                   # shared variables to all-reduce, by index in rt.registry.shareds
    op: str
    function_id: int            # the function to call next, without inputs
    dtype: object = None        # a 16-bit transport type ("bfloat16", "float16"), or None


def _label(rt, msg):
    return f"call of {rt.registry.functions[msg.function_id].name or 'function'}"


def _combine(rt, msg, entries):
    """A node master: its machine's ranks' outputs, combined before they travel."""
    if msg.chunks is not None:
        return entries  # each rank's chunks, combined in chunk order in the master (spread.py)
    place = rt.place
    return machine_part(rt.registry.functions[msg.function_id].spec, msg.subset, entries,
                        place.rank_offset, place.n_local)


def _call_prepare(rt, msg):
    """What a worker runs for a kept CALL message: its share, prepared once (or None)."""
    spec = rt.registry.functions[msg.function_id].spec
    if msg.chunks is not None:
        return (chunks if msg.chunks.name else spread).worker_runner(spec, rt, msg)
    if not Share.reusable_for(spec, msg):
        return None
    run = Share(spec, rt, msg).bound()
    contribute = rt.backend.contribute

    def runner():
        results, weight = run()
        contribute(results, weight)
    return runner


@handler(Command.CALL, CallMsg, collected=True, combine=_combine, label=_label,
         prepare=_call_prepare)
def _call_worker(rt, msg):
    if msg.chunks is not None:
        spec = rt.registry.functions[msg.function_id].spec
        (chunks if msg.chunks.name else spread).worker_runner(spec, rt, msg)()
        return
    execute(rt.registry.functions[msg.function_id].spec, rt, msg)


def execute(spec, rt, msg, arrays=None):
    """Run this rank's share of a call (a ``CallMsg``) and take part in the reduction.

    ``arrays``: the master's own arrays of the inputs (workers map them from
    the message).  Returns, in the master, ``(results, weight)`` or None.
    """
    results, weight = Share(spec, rt, msg, arrays).run()
    if rt.is_master:
        return None if results is None else (results, weight)
    rt.backend.contribute(results, weight)


def run_share(spec, rt, msg, arrays=None):
    """Run this rank's share of a call; return ``(results or None, weight)``.

    ``arrays``: the inputs' arrays in this process, or None to map them from
    the message's descriptors (a worker's way).
    """
    return Share(spec, rt, msg, arrays).run()


class Share:
    """One rank's share of a call (a ``CallMsg``): its rows of every input, and how to run them.

    Made from the message (the rows, this rank's views of them); ``run()``
    runs the function on them.  A worker keeps one for a kept message and
    runs it again at each repeat (``reusable_for``); the master keeps one
    beside its kept message.

    Args:
        spec: the function's ``FunctionSpec``.
        rt: the run.
        msg: the ``CallMsg``.
        arrays: the inputs' arrays in this process, or None to map them from
            the message's descriptors (a worker's way).
    """

    __slots__ = ("spec", "rt", "msg", "arrays", "rows", "plain", "runs", "weight",
                 "wait_updates")

    def __init__(self, spec, rt, msg, arrays=None):
        if type(spec.fn) is Deferred:   # built at its first call (build.function_at_first_call)
            spec.ready()
        descs = msg.descs
        arrays = [mappings.view(rt, d) for d in descs] if arrays is None else list(arrays)
        rows = None
        sel = msg.sel
        if msg.plan is not None and msg.n_scattered:
            # Cluster: this machine's rows, some held here only (machine_rows.py).
            rows = machine_rows.take_share(rt, arrays, descs, msg.n_scattered, sel,
                                           msg.plan[rt.place.rank_offset])
        elif msg.n_scattered:
            lo, hi = rank_rows.rank_range(msg.n_rows, rt.place.n_parallel, rt.place.rank)
            for i in range(msg.n_scattered):
                arrays[i] = rank_rows.take(arrays[i], sel, lo, hi,
                                           descs[i].minibatch and sel is not None)
            rows = hi - lo
        self.spec, self.rt, self.msg, self.arrays, self.rows = spec, rt, msg, arrays, rows
        whole_empty = msg.n_scattered and msg.n_rows == 0 and rt.is_master
        # The common call: the whole function once on this rank's rows, nothing else.
        self.plain = (not spec.sliceable and not spec.collective and msg.then is None
                      and msg.subset is None and (msg.num_slices == 1 or not msg.n_scattered))
        # A rank with no rows does not run (unless no rank has any: the master's
        # result on the empty input stands for the whole, as PyTensor's would).
        self.runs = rows != 0 or whole_empty
        self.weight = 1.0 if rows is None or whole_empty else float(rows)
        self.wait_updates = spec.jax and bool(spec.updates)

    @staticmethod
    def reusable_for(spec, msg):
        """Whether a Share of ``msg`` may run again for a repeat of it.

        Not where its rows depend on values that change between calls: a
        cluster's per-call parts, or sliceable shared variables' lengths.
        """
        return msg.plan is None and not spec.sliceable

    def bound(self):
        """``run`` as a callable for a share run again and again (without a profile).

        The common call's steps with every name bound once: a kept call's
        repeats run nothing else.
        """
        if not (self.plain and self.runs):
            return self.run
        rt, spec, fn, arrays, weight = self.rt, self.spec, self.spec.fn, self.arrays, self.weight
        wait_updates = self.wait_updates
        ndarray = np.ndarray

        def run():
            rt.in_call = True
            try:
                if _trace:
                    trace.stamp(trace.SHARE_START)
                results = fn(*arrays)
                if _trace:
                    trace.stamp(trace.SHARE_DONE)
            finally:
                rt.in_call = False
            if wait_updates:
                _wait_device(spec, results)
            for r in results:
                if type(r) is not ndarray:
                    # Backends other than NumPy's (JAX) return their own array types.
                    return [np.asarray(r) for r in results], weight
            return results, weight
        return run

    def run(self):
        """Run this share; return ``(results or None, weight)``."""
        if not self.plain or self.rt.profiler is not None:
            return self._run_general()
        if not self.runs:
            return None, self.weight
        rt = self.rt
        # The flag makes a collective or call from inside one of the graph's Ops
        # raise at once.
        rt.in_call = True
        try:
            if _trace:
                trace.stamp(trace.SHARE_START)
            results = self.spec.fn(*self.arrays)
            if _trace:
                trace.stamp(trace.SHARE_DONE)
        finally:
            rt.in_call = False
        if self.wait_updates:
            _wait_device(self.spec, results)
        # Backends other than NumPy's (JAX) return their own array types.
        return [r if type(r) is np.ndarray else np.asarray(r) for r in results], self.weight

    def _run_general(self):
        """``run`` for slices, ``batch_s``, output subsets, fused steps and in-graph collectives."""
        spec, rt, msg, arrays, rows = self.spec, self.rt, self.msg, self.arrays, self.rows
        rank = rt.place.rank
        prof = rt.profiler
        if prof is not None:
            prof.lap("gather")
        num_slices = msg.num_slices
        shared_sel, rows = _shared_rows(spec, msg, rank, rows)
        subset = msg.subset
        whole_empty = msg.n_scattered and msg.n_rows == 0 and rt.is_master
        if spec.collective:
            # Every rank reaches the graph's collectives, a rank with no rows too
            # (its results still count for nothing).
            results = _run_collective(spec, rt, arrays, msg, shared_sel, subset)
            if rows == 0:
                results = None
        elif rows == 0 and not whole_empty:
            results = None
        else:
            with rt.calling():
                if shared_sel is None and (num_slices == 1 or not msg.n_scattered):
                    if _trace:
                        trace.stamp(trace.SHARE_START)
                    results = spec.fn(*arrays) if subset is None else \
                        call_subset(spec.fn, arrays, subset)
                    if _trace:
                        trace.stamp(trace.SHARE_DONE)
                else:
                    out_idx = list(range(len(spec.outputs))) if subset is None else subset
                    # More slices than rows would only add empty calls: cost stays that of
                    # the unsliced call.
                    num_slices = max(1, min(num_slices, rows))
                    results = run_slices(spec, rt, arrays, msg.n_scattered, shared_sel,
                                         num_slices, out_idx)
        if (rows != 0 or spec.collective) and spec.updates:
            _wait_device(spec)
        if prof is not None:
            prof.lap("compute")
        if msg.then is not None:
            # Every rank joins, with rows or without: the others wait in the all-reduce.
            run_then(rt, msg.then)
        # No rows anywhere: the master's result on the empty input stands for the
        # whole, as PyTensor's on an empty array (0 for sum; max raises there too).
        weight = 1.0 if rows is None or whole_empty else float(rows)
        if results is not None:
            # Backends other than NumPy's (JAX) return their own array types.
            results = [r if type(r) is np.ndarray else np.asarray(r) for r in results]
        return results, weight


def _shared_rows(spec, msg, rank, rows):
    """This rank's rows of the sliceable shared variables: ``(selection or None, rows)``.

    The selection lists ``(value, rows selected, length)`` per variable where
    ``batch_s`` or slicing applies; ``rows`` becomes their length where the call
    scatters no input (``avg`` weighs by the shared rows used).
    """
    sliceable = spec.sliceable
    if not sliceable:
        return None, rows
    if msg.sel_s is None and msg.num_slices <= 1:
        return None, len(sliceable[0].get_value(borrow=True)) if rows is None else rows
    shared_sel = []
    for s in sliceable:
        value = s.get_value(borrow=True)
        my = None if msg.sel_s is None else msg.sel_s[rank]
        my = rank_rows.resolve_selection(my, len(value))
        length = rank_rows.selection_length(my, len(value))
        if my is not None and rank_rows.rows_needed(my, len(value)) > len(value):
            raise IndexError(f"batch_s selects row {rank_rows.rows_needed(my, len(value)) - 1}"
                             f" but shared variable {s} has {len(value)} rows in rank {rank}")
        shared_sel.append((value, my, length))
    return shared_sel, shared_sel[0][2] if rows is None else rows


def _run_collective(spec, rt, arrays, msg, shared_sel, subset):
    """Run a graph holding in-graph collectives once, whatever this rank's rows."""
    with rt.calling():
        if shared_sel is None:
            results = call_subset(spec.fn, arrays, subset)
        else:
            out_idx = list(range(len(spec.outputs))) if subset is None else subset
            results = run_slices(spec, rt, arrays, msg.n_scattered, shared_sel, 1, out_idx)
        # JAX dispatches asynchronously: its collectives (host callbacks)
        # must run while this rank is still inside the call.
        _wait_device(spec, results)
    # Another rank may still read this rank's buffers from the graph's last
    # collective; meet before anyone packs its results into them.
    rt.backend.settle()
    return results


def run_then(rt, then):
    """The rest of a fused step on every rank: all-reduce (a ``ThenMsg``), then the follow-up.

    Runs after the call's own computation and before its results go to the
    master, so one command does gradient, all-reduce and update.
    """
    prof = rt.profiler
    all_reduce_local(rt, AllReduceMsg(then.idx, then.op, True, then.dtype))
    # Other ranks may still copy reduced parts out of this rank's buffers, which the
    # follow-up (zeroing the gradient) and the results about to be sent overwrite.
    rt.backend.settle()
    if prof is not None:
        prof.lap("collective")
    follow = rt.registry.functions[then.function_id].spec
    # in_call only where it changes no in-graph collective (those act alone in a follow-up).
    with rt.calling(not follow.collective):
        follow.fn()
    if follow.updates:
        _wait_device(follow)
    if prof is not None:
        prof.lap("compute")


def _wait_device(spec, results=()):
    """Return once a JAX function's ``results`` and updated shared variables are computed.

    Every rank, inside a command; no-op for functions on other backends.  JAX
    runs asynchronously and reads NumPy inputs (shared memory) in place: a
    rank finishes before its command ends and the master may reuse them.
    """
    if spec.jax:
        devices.wait([access.raw(var) for var, _ in spec.updates], fetch=results)
