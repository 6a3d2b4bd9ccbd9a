"""A rank's rows run in slices (``num_slices``, ``batch_s``): the variant function, folding results."""

import pytensor
import pytensor.tensor as pt

from ..comm import reduce_ops
from ..inputs import rank_rows
from ..variables import access
from .outputs import fold, unfold


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
    scat_parts = rank_rows.split_ranges(scat_len, num_slices) if n_scattered else None
    sh_parts = [rank_rows.split_ranges(length, num_slices) for _, _, length in shared_sel] \
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
                call.append(rank_rows.take(value, my, lo, hi))
            if not n_scattered:
                w = float(sh_parts[0][k][1] - sh_parts[0][k][0])
        if w == 0 and num_slices > 1:
            continue
        res = fn(*call)
        if not defer:
            return [res[i] for i in out_idx]
        for i in out_idx:
            acc_out[i] = fold(spec.output_ops[i], acc_out[i], res[i], w_acc, w)
        for j, op in enumerate(spec.update_ops):
            acc_upd[j] = reduce_ops.accumulate(op, acc_upd[j], res[n_out + j], w_acc, w)
        w_acc += w
    for (var, _), value in zip(spec.updates, acc_upd):
        if value is not None:
            access.adopt(rt, var, value)  # a JAX function's variable stays on the device
    return [unfold(spec.output_ops[i], acc_out[i]) for i in out_idx]
