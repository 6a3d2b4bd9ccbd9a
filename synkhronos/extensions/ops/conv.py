"""The convolution Ops (Conv2d and its two gradients), ``conv2d``, and their Numba implementations.

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
from .geometry import (channel_axis, check_layout, conv_out_len, disconnected, filter_hw,
                          float_dtype, geometry_constant, image_shape, int_pair, register_numba,
                          spatial_axes, tensor4, weight_io, weight_shape)

__all__ = ["Conv2d", "Conv2dGradInput", "Conv2dGradWeights", "conv2d"]

_c = np.ascontiguousarray   # kernels then compile for C-ordered arrays only


class _Geometry(Op):
    """Shared props and checks of the convolution Ops.

    Every node has a last input: the geometry as a constant int64 vector
    ``[nchw, sh, sw, ph, pw, dh, dw, groups, extra...]`` for the Numba backend.
    """

    __props__ = ("layout", "stride", "padding", "dilation", "groups")

    def __init__(self, layout="NCHW", stride=1, padding=0, dilation=1, groups=1):
        where = type(self).__name__
        check_layout(layout, where)
        self.layout = layout
        self.stride = int_pair(stride, "stride", where)
        self.padding = int_pair(padding, "padding", where)
        self.dilation = int_pair(dilation, "dilation", where)
        if not isinstance(groups, (int, np.integer)) or groups < 1:
            raise ValueError(f"{where}: groups must be a positive int; got {groups!r}")
        self.groups = int(groups)
        if min(self.stride) < 1 or min(self.dilation) < 1 or min(self.padding) < 0:
            raise ValueError(f"{where}: stride and dilation must be >= 1 and padding >= 0")

    def _geom(self):
        return (*self.stride, *self.padding, *self.dilation, self.groups)

    def _geom_input(self, *extra):
        return geometry_constant((self.layout == "NCHW", *self._geom(), *extra))

    def connection_pattern(self, node):
        return [[True], [True], [False]]

    def _out_hw(self, h, w, fh, fw):
        (sh, sw), (ph, pw), (dh, dw) = self.stride, self.padding, self.dilation
        return conv_out_len(h, fh, sh, ph, dh), conv_out_len(w, fw, sw, pw, dw)

    def _geometry_props(self):
        return dict(layout=self.layout, stride=self.stride, padding=self.padding,
                    dilation=self.dilation, groups=self.groups)


class Conv2d(_Geometry):
    """Cross-correlate images with filters, as every DL library's "convolution".

    Inputs ``(x, w)``; see the module docstring for the layouts.
    """

    def make_node(self, x, w):
        dtype = float_dtype(pt.as_tensor_variable(x), pt.as_tensor_variable(w))
        x = tensor4(x, dtype, "conv2d", "x")
        w = tensor4(w, dtype, "conv2d", "w")
        n = x.type.shape[0]
        c = x.type.shape[channel_axis(self.layout)]
        h, wd = (x.type.shape[a] for a in spatial_axes(self.layout))
        cg, f = weight_io(self.layout, w.type.shape)
        fh, fw = filter_hw(self.layout, w.type.shape)
        if c is not None and cg is not None and c != cg * self.groups:
            raise ValueError(f"conv2d: images have {c} channels, weights expect "
                             f"{cg} x {self.groups} groups")
        if f is not None and f % self.groups:
            raise ValueError(f"conv2d: {f} filters do not split into {self.groups} groups")
        oh, ow = self._out_hw(h, wd, fh, fw) if None not in (fh, fw) else (None, None)
        if (oh is not None and oh < 1) or (ow is not None and ow < 1):
            raise ValueError(f"conv2d: a {fh}x{fw} filter does not fit {h}x{wd} images "
                             f"(padding {self.padding}, dilation {self.dilation})")
        out = pt.tensor(dtype=dtype, shape=image_shape(self.layout, n, f, oh, ow))
        return Apply(self, [x, w, self._geom_input()], [out])

    def perform(self, node, inputs, output_storage):
        x, w, _ = inputs
        output_storage[0][0] = K.conv_forward(_c(x), _c(w), self.layout == "NCHW", *self._geom())

    @compat.infer_shape

    def infer_shape(self, node, shapes):
        xs, ws = shapes[:2]
        h, w = (xs[a] for a in spatial_axes(self.layout))
        fh, fw = filter_hw(self.layout, ws)
        oh, ow = self._out_hw(h, w, fh, fw)
        return [image_shape(self.layout, xs[0], weight_io(self.layout, ws)[1], oh, ow)]

    def pullback(self, inputs, outputs, output_grads):
        x, w, _ = inputs
        (gy,) = output_grads
        h, wd = (x.type.shape[a] for a in spatial_axes(self.layout))
        if None in (h, wd):
            raise ValueError("conv2d: the gradient needs the images' height and width static; "
                             "declare the input as e.g. pt.tensor4('x', shape=(None, 3, 32, 32))")
        fh, fw = filter_hw(self.layout, w.type.shape)
        if None in (fh, fw):
            raise ValueError("conv2d: the gradient needs the filter size static (a shared "
                             "variable created with shape=..., or a tensor with static shape)")
        props = self._geometry_props()
        return [Conv2dGradInput(in_hw=(h, wd), **props)(gy, w),
                Conv2dGradWeights(kernel_hw=(fh, fw), **props)(x, gy), disconnected()]


class Conv2dGradInput(_Geometry):
    """Return the gradient of ``Conv2d`` wrt its images: inputs ``(gy, w)``."""

    __props__ = _Geometry.__props__ + ("in_hw",)

    def __init__(self, in_hw, **kwargs):
        super().__init__(**kwargs)
        self.in_hw = int_pair(in_hw, "in_hw", "Conv2dGradInput")

    def make_node(self, gy, w):
        dtype = float_dtype(pt.as_tensor_variable(gy), pt.as_tensor_variable(w))
        gy = tensor4(gy, dtype, "Conv2dGradInput", "gy")
        w = tensor4(w, dtype, "Conv2dGradInput", "w")
        cg, _ = weight_io(self.layout, w.type.shape)
        c = None if cg is None else cg * self.groups
        out = pt.tensor(dtype=dtype, shape=image_shape(self.layout, gy.type.shape[0], c,
                                                        *self.in_hw))
        return Apply(self, [gy, w, self._geom_input(*self.in_hw)], [out])

    def perform(self, node, inputs, output_storage):
        gy, w, _ = inputs
        output_storage[0][0] = K.conv_grad_input(_c(gy), _c(w), self.layout == "NCHW", *self.in_hw,
                                                 *self._geom())

    @compat.infer_shape

    def infer_shape(self, node, shapes):
        gys, ws = shapes[:2]
        c = weight_io(self.layout, ws)[0] * self.groups
        return [image_shape(self.layout, gys[0], c, *self.in_hw)]


class Conv2dGradWeights(_Geometry):
    """Return the gradient of ``Conv2d`` wrt its weights: inputs ``(x, gy)``."""

    __props__ = _Geometry.__props__ + ("kernel_hw",)

    def __init__(self, kernel_hw, **kwargs):
        super().__init__(**kwargs)
        self.kernel_hw = int_pair(kernel_hw, "kernel_hw", "Conv2dGradWeights")

    def make_node(self, x, gy):
        dtype = float_dtype(pt.as_tensor_variable(x), pt.as_tensor_variable(gy))
        x = tensor4(x, dtype, "Conv2dGradWeights", "x")
        gy = tensor4(gy, dtype, "Conv2dGradWeights", "gy")
        ca = channel_axis(self.layout)
        c, f = x.type.shape[ca], gy.type.shape[ca]
        cg = None if c is None else c // self.groups
        out = pt.tensor(dtype=dtype, shape=weight_shape(self.layout, f, cg, *self.kernel_hw))
        return Apply(self, [x, gy, self._geom_input(*self.kernel_hw)], [out])

    def perform(self, node, inputs, output_storage):
        x, gy, _ = inputs
        output_storage[0][0] = K.conv_grad_weights(_c(x), _c(gy), self.layout == "NCHW",
                                                   *self.kernel_hw, *self._geom())

    @compat.infer_shape

    def infer_shape(self, node, shapes):
        xs, gys = shapes[:2]
        ca = channel_axis(self.layout)
        return [weight_shape(self.layout, gys[ca], xs[ca] // self.groups, *self.kernel_hw)]


def conv2d(x, w, stride=1, padding=0, dilation=1, groups=1, layout="NCHW"):
    """Return the 2-D cross-correlation of images ``x`` with weights ``w``.

    Args:
        x: images, ``(n, c, h, w)`` or, with layout "NHWC", ``(n, h, w, c)``.
        w: weights, ``(f, c // groups, fh, fw)`` or, with "NHWC", ``(fh, fw, c // groups, f)``.
        stride: an int or a pair.
        padding: zero padding on each side, an int or a pair.
        dilation: spacing of the filter taps, an int or a pair.
        groups: split channels and filters into this many independent groups.
        layout: "NCHW" or "NHWC".
    """
    return Conv2d(layout, stride, padding, dilation, groups)(x, w)


# One module-level function per Op class reads the geometry input (``register_numba``).

@numba_basic.numba_njit
def _conv2d_numba(x, w, g):
    return K.conv_forward(_c(x), _c(w), g[0] == 1, g[1], g[2], g[3], g[4], g[5], g[6], g[7])


@numba_basic.numba_njit
def _conv2d_grad_input_numba(gy, w, g):
    return K.conv_grad_input(_c(gy), _c(w), g[0] == 1, g[8], g[9], g[1], g[2], g[3], g[4], g[5], g[6],
                             g[7])


@numba_basic.numba_njit
def _conv2d_grad_weights_numba(x, gy, g):
    return K.conv_grad_weights(_c(x), _c(gy), g[0] == 1, g[8], g[9], g[1], g[2], g[3], g[4], g[5], g[6],
                               g[7])


for _op_type, _fn in ((Conv2d, _conv2d_numba), (Conv2dGradInput, _conv2d_grad_input_numba),
                      (Conv2dGradWeights, _conv2d_grad_weights_numba)):
    register_numba(_op_type, _fn)
