"""One flat gradient vector for a whole model: its size, (un)flattening, writing and reading it.

The gradient half of every update rule (``updates``): one all-reduce of one
long vector is much faster than one per parameter.
"""

import math

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile import SharedVariable

__all__ = ["make_flat_grad", "flatten", "unflatten", "flat_size", "grads_from_flat",
           "check_params"]

# Guards the division by the total weight when no rank ran (an empty batch):
# the gradient is then zero instead of NaN.
_TINY = 1e-30


def check_params(params, where):
    if isinstance(params, SharedVariable):
        params = [params]
    params = list(params)
    if not params:
        raise ValueError(f"{where}: params is empty")
    for p in params:
        if not isinstance(p, SharedVariable):
            raise TypeError(f"{where}: params must be shared variables; got {p!r}")
    return params


def shape_of(p):
    return p.get_value(borrow=True).shape


def flat_size(params):
    """Return the total number of elements of ``params`` (shared variables)."""
    return sum(math.prod(shape_of(p)) for p in check_params(params, "flat_size"))


def flatten(exprs):
    """Return one symbolic vector: every expression raveled and concatenated, in order."""
    return pt.concatenate([pt.flatten(e) for e in exprs])


def unflatten(flat, params):
    """Split a symbolic flat vector into pieces shaped like ``params``, in order.

    Args:
        flat: a vector with at least ``flat_size(params)`` elements; elements
            past those are ignored.
        params: shared variables giving the shapes.

    Returns:
        A list of symbolic tensors, one per parameter.
    """
    params = check_params(params, "unflatten")
    out, start = [], 0
    for p in params:
        shape = shape_of(p)
        n = math.prod(shape)
        out.append(pt.reshape(flat[start:start + n], shape, ndim=len(shape)))
        start += n
    return out


def make_flat_grad(loss, params, weight=None, name="flat_grad"):
    """Build the gradient half: updates writing the weighted flat gradient.

    The vector holds ``w * g`` (the gradient of ``loss`` w.r.t. every
    parameter, raveled and concatenated) followed by ``w``.  Give the updates
    to the gradient function; all-reduce the vector ("sum" or "avg") before
    the update function runs.

    Args:
        loss: a scalar expression, normally a mean over the rows of a batch.
        params: shared variables to differentiate with respect to.
        weight: a scalar expression weighing this rank's gradient, normally
            ``x.shape[0]`` (the rows its loss averages over), which makes the
            combined gradient exact for uneven splits.  None weighs every rank
            that ran equally.
        name: the name of the new shared variable.

    Returns:
        ``(grad_shared, grad_updates)``: the flat shared vector (float32,
        length ``flat_size(params) + 1``) and a list with its one update
        triple ``(grad_shared, new_value, "sum")`` (the op sums over slices).
    """
    params = check_params(params, "make_flat_grad")
    dtype = pytensor.config.floatX
    w = pt.constant(1.0, dtype=dtype) if weight is None else pt.cast(weight, dtype)
    # The gradient of the weighted loss, not the weighted gradient: the same
    # without in-graph collectives, but with them (synchronized batch norm)
    # psum's gradient sums every rank's upstream gradient, each of which
    # must already carry its rank's weight.
    grads = pytensor.grad(w * loss, params)
    grad_shared = pytensor.shared(np.zeros(flat_size(params) + 1, dtype=dtype), name=name)
    # Each piece written into the vector itself, not concatenated into a new one: an
    # updated shared variable may be written in place, so the vector keeps its memory
    # from step to step, which the all-reduce then reads where it is (no copy in).
    flat, start = grad_shared, 0
    for g, p in zip(grads, params):
        n = math.prod(shape_of(p))
        flat = pt.set_subtensor(flat[start:start + n], pt.cast(pt.flatten(g), dtype))
        start += n
    flat = pt.set_subtensor(flat[start], w)
    return grad_shared, [(grad_shared, flat, "sum")]


def grads_from_flat(grad_shared, params):
    """Return the combined gradient per parameter, read from an all-reduced flat vector.

    Args:
        grad_shared: the vector made by ``make_flat_grad``.
        params: the same parameters, in the same order.

    Returns:
        A list of symbolic gradients ``sum(w * g) / sum(w)``, one per parameter.
    """
    total = pt.maximum(grad_shared[-1], _TINY)
    return unflatten(grad_shared[:-1] / total, params)
