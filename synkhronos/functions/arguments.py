"""The arguments of synk.function() (variables, outputs with ops, updates with ops) and the
row checks of its calls."""

from pytensor.compile import SharedVariable
from pytensor.graph.basic import Variable

from ..comm import reduce_ops as reducers
from ..inputs import rank_rows as split


def var_list(value, what, shared=False):
    if value is None:
        return []
    if isinstance(value, Variable):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"function: {what} must be a variable or a list of variables; "
                        f"got {type(value).__name__}")
    for v in value:
        if not isinstance(v, Variable):
            raise TypeError(f"function: {what} must hold PyTensor variables; got {type(v).__name__}")
        if shared and not isinstance(v, SharedVariable):
            raise TypeError(f"function: {what} must hold shared variables; got {v}")
        if not shared and isinstance(v, SharedVariable):
            raise TypeError(f"function: {what} cannot hold shared variable {v}; "
                            "shared variables are implicit inputs")
    return list(value)


def _is_op_pair(x):
    return (isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], Variable)
            and (x[1] is None or isinstance(x[1], str)))


def _check_not_a_long_pair(x):
    """A tuple of a variable and strings is a malformed (variable, op) pair: say so."""
    if (isinstance(x, tuple) and len(x) != 2 and x and isinstance(x[0], Variable)
            and any(isinstance(e, str) for e in x[1:])):
        raise TypeError(f"function: an output with its op is a (variable, op) pair of 2 "
                        f"entries; got a {len(x)}-tuple {x!r}")


def parse_outputs(outputs):
    """Return (variables, ops, whether a list was given) from ``outputs`` as function() takes it."""
    if outputs is None:
        return [], [], True
    _check_not_a_long_pair(outputs)
    single = isinstance(outputs, Variable) or _is_op_pair(outputs)
    entries = [outputs] if single else outputs
    if not isinstance(entries, (list, tuple)):
        raise TypeError(f"function: outputs must be a variable, a (variable, op) pair or a "
                        f"list of them; got {type(outputs).__name__}")
    out_vars, out_ops = [], []
    for e in entries:
        _check_not_a_long_pair(e)
        if _is_op_pair(e):
            var, op = e
        elif isinstance(e, Variable):
            var, op = e, "avg"
        else:
            raise TypeError(f"function: each output must be a variable or a (variable, op) "
                            f"pair; got {e!r}")
        out_vars.append(var)
        out_ops.append(reducers.check_op(op, "function: output op", reducers.OUTPUT_OPS))
    return out_vars, out_ops, not single


def parse_updates(updates):
    if updates is None:
        return [], []
    if isinstance(updates, dict):
        updates = list(updates.items())
    if not isinstance(updates, (list, tuple)):
        raise TypeError("function: updates must be a list of (shared, update) pairs or "
                        f"(shared, update, op) triples; got {type(updates).__name__}")
    pairs, ops = [], []
    for u in updates:
        if not isinstance(u, (list, tuple)) or len(u) not in (2, 3):
            raise TypeError("function: each update must be a (shared, update) pair or a "
                            f"(shared, update, op) triple; got {u!r}")
        if not isinstance(u[0], SharedVariable):
            raise TypeError(f"function: an update must target a shared variable; got {u[0]!r}")
        op = u[2] if len(u) == 3 else "avg"
        ops.append(reducers.check_op(op, "function: update op"))
        pairs.append((u[0], u[1]))
    return pairs, ops


def check_lengths(name, inputs, scattered, sel):
    """Check every scattered input against the selection; return the rows selected."""
    if sel is None and len(scattered) == 1 and scattered[0]._ndim:
        return len(scattered[0]._data)
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
        need = split.rows_needed(sel, length)
        for d, v in full:
            if len(d) < need:
                raise ValueError(f"{name}: batch needs {need} rows but input {v} has {len(d)}")
        n_rows = split.selection_length(sel, length)
    else:
        if sel[0] == "range" and sel[2] is None:
            raise ValueError(f"{name}: an open-ended batch slice needs a non-minibatch input")
        n_rows = split.selection_length(sel, 0)
    for d, v in zip(scattered, inputs):
        if d.minibatch and len(d) < n_rows:
            raise ValueError(f"{name}: minibatch input {v} has {len(d)} rows; "
                             f"batch selects {n_rows}")
    return n_rows


def common_length(scattered):
    """The rows of the scattered inputs a selection is resolved against."""
    full = [d for d in scattered if not d.minibatch]
    return min(len(d) for d in (full or scattered))
