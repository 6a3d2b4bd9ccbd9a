"""Extensions: update rules split for data parallelism, a training-step helper, small layers.

    from synkhronos.extensions import updates, train, layers, ops, bn_ops
"""

from . import bn_ops, layers, ops, train, updates
from . import ops_jax  # noqa: F401 - registers the Ops with the JAX backend when it loads
from .train import make_serial_train_function, make_train_function

__all__ = ["updates", "train", "layers", "ops", "bn_ops", "make_train_function", "make_serial_train_function"]
