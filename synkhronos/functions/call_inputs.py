"""A call's arguments as the master checks them: inputs as Data, rows, slices, outputs.

Pure checks and conversions, each naming the function and the argument
at fault; ``Function.plan_call`` strings them together into a ``CallMsg``.
"""

import numbers

import numpy as np

from ..inputs import conditioning, rank_rows
from ..inputs.create import data as new_data
from ..inputs.data_object import Data, check_data


class Rows:
    """A NumPy input of a cluster call, as the row checks see it, until each machine is sent its rows."""

    minibatch = False

    def __init__(self, array):
        self.array = array
        self.ndim = array.ndim

    def __len__(self):
        return len(self.array)


def as_data(name, var, value, rt, scratch, key, placed_ok):
    """Return ``value`` as a Data for input ``var``, or raise naming what is wrong.

    A NumPy value is copied into ``scratch[key]``, a Data the Function keeps
    for this input (made, or grown, here).
    """
    what = f"input {var}"
    if isinstance(value, Data):
        check_data(value, rt, var.dtype, var.ndim, name, what, placed_ok=placed_ok)
        return value
    arr = input_array(name, var, value)
    kept = scratch.get(key)
    if kept is None or not kept.belongs_to(rt) or kept.placed:
        kept = scratch[key] = new_data(value=arr, var=var, oversize=1.5)
    else:
        kept.set_value(arr, oversize=1.5)
    return kept


def input_array(name, var, value):
    """A NumPy input ``value`` for ``var``, conditioned, or raise naming it."""
    if isinstance(value, np.ndarray) or np.isscalar(value) or isinstance(value, (list, tuple)):
        # A call has no force_cast (its keywords name inputs): say what casts instead.
        hint = (f"cast it first, value.astype({str(var.dtype)!r}), or pass "
                f"synk.data(value, var={var.name or '<the input variable>'}, force_cast=True)")
        return conditioning.condition(value, var.dtype, var.ndim, name, f"input {var}",
                                      hint=hint)
    raise TypeError(f"{name}: input {var} must be a synkhronos Data or a NumPy array; "
                    f"got {type(value).__name__}")


def check_lengths(name, inputs, scattered, sel):
    """Check every scattered input against the selection; return the rows selected."""
    if sel is None and len(scattered) == 1 and scattered[0].ndim:
        return len(scattered[0])
    if not scattered:
        if sel is not None:
            raise ValueError(f"{name}: batch needs at least one scattered input")
        return 0
    for d, var in zip(scattered, inputs):
        if d.ndim == 0:
            raise ValueError(f"{name}: input {var} is 0-d and cannot be scattered; "
                             "put it in bcast_inputs")
    full = [(d, v) for d, v in zip(scattered, inputs) if not (d.minibatch and sel is not None)]
    if sel is None:
        lengths = {len(d) for d in scattered}
        if len(lengths) > 1:
            desc = ", ".join(f"{v}: {len(d)}" for d, v in zip(scattered, inputs))
            raise ValueError(f"{name}: scattered inputs must have equal lengths; got {desc}")
        return lengths.pop()
    if full:
        length = min(len(d) for d, _ in full)
        need = rank_rows.rows_needed(sel, length)
        for d, v in full:
            if len(d) < need:
                raise ValueError(f"{name}: batch needs {need} rows but input {v} has {len(d)}")
        n_rows = rank_rows.selection_length(sel, length)
    else:
        if sel.kind == rank_rows.RANGE and sel.stop is None:
            raise ValueError(f"{name}: an open-ended batch slice needs a non-minibatch input")
        n_rows = rank_rows.selection_length(sel, 0)
    for d, v in zip(scattered, inputs):
        if d.minibatch and len(d) < n_rows:
            raise ValueError(f"{name}: minibatch input {v} has {len(d)} rows; "
                             f"batch selects {n_rows}")
    return n_rows


def common_length(scattered):
    """The rows of the scattered inputs a selection is resolved against."""
    full = [d for d in scattered if not d.minibatch]
    return min(len(d) for d in (full or scattered))


def check_num_slices(name, num_slices, spec):
    """Raise unless ``num_slices`` is an int >= 1 the function ``spec`` can run."""
    if not (isinstance(num_slices, numbers.Integral) and not isinstance(num_slices, bool)
            and num_slices >= 1):
        raise ValueError(f"{name}: num_slices must be an int >= 1; got {num_slices!r}")
    if num_slices > 1 and spec.collective:
        raise ValueError(f"{name}: num_slices > 1 cannot run a graph holding in-graph "
                         "collectives (ranks would meet them a different number of times); "
                         "use num_slices=1")
    if num_slices > 1 and None in spec.output_ops:
        raise ValueError(f"{name}: num_slices > 1 cannot combine the slices of an output "
                         "with op None; use 'gather' or a reduce op")


def check_batch_s(name, spec, batch_s, rank, n_parallel):
    """Return ``batch_s`` as one normalized selection per rank, checked against this rank's rows.

    Only the master's rows are known here; a worker with fewer rows raises in
    that worker (WorkerError) before computing.

    Raises:
        ValueError: no sliceable shared variables, or a malformed selection.
        IndexError: rows beyond the master's sliceable shared variables.
    """
    if not spec.sliceable:
        raise ValueError(f"{name}: batch_s needs sliceable_shareds in function()")
    sel_s = rank_rows.normalize_batch_s(batch_s, n_parallel)
    for s in spec.sliceable:
        value = s.get_value(borrow=True)
        if not np.ndim(value):
            continue
        n = len(value)
        need = rank_rows.rows_needed(rank_rows.resolve_selection(sel_s[rank], n), n)
        if need > n:
            raise IndexError(f"{name}: batch_s selects row {need - 1} but shared variable {s} "
                             f"has {n} rows in rank {rank}")
    return sel_s


def check_subset(name, n_outputs, output_subset):
    """Return ``output_subset`` as a list of distinct output indices, or raise."""
    items = output_subset.tolist() if isinstance(output_subset, np.ndarray) else output_subset
    if not isinstance(items, (list, tuple)) or (isinstance(output_subset, np.ndarray)
                                                and output_subset.ndim != 1):
        raise TypeError(f"{name}: output_subset must be a list of output indices; "
                        f"got {output_subset!r}")
    for i in items:
        # Not int(i): 0.7, "1" and True are no output indices.
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"{name}: output_subset must hold ints (output indices); "
                            f"got {i!r} in {output_subset!r}")
    subset = [int(i) for i in items]
    if any(not 0 <= i < n_outputs for i in subset) or len(set(subset)) != len(subset):
        raise ValueError(f"{name}: output_subset must list distinct "
                         f"indices in range({n_outputs}); got {output_subset!r}")
    return subset
