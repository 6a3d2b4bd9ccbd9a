"""Extensions, three groups, each a client of the public API (``tests/extensions/test_extension_seams.py``):

- training: ``updates`` (the update rules split for data parallelism, on ``flat``'s
  flat gradient) and ``train`` (a training-step helper and its serial twin);
- Ops and layers: ``ops`` (convolution, pooling and batch-norm Ops, their CPU kernels
  and JAX implementations), ``layers`` (small layers on them) and ``batchnorm``
  (``SyncBatchNorm``);
- PyMC: ``pymc`` (imported on its own; it needs PyMC).

    from synkhronos.extensions import updates, train, layers, ops

Each group is imported when first named: the Ops register Numba implementations, which
imports Numba and PyTensor's Numba dispatch (0.35 s), a cost a PyMC user of
``synkhronos.extensions.pymc`` has no reason to pay.
"""

import importlib

_SUBMODULES = ("updates", "train", "layers", "ops")
_FROM_TRAIN = ("make_train_function", "make_serial_train_function")
# Import paths the docs showed before the Ops moved into ops/, kept working (bn_ops.py).


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _FROM_TRAIN:
        return getattr(importlib.import_module(f"{__name__}.train"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_SUBMODULES, *_FROM_TRAIN})


__all__ = ["updates", "train", "layers", "ops", "make_train_function", "make_serial_train_function"]
