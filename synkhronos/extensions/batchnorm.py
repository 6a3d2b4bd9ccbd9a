"""Synchronized batch normalization: statistics over the whole global minibatch.

ChainerMN's ``MultiNodeBatchNormalization`` for synkhronos.  In a data-parallel
call every rank normalizes with the mean and variance of all ranks' rows
together, combined by in-graph collectives (``synkhronos.ingraph.psum``), so
N ranks with B rows each train exactly like one process with N*B rows, uneven
splits included.  Outside a synkhronos call (the serial twin, ``as_theano``)
the collectives are the identity and the layer is plain batch normalization.

    bn = SyncBatchNorm(64)
    h = bn(x)                                   # training mode
    step = make_train_function(loss, params + bn.params, x, y,
                               extra_updates=bn.updates, ...)

The running statistics computed in training are the same on every rank, so
the replicas stay equal without an all-reduce of them.
"""

import pytensor
import pytensor.tensor as pt

from .. import ingraph
from .layers import BatchNorm

__all__ = ["SyncBatchNorm", "global_moments"]


def global_moments(x, axes):
    """Return the mean and (biased) variance of ``x`` over ``axes`` and every rank's rows.

    Two passes, each one in-graph collective: the sums and the count, then the
    squared deviations from the global mean (steadier than ``E[x^2] - E[x]^2``).
    A rank with no rows adds zeros.  Symbolic; runs in every rank of a call.

    Args:
        x: a tensor.
        axes: the axes to reduce, a tuple of ints (axis 0, the rows, among them).

    Returns:
        ``(mean, var)`` with the reduced axes removed.
    """
    dtype = x.dtype
    count = pt.cast(pt.prod([x.shape[a] for a in axes]), dtype)
    first = ingraph.psum(pt.concatenate([pt.flatten(x.sum(axis=axes)), pt.shape_padleft(count)]))
    total = pt.maximum(first[-1], 1)  # an empty global batch: zeros, not NaN
    mean = pt.reshape(first[:-1] / total, x.sum(axis=axes).shape)
    keep = [i for i in range(x.ndim) if i not in axes]
    centred = x - pt.expand_dims(mean, axes) if keep else x - mean
    var = ingraph.psum(pt.sqr(centred).sum(axis=axes)) / total
    return pt.cast(mean, dtype), pt.cast(var, dtype)


class SyncBatchNorm(BatchNorm):
    """Batch normalization over every axis but the last, with statistics over all ranks.

    Args:
        n_features: size of the last axis.
        alpha: weight of the newest batch in the running averages.
        epsilon: added to the variance.
        name: prefix of the parameter names.

    Attributes:
        gamma, beta: the trained scale and shift (``params``).
        mean, var: running statistics (shared, not trained; equal on every rank).
        updates: ``(shared, update)`` pairs from the last training-mode call;
            give them to the training function (``extra_updates``).
    """

    def __init__(self, n_features, alpha=0.1, epsilon=1e-4, name="bn"):
        # The parameters and running statistics of the per-rank layer; only the
        # statistics of a training-mode call differ (global over all ranks).
        super().__init__(n_features, alpha=alpha, epsilon=epsilon, name=name)

    def __call__(self, x, deterministic=False):
        """Normalize ``x`` (any ndim >= 2, features last); symbolic."""
        if deterministic:
            mean, var = self.mean, self.var
        else:
            mean, var = global_moments(x, tuple(range(x.ndim - 1)))
            a = self.alpha
            dtype = pytensor.config.floatX
            self.updates = [(self.mean, pt.cast((1 - a) * self.mean + a * mean, dtype)),
                            (self.var, pt.cast((1 - a) * self.var + a * var, dtype))]
        return (x - mean) * (self.gamma / pt.sqrt(var + self.epsilon)) + self.beta
