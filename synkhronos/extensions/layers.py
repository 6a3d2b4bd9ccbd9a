"""A few small layers for the demos and quick starts: dense, convolution, batch norm, pooling.

Convolution and pooling are the Ops of ``synkhronos.extensions.ops``: one
node each (and one per gradient), run by ``jax.lax`` in GPU mode (mode "JAX")
and by Numba im2col + BLAS kernels in CPU mode, so one model definition
trains in both.  Everything else is plain PyTensor expressions.  Images are
channels-last by default, ``(batch, height, width, channels)``, the faster
layout on the CPU (``layout="NCHW"`` is accepted too).  The images' height,
width and channels must be static, e.g. ``pt.tensor4("x", shape=(None, 28, 28,
1))``: every shape but the batch size then stays a constant, which the JAX
backend needs.  Layers are callables holding their parameters in ``params``;
this is a quick start, not a deep-learning framework.
"""

import math

import numpy as np
import pytensor
import pytensor.tensor as pt

from . import ops

__all__ = [
    "he_normal", "glorot_uniform", "Dense", "Conv2D", "BatchNorm",
    "relu", "softmax", "log_softmax", "cross_entropy", "softmax_cross_entropy", "accuracy",
    "flatten2d", "window_index", "im2col", "conv2d", "max_pool2d", "avg_pool2d", "global_avg_pool",
    "batch_norm_stats",
]


def _floatx():
    return pytensor.config.floatX


def _rng(rng):
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def he_normal(shape, fan_in, rng=None, gain=math.sqrt(2.0)):
    """Return He-normal weights: N(0, (gain / sqrt(fan_in))**2), as floatX.

    The default gain suits ReLU layers (He et al., 2015).
    """
    std = gain / math.sqrt(fan_in)
    return (_rng(rng).standard_normal(shape) * std).astype(_floatx())


def glorot_uniform(shape, fan_in, fan_out, rng=None, gain=1.0):
    """Return Glorot-uniform weights: U(-a, a), a = gain * sqrt(6 / (fan_in + fan_out)), as floatX."""
    a = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return _rng(rng).uniform(-a, a, shape).astype(_floatx())


def _shared(value, name):
    # Static shapes let PyTensor fold shapes to constants while rewriting.
    value = np.asarray(value, dtype=_floatx())
    return pytensor.shared(value, name=name, shape=value.shape)


class Dense:
    """A fully connected layer: ``x @ W + b``.

    Args:
        n_in: input features.
        n_out: output features.
        rng: a NumPy Generator or seed for the weights.
        init: "he" (ReLU layers) or "glorot".
        bias: add a bias vector.
        name: prefix of the parameter names.

    Attributes:
        W, b: the parameters (b is None without bias).
        params: the list of parameters.
    """

    def __init__(self, n_in, n_out, rng=None, init="he", bias=True, name="dense"):
        if init == "he":
            w = he_normal((n_in, n_out), n_in, rng)
        elif init == "glorot":
            w = glorot_uniform((n_in, n_out), n_in, n_out, rng)
        else:
            raise ValueError(f"Dense: init must be 'he' or 'glorot'; got {init!r}")
        self.W = _shared(w, f"{name}.W")
        self.b = _shared(np.zeros(n_out), f"{name}.b") if bias else None
        self.params = [self.W] + ([self.b] if bias else [])

    def __call__(self, x):
        """Apply to a ``(batch, n_in)`` matrix (flatten images first with ``flatten2d``)."""
        out = pt.dot(x, self.W)
        return out if self.b is None else out + self.b


class Conv2D:
    """A 2-D convolution (cross-correlation, as in every DL library): one ``ops.Conv2d`` node.

    Args:
        n_in: input channels.
        n_out: output channels (filters).
        filter_size: an int or ``(height, width)``.
        stride: an int or a pair.
        pad: zero padding on each side, an int, a pair, or "same" (``filter_size // 2``).
        rng: a NumPy Generator or seed for the weights (He-normal).
        bias: add a bias per filter (leave it out before batch norm).
        name: prefix of the parameter names.
        dilation: spacing of the filter taps, an int or a pair.
        groups: split channels and filters into this many groups.
        layout: "NHWC" (weights ``(fh, fw, n_in // groups, n_out)``) or "NCHW"
            (weights ``(n_out, n_in // groups, fh, fw)``).

    Attributes:
        W: the weights.
        b: the bias, or None.
        params: the list of parameters.
    """

    def __init__(self, n_in, n_out, filter_size, stride=1, pad=0, rng=None, bias=True,
                 name="conv", dilation=1, groups=1, layout="NHWC"):
        fh, fw = _pair(filter_size)
        if n_in % groups or n_out % groups:
            raise ValueError(f"Conv2D: n_in {n_in} and n_out {n_out} must split into "
                             f"{groups} groups")
        self.filter_size = (fh, fw)
        self.stride = stride
        self.pad = (fh // 2, fw // 2) if pad == "same" else pad
        self.dilation = dilation
        self.groups = groups
        self.layout = layout
        w = he_normal((fh, fw, n_in // groups, n_out), fh * fw * n_in // groups, rng)
        if layout == "NCHW":
            w = np.ascontiguousarray(w.transpose(3, 2, 0, 1))
        self.W = _shared(w, f"{name}.W")
        self.b = _shared(np.zeros(n_out), f"{name}.b") if bias else None
        self.params = [self.W] + ([self.b] if bias else [])

    def __call__(self, x):
        """Apply to images ``(batch, height, width, n_in)`` (or NCHW); return the feature maps."""
        out = conv2d(x, self.W, self.stride, self.pad, self.dilation, self.groups, self.layout)
        if self.b is None:
            return out
        return out + (self.b if self.layout == "NHWC" else self.b[:, None, None])


class BatchNorm:
    """Batch normalization over every axis but the feature axis, with running statistics.

    In training (``deterministic=False``) the layer normalizes with the
    statistics of the rows it sees (in data-parallel runs: each rank's share,
    as the original Synkhronos did) and its ``updates`` move the running mean
    and variance towards them; add those updates to the training function.
    Each rank then keeps its own running statistics: average them with one
    ``synk.all_reduce(batch_norm_stats(layers), "avg")`` (e.g. at the end of an
    epoch).  With ``deterministic=True`` it normalizes with the running
    statistics (evaluation).

    Args:
        n_features: size of the feature axis.
        alpha: weight of the newest batch in the running averages.
        epsilon: added to the variance.
        name: prefix of the parameter names.
        axis: the feature axis (-1 for NHWC images and matrices, 1 for NCHW).
        n_groups: normalize each of this many equal, consecutive groups of
            rows with its own statistics ("ghost" batch norm).  A serial
            twin of a data-parallel run on N ranks sets N, so it computes
            what the ranks compute; the running statistics then follow the
            mean of the groups' statistics, as the ranks' averaged ones do.

    Attributes:
        gamma, beta: the trained scale and shift (``params``).
        mean, var: running statistics (shared, not trained).
        updates: ``(shared, update)`` pairs from the last training-mode call.
    """

    def __init__(self, n_features, alpha=0.1, epsilon=1e-4, name="bn", axis=-1, n_groups=1):
        self.axis = axis
        self.n_groups = n_groups
        self.alpha = alpha
        self.epsilon = epsilon
        self.gamma = _shared(np.ones(n_features), f"{name}.gamma")
        self.beta = _shared(np.zeros(n_features), f"{name}.beta")
        self.mean = _shared(np.zeros(n_features), f"{name}.mean")
        self.var = _shared(np.ones(n_features), f"{name}.var")
        self.params = [self.gamma, self.beta]
        self.updates = []

    @property
    def stats(self):
        """The running statistics ``[mean, var]`` (shared variables, one copy per rank)."""
        return [self.mean, self.var]

    def __call__(self, x, deterministic=False):
        """Normalize ``x`` (any ndim >= 2)."""
        axis = self.axis % x.ndim
        shape = [1] * x.ndim
        shape[axis] = -1
        gamma, beta = self.gamma.reshape(shape), self.beta.reshape(shape)
        if deterministic:
            mean, var = self.mean.reshape(shape), self.var.reshape(shape)
            return (x - mean) * (gamma / pt.sqrt(var + self.epsilon)) + beta
        if not (axis == x.ndim - 1 or (axis == 1 and x.ndim == 4)):
            raise ValueError("BatchNorm: the feature axis must be the last one, or 1 of 4-d "
                             f"images; got axis {self.axis} of a {x.ndim}-d input")
        axis = -1 if axis == x.ndim - 1 else 1
        out, batch_mean, batch_var = ops.batch_norm_train(x, self.gamma, self.beta, axis,
                                                          self.epsilon, self.n_groups)
        a = self.alpha
        self.updates = [(self.mean, pt.cast((1 - a) * self.mean + a * batch_mean, _floatx())),
                        (self.var, pt.cast((1 - a) * self.var + a * batch_var, _floatx()))]
        return out


def batch_norm_stats(layers):
    """Return the running statistics of batch-norm layers, for one all-reduce.

    ``synk.all_reduce(batch_norm_stats(bns), "avg")`` makes every rank's
    running mean and variance the average over ranks.
    """
    return [s for bn in layers for s in bn.stats]


def relu(x):
    """Return ``max(x, 0)``."""
    return pt.maximum(x, 0)


def softmax(x):
    """Return the softmax over the last axis."""
    return pt.special.softmax(x, axis=-1)


def log_softmax(x):
    """Return the log-softmax over the last axis (stable for large logits)."""
    return pt.special.log_softmax(x, axis=-1)


def cross_entropy(probs, targets):
    """Return the per-row categorical cross-entropy of probabilities vs. class indices.

    Args:
        probs: ``(batch, classes)`` probabilities (e.g. ``softmax`` output).
        targets: ``(batch,)`` integer class indices.

    Returns:
        A ``(batch,)`` vector; take ``.mean()`` for a loss.
    """
    return -pt.sum(pt.log(probs) * _one_hot(targets, probs), axis=-1)


def softmax_cross_entropy(logits, targets):
    """Return the per-row cross-entropy of ``softmax(logits)``, computed stably from logits.

    Args:
        logits: ``(batch, classes)`` unnormalized scores.
        targets: ``(batch,)`` integer class indices.
    """
    return -pt.sum(log_softmax(logits) * _one_hot(targets, logits), axis=-1)


def _one_hot(targets, scores):
    """A 0/1 matrix selecting each row's target class, built without indexing.

    A product with it differentiates to plain elementwise ops, where indexing
    ``scores[arange(n), targets]`` would differentiate into an indexed update
    of a zeros array, which the JAX backend cannot compile.
    """
    k = scores.type.shape[-1]
    classes = np.arange(k) if k is not None else pt.arange(scores.shape[-1])
    return pt.cast(pt.eq(targets[:, None], classes[None, :]), scores.dtype)


def accuracy(scores, targets):
    """Return the fraction of rows whose highest score is the target class."""
    return pt.mean(pt.eq(pt.argmax(scores, axis=-1), targets), dtype=_floatx())


def flatten2d(x):
    """Return ``x`` reshaped to ``(batch, everything else)``."""
    rest = x.type.shape[1:]
    if None in rest:
        return x.reshape((x.shape[0], -1))
    return x.reshape((x.shape[0], math.prod(rest)))


def _spatial(x, where):
    """The static height, width and channels of images ``(n, h, w, c)``; they must be known."""
    if x.ndim != 4:
        raise ValueError(f"{where}: images must be 4-d (batch, height, width, channels); "
                         f"got ndim {x.ndim}")
    _, h, w, c = x.type.shape
    if None in (h, w, c):
        raise ValueError(f"{where}: the height, width and channels of {x} must be static; "
                         "declare the input as e.g. pt.tensor4('x', shape=(None, 28, 28, 1))")
    return h, w, c


def _pair(size):
    return (size, size) if isinstance(size, int) else tuple(size)


def window_index(h, w, filter_size, stride=1, pad=0):
    """Return where every window cell of every output position reads, as an int array.

    Entry ``[y * ow + x, i * fw + j]`` is the flat position ``r * w + s`` of the
    input cell ``(r, s) = (y * stride + i - pad, x * stride + j - pad)``, or
    ``h * w`` (one past the last cell) where that cell is padding.

    Returns:
        ``(index, oh, ow)`` with ``index`` of shape ``(oh * ow, fh * fw)``.
    """
    fh, fw = _pair(filter_size)
    oh = (h + 2 * pad - fh) // stride + 1
    ow = (w + 2 * pad - fw) // stride + 1
    if oh < 1 or ow < 1:
        raise ValueError(f"a {fh}x{fw} window (pad {pad}) does not fit a {h}x{w} image")
    rows = (np.arange(oh) * stride)[:, None] + np.arange(fh)[None, :] - pad   # (oh, fh)
    cols = (np.arange(ow) * stride)[:, None] + np.arange(fw)[None, :] - pad   # (ow, fw)
    r = rows[:, None, :, None]
    s = cols[None, :, None, :]
    inside = (r >= 0) & (r < h) & (s >= 0) & (s < w)
    index = np.where(inside, r * w + s, h * w).reshape(oh * ow, fh * fw)
    return index.astype(np.int64), oh, ow


def _windows(x, filter_size, stride, pad, fill, where):
    """Gather every window: ``(n, oh * ow, fh * fw, c)``, padding read as ``fill``.

    One gather with a constant index array (rather than one strided slice per
    window offset) keeps the graph small: a few ops per layer, which compile
    quickly.  Padded cells read cell 0 and are then overwritten through a
    constant mask, which avoids building a padded array.
    """
    h, w, c = _spatial(x, where)
    index, oh, ow = window_index(h, w, filter_size, stride, pad)
    outside = index == h * w
    flat = x.reshape((x.shape[0], h * w, c))
    # A 1-d index, then a reshape: PyTensor rewrites a 2-d index into this anyway.
    cols = flat[:, np.where(outside, 0, index).ravel()]
    cols = cols.reshape((x.shape[0], oh * ow, index.shape[1], c))
    if outside.any():
        inside = (~outside)[None, :, :, None]
        cols = pt.switch(inside, cols, np.asarray(fill, dtype=x.dtype))
    return cols, oh, ow


def im2col(x, filter_size, stride=1, pad=0):
    """Return the im2col matrix of images ``(n, h, w, c)``: ``(n, oh, ow, fh * fw * c)``.

    Entry ``[b, y, x, (i * fw + j) * c + k]`` is the zero-padded input
    ``[b, y * stride + i - pad, x * stride + j - pad, k]``, which matches
    weights of shape ``(fh, fw, c, filters)`` reshaped to ``(fh * fw * c, filters)``.
    """
    fh, fw = _pair(filter_size)
    _, _, c = _spatial(x, "im2col")
    if (fh, fw) == (1, 1) and not pad:
        return x[:, ::stride, ::stride, :] if stride != 1 else x
    cols, oh, ow = _windows(x, (fh, fw), stride, pad, 0.0, "im2col")
    return cols.reshape((x.shape[0], oh, ow, fh * fw * c))


def _static_weights(W):
    # A shared variable made without shape= has no static shape; its value has one.
    if hasattr(W, "get_value") and None in W.type.shape:
        return pt.specify_shape(W, W.get_value(borrow=True).shape)
    return W


def conv2d(x, W, stride=1, pad=0, dilation=1, groups=1, layout="NHWC"):
    """Return the convolution of images ``(n, h, w, c)`` with weights ``(fh, fw, c, f)``.

    One ``ops.Conv2d`` node (see there for "NCHW").
    """
    return ops.conv2d(x, _static_weights(W), stride, pad, dilation, groups, layout)


def max_pool2d(x, size=2, stride=None, pad=0, layout="NHWC"):
    """Return the max over ``size x size`` windows of images ``(n, h, w, c)``.

    Args:
        size: the window side (or a pair).
        stride: the step (default ``size``).
        pad: padding on each side; padded cells never win the max.
        layout: "NHWC" or "NCHW".
    """
    return ops.max_pool2d(x, size, stride, pad, layout)


def avg_pool2d(x, size=2, stride=None, pad=0, layout="NHWC"):
    """Return the mean over ``size x size`` windows (padding counts as zeros)."""
    return ops.avg_pool2d(x, size, stride, pad, layout)


def global_avg_pool(x, layout="NHWC"):
    """Return the mean over height and width: ``(n, h, w, c)`` (or NCHW) to ``(n, c)``."""
    return x.mean(axis=(1, 2) if layout == "NHWC" else (2, 3))
