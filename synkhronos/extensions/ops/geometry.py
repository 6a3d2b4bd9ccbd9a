"""What the convolution and pooling Ops share: layouts, shapes, argument checks, Numba registration.

An Op registers its Numba implementation with ``register_numba``: one
module-level function per Op class, under a cache key of its own.
"""

import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import DisconnectedType
from pytensor.link.numba.dispatch import basic as numba_basic
from pytensor.scalar import upcast

LAYOUTS = ("NCHW", "NHWC")

_NUMBA_KEY_VERSION = 1


def int_pair(value, name, where):
    pair = (value, value) if isinstance(value, (int, np.integer)) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, (int, np.integer)) for v in pair):
        raise ValueError(f"{where}: {name} must be an int or a pair of ints; got {value!r}")
    return tuple(int(v) for v in pair)


def conv_out_len(size, k, stride, pad, dilation=1):
    """Return an output length along one axis; ``size`` may be an int, None or symbolic."""
    if size is None:
        return None
    return (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1


def check_layout(layout, where):
    if layout not in LAYOUTS:
        raise ValueError(f"{where}: layout must be 'NCHW' or 'NHWC'; got {layout!r}")


def spatial_axes(layout):
    return (2, 3) if layout == "NCHW" else (1, 2)


def channel_axis(layout):
    return 1 if layout == "NCHW" else 3


def image_shape(layout, n, c, h, w):
    return (n, c, h, w) if layout == "NCHW" else (n, h, w, c)


def weight_shape(layout, f, cg, fh, fw):
    return (f, cg, fh, fw) if layout == "NCHW" else (fh, fw, cg, f)


def filter_hw(layout, wshape):
    return tuple(wshape[2:]) if layout == "NCHW" else tuple(wshape[:2])


def weight_io(layout, wshape):
    """(input channels per group, filters) of a weight shape."""
    return (wshape[1], wshape[0]) if layout == "NCHW" else (wshape[2], wshape[3])


def tensor4(x, dtype, where, name):
    x = pt.as_tensor_variable(x)
    if x.ndim != 4:
        raise ValueError(f"{where}: {name} must be 4-d; got ndim {x.ndim}")
    return pt.cast(x, dtype) if x.dtype != dtype else x


def float_dtype(*xs):
    dtype = upcast(*(x.dtype for x in xs))
    return dtype if dtype.startswith("float") else "float64"


def disconnected():
    return DisconnectedType()()


def geometry_constant(values):
    # The geometry also travels as a constant input: the Numba backend then compiles one
    # function per Op class and dtype that reads it at run time, where a closure over each
    # node's props compiled one per node (minutes of LLVM for a ResNet).
    return pt.constant(np.asarray(values, dtype="int64"))


def register_numba(op_type, fn):
    """Make ``fn``, a Numba function reading the geometry input, ``op_type``'s implementation.

    The function is module-level, so every node of the class shares one
    compiled function (and one cache entry) per dtype.
    """
    # A cache entry pickles the module of the code it compiled: the key names that module,
    # so an entry made before the module moved (or in a checkout where it has not) is not
    # loaded here.
    key = f"{fn.__module__}.{op_type.__name__}.v{_NUMBA_KEY_VERSION}"

    @numba_basic.register_funcify_and_cache_key(op_type)
    def funcify(op, node=None, **kwargs):
        return fn, key
