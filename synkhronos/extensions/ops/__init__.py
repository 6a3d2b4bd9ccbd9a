"""PyTensor Ops for 2-D convolution, pooling and batch norm, with gradients, on every backend.

Nine Ops: ``Conv2d``, ``Conv2dGradInput``, ``Conv2dGradWeights``, ``MaxPool2d``,
``MaxPool2dGrad``, ``AvgPool2d``, ``AvgPool2dGrad``, ``BatchNormTrain`` and
``BatchNormGrad``.  Each runs

- under the JAX backend as ``jax.lax.conv_general_dilated`` /
  ``jax.lax.reduce_window`` / ``jax.numpy`` (gradients as their ``jax.vjp``),
  so XLA and cuDNN do the work in GPU mode (registered by ``jax_impl``);
- under the default Numba backend, and in ``perform`` for the C and Python
  linkers, as the Numba kernels of ``kernels`` (im2col + BLAS GEMM, plain
  loops for pooling and batch norm), never as an object-mode fallback.

Images are ``"NCHW"`` (weights ``(f, c // groups, fh, fw)``, as cuDNN and torch)
or ``"NHWC"`` (weights ``(fh, fw, c // groups, f)``, as the layers use: it is
the faster layout on the CPU).  Output shapes are inferred from input shapes,
static wherever the inputs' are, so JAX sees constants.  The functions
``conv2d``, ``max_pool2d``, ``avg_pool2d`` and ``batch_norm_train`` build the nodes.

This package is the Ops' public home, one module per job:

- ``conv``, ``pool``, ``batch_norm``: the Ops, their builders and Numba registrations;
- ``kernels``: their CPU kernels (Numba);
- ``geometry``: what the convolution and pooling Ops share (layouts, shapes, checks);
- ``jax_impl``: every JAX implementation, registered when PyTensor's JAX backend loads.
"""

import logging

from .batch_norm import BatchNormGrad, BatchNormTrain, batch_norm_train
from .conv import Conv2d, Conv2dGradInput, Conv2dGradWeights, conv2d
from .geometry import conv_out_len
from .jax_impl import register_when_loaded as _register_jax
from .pool import AvgPool2d, AvgPool2dGrad, MaxPool2d, MaxPool2dGrad, avg_pool2d, max_pool2d

logger = logging.getLogger(__name__)

_register_jax()

__all__ = ["Conv2d", "Conv2dGradInput", "Conv2dGradWeights", "MaxPool2d", "MaxPool2dGrad",
           "AvgPool2d", "AvgPool2dGrad", "BatchNormTrain", "BatchNormGrad", "conv2d", "max_pool2d",
           "avg_pool2d", "batch_norm_train", "conv_out_len"]
