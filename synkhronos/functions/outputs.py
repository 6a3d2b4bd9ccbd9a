"""Combining a call's results by op: a rank's slices, and every rank's results in the master.

``collect`` runs in the master after a call's end barrier: what every rank
contributed (``Backend.contribute``), reduced by each output's op.
"""

from typing import NamedTuple

import numpy as np

from ..comm import reduce_ops


def collect(spec, rt, mine, subset, name):
    """In the master, after the end barrier: combine every rank's results by op."""
    if not spec.outputs:
        return []
    if spec.simple and subset is None and mine is not None:
        # One float scalar from every rank (a loss): straight from the control slots.
        a = mine[0][0]
        if a.ndim == 0:
            out = rt.backend.scalar_result(spec.output_ops[0], a, mine[1])
            if out is not None:
                return [out] if spec.return_list else out
    parts = rt.backend.collect()
    parts[rt.place.rank] = mine
    if spec.simple and subset is None and None not in parts:
        # Fast path: one reducible output, every rank contributed.
        values = counted(spec.output_ops[0], [p[0][0] for p in parts])
        if len({v.shape for v in values}) == 1:
            out = reduce_ops.combine(spec.output_ops[0], values, [p[1] for p in parts])
            return [out] if spec.return_list else out
    out_idx = range(len(spec.outputs)) if subset is None else subset
    final = []
    for j, i in enumerate(out_idx):
        op = spec.output_ops[i]
        entries = _entries(parts, j)
        if op is None:
            final.append([None if e is None else np.array(e[0]) for e in entries])
            continue
        have = [e for e in entries if e is not None]
        if op == "gather":
            final.append(concat([e[0] for e in have]))
            continue
        if not have:
            final.append(None)
            continue
        values = counted(op, [e[0] for e in have])
        shapes = {v.shape for v in values}
        if len(shapes) > 1:
            raise ValueError(
                f"{name}: output {i} has different shapes across ranks "
                f"({', '.join(str(v.shape) for v in values)}); op {op!r} needs equal shapes "
                "(use 'gather' or None)")
        final.append(reduce_ops.combine(op, values, [e[1] for e in have]))
    return final if spec.return_list else final[0]


def counted(op, values):
    """Bools under "sum" or "prod" as NumPy's ``sum``/``prod`` take them: as integers.

    ``True + True`` is 2 in ``numpy.sum``; an elementwise ``numpy.add`` of bools
    would be a logical or.
    """
    if op in ("sum", "prod") and values and values[0].dtype == np.bool_:
        return [v.astype(np.int_) for v in values]
    return values


# A cluster's machine combines its ranks' outputs of at least this many bytes before they
# travel; smaller ones (losses, accuracies) travel per rank and combine as on one machine.
MACHINE_PART_BYTES = 1 << 16


class MachinePart(NamedTuple):
    """One machine's ranks' results of a call, combined by op before they travel (a cluster).

    Attributes:
        outputs: per output, ``(value, weight)`` for the machine's ranks combined, or
            a list with one ``(value, weight)`` or None per rank of the machine.
        n_ranks: the machine's ranks, whose results this stands for.
    """

    outputs: list
    n_ranks: int


def machine_part(spec, subset, entries, offset, n_ranks):
    """A node master's contributions ``[(rank, arrays, weight)]`` combined output by output.

    Outputs under a reduce op of ``MACHINE_PART_BYTES`` or more are reduced
    here, and gathered ones concatenated, so each travels once per machine;
    the rest (op None, small ones, shapes that differ) stay per rank.
    Returns the entries to send: one ``(offset, MachinePart, weight)``, or
    ``entries`` unchanged where combining saves nothing.
    """
    if len(entries) < 2:
        return entries
    out_idx = range(len(spec.outputs)) if subset is None else subset
    outputs, combined = [], False
    for j, i in enumerate(out_idx):
        op = spec.output_ops[i]
        values = counted(op, [np.asarray(a[j]) for _, a, _ in entries])
        big = values[0].nbytes >= MACHINE_PART_BYTES
        if op == "gather" and big and all(v.ndim for v in values):
            outputs.append((concat(values), None))
            combined = True
        elif op in reduce_ops.COLLECTIVE_OPS and big and len({v.shape for v in values}) == 1:
            weights = [w for _, _, w in entries]
            outputs.append((reduce_ops.combine(op, values, weights), float(sum(weights))))
            combined = True
        else:
            per = [None] * n_ranks
            for (rank, _, w), v in zip(entries, values):
                per[rank - offset] = (v, w)
            outputs.append(per)
    if not combined:
        return entries
    return [(offset, MachinePart(outputs, n_ranks), float(sum(w for _, _, w in entries)))]


def _entries(parts, j):
    """Output ``j``'s contributions in rank order: ``(value, weight)`` or None per rank.

    A machine's combined contribution (``MachinePart``) stands once, for all
    its ranks.
    """
    out = []
    skip = 0
    for p in parts:
        if skip:
            skip -= 1  # a rank the machine's part stands for
            continue
        if p is None:
            out.append(None)
            continue
        arrays, weight = p
        if type(arrays) is MachinePart:
            skip = arrays.n_ranks - 1
            v = arrays.outputs[j]
            if type(v) is list:
                out.extend(v)
            else:
                out.append(v)
            continue
        out.append((arrays[j], weight))
    return out


def fold(op, acc, value, w_acc, w):
    """Fold one slice's ``value`` of an output into ``acc`` (a rank's slices, by ``op``)."""
    if op == "gather":
        if np.ndim(value) == 0:
            # A rank's 0-d result has no rows to concatenate: its slices add up,
            # so the master still gets one value per rank.
            return reduce_ops.accumulate("sum", acc, value)
        return (acc or []) + [np.asarray(value)]
    return reduce_ops.accumulate(op, acc, counted(op, [np.asarray(value)])[0], w_acc, w)


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
