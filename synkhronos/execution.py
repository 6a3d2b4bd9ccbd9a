"""Running a call on one rank: input views, batch_s, slices, and combining results by op.

Every rank runs ``execute`` on the same call message; the master then runs
``collect`` once the end barrier has passed.
"""

import numpy as np
import pytensor
import pytensor.tensor as pt

from . import compat, data_module, gpu, reducers, sharedvars, split


def execute(f, rt, msg):
    """Run this rank's share of a call and take part in the reduction."""
    _, descs, n_scattered, sel, n_rows, sel_s, num_slices, subset = msg
    rank = rt.rank
    if rt.is_master:
        datas = rt.datas
        arrays = [datas[desc[0]]._data for desc in descs]
    else:
        arrays = [data_module.view(rt, desc) for desc in descs]
    rows = None
    if n_scattered:
        lo, hi = split.rank_range(n_rows, rt.n_parallel, rank)
        for i in range(n_scattered):
            arrays[i] = split.take(arrays[i], sel, lo, hi, descs[i][3] and sel is not None)
        rows = hi - lo
    shared_sel = None
    if f._sliceable and (sel_s is not None or num_slices > 1):
        shared_sel = []
        for s in f._sliceable:
            value = s.get_value(borrow=True)
            my = None if sel_s is None else sel_s[rank]
            my = split.resolve(my, len(value))
            length = split.selection_length(my, len(value))
            if my is not None and split.rows_needed(my, len(value)) > len(value):
                raise IndexError(f"batch_s selects row {split.rows_needed(my, len(value)) - 1}"
                                 f" but shared variable {s} has {len(value)} rows in rank {rank}")
            shared_sel.append((value, my, length))
        if rows is None:
            rows = shared_sel[0][2]
    elif f._sliceable and rows is None:
        # Weigh "avg" by the shared rows used, as with batch_s.
        rows = len(f._sliceable[0].get_value(borrow=True))
    if rows == 0:
        results = None
    elif shared_sel is None and (num_slices == 1 or not n_scattered):
        results = compat.call_subset(f._fn, arrays, subset)
    else:
        out_idx = list(range(len(f._outputs))) if subset is None else subset
        results = run_slices(f, arrays, n_scattered, shared_sel, num_slices, out_idx)
    if rows != 0 and f._updates and gpu.uses_jax(f._fn):
        # JAX runs asynchronously and reads NumPy inputs (shared memory) in
        # place: finish before the command ends and the master may reuse them.
        gpu.wait([sharedvars.raw(var) for var, _ in f._updates])
    weight = 1.0 if rows is None else float(rows)
    if results is not None:
        # Backends other than NumPy's (JAX) return their own array types.
        results = [r if type(r) is np.ndarray else np.asarray(r) for r in results]
    if rt.is_master:
        return None if results is None else (results, weight)
    rt.backend.contribute(results, weight)


def variant(f, slice_shareds, defer):
    """Compile (once per process) the function used for batch_s and slicing."""
    key = (slice_shareds, defer)
    fn = f._variants.get(key)
    if fn is None:
        ins = f._inputs + f._bcast_inputs
        givens = dict(f._givens.items() if isinstance(f._givens, dict)
                      else (f._givens or []))
        if slice_shareds:
            reps = [pt.tensor(dtype=s.dtype, shape=(None,) * s.ndim, name=f"{s.name}_slice")
                    for s in f._sliceable]
            givens.update(zip(f._sliceable, reps))
            ins = ins + reps
        outs = list(f._outputs)
        updates = f._updates or None
        if defer:
            outs += [u for _, u in f._updates]
            updates = None
        fn = pytensor.function(ins, outs, updates=updates, givens=givens or None, **f._kwargs)
        fn.trust_input = True
        f._variants[key] = fn
    return fn

def run_slices(f, arrays, n_scattered, shared_sel, num_slices, out_idx):
    defer = num_slices > 1
    fn = variant(f, shared_sel is not None, defer)
    n_out = len(f._outputs)
    scat_len = len(arrays[0]) if n_scattered else None
    scat_parts = split.split_ranges(scat_len, num_slices) if n_scattered else None
    sh_parts = [split.split_ranges(length, num_slices) for _, _, length in shared_sel] \
        if shared_sel else None
    acc_out = [None] * n_out
    acc_upd = [None] * len(f._updates)
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
            acc_out[i] = _fold(f._output_ops[i], acc_out[i], res[i], w_acc, w)
        for j, op in enumerate(f._update_ops):
            acc_upd[j] = reducers.accumulate(op, acc_upd[j], res[n_out + j], w_acc, w)
        w_acc += w
    for (var, _), value in zip(f._updates, acc_upd):
        if value is not None:
            sharedvars.adopt(var, value)  # a JAX function's variable stays on the device
    return [_finish_fold(f._output_ops[i], acc_out[i]) for i in out_idx]

def collect(f, rt, mine, subset):
    """In the master, after the end barrier: combine every rank's results by op."""
    if not f._outputs:
        return []
    parts = rt.backend.collect()
    parts[rt.rank] = mine
    if f._simple and subset is None and None not in parts:
        # Fast path: one reducible output, every rank contributed.
        values = [p[0][0] for p in parts]
        if len({v.shape for v in values}) == 1:
            out = reducers.combine(f._output_ops[0], values, [p[1] for p in parts])
            return [out] if f._return_list else out
    out_idx = range(len(f._outputs)) if subset is None else subset
    final = []
    for j, i in enumerate(out_idx):
        op = f._output_ops[i]
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
                f"{f.name or 'function'}: output {i} has different shapes across ranks "
                f"({', '.join(str(v.shape) for v in values)}); op {op!r} needs equal shapes "
                "(use 'gather' or None)")
        final.append(reducers.combine(op, values, [p[1] for p in have]))
    return final if f._return_list else final[0]


def _fold(op, acc, value, w_acc, w):
    if op == "gather":
        return (acc or []) + [np.asarray(value)]
    return reducers.accumulate(op, acc, value, w_acc, w)


def _finish_fold(op, acc):
    if op == "gather":
        return _concat(acc)
    return acc


def _concat(parts):
    if not parts:
        return None
    if np.ndim(parts[0]) == 0:
        return np.stack(parts)
    return np.concatenate(parts, axis=0)
