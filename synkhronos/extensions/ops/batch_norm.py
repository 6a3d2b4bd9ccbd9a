"""PyTensor Ops for training-mode batch normalization and its gradient, on every backend.

``BatchNormTrain`` turns ``(x, gamma, beta)`` into ``(y, mean, var)`` and
``BatchNormGrad`` gives the gradients; two nodes per layer where the same
expression written elementwise is a few dozen, which is most of a ResNet
graph's compile time.  In GPU mode (mode "JAX") they are ``jax.numpy``
expressions (the gradient their ``jax.vjp``, in ``jax_impl``); on the CPU
(Numba backend and ``perform``) they are the Numba kernels of ``kernels``.  Statistics are
taken over every axis but the feature axis, separately for ``n_groups``
equal consecutive groups of rows (1: the whole batch).  ``mean`` and ``var``
are the groups' average statistics, for the running averages.
"""

import numba
import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import DisconnectedType, grad_not_implemented
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.link.numba.dispatch import basic as numba_basic

from ... import compat
from . import kernels as K

_c = np.ascontiguousarray   # kernels then compile for C-ordered arrays only

__all__ = ["BatchNormTrain", "BatchNormGrad", "batch_norm_train"]


@numba.njit(cache=True)
def _rows_last(x):
    c = x.shape[x.ndim - 1]
    return x.reshape((x.size // c, c))


@numba.njit(cache=True)
def _rows_first(x):
    # NCHW images: features to the end, as a (rows, features) matrix.
    x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    return x.reshape((x.size // x.shape[3], x.shape[3]))


@numba.njit(cache=True)
def _unrows_first(y, x):
    n, c, h, w = x.shape
    return np.ascontiguousarray(y.reshape((n, h, w, c)).transpose(0, 3, 1, 2))


@numba.njit(cache=True)
def bn_train_last(x, gamma, beta, eps, groups):
    """Return ``(y, mean, var)`` of C-ordered ``x`` of any shape, features last."""
    y, mean, var = K.bn_forward(_rows_last(x), gamma, beta, eps, groups)
    return y.reshape(x.shape), mean, var


@numba.njit(cache=True)
def bn_train_first(x, gamma, beta, eps, groups):
    """Return ``(y, mean, var)`` of NCHW images ``x``."""
    y, mean, var = K.bn_forward(_rows_first(x), gamma, beta, eps, groups)
    return _unrows_first(y, x), mean, var


@numba.njit(cache=True)
def bn_grad_last(x, gamma, gy, eps, groups):
    """Return ``(gx, ggamma, gbeta)``, features last."""
    gx, ggamma, gbeta = K.bn_backward(_rows_last(x), gamma, _rows_last(gy), eps, groups)
    return gx.reshape(x.shape), ggamma, gbeta


@numba.njit(cache=True)
def bn_grad_first(x, gamma, gy, eps, groups):
    """Return ``(gx, ggamma, gbeta)`` for NCHW images."""
    gx, ggamma, gbeta = K.bn_backward(_rows_first(x), gamma, _rows_first(gy), eps, groups)
    return _unrows_first(gx, x), ggamma, gbeta


class _BatchNorm(Op):
    __props__ = ("axis", "epsilon", "n_groups")

    def __init__(self, axis=-1, epsilon=1e-4, n_groups=1):
        if axis not in (-1, 1):
            raise ValueError(f"{type(self).__name__}: axis must be -1 (features last) or 1 "
                             f"(NCHW images); got {axis!r}")
        if not isinstance(n_groups, (int, np.integer)) or n_groups < 1:
            raise ValueError(f"{type(self).__name__}: n_groups must be a positive int; "
                             f"got {n_groups!r}")
        self.axis = axis
        self.epsilon = float(epsilon)
        self.n_groups = int(n_groups)

    def _inputs(self, x, *vectors):
        x = pt.as_tensor_variable(x)
        if x.ndim < 2 or (self.axis == 1 and x.ndim != 4):
            raise ValueError(f"batch_norm: x must be >= 2-d (4-d with axis 1); got ndim {x.ndim}")
        dtype = x.dtype if x.dtype.startswith("float") else "float64"
        vecs = [pt.cast(pt.as_tensor_variable(v), dtype) for v in vectors]
        return pt.cast(x, dtype), vecs

    def _first(self):
        return self.axis == 1

    def _params_input(self):
        # Also a constant input, so every node shares one compiled Numba function (see ops).
        return pt.constant(np.array([self.epsilon, self.n_groups, self._first()], "float64"))

    def _vector_type(self, x):
        c = x.type.shape[self.axis]
        return pt.tensor(dtype=x.dtype, shape=(c,))


class BatchNormTrain(_BatchNorm):
    """Normalize with batch statistics: inputs ``(x, gamma, beta)``, outputs ``(y, mean, var)``."""

    def make_node(self, x, gamma, beta):
        x, (gamma, beta) = self._inputs(x, gamma, beta)
        return Apply(self, [x, gamma, beta, self._params_input()],
                     [x.type(), self._vector_type(x), self._vector_type(x)])

    def perform(self, node, inputs, output_storage):
        x, gamma, beta, _ = inputs
        train = bn_train_first if self._first() else bn_train_last
        outs = train(_c(x), _c(gamma), _c(beta), self.epsilon, self.n_groups)
        for storage, value in zip(output_storage, outs):
            storage[0] = value

    @compat.infer_shape

    def infer_shape(self, node, shapes):
        c = shapes[0][self.axis]
        return [shapes[0], (c,), (c,)]

    def pullback(self, inputs, outputs, output_grads):
        x, gamma = inputs[:2]
        gy, gmean, gvar = output_grads
        for g, name in ((gmean, "mean"), (gvar, "var")):
            if not isinstance(g.type, DisconnectedType):
                return [grad_not_implemented(self, i, inp,
                                             f"the batch {name} output is not differentiable")
                        for i, inp in enumerate(inputs)]
        if isinstance(gy.type, DisconnectedType):
            return [DisconnectedType()() for _ in inputs]
        props = dict(axis=self.axis, epsilon=self.epsilon, n_groups=self.n_groups)
        return list(BatchNormGrad(**props)(x, gamma, gy)) + [DisconnectedType()()]

    def connection_pattern(self, node):
        return [[True, True, True], [True, False, False], [True, False, False],
                [False, False, False]]


class BatchNormGrad(_BatchNorm):
    """Return the gradients of ``BatchNormTrain``'s ``y``: inputs ``(x, gamma, gy)``."""

    def make_node(self, x, gamma, gy):
        x, (gamma,) = self._inputs(x, gamma)
        gy = pt.cast(pt.as_tensor_variable(gy), x.dtype)
        return Apply(self, [x, gamma, gy, self._params_input()],
                     [x.type(), gamma.type(), gamma.type()])

    def perform(self, node, inputs, output_storage):
        x, gamma, gy, _ = inputs
        grad = bn_grad_first if self._first() else bn_grad_last
        outs = grad(_c(x), _c(gamma), _c(gy), self.epsilon, self.n_groups)
        for storage, value in zip(output_storage, outs):
            storage[0] = value

    @compat.infer_shape

    def infer_shape(self, node, shapes):
        return [shapes[0], shapes[1], shapes[1]]


def batch_norm_train(x, gamma, beta, axis=-1, epsilon=1e-4, n_groups=1):
    """Return ``(y, mean, var)``: ``x`` normalized with its batch statistics, scaled and shifted."""
    return BatchNormTrain(axis, epsilon, n_groups)(x, gamma, beta)


@numba_basic.numba_njit
def _bn_train_last_numba(x, gamma, beta, p):
    return bn_train_last(_c(x), _c(gamma), _c(beta), p[0], int(p[1]))


@numba_basic.numba_njit
def _bn_train_first_numba(x, gamma, beta, p):
    return bn_train_first(_c(x), _c(gamma), _c(beta), p[0], int(p[1]))


@numba_basic.numba_njit
def _bn_grad_last_numba(x, gamma, gy, p):
    return bn_grad_last(_c(x), _c(gamma), _c(gy), p[0], int(p[1]))


@numba_basic.numba_njit
def _bn_grad_first_numba(x, gamma, gy, p):
    return bn_grad_first(_c(x), _c(gamma), _c(gy), p[0], int(p[1]))


# Keyed by the code's module, as geometry.register_numba keys (a cache entry pickles it).
@numba_basic.register_funcify_and_cache_key(BatchNormTrain)
def _numba_bn_train(op, node=None, **kwargs):
    fn = _bn_train_first_numba if op._first() else _bn_train_last_numba
    return fn, f"{fn.__module__}.BatchNormTrain.first{int(op._first())}.v1"


@numba_basic.register_funcify_and_cache_key(BatchNormGrad)
def _numba_bn_grad(op, node=None, **kwargs):
    fn = _bn_grad_first_numba if op._first() else _bn_grad_last_numba
    return fn, f"{fn.__module__}.BatchNormGrad.first{int(op._first())}.v1"
