"""Which machine uses which rows: pure functions behind Data produced where it is used.

In a cluster, a call's selected rows are split machine by machine, and each
machine's rows among its ranks (``rank_rows.rank_range``).  With only replicated
inputs a machine takes the positions its ranks take in the even split over
every rank, so the split is the one a single machine makes.  With a Data
produced where it is used (``produced.PlacedData``) every machine takes the
selected rows of its own part, so no row crosses a link.
"""

from typing import NamedTuple, Optional

import numpy as np

from . import conditioning, rank_rows
from .rank_rows import INDEX, RANGE, RowIndex, RowRange

_new = tuple.__new__  # the named tuples' own constructors run Python code at every call

# How a Data's rows are held in a cluster (mappings.DataDesc.placed): every machine all of
# them, each machine its own part of the whole (produced.PlacedData), or each machine the
# rows its ranks use in one call, in the order they use them (a NumPy input).
REPLICATED, PLACED_ROWS, PLACED_POSITIONS = 0, 1, 2


class Part(NamedTuple):
    """What ``synk.data(produce=fn)`` gives ``fn``: the machine asked for rows.

    Attributes:
        machine: this machine's index (0 holds the controller).
        n_machines: machines in the run.
        lo: the first row (of the whole Data) this machine holds, or None
            when no ``length`` was given (then ``fn`` returns whatever rows
            this machine has, e.g. its own files, and the parts are stacked
            in machine order).
        hi: one past its last row, or None likewise.
    """

    machine: int
    n_machines: int
    lo: Optional[int]
    hi: Optional[int]


class MachinePlan(NamedTuple):
    """One machine's rows of a call.

    Attributes:
        sel: the selection of the whole inputs' rows this machine uses, in the
            order its ranks take them (a ``rank_rows.RowRange`` or ``RowIndex``).
        n: how many (its ranks split them with ``rank_rows.rank_range``).
        pos: where they stand in the call's ``batch``, a selection of its
            positions likewise (for ``minibatch`` inputs).
        row_lo: the first row of the machine's part of the placed inputs.
        row_n: rows in that part.
    """

    sel: tuple
    n: int
    pos: tuple
    row_lo: int = 0
    row_n: int = 0


def machine_rows(n_rows, n_local):
    """Each machine's rows ``(lo, hi)`` of ``n_rows``: the rows its ranks take in an even rank_rows."""
    n_parallel = sum(n_local)
    out, rank = [], 0
    for k in n_local:
        lo = rank_rows.rank_range(n_rows, n_parallel, rank)[0]
        hi = rank_rows.rank_range(n_rows, n_parallel, rank + k - 1)[1] if k else lo
        out.append((lo, hi))
        rank += k
    return out


def even_plan(sel, n_rows, n_local):
    """Plans for a call with replicated inputs only: each machine its ranks' positions."""
    plans = []
    for a, b in machine_rows(n_rows, n_local):
        plans.append(MachinePlan(_positions(sel, a, b), b - a, _new(RowRange, (RANGE, a, b))))
    return plans


def owner_plan(sel, parts):
    """Plans for a call with inputs placed in ``parts`` (machine -> (lo, hi) of the whole).

    Each machine takes the selected rows that lie in its own part.
    """
    plans = []
    if sel is None:
        for lo, hi in parts:
            plans.append(MachinePlan(_new(RowRange, (RANGE, lo, hi)), hi - lo,
                                     _new(RowRange, (RANGE, lo, hi)), lo, hi - lo))
    elif sel.kind == RANGE:
        start, stop = sel.start, sel.stop
        for lo, hi in parts:
            a, b = max(start, lo), min(stop, hi)
            b = max(a, b)
            plans.append(MachinePlan(_new(RowRange, (RANGE, a, b)), b - a,
                                     _new(RowRange, (RANGE, a - start, b - start)), lo, hi - lo))
    else:
        idx = sel.rows
        for lo, hi in parts:
            where = np.flatnonzero((idx >= lo) & (idx < hi))
            plans.append(MachinePlan(_new(RowIndex, (INDEX, idx[where])), len(where),
                                     _new(RowIndex, (INDEX, where)), lo, hi - lo))
    return plans


def take_share(rt, arrays, descs, n_scattered, sel, plan):
    """Replace the scattered ``arrays`` by this rank's rows of its machine's ``plan``; return how many.

    ``arrays`` hold whole inputs, this machine's part of a placed one (the
    master's), or the segment holding that part (a worker's, ``mappings.view``).
    """
    place = rt.place
    lo, hi = rank_rows.rank_range(plan.n, place.n_local, place.local_index)
    for i in range(n_scattered):
        d, a = descs[i], arrays[i]
        if d.placed == PLACED_ROWS:  # the machine's part of the whole
            if not isinstance(a, np.ndarray):
                a = a.cached_view(d.dtype, (plan.row_n,) + tuple(d.shape[1:]))
            arrays[i] = rank_rows.take(a, local(plan.sel, plan.row_lo), lo, hi)
        elif d.placed == PLACED_POSITIONS:  # the rows the machine's ranks use, in order
            if not isinstance(a, np.ndarray):
                a = a.cached_view(d.dtype, (plan.n,) + tuple(d.shape[1:]))
            arrays[i] = a[lo:hi]
        elif d.minibatch and sel is not None:
            arrays[i] = take_positions(a, plan.pos, lo, hi)
        else:
            arrays[i] = rank_rows.take(a, plan.sel, lo, hi)
    return hi - lo


def _positions(sel, a, b):
    """The rows at positions ``a:b`` of selection ``sel``."""
    if sel is None:
        return _new(RowRange, (RANGE, a, b))
    if sel.kind == RANGE:
        return _new(RowRange, (RANGE, sel.start + a, sel.start + b))
    return _new(RowIndex, (INDEX, sel.rows[a:b]))


def local(sel, row_lo):
    """Selection ``sel`` of whole rows as rows of a part starting at ``row_lo``."""
    if sel.kind == RANGE:
        return _new(RowRange, (RANGE, sel.start - row_lo, sel.stop - row_lo))
    return _new(RowIndex, (INDEX, sel.rows - row_lo))


def take_positions(array, pos, lo, hi):
    """Rows of a ``minibatch`` input at positions ``lo:hi`` of a machine's share (``pos``)."""
    if pos.kind == RANGE:
        return array[pos.start + lo:pos.start + hi]
    return array[pos.rows[lo:hi]]


def gather_rows(array, sel):
    """The rows ``sel`` picks of ``array``, contiguous (what a machine is sent)."""
    if sel.kind == RANGE:
        return array[sel.start:sel.stop]
    return array[sel.rows]


def balanced_batches(parts, batch_size, rng):
    """One epoch of shuffled batches drawing from every part alike; yields row index arrays.

    Every machine's rows are shuffled within its part and dealt out evenly
    over the epoch (a row's place is its rank in its part's order, as a
    fraction of the part), so each batch takes from each machine its share
    of the batch, to a row; batches differ in size by one row at most, and
    every row is used once.
    """
    total = sum(hi - lo for lo, hi in parts)
    if total == 0:
        return
    orders = [lo + rng.permutation(hi - lo) for lo, hi in parts if hi > lo]
    places = np.concatenate([(np.arange(len(o)) + 0.5) / len(o) for o in orders])
    dealt = np.concatenate(orders)[np.argsort(places, kind="stable")]
    for lo, hi in rank_rows.split_ranges(total, -(-total // batch_size)):
        yield dealt[lo:hi]


def count(span):
    """Rows in ``(lo, hi)``, or None for ``(None, None)``."""
    return None if span[0] is None else span[1] - span[0]


def check_produced_rows(rows, var, dtype, ndim, force_cast, n, machine):
    """What ``produce`` returned on ``machine``, as an array of the Data's dtype and ndim."""
    if var is not None:
        dtype, ndim = var.dtype, var.ndim
    what = f"the rows produce returned on machine {machine}"
    if dtype is None:
        rows = conditioning.as_array(rows, "data")
        dtype = rows.dtype
    arr = conditioning.condition(rows, dtype, ndim, "data", what, force_cast)
    if arr.ndim == 0:
        raise TypeError(f"data: {what} are 0-d; produce returns rows (ndim >= 1)")
    if n is not None and len(arr) != n:
        raise TypeError(f"data: {what} number {len(arr)}; machine {machine} was asked for {n}")
    return np.ascontiguousarray(arr)


def batches(data, batch_size, rng=None):
    """One epoch of shuffled batches for ``data``: yields arrays of row indices, for ``batch=``.

    For a Data produced where it is used, each batch draws from every
    machine's part in proportion to its rows, so every machine's ranks get
    their share of each batch from the rows they hold.  Otherwise (an
    ordinary Data, an array, or a row count) the rows are simply shuffled.
    Every row is used once per epoch.

    Args:
        data: a Data, an array, or the number of rows.
        batch_size: rows per batch (the last batches may hold one row less).
        rng: a ``numpy.random.Generator`` (default: a fresh one).

    Raises:
        ValueError: ``batch_size`` is not an int >= 1.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batches: batch_size must be an int >= 1; got {batch_size!r}")
    rng = np.random.default_rng() if rng is None else rng
    if getattr(data, "placed", False):
        parts = data.parts
    else:
        n = data if isinstance(data, int) and not isinstance(data, bool) else len(data)
        parts = [(0, n)]
    return balanced_batches(parts, batch_size, rng)
