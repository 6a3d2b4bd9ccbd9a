"""The graphs each rank runs: a PyMC log-density on its rows, batched over many positions.

On a rank with ``m`` of the ``N`` rows, the graph is

    sum(split terms on the rank's rows) + (m / N) * (whole terms)

so that the sum over ranks is the model's log-density exactly, for any
split: the whole terms (priors, potentials on unsplit data) count once in
total, and a term PyMC scales by ``total_size / rows`` (where "rows" is the
rank's ``m``) is multiplied by ``m / N`` as well, which makes its scale
``total_size / N``, the model's.  Several positions (one per chain) are
evaluated in one call, by either of two graphs: the graph vectorised over a
matrix of positions, or a loop (a Scan) running the one-position graph at
each row of that matrix.  The loop costs what PyMC's own graph costs per
position; vectorising can cost more or less, by model (``DataParallelModel``
measures both).
"""

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile import SharedVariable
from pytensor.graph.basic import Constant
from pytensor.graph.replace import vectorize_graph

from ... import compat
from . import branches, terms


def row_inputs(containers):
    """One symbolic input per split container: its rows on a rank (any number)."""
    return [pt.tensor(dtype=c.dtype, shape=(None,) + tuple(c.type.shape[1:]), name=c.name)
            for c in containers]


def row_dims(model, containers, rows):
    """The lengths of the dims named for the split rows: ``rows`` on a rank.

    A container's own dims, or a lifted observed array's variable's (``observed=y,
    dims="obs"``); the length is a shared variable, or a constant equal to the rows.
    """
    out = {}
    for c in containers:
        dims = model.named_vars_to_dims.get(getattr(c, "dims_of", c.name)) or ()
        if dims and dims[0] is not None:
            length = model.dim_lengths.get(dims[0])
            if isinstance(length, SharedVariable) or (
                    isinstance(length, Constant) and int(length.data) == len(c.get_value(borrow=True))):
                out[length] = rows.astype(length.dtype)
    return out


MAX_COLUMNS = 8
"""The most columns a rows-by-columns matrix times a parameter vector is written out for
(``unrolled_products``); wider ones (covtype's 55) stay one BLAS call."""


def unrolled_products(expr, inputs):
    """``expr`` with each product of a matrix over the rows and a vector of at most
    ``MAX_COLUMNS`` parameters (``X @ b``, ``pm.math.dot(X, b)``) written as the sum of its
    columns (``X[:, 0] * b[0] + ...``): elementwise, so it fuses into the loop over the rows
    with the rest of the term, and so does its gradient, where a product is a BLAS call
    and its gradient a transposed one, each a pass of its own.  At 50,000 rows a Normal
    regression's (logp, dlogp) in Numba on PyTensor 2 with ``rowsums``: 274 -> 47 us with 2
    columns, 710 -> 111 with 5; on PyTensor 3 79 -> 78 with 2 (one-off, bench/HISTORY.md,
    2026-12-07)."""
    rows = set(inputs)

    def written_out(node, new):
        core = getattr(node.op, "core_op", node.op)
        if type(core).__name__ not in ("Dot", "Matmul") or len(new) != 2:
            return None
        m, w = new
        k = w.type.shape[0] if w.ndim == 2 and w.type.shape[1:] == (1,) else None
        if (m.ndim != 2 or k is None or not 0 < k <= MAX_COLUMNS
                or not set(compat.ancestors([m])) & rows or set(compat.ancestors([w])) & rows):
            return None
        total = pt.add(*[m[:, j] * w[j, 0] for j in range(k)]) if k > 1 else m[:, 0] * w[0, 0]
        out = node.outputs[0]
        return [total[:, None].astype(out.dtype)]
    return compat.rebuilt(expr, {}, override=written_out)


def rank_terms(model, plan, inputs, whole_copies, n_total, by_class=True, sort=False):
    """Return ``(split_exprs, whole_expr, frac)`` in the model's value variables.

    Args:
        inputs: ``row_inputs(plan.split)``.
        whole_copies: {container: variable} for the containers used whole.
        n_total: a float64 scalar variable, the rows of the whole data set.
        by_class: whether a term whose switches read only rows runs each group of rows on
            the branches it takes (``branches.by_class``); the master must hold the rows.
        sort: whether, where every split array is a ``Lifted`` one, the first such term
            may have the rows put in its groups' order, each group then a slice
            (``branches.by_sorted_class``; every ``Lifted`` is ``put_in_order``).
    """
    rows = inputs[0].shape[0]
    frac = rows.astype("float64") / n_total
    replace = {terms.graph_var(c): inp for c, inp in zip(plan.split, inputs)}
    for size in plan.row_sizes:   # [n_rows, ...] -> [rows, ...]
        here = rows.astype(size.dtype)[None]
        replace[size] = pt.concatenate([here, size[1:]]) if len(size.data) > 1 else here
    if plan.row_params:           # a per-row parameter: the rank's rows' entries
        ids = replace[terms.graph_var(plan.row_ids)]
        replace.update({v: v[ids] for v in plan.row_params})
    replace.update(row_dims(model, plan.split, rows))
    replace.update(whole_copies)
    # A lifted array's constant has its rows in its static shape: the nodes above it are
    # rebuilt for the rank's rows (containers' shapes already say "any number").
    strict = not any(isinstance(c, terms.Lifted) for c in plan.split)
    arrays = [c.get_value(borrow=True) for c in plan.split] if by_class else None
    changeable = [not isinstance(c, terms.Lifted) for c in plan.split]
    sort = sort and by_class and all(isinstance(c, terms.Lifted) for c in plan.split)
    split_exprs = []
    for term in plan.split_terms:
        expr = unrolled_products(compat.clone_replace(term.graph, replace=replace, strict=strict),
                                 inputs)
        order = None
        if sort:
            expr, order = branches.by_sorted_class(expr, inputs, arrays)
        if order is None:
            expr = branches.by_class(expr, inputs, arrays, changeable)
        else:   # the rows in this term's groups' order; the terms after pick theirs
            sort = False
            for c in plan.split:
                c.put_in_order(order)
        split_exprs.append(expr * frac if term.scaled else expr)
    whole = [t.graph for t in plan.whole_terms]
    whole_expr = (compat.clone_replace(pt.add(*whole) if len(whole) > 1 else whole[0],
                                         replace=dict(whole_copies))
                  if whole else None)
    return split_exprs, whole_expr, frac


def rank_logp(split_exprs, whole_expr, frac, dtype):
    """The rank's share of the log-density (a scalar)."""
    parts = list(split_exprs)
    if whole_expr is not None:
        parts.append(whole_expr * frac)
    total = pt.add(*parts) if len(parts) > 1 else parts[0]
    return total.astype(dtype) if total.dtype != dtype else total


def joined(logp, value_vars, shapes, position, pregrad=None):
    """``[logp, *gradient]`` at one position (a vector of ``size``): one vector of size + 1.

    The graph PyMC's own (logp, dlogp) function runs (``ravel_inputs=True``),
    on the rank's rows: no batch axis, so each row costs what it costs
    PyMC.  Vectorised graphs can cost several times more per row (the
    gradient of an indexing such as ``a[county]`` becomes an increment of
    a (groups, k) matrix row by row), so a lone position takes this graph.
    """
    cost = pregrad(logp) if pregrad is not None else logp
    grads = pytensor.grad(cost, value_vars, disconnected_inputs="ignore")
    replace, lo = {}, 0
    for v, shape in zip(value_vars, shapes):
        size = int(np.prod(shape, dtype=int))
        part = position[lo:lo + size].reshape(shape)
        replace[v] = part.astype(v.dtype) if part.dtype != v.dtype else part
        lo += size
    out = compat.private_inner_graphs(compat.clone_replace([logp, *grads], replace=replace))
    parts = [out[0].astype(position.dtype)[None]]
    parts += [g.reshape((-1,)).astype(position.dtype) for g in out[1:]]
    return without_shape_checks(pt.concatenate(parts) if len(parts) > 1 else parts[0])


def scanned(one, position, positions, mode=None):
    """``one`` (``joined``'s graph at ``position``) at every row of ``positions``: (k, size + 1).

    A loop in the graph (a Scan) over the rows, each step the one-position
    graph: k evaluations in one call, each costing what one costs (what
    depends on the data only is computed once, outside the loop).  Vectorised
    graphs can cost several times more per position (``joined``).

    Args:
        mode: the PyTensor mode of the loop's body, the one the function compiles in
            (else the body compiles in PyTensor's default and keeps PyMC's
            parameter checks as errors instead of -inf).
    """
    out = compat.scan(lambda q: compat.clone_replace(one, replace={position: q}), [positions],
                      mode=mode)
    return without_shape_checks(out)


# The outputs of the rank's three functions, each made at its first call in each process
# (functions/deferred.Lazy) from the rank's log-density ``logp`` of ``value_vars``.
def at_one(logp, value_vars, shapes, position, pregrad=None):
    """[``joined``'s graph]: (logp, gradient) at ``position``."""
    return [joined(logp, value_vars, shapes, position, pregrad=pregrad)]


def many(logp, value_vars, shapes, positions, pregrad=None):
    """[(logp, gradient) at every row of ``positions``]: ``batched``'s two joined, (k, size + 1)."""
    logps, grads = batched(logp, value_vars, shapes, positions, pregrad=pregrad)
    return [pt.concatenate([logps[:, None].astype(grads.dtype), grads], axis=1)]


def looped(logp, value_vars, shapes, position, positions, pregrad=None, mode=None):
    """[``scanned``'s graph of ``joined``'s at ``position``]: a loop over ``positions``."""
    one = joined(logp, value_vars, shapes, position, pregrad=pregrad)
    return [scanned(one, position, positions, mode=mode)]


def without_shape_checks(graph):
    """``graph`` (a variable or a list) without its ``SpecifyShape`` nodes (shape assertions).

    PyTensor's Numba backend leaves out the check of a dimension given as
    ``None`` by comparing it with the ``NoneConst`` object itself; in a graph
    unpickled in a rank (``synk.distribute``) ``None`` is another object, so
    the generated check fails to compile there (a vectorised radon model:
    "Unknown attribute 'item' of type none", on a cold Numba cache).
    """
    from pytensor.graph.replace import graph_replace
    from pytensor.tensor.shape import SpecifyShape


    checks = {v: v.owner.inputs[0]
              for v in compat.ancestors(graph if isinstance(graph, list) else [graph])
              if v.owner is not None and isinstance(v.owner.op, SpecifyShape)}
    if not checks:
        return graph
    return graph_replace(graph, checks, strict=False)


def batched(logp, value_vars, shapes, positions, pregrad=None):
    """Vectorise ``logp`` and its gradient over the rows of ``positions`` (k x size).

    Returns:
        ``(logps, grads)``: shape (k,) and (k, size), the gradient flat in the
        order of ``value_vars`` as ``model.compile_dlogp()`` gives it.
    """
    cost = pregrad(logp) if pregrad is not None else logp
    grads = pytensor.grad(cost, value_vars, disconnected_inputs="ignore")
    k = positions.shape[0]
    replace, lo = {}, 0
    for v, shape in zip(value_vars, shapes):
        size = int(np.prod(shape, dtype=int))
        part = positions[:, lo:lo + size].reshape((k, *shape))
        replace[v] = part.astype(v.dtype) if part.dtype != v.dtype else part
        lo += size
    out = _join_in_batches(compat.private_inner_graphs(vectorize_graph([logp, *grads],
                                                                       replace=replace)))
    logps, bgrads = out[0], out[1:]
    flat = [g.reshape((k, -1)) for g in bgrads]
    grad = pt.concatenate(flat, axis=1) if len(flat) > 1 else flat[0]
    if grad.dtype != positions.dtype:
        grad = grad.astype(positions.dtype)
    logps, grad = without_shape_checks([logps, grad])
    return logps, grad


def _join_in_batches(outputs):
    """Replace ``Blockwise(Join)`` and ``Blockwise(Split)`` (PyTensor's fallbacks when
    vectorising a join and its gradient) by a join or split along the shifted axis.

    A Blockwise node keeps a local function in its tag once compiled, which
    ``synk.distribute()`` cannot pickle; time-series likelihoods such as
    GaussianRandomWalk's have a join.  Other Blockwise fallbacks stay (and
    distribute() says it cannot pickle them).
    """
    from pytensor.graph.replace import graph_replace
    from pytensor.tensor.basic import Join, Split
    from pytensor.tensor.blockwise import Blockwise

    def one(outputs):
        """The replacements for one Blockwise Join or Split node, or None."""
        in_graph = set(compat.ancestors(outputs))
        for var in in_graph:
            node = var.owner
            if node is None or not isinstance(node.op, Blockwise):
                continue
            core, nb = node.op.core_op, node.op.batch_ndim(node)
            if not isinstance(core, (Join, Split)):
                continue
            core_axis, operands = compat.axis_and_operands(core, node.inputs)
            if core_axis is None:
                continue
            x_axis = core_axis + nb if core_axis >= 0 else core_axis
            if isinstance(core, Join):
                out = node.outputs[0]
                # The batch shape from the parts (1 broadcasts), never from out: no cycle.
                batch = tuple(pt.max(pt.stack([p.shape[i] for p in operands])) for i in range(nb))
                parts = [pt.broadcast_to(p, (*batch, *(p.shape[i] for i in range(nb, p.ndim))))
                         for p in operands]
                return {out: pt.join(x_axis, *parts)}
            x, sizes = operands
            sizes = sizes[(0,) * (sizes.ndim - 1)] if sizes.ndim > 1 else sizes
            pieces = pt.split(x, sizes, n_splits=core.len_splits, axis=x_axis)
            pieces = pieces if isinstance(pieces, list) else [pieces]
            return {o: p for o, p in zip(node.outputs, pieces) if o in in_graph}
        return None

    for _ in range(100):
        replace = one(outputs)
        if not replace:
            break
        outputs = graph_replace(outputs, replace, strict=False)
    return outputs
