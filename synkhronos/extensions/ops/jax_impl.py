"""The JAX implementations of the convolution, pooling and batch-norm Ops (GPU mode).

The Ops' one module that imports jax: the Ops and their CPU kernels
(``conv``, ``pool``, ``batch_norm``) load without it.

Registered with PyTensor's ``jax_funcify`` (``register_when_loaded``, called when
the package loads) once PyTensor's JAX dispatch module is imported (it imports jax,
which CPU users need not pay for): at once if it is loaded already, otherwise right
after it loads (``import_hooks.when_imported``).
"""

import logging

from ... import import_hooks
from .batch_norm import BatchNormGrad, BatchNormTrain
from .conv import Conv2d, Conv2dGradInput, Conv2dGradWeights
from .geometry import channel_axis, image_shape, weight_io, weight_shape
from .pool import AvgPool2d, AvgPool2dGrad, MaxPool2d, MaxPool2dGrad

logger = logging.getLogger(__name__)

_JAX_DISPATCH = "pytensor.link.jax.dispatch"


def _dimension_numbers(layout):
    return ("NCHW", "OIHW", "NCHW") if layout == "NCHW" else ("NHWC", "HWIO", "NHWC")


def _jax_conv(op):
    from jax import lax

    (sh, sw), (ph, pw) = op.stride, op.padding
    dn = _dimension_numbers(op.layout)

    def conv(x, w, geometry=None):
        return lax.conv_general_dilated(x, w, window_strides=(sh, sw),
                                        padding=((ph, ph), (pw, pw)), rhs_dilation=op.dilation,
                                        dimension_numbers=dn, feature_group_count=op.groups)
    return conv


def _jax_window(op):
    fh, fw = op.size
    sh, sw = op.stride
    ph, pw = op.padding
    if op.layout == "NCHW":
        return (1, 1, fh, fw), (1, 1, sh, sw), ((0, 0), (0, 0), (ph, ph), (pw, pw))
    return (1, fh, fw, 1), (1, sh, sw, 1), ((0, 0), (ph, ph), (pw, pw), (0, 0))


def _jax_max_pool(op):
    import jax.numpy as jnp
    from jax import lax

    dims, strides, pads = _jax_window(op)

    def pool(x, geometry=None):
        return lax.reduce_window(x, -jnp.inf, lax.max, dims, strides, pads)
    return pool


def _jax_avg_pool(op):
    from jax import lax

    dims, strides, pads = _jax_window(op)
    scale = 1.0 / (op.size[0] * op.size[1])

    def pool(x, geometry=None):
        return lax.reduce_window(x, 0.0, lax.add, dims, strides, pads) * \
            x.dtype.type(scale)
    return pool


def _jax_bn(op):
    import jax.numpy as jnp

    g, eps, axis = op.n_groups, op.epsilon, op.axis

    def forward(x, gamma, beta, params=None):
        ax = axis % x.ndim
        xg = x.reshape((g, x.shape[0] // g) + x.shape[1:])
        axes = tuple(i for i in range(1, xg.ndim) if i != ax + 1)
        mean = xg.mean(axis=axes, keepdims=True)
        var = ((xg - mean) ** 2).mean(axis=axes, keepdims=True)
        shape = [1] * xg.ndim
        shape[ax + 1] = -1
        scale = gamma.reshape(shape) / jnp.sqrt(var + eps)
        y = ((xg - mean) * scale + beta.reshape(shape)).reshape(x.shape)
        return y, mean.mean(axis=0).reshape(-1), var.mean(axis=0).reshape(-1)
    return forward


def _register_jax():
    import jax
    import jax.numpy as jnp
    from pytensor.link.jax.dispatch import jax_funcify

    @jax_funcify.register(Conv2d)
    def _jax_conv2d(op, **kwargs):
        return _jax_conv(op)

    @jax_funcify.register(Conv2dGradInput)
    def _jax_conv2d_grad_input(op, **kwargs):
        conv = _jax_conv(op)

        def conv2d_grad_input(gy, w, geometry=None):
            cg, _ = weight_io(op.layout, w.shape)
            shape = image_shape(op.layout, gy.shape[0], cg * op.groups, *op.in_hw)
            _, vjp = jax.vjp(lambda x: conv(x, w), jnp.zeros(shape, gy.dtype))
            return vjp(gy)[0]
        return conv2d_grad_input

    @jax_funcify.register(Conv2dGradWeights)
    def _jax_conv2d_grad_weights(op, **kwargs):
        conv = _jax_conv(op)
        ca = channel_axis(op.layout)

        def conv2d_grad_weights(x, gy, geometry=None):
            shape = weight_shape(op.layout, gy.shape[ca], x.shape[ca] // op.groups,
                                  *op.kernel_hw)
            _, vjp = jax.vjp(lambda w: conv(x, w), jnp.zeros(shape, x.dtype))
            return vjp(gy)[0]
        return conv2d_grad_weights

    @jax_funcify.register(MaxPool2d)
    def _jax_max_pool2d(op, **kwargs):
        return _jax_max_pool(op)

    @jax_funcify.register(MaxPool2dGrad)
    def _jax_max_pool2d_grad(op, **kwargs):
        pool = _jax_max_pool(op)

        def max_pool2d_grad(x, gy, geometry=None):
            return jax.vjp(pool, x)[1](gy)[0]
        return max_pool2d_grad

    @jax_funcify.register(AvgPool2d)
    def _jax_avg_pool2d(op, **kwargs):
        return _jax_avg_pool(op)

    @jax_funcify.register(AvgPool2dGrad)
    def _jax_avg_pool2d_grad(op, **kwargs):
        pool = _jax_avg_pool(op)

        def avg_pool2d_grad(gy, geometry=None):
            c = gy.shape[channel_axis(op.layout)]
            shape = image_shape(op.layout, gy.shape[0], c, *op.in_hw)
            return jax.vjp(pool, jnp.zeros(shape, gy.dtype))[1](gy)[0]
        return avg_pool2d_grad

    @jax_funcify.register(BatchNormTrain)
    def _jax_bn_train(op, **kwargs):
        return _jax_bn(op)

    @jax_funcify.register(BatchNormGrad)
    def _jax_bn_grad(op, **kwargs):
        forward = _jax_bn(op)

        def batch_norm_grad(x, gamma, gy, params=None):
            _, vjp = jax.vjp(lambda x_, g_: forward(x_, g_, gamma * 0)[0], x, gamma)
            gx, ggamma = vjp(gy)
            return gx, ggamma, gy.sum(axis=tuple(i for i in range(gy.ndim)
                                                  if i != op.axis % gy.ndim))
        return batch_norm_grad

    logger.debug("convolution, pooling and batch-norm Ops registered with the JAX backend")


def register_when_loaded():
    """Register the Ops with PyTensor's JAX backend: now if it is loaded, else once it loads."""
    import_hooks.when_imported(_JAX_DISPATCH, _register_jax)
