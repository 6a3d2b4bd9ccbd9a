"""Missing values: constant row selections moved onto the arrays they select, and what is refused.

PyMC observes a NumPy array with missing values (NaN, or a masked array) as
two variables: ``<name>_observed`` over the rows present and
``<name>_unobserved`` over the others, imputed.  The likelihood of the rows
present reads the covariates of every row through a constant mask,
``(a + b * x)[mask]``: its rows are the rows present, while ``x`` has one
entry for every row of the data set, so ``x`` cannot follow a rank's share of
them.  A selection along the rows commutes with elementwise arithmetic, so it
is moved onto the arrays it selects from, ``a + b * x[mask]`` (computed here
with NumPy): every array then has one row per observed row, and is split as
any other (``terms.lift_rows``).  A selection of an indexed vector,
``theta[group][mask]``, becomes one index, ``theta[group[mask]]``.  Where a
selection reads anything else along the rows (a free variable with one entry
per row), it is left as it is, and the terms' checks decide.  Covariates
with missing values are joined by PyMC from their observed and imputed cells;
the join is made a gather by rows (``_gathered``); the terms of the variable's
own cells are written over its rows in ``cells.py``.  Refused, naming the fix:
imputed values another term reads by position (a join of another form) and
discrete imputed values (NUTS takes no gradient of them).
"""

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Constant
from pytensor.tensor.elemwise import DimShuffle, Elemwise

from ... import compat


def fold(graph, joins=None):
    """``graph`` with each constant row selection of constant rows moved onto the arrays it
    selects from, and each join of observed and imputed values made a gather by rows;
    ``graph`` itself where there is none.  ``joins`` (a dict): the gathers already made
    for the model's other terms, reused (``switched``)."""
    indexing = compat.indexing_ops()
    moved = {}
    for var in compat.ancestors([graph]):
        node = var.owner
        gathered = _gathered(var, joins) if node is not None else None
        if gathered is not None:
            moved[var] = gathered
            continue
        if (node is None or not isinstance(node.op, indexing) or len(node.inputs) != 2
                or len(node.outputs) != 1):
            continue
        index = node.inputs[1]
        if not isinstance(index, Constant) or np.ndim(index.data) != 1:
            continue
        selected = _selected(node.inputs[0], np.asarray(index.data))
        if selected is not None and selected.type.dtype == var.type.dtype:
            moved[var] = selected
    return compat.clone_replace(graph, moved, strict=False) if moved else graph


def _selected(var, index):
    """``var[index]`` (rows of ``var`` selected by a constant mask or index vector) with the
    selection taken by the constants it reaches, or None where it reaches anything else."""
    if var.ndim < 1 or var.type.broadcastable[0]:
        return None
    if isinstance(var, Constant):
        data = np.asarray(var.data)
        if not _fits(index, len(data)):
            return None
        return pt.constant(data[index], name=var.name)
    node = var.owner
    if node is None or len(node.outputs) != 1:
        return None
    if isinstance(node.op, Elemwise):
        inputs = []
        for inp in node.inputs:
            # An input broadcast along the rows (a scalar parameter) is the same on every row.
            chosen = inp if inp.type.broadcastable[0] else _selected(inp, index)
            if chosen is None:
                return None
            inputs.append(chosen)
        return node.op(*inputs)
    if isinstance(node.op, DimShuffle) and node.op.new_order and node.op.new_order[0] == 0:
        # Axes moved or dropped behind the rows: X @ b is Squeeze(Dot(X, b[:, None])).
        rows = _selected(node.inputs[0], index)
        return None if rows is None else node.op(rows)
    if _row_product(node):
        # The rows of X @ B are X's rows.
        rows = _selected(node.inputs[0], index)
        return None if rows is None else node.op(rows, node.inputs[1])
    if (isinstance(node.op, compat.indexing_ops()) and len(node.inputs) == 2
            and isinstance(node.inputs[1], Constant) and np.ndim(node.inputs[1].data) == 1
            and np.asarray(node.inputs[1].data).dtype.kind in "iu"):
        # theta[group][mask] reads theta at group[mask].
        inner = np.asarray(node.inputs[1].data)
        if not _fits(index, len(inner)):
            return None
        return node.inputs[0][pt.constant(inner[index])]
    return None


def _gathered(var, joins=None):
    """PyMC's join of a variable's observed and imputed values, as a gather by rows, or None.

    PyMC joins them by setting an empty array's cells through constant masks,
    the imputed values at the missing cells, the observed at the others, each
    flattened in the masks' order.  As ``switch(missing, imputed[at], observed)``,
    with ``missing``, ``at`` (each cell's place among its values, ``places``) and
    ``observed`` (the observed values at their cells) constant arrays of the
    variable's shape, every array has the variable's rows, and the imputed
    values are read through an index, as a group's effects are.
    """
    layers, v = [], var
    while v.owner is not None and is_set(v.owner.op):
        node = v.owner
        if len(node.inputs) != 3 or not isinstance(node.inputs[2], Constant):
            return None
        mask = np.asarray(node.inputs[2].data)
        if mask.dtype != bool or mask.shape != tuple(layers[0][0].shape if layers else mask.shape):
            return None
        if node.inputs[1].ndim != 1 or var.ndim != mask.ndim:
            return None
        layers.append((mask, node.inputs[1]))
        v = node.inputs[0]
    if (not layers or v.owner is None or type(v.owner.op).__name__ != "AllocEmpty"
            or not np.logical_or.reduce([m for m, _ in layers]).all()):
        return None
    if len(layers) == 2 and (layers[0][0] == ~layers[1][0]).all():
        (mask, present), (_, imputed) = layers[::-1] if isinstance(layers[1][1], Constant) else layers
        if isinstance(present, Constant) and not isinstance(imputed, Constant):
            data = np.asarray(present.data)
            out = None if len(data) != mask.sum() else switched(mask, data, imputed, joins)
            return out if out is not None and out.type.dtype == var.type.dtype else None
    out = None
    for mask, values in reversed(layers):   # the innermost set first: a later one wins
        if isinstance(values, Constant):
            data = np.asarray(values.data)
            if len(data) != mask.sum():
                return None
            filled = np.zeros(mask.shape, dtype=var.dtype)
            filled[mask] = data
            cells = pt.constant(filled)
        else:
            cells = values[pt.constant(places(mask))]
        out = cells if out is None else pt.switch(pt.constant(mask), cells, out)
    return out if out.type.dtype == var.type.dtype else None


def switched(mask, present, imputed, joins=None):
    """``switch(mask, present placed at its cells, imputed[places(~mask)])``: a variable's
    observed values (``present``, the cells of ``mask``) and imputed values, joined.

    ``joins`` (a dict) holds the joins already made: the term of the variable's own cells
    (``cells.joined``) and a likelihood reading it then read the same arrays, which a rank
    gathers once, and whose gradients it adds before one increment of the imputed values.
    """
    key = (imputed, mask.shape, mask.tobytes(), present.tobytes())
    if joins is not None and key in joins:
        return joins[key]
    filled = np.zeros(mask.shape + present.shape[1:], dtype=present.dtype)
    filled[mask] = present
    out = pt.switch(pt.constant(mask), pt.constant(filled), imputed[pt.constant(places(~mask))])
    if joins is not None:
        joins[key] = out
    return out


def places(mask):
    """Each cell's place among the cells ``mask`` selects, in the mask's order (0 elsewhere).

    Why a gather over every cell: ``set(x[mask], values[places[mask]])`` reads only the
    mask's cells, but a rank's mask is an input, and Numba sets through a mask that is not
    a constant slowly (one-off, 10^5 x 2 cells, a regression's log-density and gradient:
    1960 us against 878 gathered and switched).
    """
    at = np.cumsum(mask.ravel()).reshape(mask.shape) - 1
    at[~mask] = 0
    return at


def is_set(op):
    """Whether ``op`` sets (not increments) the cells an index array selects."""
    from pytensor.tensor.subtensor import AdvancedIncSubtensor
    return isinstance(op, AdvancedIncSubtensor) and op.set_instead_of_inc


def _row_product(node):
    """Whether ``node`` is a matrix product of two matrices (``Dot``, or PyTensor's unbatched
    ``Matmul``), whose rows are its first input's."""
    name = type(getattr(node.op, "core_op", node.op)).__name__
    return (name == "Dot" and len(node.inputs) == 2
            and all(i.ndim == 2 for i in node.inputs) and node.outputs[0].ndim == 2)


def _fits(index, rows):
    """Whether ``index`` (a mask or an index vector) selects among ``rows`` rows."""
    if index.dtype == bool:
        return len(index) == rows
    return index.dtype.kind in "iu" and (not index.size or -rows <= index.min() <= index.max() < rows)


def imputed(model):
    """{the imputed values' free variable: the name of the variable they complete}: PyMC
    names them ``<name>_unobserved`` beside the observed ``<name>_observed``."""
    tail = "_unobserved"
    return {rv: rv.name[:-len(tail)] for rv in model.free_RVs
            if rv.name.endswith(tail) and rv.name[:-len(tail)] + "_observed" in model.named_vars}


def flattened(model):
    """Names of the observed parts of imputed variables of more than one axis: their values
    are the observed cells, flattened, not rows."""
    return {name + "_observed" for rv, name in imputed(model).items()
            if name in model.named_vars and model.named_vars[name].ndim > 1}


def refuse_discrete_imputed(model, discrete):
    """Refuse missing values that PyMC imputes as discrete free variables (among ``discrete``,
    names of value variables), naming the fix."""
    names = [name for rv, name in imputed(model).items()
             if model.rvs_to_values[rv].name in discrete]
    if names:
        raise ValueError(
            f"data_parallel: {names} have missing values, which PyMC imputes as discrete "
            f"free variables ({[n + '_unobserved' for n in names]}), and NUTS (what dp.sample "
            "drives) needs the gradient of every free variable. Leave the rows with missing "
            "values out of the model (y[present] and the same rows of every covariate): they "
            "say nothing about the other variables")


def refuse_imputed_reads(model, plan):
    """Refuse a split term that reads another variable's imputed values (covariates with
    missing values): a rank's rows would need their own of them, laid out by the mask."""
    values = {model.rvs_to_values[rv]: name for rv, name in imputed(model).items()}
    for term in plan.split_terms:
        positional = read_by_position(term.graph)   # through a gather: as a group's effects
        read = [name for v, name in values.items()
                if v in positional and term.name != f"{name}_observed"]
        if read:
            raise ValueError(
                f"data_parallel: the log-density term of {term.name!r} reads {read[0]!r}, whose "
                f"missing values PyMC imputes ({read[0]}_unobserved, laid out by its mask, "
                "not by rows): a rank's share of the rows cannot pick its own of them. Give "
                f"{read[0]!r} without missing values (imputed before building the model, or "
                "the rows with missing values left out), or sample this model with pm.sample")


def read_by_position(graph):
    """The variables ``graph`` reads other than through an index: ``theta[school]`` reads
    ``school``, not ``theta`` (a rank picks its rows' entries by the index it holds)."""
    indexing = compat.indexing_ops()
    seen, todo = set(), [graph]
    while todo:
        var = todo.pop()
        if var in seen:
            continue
        seen.add(var)
        node = var.owner
        if node is None:
            continue
        inputs = node.inputs
        if isinstance(node.op, indexing):
            inputs = inputs[1:]
        todo.extend(inputs)
    return seen
