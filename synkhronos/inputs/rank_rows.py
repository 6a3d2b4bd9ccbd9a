"""Pure functions that turn lengths and selections into per-rank rows."""

import numbers
from typing import NamedTuple, Optional

import numpy as np


def split_ranges(n, n_parallel):
    """Split ``n`` rows as evenly as possible; return one (lo, hi) per rank.

    The first ``n % n_parallel`` ranks get one row more than the rest.
    """
    base, extra = divmod(int(n), n_parallel)
    out = []
    lo = 0
    for r in range(n_parallel):
        hi = lo + base + (1 if r < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def rank_range(n, n_parallel, rank):
    """Return rank ``rank``'s (lo, hi) of ``split_ranges(n, n_parallel)``."""
    base, extra = divmod(n, n_parallel)
    lo = rank * base + (rank if rank < extra else extra)
    return lo, lo + base + (1 if rank < extra else 0)


INDEX_MAX = np.iinfo(np.int64).max
RANGE, INDEX = "range", "index"   # a selection's ``kind``


class RowRange(NamedTuple):
    """The rows ``start:stop`` (a call's ``batch``, or a machine's share of it).

    ``stop`` None: to the inputs' end, until ``resolve_selection`` fixes it.
    """

    kind: str   # RANGE
    start: int
    stop: Optional[int]


class RowIndex(NamedTuple):
    """The rows listed in ``rows`` (int64), in the order the ranks take them."""

    kind: str   # INDEX
    rows: np.ndarray


# tuple.__new__: a named tuple's own constructor runs Python code, and calls make selections.
_new = tuple.__new__


def selection_from_wire(raw):
    """The selection a message carried as a plain tuple (``tuple(sel)``, the cheapest to pickle)."""
    return _new(RowRange if raw[0] == RANGE else RowIndex, raw)


def _is_int(x):
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def normalize_batch(batch, where="batch"):
    """Check a ``batch`` selection; return a ``RowRange`` or a ``RowIndex`` (int64 rows).

    An int ``k`` means rows ``[:k]``; a slice needs int (or None) start and
    stop and no step other than 1; a list or 1-d integer array lists rows.
    Lengths are checked later, against each input (``call_inputs.check_lengths``).
    """
    if _is_int(batch):
        if batch < 0:
            raise ValueError(f"{where}: an int batch must be >= 0; got {batch}")
        return _new(RowRange, (RANGE, 0, int(batch)))
    if isinstance(batch, slice):
        if batch.step not in (None, 1):
            raise ValueError(f"{where}: slice step must be None or 1; got {batch.step!r}")
        start = 0 if batch.start is None else batch.start
        stop = batch.stop
        if not _is_int(start) or not (stop is None or _is_int(stop)):
            raise TypeError(f"{where}: slice start and stop must be ints; got {batch!r}")
        if start < 0 or (stop is not None and stop < 0):
            raise ValueError(f"{where}: slice start and stop must be >= 0; got {batch!r}")
        if stop is not None and stop < start:
            raise ValueError(f"{where}: slice stop must be >= start; got {batch!r}")
        return _new(RowRange, (RANGE, int(start), None if stop is None else int(stop)))
    if isinstance(batch, (list, tuple, np.ndarray)):
        if not isinstance(batch, np.ndarray) and any(isinstance(b, (bool, np.bool_))
                                                     for b in batch):
            # NumPy would read [0, True] as the rows 0 and 1.
            raise TypeError(f"{where}: an index list must hold ints, not bools; got {batch!r}")
        try:
            arr = np.asarray(batch)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{where}: an index list must be 1-d integers; {exc}") from None
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise TypeError(f"{where}: an index list must be 1-d integers; got "
                            f"{'ndim %d ' % arr.ndim if arr.ndim != 1 else ''}dtype {arr.dtype}")
        if arr.size and arr.min() < 0:
            raise ValueError(f"{where}: indices must be >= 0; got {int(arr.min())}")
        if arr.dtype.kind == "u" and arr.size and arr.max() > INDEX_MAX:
            # Cast to int64 it would wrap around to a negative row.
            raise IndexError(f"{where}: index {int(arr.max())} is out of range "
                             f"(indices must be below 2**63)")
        return _new(RowIndex, (INDEX, np.ascontiguousarray(arr, dtype=np.int64)))
    raise TypeError(f"{where}: must be an int, a slice, a list or a 1-d int array; "
                    f"got {type(batch).__name__}")


def selection_length(sel, length):
    """Return how many rows ``sel`` picks from data of ``length`` rows."""
    if sel is None:
        return length
    if sel.kind == RANGE:
        stop = length if sel.stop is None else sel.stop
        return max(stop - sel.start, 0)
    return len(sel.rows)


def rows_needed(sel, length):
    """Return the data length ``sel`` requires (one past the highest row)."""
    if sel is None:
        return 0
    if sel.kind == RANGE:
        return length if sel.stop is None else sel.stop
    return int(sel.rows.max()) + 1 if len(sel.rows) else 0


def resolve_selection(sel, length):
    """Fix an open-ended range against ``length``; index selections pass through."""
    if sel is not None and sel.kind == RANGE and sel.stop is None:
        return _new(RowRange, (RANGE, sel.start, length))
    return sel


def take(array, sel, lo, hi, minibatch=False):
    """Return rows ``lo:hi`` of the selection ``sel`` of ``array``.

    A view for ranges (and for minibatch data, whose rows pair with positions
    in the selection), a gathered copy for index lists.
    """
    if sel is None or minibatch:
        return array[lo:hi]
    if sel.kind == RANGE:
        start = sel.start
        return array[start + lo:start + hi]
    return array[sel.rows[lo:hi]]


def normalize_batch_s(batch_s, n_parallel):
    """Check ``batch_s``: one selection for all ranks, or a list with one per rank.

    Returns a list of ``n_parallel`` normalized selections.
    """
    per_rank = (isinstance(batch_s, (list, tuple)) and len(batch_s) > 0
                and all(isinstance(b, (slice, list, tuple, np.ndarray)) for b in batch_s))
    if per_rank:
        if len(batch_s) != n_parallel:
            raise ValueError(f"batch_s: a list of selections needs one per rank "
                             f"({n_parallel}); got {len(batch_s)}")
        kinds = {type(b) if not isinstance(b, tuple) else list for b in batch_s}
        if len(kinds) > 1:
            raise TypeError("batch_s: the per-rank selections must all be of one type")
        return [_normalize_s(b, f"batch_s[{r}]") for r, b in enumerate(batch_s)]
    sel = _normalize_s(batch_s, "batch_s")
    return [sel] * n_parallel


def _normalize_s(b, where):
    if _is_int(b):
        raise TypeError(f"{where}: must be a slice, a list or a 1-d int array; got int")
    return normalize_batch(b, where)
