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

This module is the Ops' public home; they live in ``conv_ops`` and
``pool_ops``, with what they share in ``op_geometry``.
"""

import logging

from .conv_ops import Conv2d, Conv2dGradInput, Conv2dGradWeights, conv2d
from .op_geometry import conv_out_len
from .pool_ops import AvgPool2d, AvgPool2dGrad, MaxPool2d, MaxPool2dGrad, avg_pool2d, max_pool2d

logger = logging.getLogger(__name__)

__all__ = ["Conv2d", "Conv2dGradInput", "Conv2dGradWeights", "MaxPool2d", "MaxPool2dGrad",
           "AvgPool2d", "AvgPool2dGrad", "conv2d", "max_pool2d", "avg_pool2d", "conv_out_len"]
