"""PyTensor Ops for 2-D convolution and pooling, with gradients, on every backend.

Seven Ops: ``Conv2d``, ``Conv2dGradInput``, ``Conv2dGradWeights``, ``MaxPool2d``,
``MaxPool2dGrad``, ``AvgPool2d`` and ``AvgPool2dGrad``.  Each runs

- under the JAX backend as ``jax.lax.conv_general_dilated`` /
  ``jax.lax.reduce_window`` (gradients as their ``jax.vjp``), so XLA and cuDNN
  do the work in GPU mode (registered by ``ops_jax``);
- under the default Numba backend, and in ``perform`` for the C and Python
  linkers, as the Numba kernels of ``kernels.py`` (im2col + BLAS GEMM, plain
  loops for pooling), never as an object-mode fallback.

Images are ``"NCHW"`` (weights ``(f, c // groups, fh, fw)``, as cuDNN and torch)
or ``"NHWC"`` (weights ``(fh, fw, c // groups, f)``, as the layers use: it is
the faster layout on the CPU).  Output shapes are inferred from input shapes,
static wherever the inputs' are, so JAX sees constants.  The functions
``conv2d``, ``max_pool2d`` and ``avg_pool2d`` build the nodes.
"""

import logging

import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import DisconnectedType
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.link.numba.dispatch import basic as numba_basic
from pytensor.scalar import upcast

from . import kernels as K

logger = logging.getLogger(__name__)

__all__ = ["Conv2d", "Conv2dGradInput", "Conv2dGradWeights", "MaxPool2d", "MaxPool2dGrad",
           "AvgPool2d", "AvgPool2dGrad", "conv2d", "max_pool2d", "avg_pool2d", "conv_out_len"]

LAYOUTS = ("NCHW", "NHWC")


def _pair(value, name, where):
    pair = (value, value) if isinstance(value, (int, np.integer)) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, (int, np.integer)) for v in pair):
        raise ValueError(f"{where}: {name} must be an int or a pair of ints; got {value!r}")
    return tuple(int(v) for v in pair)


def conv_out_len(size, k, stride, pad, dilation=1):
    """Return an output length along one axis; ``size`` may be an int, None or symbolic."""
    if size is None:
        return None
    return (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1


def _check_layout(layout, where):
    if layout not in LAYOUTS:
        raise ValueError(f"{where}: layout must be 'NCHW' or 'NHWC'; got {layout!r}")


def _spatial_axes(layout):
    return (2, 3) if layout == "NCHW" else (1, 2)


def _channel_axis(layout):
    return 1 if layout == "NCHW" else 3


def _image_shape(layout, n, c, h, w):
    return (n, c, h, w) if layout == "NCHW" else (n, h, w, c)


def _weight_shape(layout, f, cg, fh, fw):
    return (f, cg, fh, fw) if layout == "NCHW" else (fh, fw, cg, f)


def _kernel_hw(layout, wshape):
    return tuple(wshape[2:]) if layout == "NCHW" else tuple(wshape[:2])


def _weight_io(layout, wshape):
    """(input channels per group, filters) of a weight shape."""
    return (wshape[1], wshape[0]) if layout == "NCHW" else (wshape[2], wshape[3])


def _tensor4(x, dtype, where, name):
    x = pt.as_tensor_variable(x)
    if x.ndim != 4:
        raise ValueError(f"{where}: {name} must be 4-d; got ndim {x.ndim}")
    return pt.cast(x, dtype) if x.dtype != dtype else x


def _float_dtype(*xs):
    dtype = upcast(*(x.dtype for x in xs))
    return dtype if dtype.startswith("float") else "float64"


def _disconnected():
    return DisconnectedType()()


def _geometry_constant(values):
    # The geometry also travels as a constant input: the Numba backend then compiles one
    # function per Op class and dtype that reads it at run time, where a closure over each
    # node's props compiled one per node (minutes of LLVM for a ResNet).
    return pt.constant(np.asarray(values, dtype="int64"))


class _Geometry(Op):
    """Shared props and checks of the convolution Ops.

    Every node has a last input: the geometry as a constant int64 vector
    ``[nchw, sh, sw, ph, pw, dh, dw, groups, extra...]`` for the Numba backend.
    """

    __props__ = ("layout", "stride", "padding", "dilation", "groups")

    def __init__(self, layout="NCHW", stride=1, padding=0, dilation=1, groups=1):
        where = type(self).__name__
        _check_layout(layout, where)
        self.layout = layout
        self.stride = _pair(stride, "stride", where)
        self.padding = _pair(padding, "padding", where)
        self.dilation = _pair(dilation, "dilation", where)
        if not isinstance(groups, (int, np.integer)) or groups < 1:
            raise ValueError(f"{where}: groups must be a positive int; got {groups!r}")
        self.groups = int(groups)
        if min(self.stride) < 1 or min(self.dilation) < 1 or min(self.padding) < 0:
            raise ValueError(f"{where}: stride and dilation must be >= 1 and padding >= 0")

    def _geom(self):
        return (*self.stride, *self.padding, *self.dilation, self.groups)

    def _geom_input(self, *extra):
        return _geometry_constant((self.layout == "NCHW", *self._geom(), *extra))

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
        dtype = _float_dtype(pt.as_tensor_variable(x), pt.as_tensor_variable(w))
        x = _tensor4(x, dtype, "conv2d", "x")
        w = _tensor4(w, dtype, "conv2d", "w")
        n = x.type.shape[0]
        c = x.type.shape[_channel_axis(self.layout)]
        h, wd = (x.type.shape[a] for a in _spatial_axes(self.layout))
        cg, f = _weight_io(self.layout, w.type.shape)
        fh, fw = _kernel_hw(self.layout, w.type.shape)
        if c is not None and cg is not None and c != cg * self.groups:
            raise ValueError(f"conv2d: images have {c} channels, weights expect "
                             f"{cg} x {self.groups} groups")
        if f is not None and f % self.groups:
            raise ValueError(f"conv2d: {f} filters do not split into {self.groups} groups")
        oh, ow = self._out_hw(h, wd, fh, fw) if None not in (fh, fw) else (None, None)
        if (oh is not None and oh < 1) or (ow is not None and ow < 1):
            raise ValueError(f"conv2d: a {fh}x{fw} filter does not fit {h}x{wd} images "
                             f"(padding {self.padding}, dilation {self.dilation})")
        out = pt.tensor(dtype=dtype, shape=_image_shape(self.layout, n, f, oh, ow))
        return Apply(self, [x, w, self._geom_input()], [out])

    def perform(self, node, inputs, output_storage):
        x, w, _ = inputs
        output_storage[0][0] = K.conv_forward(_c(x), _c(w), self.layout == "NCHW", *self._geom())

    def infer_shape(self, fgraph, node, shapes):
        xs, ws = shapes[:2]
        h, w = (xs[a] for a in _spatial_axes(self.layout))
        fh, fw = _kernel_hw(self.layout, ws)
        oh, ow = self._out_hw(h, w, fh, fw)
        return [_image_shape(self.layout, xs[0], _weight_io(self.layout, ws)[1], oh, ow)]

    def pullback(self, inputs, outputs, output_grads):
        x, w, _ = inputs
        (gy,) = output_grads
        h, wd = (x.type.shape[a] for a in _spatial_axes(self.layout))
        if None in (h, wd):
            raise ValueError("conv2d: the gradient needs the images' height and width static; "
                             "declare the input as e.g. pt.tensor4('x', shape=(None, 3, 32, 32))")
        fh, fw = _kernel_hw(self.layout, w.type.shape)
        if None in (fh, fw):
            raise ValueError("conv2d: the gradient needs the filter size static (a shared "
                             "variable created with shape=..., or a tensor with static shape)")
        props = self._geometry_props()
        return [Conv2dGradInput(in_hw=(h, wd), **props)(gy, w),
                Conv2dGradWeights(kernel_hw=(fh, fw), **props)(x, gy), _disconnected()]


class Conv2dGradInput(_Geometry):
    """Return the gradient of ``Conv2d`` wrt its images: inputs ``(gy, w)``."""

    __props__ = _Geometry.__props__ + ("in_hw",)

    def __init__(self, in_hw, **kwargs):
        super().__init__(**kwargs)
        self.in_hw = _pair(in_hw, "in_hw", "Conv2dGradInput")

    def make_node(self, gy, w):
        dtype = _float_dtype(pt.as_tensor_variable(gy), pt.as_tensor_variable(w))
        gy = _tensor4(gy, dtype, "Conv2dGradInput", "gy")
        w = _tensor4(w, dtype, "Conv2dGradInput", "w")
        cg, _ = _weight_io(self.layout, w.type.shape)
        c = None if cg is None else cg * self.groups
        out = pt.tensor(dtype=dtype, shape=_image_shape(self.layout, gy.type.shape[0], c,
                                                        *self.in_hw))
        return Apply(self, [gy, w, self._geom_input(*self.in_hw)], [out])

    def perform(self, node, inputs, output_storage):
        gy, w, _ = inputs
        output_storage[0][0] = K.conv_grad_input(_c(gy), _c(w), self.layout == "NCHW", *self.in_hw,
                                                 *self._geom())

    def infer_shape(self, fgraph, node, shapes):
        gys, ws = shapes[:2]
        c = _weight_io(self.layout, ws)[0] * self.groups
        return [_image_shape(self.layout, gys[0], c, *self.in_hw)]


class Conv2dGradWeights(_Geometry):
    """Return the gradient of ``Conv2d`` wrt its weights: inputs ``(x, gy)``."""

    __props__ = _Geometry.__props__ + ("kernel_hw",)

    def __init__(self, kernel_hw, **kwargs):
        super().__init__(**kwargs)
        self.kernel_hw = _pair(kernel_hw, "kernel_hw", "Conv2dGradWeights")

    def make_node(self, x, gy):
        dtype = _float_dtype(pt.as_tensor_variable(x), pt.as_tensor_variable(gy))
        x = _tensor4(x, dtype, "Conv2dGradWeights", "x")
        gy = _tensor4(gy, dtype, "Conv2dGradWeights", "gy")
        ca = _channel_axis(self.layout)
        c, f = x.type.shape[ca], gy.type.shape[ca]
        cg = None if c is None else c // self.groups
        out = pt.tensor(dtype=dtype, shape=_weight_shape(self.layout, f, cg, *self.kernel_hw))
        return Apply(self, [x, gy, self._geom_input(*self.kernel_hw)], [out])

    def perform(self, node, inputs, output_storage):
        x, gy, _ = inputs
        output_storage[0][0] = K.conv_grad_weights(_c(x), _c(gy), self.layout == "NCHW",
                                                   *self.kernel_hw, *self._geom())

    def infer_shape(self, fgraph, node, shapes):
        xs, gys = shapes[:2]
        ca = _channel_axis(self.layout)
        return [_weight_shape(self.layout, gys[ca], xs[ca] // self.groups, *self.kernel_hw)]


class _Pool(Op):
    """Shared props and checks of the pooling Ops."""

    __props__ = ("layout", "size", "stride", "padding")

    def __init__(self, layout="NCHW", size=2, stride=None, padding=0):
        where = type(self).__name__
        _check_layout(layout, where)
        self.layout = layout
        self.size = _pair(size, "size", where)
        self.stride = self.size if stride is None else _pair(stride, "stride", where)
        self.padding = _pair(padding, "padding", where)
        if min(self.size) < 1 or min(self.stride) < 1 or min(self.padding) < 0:
            raise ValueError(f"{where}: size and stride must be >= 1 and padding >= 0")
        if any(p >= s for p, s in zip(self.padding, self.size)):
            raise ValueError(f"{where}: padding {self.padding} must be smaller than the "
                             f"window {self.size}, or some windows would be all padding")

    def _geom(self):
        return (*self.size, *self.stride, *self.padding)

    def _geom_input(self, *extra):
        return _geometry_constant((self.layout == "NCHW", *self._geom(), *extra))

    def connection_pattern(self, node):
        return [[True]] * (len(node.inputs) - 1) + [[False]]

    def _out_shape(self, shape):
        h, w = (shape[a] for a in _spatial_axes(self.layout))
        oh = conv_out_len(h, self.size[0], self.stride[0], self.padding[0])
        ow = conv_out_len(w, self.size[1], self.stride[1], self.padding[1])
        return _image_shape(self.layout, shape[0], shape[_channel_axis(self.layout)], oh, ow)

    def _props_kw(self):
        return dict(layout=self.layout, size=self.size, stride=self.stride,
                    padding=self.padding)


class MaxPool2d(_Pool):
    """Take the max over every window; padded cells never win.  Input ``x``."""

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        x = _tensor4(x, _float_dtype(x), "max_pool2d", "x")
        out = pt.tensor(dtype=x.dtype, shape=self._out_shape(x.type.shape))
        return Apply(self, [x, self._geom_input()], [out])

    def perform(self, node, inputs, output_storage):
        output_storage[0][0] = K.max_pool_forward(_c(inputs[0]), self.layout == "NCHW",
                                                  *self._geom())

    def infer_shape(self, fgraph, node, shapes):
        return [self._out_shape(shapes[0])]

    def pullback(self, inputs, outputs, output_grads):
        return [MaxPool2dGrad(**self._props_kw())(inputs[0], output_grads[0]), _disconnected()]


class MaxPool2dGrad(_Pool):
    """Return the gradient of ``MaxPool2d``: inputs ``(x, gy)``; ties go to the first max."""

    def make_node(self, x, gy):
        x = pt.as_tensor_variable(x)
        dtype = _float_dtype(x, pt.as_tensor_variable(gy))
        x = _tensor4(x, dtype, "MaxPool2dGrad", "x")
        gy = _tensor4(gy, dtype, "MaxPool2dGrad", "gy")
        return Apply(self, [x, gy, self._geom_input()], [x.type()])

    def perform(self, node, inputs, output_storage):
        x, gy, _ = inputs
        output_storage[0][0] = K.max_pool_grad(_c(x), _c(gy), self.layout == "NCHW", *self._geom())

    def infer_shape(self, fgraph, node, shapes):
        return [shapes[0]]


class AvgPool2d(_Pool):
    """Take the mean over every window, padding counted as zeros.  Input ``x``."""

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        x = _tensor4(x, _float_dtype(x), "avg_pool2d", "x")
        out = pt.tensor(dtype=x.dtype, shape=self._out_shape(x.type.shape))
        return Apply(self, [x, self._geom_input()], [out])

    def perform(self, node, inputs, output_storage):
        output_storage[0][0] = K.avg_pool_forward(_c(inputs[0]), self.layout == "NCHW",
                                                  *self._geom())

    def infer_shape(self, fgraph, node, shapes):
        return [self._out_shape(shapes[0])]

    def pullback(self, inputs, outputs, output_grads):
        x = inputs[0]
        h, w = (x.type.shape[a] for a in _spatial_axes(self.layout))
        if None in (h, w):
            raise ValueError("avg_pool2d: the gradient needs the images' height and width "
                             "static")
        return [AvgPool2dGrad(in_hw=(h, w), **self._props_kw())(output_grads[0]), _disconnected()]


class AvgPool2dGrad(_Pool):
    """Return the gradient of ``AvgPool2d`` for images of ``in_hw``: input ``gy``."""

    __props__ = _Pool.__props__ + ("in_hw",)

    def __init__(self, in_hw, **kwargs):
        super().__init__(**kwargs)
        self.in_hw = _pair(in_hw, "in_hw", "AvgPool2dGrad")

    def make_node(self, gy):
        gy = pt.as_tensor_variable(gy)
        gy = _tensor4(gy, _float_dtype(gy), "AvgPool2dGrad", "gy")
        shape = _image_shape(self.layout, gy.type.shape[0],
                             gy.type.shape[_channel_axis(self.layout)], *self.in_hw)
        return Apply(self, [gy, self._geom_input(*self.in_hw)],
                     [pt.tensor(dtype=gy.dtype, shape=shape)])

    def perform(self, node, inputs, output_storage):
        output_storage[0][0] = K.avg_pool_grad(_c(inputs[0]), self.layout == "NCHW", *self.in_hw,
                                               *self._geom())

    def infer_shape(self, fgraph, node, shapes):
        gys = shapes[0]
        return [_image_shape(self.layout, gys[0], gys[_channel_axis(self.layout)],
                             *self.in_hw)]


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


def max_pool2d(x, size=2, stride=None, padding=0, layout="NCHW"):
    """Return the max over ``size`` windows (stride defaults to ``size``)."""
    return MaxPool2d(layout, size, stride, padding)(x)


def avg_pool2d(x, size=2, stride=None, padding=0, layout="NCHW"):
    """Return the mean over ``size`` windows, padding counted as zeros."""
    return AvgPool2d(layout, size, stride, padding)(x)


# One module-level function per Op class reads the geometry input, so every node of a
# class shares one compiled function (and one cache entry) per dtype.

_NUMBA_KEY_VERSION = 1
_c = np.ascontiguousarray   # kernels then compile for C-ordered arrays only


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


def _register_numba(op_type, fn):
    key = f"synkhronos.extensions.{op_type.__name__}.v{_NUMBA_KEY_VERSION}"

    @numba_basic.register_funcify_and_cache_key(op_type)
    def funcify(op, node=None, **kwargs):
        return fn, key


for _op_type, _fn in ((Conv2d, _conv2d_numba), (Conv2dGradInput, _conv2d_grad_input_numba),
                      (Conv2dGradWeights, _conv2d_grad_weights_numba),
                      (MaxPool2d, _max_pool2d_numba), (MaxPool2dGrad, _max_pool2d_grad_numba),
                      (AvgPool2d, _avg_pool2d_numba), (AvgPool2dGrad, _avg_pool2d_grad_numba)):
    _register_numba(_op_type, _fn)
