"""Overlapped training steps (double buffering) against a serial run that updates one step late."""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from synkhronos import ingraph
from synkhronos.extensions import layers as L
from synkhronos.extensions import train, updates

pytestmark = pytest.mark.timeout(100)

MODE = "FAST_COMPILE"
STEPS = [24, 20, 7, 2, 24, 13]


def _model(rng_seed, x, y):
    d = L.Dense(5, 3, rng=np.random.default_rng(rng_seed), init="glorot")
    return L.softmax_cross_entropy(d(x), y).mean(), d.params


def _serial_delayed(rule, hyper):
    """The reference: step t computes the loss and gradient, then applies step t-1's gradient."""
    x, y = pt.matrix("xs"), pt.ivector("ys")
    loss, params = _model(0, x, y)
    f_grad = pytensor.function([x, y], [loss] + pytensor.grad(loss, params), mode=MODE)
    g_in = [p.type() for p in params]
    f_apply = pytensor.function(g_in, [], updates=getattr(updates, f"apply_{rule}")(
        g_in, params, **hyper), mode=MODE)
    return f_grad, f_apply, params


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("num_slices", [1, 2])
def test_overlap_updates_with_the_previous_gradient(forked, n, num_slices):
    forked(n)
    hyper = {"learning_rate": 0.05}
    x, y = pt.matrix("x"), pt.ivector("y")
    loss, params = _model(0, x, y)
    step = train.make_train_function(loss, params, x, y, update_rule="momentum",
                                     update_kwargs=hyper, overlap=True, mode=MODE)
    f_grad, f_apply, params_s = _serial_delayed("momentum", hyper)
    synk.distribute()
    rng = np.random.default_rng(1)
    x_data = rng.normal(size=(40, 5)).astype("float32")
    y_data = rng.integers(0, 3, size=40).astype("int32")
    pending = None
    for k, rows in enumerate(STEPS):
        idx = rng.permutation(40)[:rows]
        got = step(x_data, y_data, batch=idx, num_slices=num_slices if rows > 6 else 1)
        loss_s, *grads = f_grad(x_data[idx], y_data[idx])
        if pending is not None:
            f_apply(*pending)
        pending = grads
        np.testing.assert_allclose(got, loss_s, rtol=1e-5, err_msg=f"step {k}")
    step.flush()
    f_apply(*pending)
    step.flush()  # nothing left: no-op
    for p, q in zip(params, params_s):
        np.testing.assert_allclose(p.get_value(), q.get_value(), rtol=1e-5, atol=1e-6)
        for value in synk.gather(p):
            np.testing.assert_array_equal(value, p.get_value())


def test_overlap_with_bfloat16_and_refusals(forked):
    forked(2)
    x, y = pt.matrix("x"), pt.ivector("y")
    loss, params = _model(0, x, y)
    step = train.make_train_function(loss, params, x, y, update_rule="adam", overlap=True,
                                     all_reduce_dtype="bfloat16", mode=MODE)
    loss2, params2 = _model(1, x, y)
    with pytest.raises(ValueError, match="in-graph collectives"):
        train.make_train_function(loss2 + ingraph.psum(loss2) * 0, params2, x, y,
                                  overlap=True, update_rule="adam", mode=MODE)
    with pytest.raises(synk.SynkStateError):
        step(np.zeros((4, 5), "float32"), np.zeros(4, "int32"))
    synk.distribute()
    rng = np.random.default_rng(2)
    x_data = rng.normal(size=(30, 5)).astype("float32")
    y_data = rng.integers(0, 3, size=30).astype("int32")
    first = step(x_data, y_data)
    for _ in range(30):
        last = step(x_data, y_data)
    step.flush()
    assert last < first  # it trains
