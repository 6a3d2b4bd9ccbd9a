"""Combining a call's results by op: a rank's slices, and every rank's results in the master.

``collect`` runs in the master after a call's end barrier: what every rank
contributed (``Backend.contribute``), reduced by each output's op.
"""

import numpy as np

from ..comm import reduce_ops


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
                out = reduce_ops.combine_floats(spec.output_ops[0], [g[0] for g in got],
                                              [g[1] for g in got], a.dtype)
                return [out] if spec.return_list else out
    parts = rt.backend.collect()
    parts[rt.place.rank] = mine
    if spec.simple and subset is None and None not in parts:
        # Fast path: one reducible output, every rank contributed.
        values = [p[0][0] for p in parts]
        if len({v.shape for v in values}) == 1:
            out = reduce_ops.combine(spec.output_ops[0], values, [p[1] for p in parts])
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
            final.append(concat([p[0][j] for p in have]))
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
        final.append(reduce_ops.combine(op, values, [p[1] for p in have]))
    return final if spec.return_list else final[0]


def fold(op, acc, value, w_acc, w):
    """Fold one slice's ``value`` of an output into ``acc`` (a rank's slices, by ``op``)."""
    if op == "gather":
        if np.ndim(value) == 0:
            # A rank's 0-d result has no rows to concatenate: its slices add up,
            # so the master still gets one value per rank.
            return reduce_ops.accumulate("sum", acc, value)
        return (acc or []) + [np.asarray(value)]
    return reduce_ops.accumulate(op, acc, value, w_acc, w)


def unfold(op, acc):
    """The output a rank's folded slices give (``fold``): gathered parts concatenated."""
    if op == "gather" and isinstance(acc, list):
        return concat(acc)
    return acc


def concat(parts):
    """Concatenate per-rank (or per-slice) parts along axis 0; 0-d parts are stacked."""
    if not parts:
        return None
    if np.ndim(parts[0]) == 0:
        return np.stack(parts)
    return np.concatenate(parts, axis=0)
