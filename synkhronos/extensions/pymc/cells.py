"""An imputed variable's own terms written over its cells, so that they split by its rows.

PyMC observes a NumPy array with missing values as two variables:
``<name>_observed``, the cells present, and ``<name>_unobserved``, the
missing cells, a free variable it imputes.  Each has a term of its own, over
its cells flattened in the mask's order, and neither has the data's rows: the
observed cells' term stayed whole on every rank, and the imputed values' prior
with it, computed again with every chunk of a call.

- ``joined``: the two terms as one, where they are the same distribution on
  different cells (PyMC builds both from one variable): the log-density over
  every cell of the variable, each array the observed term reads placed at the
  cells present and the imputed term's at the missing cells, the imputed values
  gathered into their cells.  Every array then has the variable's shape, its
  rows are the data's, and nothing is computed twice.
- ``spread``: the observed cells' term alone, where the two differ (an imputed
  variable with a transform has a Jacobian the observed cells do not):
  ``sum(switch(mask, logp, 0))`` over the variable's shape, each missing cell a
  copy of an observed cell so that the masked values stay finite.
"""

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Constant
from pytensor.raise_op import CheckAndRaise
from pytensor.tensor.basic import Alloc, MakeVector, ScalarFromTensor
from pytensor.tensor.elemwise import Elemwise
from pytensor.tensor.math import All, Any, Max, Min, Sum

from ... import compat
from . import selections


def mask_of(model, rv, name):
    """The mask of the cells ``rv`` (``<name>_observed`` or ``<name>_unobserved``) holds, in
    the shape of variable ``name``, read from PyMC's join of the two; or None."""
    v = model.named_vars.get(name)
    while v is not None and v.owner is not None:
        node = v.owner
        if selections.is_set(node.op) and len(node.inputs) == 3 and isinstance(node.inputs[2], Constant):
            if node.inputs[1] is rv:
                mask = np.asarray(node.inputs[2].data)
                return mask if mask.dtype == bool and mask.ndim >= 1 else None
            v = node.inputs[0]
        elif type(node.op).__name__ == "ViewOp":
            v = node.inputs[0]
        else:
            return None
    return None


def own_term(model, rv, graph, imputed, joins):
    """``(name, graph, rows, imputed variable)`` of observed variable ``rv``'s term (``graph``,
    its folded logp): where ``rv`` holds the cells present of a variable with missing values
    (``imputed``: {name: its imputed values' variable}), that variable's two terms as one
    (``joined``, its name and rows), else its observed cells by rows (``spread``) or as they
    were (``rv``'s name, no rows, no imputed variable)."""
    name = rv.name[:-len("_observed")] if rv.name.endswith("_observed") else None
    missing = imputed.get(name)
    mask = mask_of(model, rv, name) if missing is not None else None
    if mask is None:
        return rv.name, graph, 0, None
    both = joined(graph, selections.fold(model.logp(vars=[missing], sum=True), joins), mask,
                  model.rvs_to_values[missing], joins)
    if both is not None:
        return name, both, len(mask), missing
    by_rows = spread(graph, mask)
    return rv.name, graph if by_rows is None else by_rows, 0, None


def _body(term):
    """The vector a term sums (PyMC's ``sum(logp)``), or None."""
    node = term.owner
    if node is None or not isinstance(node.op, Sum) or node.inputs[0].ndim != 1:
        return None
    return node.inputs[0]


class _NotCellwise(Exception):
    """A term reads its cells otherwise than elementwise: it is left as it is."""


def _unbroadcast(node, var):
    """PyMC's logp broadcast to the value's own shape (``Alloc(logp, [cells])``): the logp."""
    return (isinstance(node.op, Alloc) and var.ndim == 1 and node.inputs[0].ndim == 1
            and not node.inputs[0].type.broadcastable[0])


def _reduced(op, var):
    """Whether ``var`` is an all, any, max or min of every cell (a parameter's check)."""
    return isinstance(op, (All, Any, Max, Min)) and var.ndim == 0


def by_coordinates(op, x, indices, shape):
    """``x[indices]`` where each index array is every cell's own coordinate along an axis of
    a variable of ``shape`` (PyMC reads a parameter a column through each cell's column):
    ``x``'s entries broadcast over the other axes; None where the indices are otherwise.

    The same values, without a read per cell, and the gradient a sum over rows instead of
    an increment per cell (one-off, 2 x 10^5 cells in Numba: a Normal's log-density and
    its gradient 537 us broadcast, 1530 us indexed).
    """
    if len(indices) != x.ndim or any(isinstance(e, slice) for e in getattr(op, "idx_list", ())):
        return None
    basic, axes = [], []
    for index in indices:
        if getattr(index.type, "dtype", "")[:3] not in ("int", "uin"):
            return None
        if index.ndim == 0:
            basic.append(index)
            continue
        if not isinstance(index, Constant) or np.shape(index.data) != shape:
            return None
        data = np.asarray(index.data)
        axis = next((a for a in range(len(shape)) if np.array_equal(
            data, np.broadcast_to(np.arange(shape[a]).reshape(
                [-1 if b == a else 1 for b in range(len(shape))]), shape))), None)
        if axis is None or (axes and axis <= axes[-1]):
            return None
        basic.append(slice(0, shape[axis]))
        axes.append(axis)
    if not axes:
        return None
    order = ["x"] * len(shape)
    for k, axis in enumerate(axes):
        order[axis] = k
    return x[tuple(basic)].dimshuffle(order)


def joined(observed, unobserved, mask, value, joins=None):
    """The observed cells' term plus the imputed values' term, as one sum over the variable's
    cells (``mask``: the cells present, in the variable's shape; ``value``: the imputed
    values' value variable); None where the two are not one graph on different cells.
    ``joins``: as ``selections.fold``'s, shared with the terms that read the variable."""
    body_in, body_out = _body(observed), _body(unobserved)
    if body_in is None or body_out is None or mask.all() or not mask.any():
        return None
    try:
        body = _Join(mask, value, joins).zip(body_in, body_out)
    except _NotCellwise:
        return None
    if body.ndim != mask.ndim or body.type.dtype != observed.type.dtype:
        return None
    return pt.sum(body)


class _Join:
    """Two graphs alike but for their cells' arrays, zipped into one over the variable's
    cells (``joined``)."""

    def __init__(self, mask, value, joins):
        self.mask, self.value, self.joins, self.done = mask, value, joins, {}
        self.n_in, self.n_out = int(mask.sum()), int((~mask).sum())

    def zip(self, a, b):
        key = (a, b)
        if key not in self.done:
            self.done[key] = self._zip(a, b)
        return self.done[key]

    def _zip(self, a, b):
        if a is b:   # read alike by both: no cell's own
            return a
        if isinstance(a, Constant) and isinstance(b, Constant):
            return self._constants(a, b)
        if b is self.value and isinstance(a, Constant):
            present = self._fitted(np.asarray(a.data))
            return selections.switched(self.mask, present, self.value, self.joins)
        node_a, node_b = a.owner, b.owner
        if (node_a is None or node_b is None or node_a.op != node_b.op
                or len(node_a.inputs) != len(node_b.inputs)
                or node_a.outputs.index(a) != node_b.outputs.index(b)):
            raise _NotCellwise
        if _unbroadcast(node_a, a):
            return self.zip(node_a.inputs[0], node_b.inputs[0])
        if _reduced(node_a.op, a):
            return type(node_a.op)(axis=None)(self.zip(node_a.inputs[0], node_b.inputs[0]))
        inputs = [self.zip(x, y) for x, y in zip(node_a.inputs, node_b.inputs)]
        if all(x is y for x, y in zip(inputs, node_a.inputs)):
            return a
        if isinstance(node_a.op, compat.indexing_ops()):
            broadcast = by_coordinates(node_a.op, inputs[0], inputs[1:], self.mask.shape)
            if broadcast is not None:
                return broadcast
        try:
            return node_a.op.make_node(*inputs).outputs[node_a.outputs.index(a)]
        except (TypeError, ValueError, NotImplementedError) as e:
            raise _NotCellwise from e

    def _constants(self, a, b):
        da, db = np.asarray(a.data), np.asarray(b.data)
        if da.ndim and db.ndim and len(da) == self.n_in and len(db) == self.n_out:
            return pt.constant(self._placed(da, db), name=a.name)
        if da.shape == db.shape and da.dtype == db.dtype and np.array_equal(da, db, equal_nan=True):
            return a
        raise _NotCellwise

    def _fitted(self, present):
        """``present``, an array over the cells present, or ``_NotCellwise``."""
        if len(present) != self.n_in or (present.ndim > 1 and self.mask.ndim > 1):
            raise _NotCellwise
        return present

    def _placed(self, present, missing):
        """An array of the variable's shape: ``present`` at the cells present, ``missing`` at
        the others."""
        self._fitted(present)
        if missing.shape[1:] != present.shape[1:] or missing.dtype != present.dtype:
            raise _NotCellwise
        out = np.empty(self.mask.shape + present.shape[1:], dtype=present.dtype)
        out[self.mask] = present
        out[~self.mask] = missing
        return out


def spread(graph, mask):
    """``graph``, a term summing a log-density over an imputed variable's observed cells, as
    the same sum read by the variable's rows; None where it reads the cells otherwise than
    elementwise.

    PyMC observes the cells present of a variable with missing values and more
    than one axis as one flattened vector, so the term's arrays (the values,
    each cell's column as an index) are not the data's rows and it stayed whole
    on every rank.  Each such array becomes one of the variable's shape: its
    observed cells in place, each missing cell a copy of the first observed
    cell of its column (so every value stays in the distribution's support and
    every parameter it reads is one the observed cells read), and the sum reads
    the observed cells only, ``sum(switch(mask, logp, 0))``.  Every array then
    has the data's rows and is split as any other (``terms.lift_rows``).
    """
    body = _body(graph)
    if body is None or mask.ndim < 2 or not mask.any():
        return None
    cells = int(mask.sum())
    flat = mask.reshape(len(mask), -1)
    column = np.nonzero(flat)[1]
    source = np.empty(flat.shape, dtype=np.int64)
    source[flat] = np.arange(cells)
    for j in range(flat.shape[1]):
        present = np.flatnonzero(column == j)
        if not len(present):
            return None   # a column with no observed cell: nothing to copy into it
        source[~flat[:, j], j] = present[0]
    source = source.reshape(mask.shape)
    try:
        body = _Cells(cells, source).grid(body)
    except _NotCellwise:
        return None
    return pt.sum(pt.switch(pt.constant(mask), body, np.zeros((), dtype=body.dtype)))


class _Cells:
    """Variables over the observed cells rebuilt over the variable's shape (``spread``)."""

    def __init__(self, cells, source):
        self.cells, self.source, self.done, self.reads = cells, source, {}, {}

    def reads_cells(self, var):
        """Whether ``var`` reads an array over the cells (a constant of their length)."""
        known = self.reads.get(var)
        if known is None:
            if isinstance(var, Constant):
                known = np.ndim(var.data) == 1 and len(var.data) == self.cells
            else:
                known = var.owner is not None and any(map(self.reads_cells, var.owner.inputs))
            self.reads[var] = known
        return known

    def grid(self, var):
        if var in self.done:
            return self.done[var]
        out = self._grid(var) if self.reads_cells(var) else var
        self.done[var] = out
        return out

    def _grid(self, var):
        if isinstance(var, Constant):
            if np.ndim(var.data) != 1:
                raise _NotCellwise
            return pt.constant(np.asarray(var.data)[self.source], name=var.name)
        node = var.owner
        if node is None or len(node.outputs) != 1:
            raise _NotCellwise
        op, inputs = node.op, node.inputs
        if isinstance(op, Elemwise):
            return op(*[self.grid(i) for i in inputs])
        if isinstance(op, compat.indexing_ops()):
            # theta[0, column]: the parameters read through each cell's column.
            if self.reads_cells(inputs[0]) or not all(i.ndim <= 1 for i in inputs[1:]):
                raise _NotCellwise
            indices = [self.grid(i) for i in inputs[1:]]
            broadcast = by_coordinates(op, inputs[0], indices, self.source.shape)
            return inputs[0][tuple(indices)] if broadcast is None else broadcast
        if _unbroadcast(node, var):
            return self.grid(inputs[0])
        if isinstance(op, CheckAndRaise):
            return op(self.grid(inputs[0]), *[self.grid(i) for i in inputs[1:]])
        if _reduced(op, var):
            # A missing cell repeats an observed one: the same all, any, max or min.
            return type(op)(axis=None)(self.grid(inputs[0]))
        if isinstance(op, (MakeVector, ScalarFromTensor)):
            return op(*[self.grid(i) for i in inputs])
        raise _NotCellwise
