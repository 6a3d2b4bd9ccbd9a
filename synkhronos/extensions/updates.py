"""First-order update rules split in two for data parallelism: flat gradient, then update.

Every rule of Lasagne (sgd, momentum, nesterov_momentum, adagrad, rmsprop,
adadelta, adam, adamax), with Lasagne's formulas and defaults, made of two
halves:

1. ``make_flat_grad`` builds the updates that write the raw gradient of the
   loss, over this rank's rows, into ONE flat shared vector;
2. ``apply_<rule>`` builds the updates that apply the rule from that vector
   once it has been all-reduced, reshaping its slices back to the parameters.

One all-reduce of one long vector is much faster than one per parameter.
A training step on every rank:

```python
grad_updates, param_updates, grad_shared = updates.adam(loss, params, weight=x.shape[0])
f_grad = synk.function([x, y], loss, updates=grad_updates)
f_update = synk.function([], updates=param_updates)
synk.distribute()
...
f_grad(x_data, y_data, batch=idx)    # each rank: gradient of its share of the batch
synk.all_reduce(grad_shared, op="sum")
f_update()                           # each rank: the same update
```

Exact averaging over uneven splits: the flat vector holds ``w * g`` followed by
``w``, where ``g`` is the gradient of the rank's loss and ``w`` its weight
(``weight``, normally the number of rows the rank's loss averages over).
After the all-reduce the update uses ``sum(w * g) / sum(w)``: the gradient of
the whole batch's mean loss, however unevenly the rows were split, and with
either op "sum" or "avg" (the ratio is the same).  Without ``weight`` every
rank that ran weighs the same (as in the original Synkhronos), which is exact
when the split is even.  The update also zeroes the vector, so a rank that got
no rows in the next step (it does not run) adds nothing.

Used with ``num_slices``, the gradient updates accumulate over slices by "sum",
which keeps the weighting exact.
"""

from typing import NamedTuple

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile import SharedVariable

from .flat import (check_params, flat_size, flatten, grads_from_flat, shape_of, make_flat_grad,  # noqa: F401
                   unflatten)

__all__ = [
    "SplitUpdates", "make_flat_grad", "flatten", "unflatten", "flat_size", "grads_from_flat",
    "sgd", "momentum", "nesterov_momentum", "adagrad", "rmsprop", "adadelta", "adam",
    "adamax",
    "apply_sgd", "apply_momentum", "apply_nesterov_momentum", "apply_adagrad",
    "apply_rmsprop", "apply_adadelta", "apply_adam", "apply_adamax",
    "RULES",
]



class SplitUpdates(NamedTuple):
    """What every rule returns: unpack as ``grad_updates, param_updates, grad_shared``."""

    grad_updates: list
    """Updates for the gradient function: write the weighted flat gradient."""
    param_updates: list
    """Updates for the update function: apply the rule, zero the flat gradient."""
    grad_shared: SharedVariable
    """The flat gradient vector, to all-reduce between the two functions."""


def _grads(grads, params, where):
    """Return (per-parameter gradients, updates to add) for an apply_* function.

    ``grads`` is a flat vector from make_flat_grad (then it is zeroed after
    use), or a list of gradients, one per parameter (the serial form).
    """
    params = check_params(params, where)
    if isinstance(grads, SharedVariable) and grads.ndim == 1:
        expected = flat_size(params) + 1
        have = len(grads.get_value(borrow=True))
        if have != expected:
            raise ValueError(f"{where}: the flat gradient has {have} elements; these params "
                             f"need {expected} (flat_size(params) + 1)")
        return params, grads_from_flat(grads, params), [(grads, pt.zeros_like(grads))]
    grads = list(grads)
    if len(grads) != len(params):
        raise ValueError(f"{where}: got {len(grads)} gradients for {len(params)} params")
    return params, grads, []


def _state(p, name):
    """A new shared variable of zeros shaped and typed like parameter ``p``."""
    value = np.zeros(shape_of(p), dtype=p.dtype)
    return pytensor.shared(value, shape=p.type.shape, name=f"{p.name or 'param'}_{name}")


def _step_counter():
    return pytensor.shared(np.asarray(0.0, dtype=pytensor.config.floatX), name="t")


def _cast(p, expr):
    return pt.cast(expr, p.dtype)


# Each apply_* takes the flat vector (data-parallel) or a list of gradients
# (serial) and returns a list of (shared, update) pairs.

def apply_sgd(grads, params, learning_rate):
    """Build the updates of stochastic gradient descent: ``p -= learning_rate * g``.

    Args:
        grads: the all-reduced vector from ``make_flat_grad``, or a list of
            gradients, one per parameter.
        params: the parameters (shared variables), in the order of ``grads``.
        learning_rate: a float or a scalar expression.

    Returns:
        A list of ``(shared, update)`` pairs.
    """
    params, grads, updates = _grads(grads, params, "apply_sgd")
    for p, g in zip(params, grads):
        updates.append((p, _cast(p, p - learning_rate * g)))
    return updates


def apply_momentum(grads, params, learning_rate, momentum=0.9):
    """Build the updates of SGD with classical momentum (Lasagne's ``momentum``).

    ``v = momentum * v - learning_rate * g``; ``p += v``.  Arguments as for
    ``apply_sgd``.
    """
    params, grads, updates = _grads(grads, params, "apply_momentum")
    for p, g in zip(params, grads):
        v = _state(p, "velocity")
        v_new = momentum * v - learning_rate * g
        updates += [(v, _cast(p, v_new)), (p, _cast(p, p + v_new))]
    return updates


def apply_nesterov_momentum(grads, params, learning_rate, momentum=0.9):
    """Build the updates of SGD with Nesterov momentum (Lasagne's form).

    ``v = momentum * v - learning_rate * g``;
    ``p += momentum * v - learning_rate * g``.  Arguments as for ``apply_sgd``.
    """
    params, grads, updates = _grads(grads, params, "apply_nesterov_momentum")
    for p, g in zip(params, grads):
        v = _state(p, "velocity")
        v_new = momentum * v - learning_rate * g
        updates += [(v, _cast(p, v_new)),
                    (p, _cast(p, p + momentum * v_new - learning_rate * g))]
    return updates


def apply_adagrad(grads, params, learning_rate=1.0, epsilon=1e-6):
    """Build the updates of Adagrad.

    ``a += g**2``; ``p -= learning_rate * g / sqrt(a + epsilon)``.
    Arguments as for ``apply_sgd``.
    """
    params, grads, updates = _grads(grads, params, "apply_adagrad")
    for p, g in zip(params, grads):
        acc = _state(p, "accu")
        acc_new = acc + g ** 2
        updates += [(acc, _cast(p, acc_new)),
                    (p, _cast(p, p - learning_rate * g / pt.sqrt(acc_new + epsilon)))]
    return updates


def apply_rmsprop(grads, params, learning_rate=1.0, rho=0.9, epsilon=1e-6):
    """Build the updates of RMSProp.

    ``a = rho * a + (1 - rho) * g**2``; ``p -= learning_rate * g / sqrt(a + epsilon)``.
    Arguments as for ``apply_sgd``.
    """
    params, grads, updates = _grads(grads, params, "apply_rmsprop")
    for p, g in zip(params, grads):
        acc = _state(p, "accu")
        acc_new = rho * acc + (1 - rho) * g ** 2
        updates += [(acc, _cast(p, acc_new)),
                    (p, _cast(p, p - learning_rate * g / pt.sqrt(acc_new + epsilon)))]
    return updates


def apply_adadelta(grads, params, learning_rate=1.0, rho=0.95, epsilon=1e-6):
    """Build the updates of Adadelta.

    ``a = rho * a + (1 - rho) * g**2``;
    ``u = g * sqrt(d + epsilon) / sqrt(a + epsilon)``; ``p -= learning_rate * u``;
    ``d = rho * d + (1 - rho) * u**2``.  Arguments as for ``apply_sgd``.
    """
    params, grads, updates = _grads(grads, params, "apply_adadelta")
    for p, g in zip(params, grads):
        acc = _state(p, "accu")
        delta_acc = _state(p, "delta_accu")
        acc_new = rho * acc + (1 - rho) * g ** 2
        step = g * pt.sqrt(delta_acc + epsilon) / pt.sqrt(acc_new + epsilon)
        updates += [(acc, _cast(p, acc_new)),
                    (p, _cast(p, p - learning_rate * step)),
                    (delta_acc, _cast(p, rho * delta_acc + (1 - rho) * step ** 2))]
    return updates


def apply_adam(grads, params, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8):
    """Build the updates of Adam (Lasagne's form, bias correction in the step size).

    ``t += 1``; ``m = beta1 * m + (1 - beta1) * g``;
    ``v = beta2 * v + (1 - beta2) * g**2``;
    ``p -= learning_rate * sqrt(1 - beta2**t) / (1 - beta1**t) * m / (sqrt(v) + epsilon)``.
    Arguments as for ``apply_sgd``.
    """
    params, grads, updates = _grads(grads, params, "apply_adam")
    t_prev = _step_counter()
    t = t_prev + 1
    a_t = learning_rate * pt.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
    for p, g in zip(params, grads):
        m = _state(p, "m")
        v = _state(p, "v")
        m_t = beta1 * m + (1 - beta1) * g
        v_t = beta2 * v + (1 - beta2) * g ** 2
        updates += [(m, _cast(p, m_t)), (v, _cast(p, v_t)),
                    (p, _cast(p, p - a_t * m_t / (pt.sqrt(v_t) + epsilon)))]
    updates.append((t_prev, pt.cast(t, t_prev.dtype)))
    return updates


def apply_adamax(grads, params, learning_rate=0.002, beta1=0.9, beta2=0.999, epsilon=1e-8):
    """Build the updates of Adamax (Adam with the infinity norm).

    ``t += 1``; ``m = beta1 * m + (1 - beta1) * g``; ``u = max(beta2 * u, |g|)``;
    ``p -= learning_rate / (1 - beta1**t) * m / (u + epsilon)``.
    Arguments as for ``apply_sgd``.
    """
    params, grads, updates = _grads(grads, params, "apply_adamax")
    t_prev = _step_counter()
    t = t_prev + 1
    a_t = learning_rate / (1 - beta1 ** t)
    for p, g in zip(params, grads):
        m = _state(p, "m")
        u = _state(p, "u")
        m_t = beta1 * m + (1 - beta1) * g
        u_t = pt.maximum(beta2 * u, abs(g))
        updates += [(m, _cast(p, m_t)), (u, _cast(p, u_t)),
                    (p, _cast(p, p - a_t * m_t / (u_t + epsilon)))]
    updates.append((t_prev, pt.cast(t, t_prev.dtype)))
    return updates


def _split(apply, loss, params, weight, **hyper):
    params = check_params(params, apply.__name__[len("apply_"):])
    grad_shared, grad_updates = make_flat_grad(loss, params, weight)
    return SplitUpdates(grad_updates, apply(grad_shared, params, **hyper), grad_shared)


def sgd(loss, params, learning_rate, weight=None):
    """Build both halves of SGD; see ``apply_sgd`` for the rule.

    Args:
        loss: the scalar loss of one rank's rows (normally a mean).
        params: the shared variables to train.
        learning_rate: a float or a scalar expression.
        weight: this rank's weight, normally ``x.shape[0]`` (see ``make_flat_grad``).

    Returns:
        SplitUpdates: ``(grad_updates, param_updates, grad_shared)``.
    """
    return _split(apply_sgd, loss, params, weight, learning_rate=learning_rate)


def momentum(loss, params, learning_rate, momentum=0.9, weight=None):
    """Build both halves of SGD with momentum; see ``apply_momentum`` and ``sgd``."""
    return _split(apply_momentum, loss, params, weight, learning_rate=learning_rate,
                  momentum=momentum)


def nesterov_momentum(loss, params, learning_rate, momentum=0.9, weight=None):
    """Build both halves of SGD with Nesterov momentum; see ``apply_nesterov_momentum``."""
    return _split(apply_nesterov_momentum, loss, params, weight, learning_rate=learning_rate,
                  momentum=momentum)


def adagrad(loss, params, learning_rate=1.0, epsilon=1e-6, weight=None):
    """Build both halves of Adagrad; see ``apply_adagrad`` and ``sgd``."""
    return _split(apply_adagrad, loss, params, weight, learning_rate=learning_rate,
                  epsilon=epsilon)


def rmsprop(loss, params, learning_rate=1.0, rho=0.9, epsilon=1e-6, weight=None):
    """Build both halves of RMSProp; see ``apply_rmsprop`` and ``sgd``."""
    return _split(apply_rmsprop, loss, params, weight, learning_rate=learning_rate, rho=rho,
                  epsilon=epsilon)


def adadelta(loss, params, learning_rate=1.0, rho=0.95, epsilon=1e-6, weight=None):
    """Build both halves of Adadelta; see ``apply_adadelta`` and ``sgd``."""
    return _split(apply_adadelta, loss, params, weight, learning_rate=learning_rate, rho=rho,
                  epsilon=epsilon)


def adam(loss, params, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8,
         weight=None):
    """Build both halves of Adam; see ``apply_adam`` and ``sgd``."""
    return _split(apply_adam, loss, params, weight, learning_rate=learning_rate, beta1=beta1,
                  beta2=beta2, epsilon=epsilon)


def adamax(loss, params, learning_rate=0.002, beta1=0.9, beta2=0.999, epsilon=1e-8,
           weight=None):
    """Build both halves of Adamax; see ``apply_adamax`` and ``sgd``."""
    return _split(apply_adamax, loss, params, weight, learning_rate=learning_rate, beta1=beta1,
                  beta2=beta2, epsilon=epsilon)


RULES = {
    "sgd": apply_sgd,
    "momentum": apply_momentum,
    "nesterov_momentum": apply_nesterov_momentum,
    "adagrad": apply_adagrad,
    "rmsprop": apply_rmsprop,
    "adadelta": apply_adadelta,
    "adam": apply_adam,
    "adamax": apply_adamax,
}
"""Each rule's ``apply_*`` function by name, for ``make_train_function``."""
