"""The pooling Ops (max and average, with their gradients), their builders and Numba implementations.

See the package (``synkhronos.extensions.ops``) for the layouts and backends.  The JAX
implementations are in ``jax_impl``.
"""

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.link.numba.dispatch import basic as numba_basic

from ... import compat
from . import kernels as K
from .geometry import (channel_axis, check_layout, conv_out_len, disconnected, float_dtype,
                          geometry_constant, image_shape, int_pair, register_numba, spatial_axes,
                          tensor4)

__all__ = ["MaxPool2d", "MaxPool2dGrad", "AvgPool2d", "AvgPool2dGrad", "max_pool2d", "avg_pool2d"]

_c = np.ascontiguousarray   # kernels then compile for C-ordered arrays only


class _Pool(Op):
    """Shared props and checks of the pooling Ops."""

    __props__ = ("layout", "size", "stride", "padding")

    def __init__(self, layout="NCHW", size=2, stride=None, padding=0):
        where = type(self).__name__
        check_layout(layout, where)
        self.layout = layout
        self.size = int_pair(size, "size", where)
        self.stride = self.size if stride is None else int_pair(stride, "stride", where)
        self.padding = int_pair(padding, "padding", where)
        if min(self.size) < 1 or min(self.stride) < 1 or min(self.padding) < 0:
            raise ValueError(f"{where}: size and stride must be >= 1 and padding >= 0")
        if any(p >= s for p, s in zip(self.padding, self.size)):
            raise ValueError(f"{where}: padding {self.padding} must be smaller than the "
                             f"window {self.size}, or some windows would be all padding")

    def _geom(self):
        return (*self.size, *self.stride, *self.padding)

    def _geom_input(self, *extra):
        return geometry_constant((self.layout == "NCHW", *self._geom(), *extra))

    def connection_pattern(self, node):
        return [[True]] * (len(node.inputs) - 1) + [[False]]

    def _out_shape(self, shape):
        h, w = (shape[a] for a in spatial_axes(self.layout))
        oh = conv_out_len(h, self.size[0], self.stride[0], self.padding[0])
        ow = conv_out_len(w, self.size[1], self.stride[1], self.padding[1])
        return image_shape(self.layout, shape[0], shape[channel_axis(self.layout)], oh, ow)

    def _props_kw(self):
        return dict(layout=self.layout, size=self.size, stride=self.stride,
                    padding=self.padding)


class MaxPool2d(_Pool):
    """Take the max over every window; padded cells never win.  Input ``x``."""

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        x = tensor4(x, float_dtype(x), "max_pool2d", "x")
        out = pt.tensor(dtype=x.dtype, shape=self._out_shape(x.type.shape))
        return Apply(self, [x, self._geom_input()], [out])

    def perform(self, node, inputs, output_storage):
        output_storage[0][0] = K.max_pool_forward(_c(inputs[0]), self.layout == "NCHW",
                                                  *self._geom())

    @compat.infer_shape

    def infer_shape(self, node, shapes):
        return [self._out_shape(shapes[0])]

    def pullback(self, inputs, outputs, output_grads):
        return [MaxPool2dGrad(**self._props_kw())(inputs[0], output_grads[0]), disconnected()]


class MaxPool2dGrad(_Pool):
    """Return the gradient of ``MaxPool2d``: inputs ``(x, gy)``; ties go to the first max."""

    def make_node(self, x, gy):
        x = pt.as_tensor_variable(x)
        dtype = float_dtype(x, pt.as_tensor_variable(gy))
        x = tensor4(x, dtype, "MaxPool2dGrad", "x")
        gy = tensor4(gy, dtype, "MaxPool2dGrad", "gy")
        return Apply(self, [x, gy, self._geom_input()], [x.type()])

    def perform(self, node, inputs, output_storage):
        x, gy, _ = inputs
        output_storage[0][0] = K.max_pool_grad(_c(x), _c(gy), self.layout == "NCHW", *self._geom())

    @compat.infer_shape

    def infer_shape(self, node, shapes):
        return [shapes[0]]


class AvgPool2d(_Pool):
    """Take the mean over every window, padding counted as zeros.  Input ``x``."""

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        x = tensor4(x, float_dtype(x), "avg_pool2d", "x")
        out = pt.tensor(dtype=x.dtype, shape=self._out_shape(x.type.shape))
        return Apply(self, [x, self._geom_input()], [out])

    def perform(self, node, inputs, output_storage):
        output_storage[0][0] = K.avg_pool_forward(_c(inputs[0]), self.layout == "NCHW",
                                                  *self._geom())

    @compat.infer_shape

    def infer_shape(self, node, shapes):
        return [self._out_shape(shapes[0])]

    def pullback(self, inputs, outputs, output_grads):
        x = inputs[0]
        h, w = (x.type.shape[a] for a in spatial_axes(self.layout))
        if None in (h, w):
            raise ValueError("avg_pool2d: the gradient needs the images' height and width "
                             "static")
        return [AvgPool2dGrad(in_hw=(h, w), **self._props_kw())(output_grads[0]), disconnected()]


class AvgPool2dGrad(_Pool):
    """Return the gradient of ``AvgPool2d`` for images of ``in_hw``: input ``gy``."""

    __props__ = _Pool.__props__ + ("in_hw",)

    def __init__(self, in_hw, **kwargs):
        super().__init__(**kwargs)
        self.in_hw = int_pair(in_hw, "in_hw", "AvgPool2dGrad")

    def make_node(self, gy):
        gy = pt.as_tensor_variable(gy)
        gy = tensor4(gy, float_dtype(gy), "AvgPool2dGrad", "gy")
        shape = image_shape(self.layout, gy.type.shape[0],
                             gy.type.shape[channel_axis(self.layout)], *self.in_hw)
        return Apply(self, [gy, self._geom_input(*self.in_hw)],
                     [pt.tensor(dtype=gy.dtype, shape=shape)])

    def perform(self, node, inputs, output_storage):
        output_storage[0][0] = K.avg_pool_grad(_c(inputs[0]), self.layout == "NCHW", *self.in_hw,
                                               *self._geom())

    @compat.infer_shape

    def infer_shape(self, node, shapes):
        gys = shapes[0]
        return [image_shape(self.layout, gys[0], gys[channel_axis(self.layout)],
                             *self.in_hw)]


def max_pool2d(x, size=2, stride=None, padding=0, layout="NCHW"):
    """Return the max over ``size`` windows (stride defaults to ``size``)."""
    return MaxPool2d(layout, size, stride, padding)(x)


def avg_pool2d(x, size=2, stride=None, padding=0, layout="NCHW"):
    """Return the mean over ``size`` windows, padding counted as zeros."""
    return AvgPool2d(layout, size, stride, padding)(x)


# One module-level function per Op class reads the geometry input (``register_numba``).

@numba_basic.numba_njit
def _max_pool2d_numba(x, g):
    return K.max_pool_forward(_c(x), g[0] == 1, g[1], g[2], g[3], g[4], g[5], g[6])


@numba_basic.numba_njit
def _max_pool2d_grad_numba(x, gy, g):
    return K.max_pool_grad(_c(x), _c(gy), g[0] == 1, g[1], g[2], g[3], g[4], g[5], g[6])


@numba_basic.numba_njit
def _avg_pool2d_numba(x, g):
    return K.avg_pool_forward(_c(x), g[0] == 1, g[1], g[2], g[3], g[4], g[5], g[6])


@numba_basic.numba_njit
def _avg_pool2d_grad_numba(gy, g):
    return K.avg_pool_grad(_c(gy), g[0] == 1, g[7], g[8], g[1], g[2], g[3], g[4], g[5], g[6])


for _op_type, _fn in ((MaxPool2d, _max_pool2d_numba), (MaxPool2dGrad, _max_pool2d_grad_numba),
                      (AvgPool2d, _avg_pool2d_numba), (AvgPool2dGrad, _avg_pool2d_grad_numba)):
    register_numba(_op_type, _fn)
