"""Extensions, three groups, each a client of the public API (``tests/extensions/test_extension_seams.py``):

- training: ``updates`` (the update rules split for data parallelism, on ``flat``'s
  flat gradient) and ``train`` (a training-step helper and its serial twin);
- Ops and layers: ``ops`` (convolution, pooling and batch-norm Ops, their CPU kernels
  and JAX implementations), ``layers`` (small layers on them) and ``batchnorm``
  (``SyncBatchNorm``);
- PyMC: ``pymc`` (imported on its own; it needs PyMC).

    from synkhronos.extensions import updates, train, layers, ops
"""

import sys

from . import layers, ops, train, updates
from .train import make_serial_train_function, make_train_function

# Import paths the docs showed before the Ops moved into ops/, kept working.
_MOVED = {"bn_ops": ops.batch_norm}
sys.modules.update({f"{__name__}.{old}": module for old, module in _MOVED.items()})


def __getattr__(name):
    if name in _MOVED:
        return _MOVED[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["updates", "train", "layers", "ops", "make_train_function", "make_serial_train_function"]
