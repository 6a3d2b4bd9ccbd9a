"""The parts of a split term that depend on lifted NumPy arrays alone, computed once in the master.

PyMC compiles a model whose data are NumPy arrays with its constants folded:
a Poisson likelihood's ``gammaln(y + 1)`` over NumPy counts is computed once,
when PyMC compiles, and never again.  A rank's graph reads those arrays as
row inputs (``terms.Lifted``), so, left alone, it would compute such a part
at every call: on a Poisson GLM of 10^5 rows, 1839 us a call on 2 ranks
against PyMC's 1113 (bench/HISTORY.md, 2026-12-07).

So each largest part of a split term whose leaves are constants (at least
one a lifted array split by rows), whose value has the rows as its first
axis, and which runs an op worth saving (``gammaln``, ``log``, a sum: not a
cast or an addition, which cost less than reading one more array), is
computed here once over all rows and enters the term as one more lifted
array, split as the others are.  This is exact whatever the part does
across rows: every rank reads the same row ranges of every split array, and
the master computed the part on all of them, as PyMC does.  A lifted array
never changes (``pm.set_data`` cannot reach a NumPy array), so neither does
the value.  ``rowcheck`` then checks the terms as it checks any.
"""

import logging

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.graph.basic import Constant
from pytensor.tensor.elemwise import DimShuffle, Elemwise

from ... import compat
from . import branches

logger = logging.getLogger(__name__)


def _costly(node):
    """Whether ``node`` costs a row more than reading one more array: a special function or
    libm's (``branches.COSTLY``), or any op that is not elementwise or a view (a sum)."""
    if isinstance(node.op, Elemwise):
        return isinstance(node.op.scalar_op, branches.COSTLY)
    return not isinstance(node.op, DimShuffle)


def _walk(graph, lifted, n_rows):
    """Each variable of ``graph``, as ``(kind, costly)``.

    ``kind``: "lifted" where its leaves are constants, at least one of them in
    ``lifted`` (a part that can fold); "constant" where they are constants
    without rows; "rows" where one is an array of ``n_rows`` rows kept whole
    (``unsplit=``); "other" where it reads a value variable or a container.
    ``costly``: whether its part runs an op worth saving.
    """
    info = {}
    stack = [graph]
    while stack:
        var = stack[-1]
        if var in info:
            stack.pop()
            continue
        if var.owner is None:
            stack.pop()
            if var in lifted:
                kind = "lifted"
            elif isinstance(var, Constant):
                rows = np.ndim(var.data) >= 1 and np.shape(var.data)[0] == n_rows
                kind = "rows" if rows else "constant"
            else:
                kind = "other"
            info[var] = (kind, False)
            continue
        pending = [i for i in var.owner.inputs if i not in info]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        kinds = {info[i][0] for i in var.owner.inputs}
        kind = next((k for k in ("other", "rows", "lifted") if k in kinds), "constant")
        costly = any(info[i][1] for i in var.owner.inputs) or _costly(var.owner)
        for out in var.owner.outputs:
            info[out] = (kind, costly)
    return info


def _frontier(graph, info):
    """The costly "lifted" variables read by a node that is not "lifted": the largest parts."""
    out = {}
    for var in compat.ancestors([graph]):
        node = var.owner
        if node is None or info[var][0] == "lifted":
            continue
        for inp in node.inputs:
            kind, costly = info[inp]
            if (kind == "lifted" and costly and inp.owner is not None
                    and getattr(inp.type, "ndim", 0) >= 1):
                out[inp] = None
    return list(out)


def fold(split_terms, split, n_rows, lifted_type):
    """Fold each split term's largest costly parts over lifted arrays into new lifted arrays.

    Args:
        split_terms: the ``terms.Term`` s that read split rows.
        split: the containers and lifted arrays split by rows.
        n_rows: their rows.
        lifted_type: ``terms.Lifted``, to make the new arrays (no import cycle).

    Returns:
        ``(split_terms, new)``: the terms with each part replaced by its value,
        and the new ``Lifted`` arrays, one per part (none where nothing folds).
    """
    lifted = {c.constant for c in split if isinstance(c, lifted_type)}
    if not lifted or n_rows < 2:
        return split_terms, []
    parts = {}
    for term in split_terms:
        info = _walk(term.graph, lifted, n_rows)
        for var in _frontier(term.graph, info):
            parts.setdefault(var, term.name)
    if not parts:
        return split_terms, []
    candidates = list(parts)
    try:
        values = pytensor.function([], candidates, mode="FAST_COMPILE")()
    except Exception as exc:   # noqa: BLE001 -- left to the ranks, as before, where it fails here
        logger.debug("data_parallel: the data-only parts %s were not computed in the master (%s)",
                     candidates, exc)
        return split_terms, []
    replace, new, count = {}, [], {}
    for var, value in zip(candidates, values):
        value = np.asarray(value)
        if value.ndim < 1 or value.shape[0] != n_rows or value.dtype != np.dtype(var.dtype):
            continue
        name = parts[var]
        count[name] = count.get(name, 0) + 1
        const = pt.constant(value)
        replace[var] = const
        new.append(lifted_type(const, f"{name}_folded{count[name]}"))
    if not replace:
        return split_terms, []
    logger.info("data_parallel: %d part(s) of the likelihood that read only NumPy arrays "
                "computed once over all rows, as PyMC folds them: %s",
                len(new), [a.name for a in new])
    out = []
    for term in split_terms:
        read = set(compat.ancestors([term.graph]))
        mine = {v: c for v, c in replace.items() if v in read}
        graph = compat.clone_replace(term.graph, replace=mine, strict=False) if mine else term.graph
        out.append(term._replace(graph=graph))
    return out, new
