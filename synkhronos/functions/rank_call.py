"""Running a call on one rank: input views, batch_s, slices, and combining results by op.

Every rank runs ``execute`` on the same call message; the master then runs
``collect`` once the end barrier has passed.  Both read the function from its
``FunctionSpec``, the part of a Function that travels to every rank.
"""

from dataclasses import dataclass, field

import numpy as np
import pytensor
import pytensor.tensor as pt

from .. import compat
from ..inputs import mappings as datamaps, machine_rows as placement, rank_rows as split
from ..runtime import devices as gpu
from ..comm import reduce_ops as reducers
from ..variables import access as sharedvars
from ..variables.reductions import AllReduceMsg, all_reduce_local


@dataclass
class FunctionSpec:
    """What every rank needs to run a synkhronos function: the compiled function and its parts."""

    fn: object                  # the compiled pytensor function
    inputs: list                # scattered inputs
    bcast_inputs: list
    outputs: list
    output_ops: list
    return_list: bool
    updates: list               # (shared, update) pairs
    update_ops: list
    givens: object
    sliceable: list
    kwargs: dict
    variants: dict = field(default_factory=dict)  # per process: compiled slicing variants
    simple: bool = field(init=False)              # one output with a collective op
    collective: bool = field(init=False)          # the graph holds in-graph collectives
    jax: bool = field(init=False)                 # runs on PyTensor's JAX backend

    def __post_init__(self):
        self.simple = len(self.outputs) == 1 and self.output_ops[0] in reducers.COLLECTIVE_OPS
        self.collective = _holds_collective(self.fn.maker.fgraph, set())
        self.jax = gpu.uses_jax(self.fn)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["variants"] = {}  # compiled again where needed
        return state


def _holds_collective(fgraph, seen):
    """Whether a graph holds an in-graph collective, also inside inner graphs (Scan, OpFromGraph)."""
    for node in fgraph.apply_nodes:
        op = node.op
        if getattr(op, "synk_collective", False):
            return True
        inner = getattr(op, "fgraph", None)
        if hasattr(inner, "apply_nodes") and id(inner) not in seen:
            seen.add(id(inner))
            if _holds_collective(inner, seen):
                return True
    return False


def execute(spec, rt, msg):
    """Run this rank's share of a call (a ``CallMsg``) and take part in the reduction."""
    results, weight = run_share(spec, rt, msg)
    if rt.is_master:
        return None if results is None else (results, weight)
    rt.backend.contribute(results, weight)


def run_share(spec, rt, msg):
    """Run this rank's share of a call; return ``(results or None, weight)``."""
    rank = rt.place.rank
    prof = rt.profiler
    descs = msg.descs
    if rt.is_master:
        datas = rt.registry.datas
        arrays = [datas[d.data_id]._data for d in descs]
    else:
        arrays = [datamaps.view(rt, d) for d in descs]
    rows = None
    sel = msg.sel
    if msg.plan is not None and msg.n_scattered:
        # Cluster: this machine's rows, some held here only (placement.py).
        rows = placement.take_share(rt, arrays, descs, msg.n_scattered, sel,
                                    msg.plan[rt.place.rank_offset])
    elif msg.n_scattered:
        lo, hi = split.rank_range(msg.n_rows, rt.place.n_parallel, rank)
        for i in range(msg.n_scattered):
            arrays[i] = split.take(arrays[i], sel, lo, hi, descs[i].minibatch and sel is not None)
        rows = hi - lo
    if prof is not None:
        prof.lap("gather")
    num_slices = msg.num_slices
    sliceable = spec.sliceable
    shared_sel = None
    if sliceable and (msg.sel_s is not None or num_slices > 1):
        shared_sel = []
        for s in sliceable:
            value = s.get_value(borrow=True)
            my = None if msg.sel_s is None else msg.sel_s[rank]
            my = split.resolve(my, len(value))
            length = split.selection_length(my, len(value))
            if my is not None and split.rows_needed(my, len(value)) > len(value):
                raise IndexError(f"batch_s selects row {split.rows_needed(my, len(value)) - 1}"
                                 f" but shared variable {s} has {len(value)} rows in rank {rank}")
            shared_sel.append((value, my, length))
        if rows is None:
            rows = shared_sel[0][2]
    elif sliceable and rows is None:
        # Weigh "avg" by the shared rows used, as with batch_s.
        rows = len(sliceable[0].get_value(borrow=True))
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
        # A graph without in-graph collectives has none to combine; the flag
        # makes a collective or call from inside one of its Ops raise at once.
        rt.in_call = True
        try:
            if shared_sel is None and (num_slices == 1 or not msg.n_scattered):
                results = spec.fn(*arrays) if subset is None else \
                    compat.call_subset(spec.fn, arrays, subset)
            else:
                out_idx = list(range(len(spec.outputs))) if subset is None else subset
                # More slices than rows would only add empty calls: cost stays that of
                # the unsliced call.
                num_slices = max(1, min(num_slices, rows))
                results = run_slices(spec, rt, arrays, msg.n_scattered, shared_sel, num_slices,
                                     out_idx)
        finally:
            rt.in_call = False
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


def _run_collective(spec, rt, arrays, msg, shared_sel, subset):
    """Run a graph holding in-graph collectives once, whatever this rank's rows."""
    rt.in_call = True
    try:
        if shared_sel is None:
            results = compat.call_subset(spec.fn, arrays, subset)
        else:
            out_idx = list(range(len(spec.outputs))) if subset is None else subset
            results = run_slices(spec, rt, arrays, msg.n_scattered, shared_sel, 1, out_idx)
        # JAX dispatches asynchronously: its collectives (host callbacks)
        # must run while this rank is still inside the call.
        _wait_device(spec, results)
    finally:
        rt.in_call = False
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
    rt.in_call = not follow.collective
    try:
        follow.fn()
    finally:
        rt.in_call = False
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
        gpu.wait(list(results) + [sharedvars.raw(var) for var, _ in spec.updates])


def variant(spec, slice_shareds, defer):
    """Compile (once per process) the function used for batch_s and slicing."""
    key = (slice_shareds, defer)
    fn = spec.variants.get(key)
    if fn is None:
        ins = spec.inputs + spec.bcast_inputs
        givens = dict(spec.givens.items() if isinstance(spec.givens, dict)
                      else (spec.givens or []))
        if slice_shareds:
            reps = [pt.tensor(dtype=s.dtype, shape=(None,) * s.ndim, name=f"{s.name}_slice")
                    for s in spec.sliceable]
            givens.update(zip(spec.sliceable, reps))
            ins = ins + reps
        outs = list(spec.outputs)
        updates = spec.updates or None
        if defer:
            outs += [u for _, u in spec.updates]
            updates = None
        fn = pytensor.function(ins, outs, updates=updates, givens=givens or None, **spec.kwargs)
        fn.trust_input = True
        spec.variants[key] = fn
    return fn


def run_slices(spec, rt, arrays, n_scattered, shared_sel, num_slices, out_idx):
    """Run one rank's rows in ``num_slices`` slices; accumulate outputs and updates."""
    defer = num_slices > 1
    fn = variant(spec, shared_sel is not None, defer)
    n_out = len(spec.outputs)
    scat_len = len(arrays[0]) if n_scattered else None
    scat_parts = split.split_ranges(scat_len, num_slices) if n_scattered else None
    sh_parts = [split.split_ranges(length, num_slices) for _, _, length in shared_sel] \
        if shared_sel else None
    acc_out = [None] * n_out
    acc_upd = [None] * len(spec.updates)
    w_acc = 0.0
    for k in range(num_slices):
        call = list(arrays)
        if n_scattered:
            lo, hi = scat_parts[k]
            for i in range(n_scattered):
                call[i] = arrays[i][lo:hi]
            w = float(hi - lo)
        if shared_sel:
            for j, (value, my, _) in enumerate(shared_sel):
                lo, hi = sh_parts[j][k]
                call.append(split.take(value, my, lo, hi))
            if not n_scattered:
                w = float(sh_parts[0][k][1] - sh_parts[0][k][0])
        if w == 0 and num_slices > 1:
            continue
        res = fn(*call)
        if not defer:
            return [res[i] for i in out_idx]
        for i in out_idx:
            acc_out[i] = _fold(spec.output_ops[i], acc_out[i], res[i], w_acc, w)
        for j, op in enumerate(spec.update_ops):
            acc_upd[j] = reducers.accumulate(op, acc_upd[j], res[n_out + j], w_acc, w)
        w_acc += w
    for (var, _), value in zip(spec.updates, acc_upd):
        if value is not None:
            sharedvars.adopt(rt, var, value)  # a JAX function's variable stays on the device
    return [_finish_fold(spec.output_ops[i], acc_out[i]) for i in out_idx]


def collect(spec, rt, mine, subset, name):
    """In the master, after the end barrier: combine every rank's results by op."""
    if not spec.outputs:
        return []
    scalar_parts = rt.backend.scalar_parts
    if scalar_parts is not None and spec.simple and subset is None and mine is not None:
        # One float scalar from every rank (a loss): straight from the control slots.
        a = mine[0][0]
        if a.ndim == 0:
            got = scalar_parts(a.dtype)
            if got is not None:
                got[rt.place.rank] = (float(a), mine[1])
                out = reducers.combine_floats(spec.output_ops[0], [g[0] for g in got],
                                              [g[1] for g in got], a.dtype)
                return [out] if spec.return_list else out
    parts = rt.backend.collect()
    parts[rt.place.rank] = mine
    if spec.simple and subset is None and None not in parts:
        # Fast path: one reducible output, every rank contributed.
        values = [p[0][0] for p in parts]
        if len({v.shape for v in values}) == 1:
            out = reducers.combine(spec.output_ops[0], values, [p[1] for p in parts])
            return [out] if spec.return_list else out
    out_idx = range(len(spec.outputs)) if subset is None else subset
    final = []
    for j, i in enumerate(out_idx):
        op = spec.output_ops[i]
        if op is None:
            final.append([None if p is None else np.array(p[0][j]) for p in parts])
            continue
        have = [p for p in parts if p is not None]
        if op == "gather":
            final.append(_concat([p[0][j] for p in have]))
            continue
        if not have:
            final.append(None)
            continue
        values = [p[0][j] for p in have]
        shapes = {v.shape for v in values}
        if len(shapes) > 1:
            raise ValueError(
                f"{name}: output {i} has different shapes across ranks "
                f"({', '.join(str(v.shape) for v in values)}); op {op!r} needs equal shapes "
                "(use 'gather' or None)")
        final.append(reducers.combine(op, values, [p[1] for p in have]))
    return final if spec.return_list else final[0]


def _fold(op, acc, value, w_acc, w):
    if op == "gather":
        if np.ndim(value) == 0:
            # A rank's 0-d result has no rows to concatenate: its slices add up,
            # so the master still gets one value per rank.
            return reducers.accumulate("sum", acc, value)
        return (acc or []) + [np.asarray(value)]
    return reducers.accumulate(op, acc, value, w_acc, w)


def _finish_fold(op, acc):
    if op == "gather" and isinstance(acc, list):
        return _concat(acc)
    return acc


def _concat(parts):
    if not parts:
        return None
    if np.ndim(parts[0]) == 0:
        return np.stack(parts)
    return np.concatenate(parts, axis=0)
