"""Synchronized batch norm: N ranks train exactly like one process with all the rows.

Outputs and gradients of a graph with SyncBatchNorm on 2 and 3 ranks are
compared with the same graph in serial PyTensor (the collectives are the
identity there) and with batch norm written in NumPy; a training run with
make_train_function is compared with its serial twin built on the plain
BatchNorm layer.  Row counts include uneven splits and a rank with no rows.
"""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from synkhronos import ingraph
from synkhronos.extensions import layers as L
from synkhronos.extensions import train
from synkhronos.extensions.batchnorm import SyncBatchNorm

pytestmark = pytest.mark.timeout(110)

MODE = "FAST_COMPILE"
F = 4
EPS = 1e-4


def numpy_bn(x, gamma, beta):
    mean = x.mean(axis=0)
    var = x.var(axis=0)
    return (x - mean) * (gamma / np.sqrt(var + EPS)) + beta


def _graph():
    """Return (x, bn, objective per rank, outputs to differentiate)."""
    x = pt.matrix("x", dtype="float64")
    bn = SyncBatchNorm(F, epsilon=EPS)
    bn.gamma.set_value(np.array([1.0, 2.0, 0.5, -1.0], dtype=bn.gamma.dtype))
    bn.beta.set_value(np.array([0.0, 1.0, -1.0, 3.0], dtype=bn.beta.dtype))
    y = bn(pt.cast(x, bn.gamma.dtype))
    c = pt.constant(np.array([1.0, -2.0, 0.5, 3.0]))
    rows = pt.sqr(y * c).sum(axis=1) + pt.sin(y[:, 0])
    # The global mean of the row losses, as each rank's share of it.
    n_global = ingraph.psum(pt.cast(x.shape[0], "float64"))
    objective = rows.sum() / n_global
    return x, bn, y, objective


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("rows", [11, 3, 2])
def test_outputs_and_gradients_match_one_process(forked, n, rows):
    forked(n)
    x, bn, y, objective = _graph()
    g_gamma, g_beta, g_x = pytensor.grad(objective, [bn.gamma, bn.beta, x])
    outs = [(y, "gather"), (objective, "sum"), (g_gamma, "sum"), (g_beta, "sum"), (g_x, "gather")]
    f = synk.function([x], outs, updates=bn.updates, mode=MODE)
    serial = pytensor.function([x], [o for o, _ in outs], mode=MODE)
    synk.distribute()
    x_data = np.random.default_rng(rows).normal(size=(rows, F)) * 3 + 1
    got = f(x_data)
    mean_before = bn.mean.get_value()
    want = serial(x_data)  # serial updates the master's running stats: read them first
    np.testing.assert_allclose(got[0], numpy_bn(x_data, bn.gamma.get_value(), bn.beta.get_value()),
                               rtol=1e-5, atol=1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # Every rank computed the same running statistics, the rank without rows too.
    ranks = synk.gather(bn.mean)
    for value in ranks:
        np.testing.assert_array_equal(value, mean_before)
    np.testing.assert_allclose(mean_before, 0.1 * x_data.mean(axis=0), rtol=1e-5)


def _model(rng, bn_class):
    x = pt.matrix("x")
    y = pt.ivector("y")
    d1 = L.Dense(6, 8, rng=rng, bias=False, name="d1")  # BN cancels a bias: its gradient is noise
    bn = bn_class(8, epsilon=EPS)
    d2 = L.Dense(8, 3, rng=rng, init="glorot", name="d2")
    scores = d2(L.relu(bn(d1(x))))
    loss = L.softmax_cross_entropy(scores, y).mean()
    return x, y, loss, d1.params + bn.params + d2.params, bn


def test_training_matches_the_serial_twin(forked):
    forked(3)
    x, y, loss, params, bn = _model(np.random.default_rng(0), SyncBatchNorm)
    step = train.make_train_function(loss, params, x, y, update_rule="adam",
                                     update_kwargs={"learning_rate": 0.05},
                                     extra_updates=bn.updates, mode=MODE)
    xs, ys, loss_s, params_s, bn_s = _model(np.random.default_rng(0), L.BatchNorm)
    serial = train.make_serial_train_function(loss_s, params_s, xs, ys, update_rule="adam",
                                              update_kwargs={"learning_rate": 0.05},
                                              extra_updates=bn_s.updates, mode=MODE)
    synk.distribute()
    rng = np.random.default_rng(1)
    x_data = rng.normal(size=(40, 6)).astype("float32")
    y_data = rng.integers(0, 3, size=40).astype("int32")
    for k, rows in enumerate([24, 20, 7, 2, 24]):
        idx = rng.permutation(40)[:rows]
        got = step(x_data, y_data, batch=idx)
        want = serial(x_data[idx], y_data[idx])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"step {k}")
    for p, q in zip(params + [bn.mean, bn.var], params_s + [bn_s.mean, bn_s.var]):
        np.testing.assert_allclose(p.get_value(), q.get_value(), rtol=1e-4, atol=1e-5,
                                   err_msg=p.name)
        for value in synk.gather(p):  # the replicas agree
            np.testing.assert_array_equal(value, p.get_value())


def test_four_small_all_reduces_per_layer_and_step():
    # docs/sync_batchnorm.md: two in the forward pass, two in its gradient.
    x = pt.matrix("x", dtype="float64")
    bn = SyncBatchNorm(F, epsilon=EPS)
    y = bn(pt.cast(x, bn.gamma.dtype))
    loss = pt.sqr(y).sum() + pt.sin(y[:, 0]).sum()
    grads = pytensor.grad(loss, [bn.gamma, bn.beta, x])

    def count(outputs):
        f = pytensor.function([x], outputs, mode="FAST_RUN")
        return sum(isinstance(n.op, ingraph.AllReduceOp) for n in f.maker.fgraph.apply_nodes)
    assert count([y]) == 2
    assert count([loss, *grads]) == 4
