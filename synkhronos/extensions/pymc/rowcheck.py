"""Check that each split term of a PyMC log-density is a sum over its rows, before anything runs.

A term split over ranks is exact only if its value on all rows equals the
sum of its values on parts of the rows.  Statistics across rows (centring
with a mean, sorts, cumulative sums, time-series likelihoods such as an
observed ``GaussianRandomWalk``) break that, silently.  The check evaluates
every split term, serially, on the first rows of the data and on three
uneven parts of them, at jittered points (as PyMC starts its chains), and
refuses, naming the variable, a term whose parts do not add up.
"""

import logging

import numpy as np
import pytensor
import pytensor.tensor as pt

from ... import compat
from . import graphs, terms
from .terms import WHERE

logger = logging.getLogger(__name__)

CHECK_ROWS = 97
"""Rows the check evaluates (the first ones; fewer if the data set has fewer)."""

_ROW_COMBINING = ("CumOp", "SortOp", "ArgSortOp", "Scan", "Convolve", "DiffOp")


def check_rows(model, plan, value_vars, point_fn, mode, n_points=3):
    """Raise ValueError naming the first split term whose parts do not add up to the whole.

    Args:
        point_fn: ``point_fn(i)`` returns the i-th point to try (a point dict).
        mode: the PyTensor mode to compile the check with (cheap to compile).
    """
    if not plan.split_terms:
        return
    inputs = graphs.row_inputs(plan.split)
    n_total = pt.dscalar("n_total")
    exprs, _, _ = graphs.rank_terms(model, plan, inputs, {}, n_total, by_class=False)
    fn = pytensor.function([*value_vars, *inputs, n_total], exprs, mode=mode,
                           on_unused_input="ignore")
    def per_term(lo, hi):
        """One function per term, compiled only when the check fails (to name the term)."""
        return _Lazy(lambda: [pytensor.function([*value_vars, *inputs, n_total], e, mode=mode,
                                                on_unused_input="ignore") for e in exprs])

    t = min(plan.n_rows, CHECK_ROWS)
    rows = [np.asarray(c.get_value(borrow=True)[:t]) for c in plan.split]
    cuts = _cuts(t)
    rtol = 1e-8 if all(np.dtype(v.dtype).itemsize >= 8 for v in value_vars) else 1e-3
    checked = False
    for i in range(n_points):
        point = point_fn(i)
        args = [point[v.name] for v in value_vars]
        whole = _evaluate(fn, args, rows, t, plan, None, per_term(0, t))
        if not np.all(np.isfinite(whole)):
            continue
        parts = [_evaluate(fn, args, [r[lo:hi] for r in rows], t, plan, (lo, hi),
                           per_term(lo, hi))
                 for lo, hi in zip(cuts[:-1], cuts[1:])]
        summed = np.sum(parts, axis=0)
        scale = np.sum(np.abs(parts), axis=0) + np.abs(whole) + 1e-300
        for term, w, s, sc in zip(plan.split_terms, whole, summed, scale):
            if not abs(w - s) <= rtol * sc:
                raise ValueError(_combines_rows(term, plan, w, s))
        checked = True
    if not checked:
        logger.warning("%s: could not check that the terms %s add up over rows (not finite at "
                       "%d start points)", WHERE, [t.name for t in plan.split_terms], n_points)


def _cuts(t):
    """Three uneven parts of t rows (fewer when t is small)."""
    if t < 3:
        return [0, t] if t < 2 else [0, 1, t]
    a = max(1, (2 * t) // 5)
    b = max(a + 1, a + (t - a) // 2 + 1)
    return [0, a, min(b, t - 1), t]


def _evaluate(fn, args, rows, t, plan, part, per_term=None):
    try:
        return np.asarray(fn(*args, *rows, float(t)), dtype=np.float64)
    except Exception as exc:  # noqa: BLE001 - any failure on part of the rows is the user's to see
        where = "its first rows" if part is None else f"rows {part[0]}:{part[1]} of its first rows"
        names = [t.name for t in plan.split_terms]
        if per_term is not None:     # name the terms that fail, not all of them
            names = [n for n, f in zip(names, per_term) if _fails(f, args, rows, t)] or names
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{WHERE}: the log-density term of {names[0]!r}"
            + (f" (and {names[1:]})" if len(names) > 1 else "")
            + f" fails on {where} ({type(exc).__name__}: {first}). "
            + _whole_fix(plan, [t for t in plan.split_terms if t.name in names],
                         "A term that needs all its rows (a time series, a fixed number of "
                         "steps)")
            + "; otherwise every array with one row per observation must be a pm.Data "
            "container with the same rows") from exc


def _whole_fix(plan, failing, what):
    """What to do with terms that need every row: keep the arrays they read whole, or, where
    those are all the arrays split, sample the model with pm.sample."""
    read = set()
    for term in failing:
        read.update(compat.ancestors([term.graph]))
    names = [c.name for c in plan.split if terms.graph_var(c) in read]
    if len(names) == len(plan.split):
        return (f"{what} reads every array split by rows ({names}): kept whole, nothing "
                "would be left to split, and splitting gains nothing on this model. Sample "
                "it with pm.sample (with model: pm.sample(...))")
    return (f"{what} must keep its data whole: data_parallel(model, unsplit={names})")


class _Lazy:
    """A list built on first iteration."""

    def __init__(self, make):
        self._make = make

    def __iter__(self):
        return iter(self._make())


def _fails(fn, args, rows, t):
    try:
        fn(*args, *rows, float(t))
    except Exception:  # noqa: BLE001 - only whether it fails
        return True
    return False


def _combines_rows(term, plan, whole, summed):
    ops = sorted({type(v.owner.op).__name__ for v in compat.ancestors([term.graph])
                  if v.owner is not None
                  and any(k in type(v.owner.op).__name__ for k in _ROW_COMBINING)})
    found = f" Its graph has {', '.join(ops)}." if ops else ""
    numpy_fix = (" If it centres or scales by statistics over the rows (X - X.mean(0), "
                 "(x - x.mean()) / x.std()), compute them with NumPy before building the "
                 "model, pm.Data(\"X\", X - X.mean(0)): every row then stands alone and the "
                 "rows split exactly.")
    whole_fix = " " + _whole_fix(plan, [term], "If it needs every row (a time series, a sort), it") + "."
    return (f"{WHERE}: the log-density term of {term.name!r} combines rows (statistics across "
            "rows such as a mean or a sort, a cumulative sum, a time series): on parts of the "
            f"rows it adds up to {float(summed):.10g}, on all of them it is {float(whole):.10g}, "
            f"so split over ranks it would be silently wrong.{found}"
            + (whole_fix + numpy_fix if ops else numpy_fix + whole_fix))
