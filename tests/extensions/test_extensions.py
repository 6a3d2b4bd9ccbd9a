"""synkhronos.extensions: update rules vs. NumPy on 1-3 ranks, the training step, layers."""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from synkhronos.runtime.state import get_runtime
from synkhronos.extensions import layers as L
from synkhronos.extensions import train, updates

# Hyper-parameters per rule: the learning rates are chosen so that a few steps
# move the parameters visibly; the rest are the defaults under test.
HYPER = {
    "sgd": dict(learning_rate=0.05),
    "momentum": dict(learning_rate=0.05),
    "nesterov_momentum": dict(learning_rate=0.05),
    "adagrad": dict(learning_rate=0.1),
    "rmsprop": dict(learning_rate=0.01),
    "adadelta": dict(),
    "adam": dict(learning_rate=0.01),
    "adamax": dict(),
}
RULES = list(HYPER)

# Rows per step: even and uneven splits over 2 and 3 ranks, and a step with
# fewer rows than ranks (a rank gets none and must add nothing).
STEPS = [24, 20, 7, 2, 24]
N_ROWS, N_IN, N_OUT = 64, 5, 3

# The rule and layer checks compile many small graphs; PyTensor's Python
# backend compiles them in a fraction of the time Numba needs on a cold cache.
# The demos (tests/test_demos.py) run the same code on the default (Numba) backend.
FAST = "FAST_COMPILE"


# ---- the rules in NumPy (float64), written from Lasagne's definitions ----------

def numpy_rule(name, learning_rate=None, momentum=0.9, epsilon=None, rho=None,
               beta1=0.9, beta2=0.999):
    """Return step(params, grads) applying rule ``name`` in place, with Lasagne's defaults."""
    defaults = {"adagrad": (1.0, 1e-6, None), "rmsprop": (1.0, 1e-6, 0.9),
                "adadelta": (1.0, 1e-6, 0.95), "adam": (0.001, 1e-8, None),
                "adamax": (0.002, 1e-8, None)}
    lr0, eps0, rho0 = defaults.get(name, (None, None, None))
    lr = lr0 if learning_rate is None else learning_rate
    eps = eps0 if epsilon is None else epsilon
    rho = rho0 if rho is None else rho
    state = {}

    def zeros(i, key, p):
        return state.setdefault((i, key), np.zeros_like(p))

    def step(params, grads):
        t = state["t"] = state.get("t", 0) + 1
        for i, (p, g) in enumerate(zip(params, grads)):
            if name == "sgd":
                p -= lr * g
            elif name == "momentum":
                v = zeros(i, "v", p)
                v[...] = momentum * v - lr * g
                p += v
            elif name == "nesterov_momentum":
                v = zeros(i, "v", p)
                v[...] = momentum * v - lr * g
                p += momentum * v - lr * g
            elif name == "adagrad":
                a = zeros(i, "a", p)
                a += g ** 2
                p -= lr * g / np.sqrt(a + eps)
            elif name == "rmsprop":
                a = zeros(i, "a", p)
                a[...] = rho * a + (1 - rho) * g ** 2
                p -= lr * g / np.sqrt(a + eps)
            elif name == "adadelta":
                a, d = zeros(i, "a", p), zeros(i, "d", p)
                a[...] = rho * a + (1 - rho) * g ** 2
                u = g * np.sqrt(d + eps) / np.sqrt(a + eps)
                p -= lr * u
                d[...] = rho * d + (1 - rho) * u ** 2
            elif name == "adam":
                m, v = zeros(i, "m", p), zeros(i, "v", p)
                m[...] = beta1 * m + (1 - beta1) * g
                v[...] = beta2 * v + (1 - beta2) * g ** 2
                p -= lr * np.sqrt(1 - beta2 ** t) / (1 - beta1 ** t) * m / (np.sqrt(v) + eps)
            elif name == "adamax":
                m, u = zeros(i, "m", p), zeros(i, "u", p)
                m[...] = beta1 * m + (1 - beta1) * g
                u[...] = np.maximum(beta2 * u, np.abs(g))
                p -= lr / (1 - beta1 ** t) * m / (u + eps)
    return step


def linreg_grads(W, b, X, Y):
    """Gradient of mean((X @ W + b - Y)**2) over all elements."""
    err = X @ W + b - Y
    scale = 2.0 / err.size
    return [X.T @ err * scale, err.sum(axis=0) * scale]


def numpy_trajectory(name, W0, b0, X, Y, batches):
    W, b = W0.astype(np.float64), b0.astype(np.float64)
    step = numpy_rule(name, **HYPER[name])
    for idx in batches:
        step([W, b], linreg_grads(W, b, X[idx], Y[idx]))
    return W, b


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(7)
    X = rng.standard_normal((N_ROWS, N_IN)).astype("float32")
    Y = (X @ rng.standard_normal((N_IN, N_OUT)) + 0.3).astype("float32")
    W0 = rng.standard_normal((N_IN, N_OUT)).astype("float32")
    b0 = rng.standard_normal(N_OUT).astype("float32")
    batches = [rng.permutation(N_ROWS)[:k] for k in STEPS]
    return X, Y, W0, b0, batches


def linreg(W0, b0, tag):
    x = pt.matrix("x")
    y = pt.matrix("y")
    W = pytensor.shared(W0.copy(), name=f"W_{tag}")
    b = pytensor.shared(b0.copy(), name=f"b_{tag}")
    loss = pt.mean((pt.dot(x, W) + b - y) ** 2)
    return x, y, W, b, loss


def assert_close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=2e-4, atol=2e-5)


# ---- update rules, data-parallel ------------------------------------------------

@pytest.mark.parametrize("n_parallel", [1, 2, 3])
def test_rules_match_numpy(forked, problem, n_parallel):
    """Every rule, split in two with one all-reduce, follows NumPy's full-batch trajectory."""
    X, Y, W0, b0, batches = problem
    forked(n_parallel)
    models = {}
    for name in RULES:
        x, y, W, b, loss = linreg(W0, b0, name)
        split = getattr(updates, name)(loss, [W, b], weight=x.shape[0], **HYPER[name])
        f_grad = synk.function([x, y], loss, updates=split.grad_updates, mode=FAST)
        f_update = synk.function([], updates=split.param_updates, mode=FAST)
        models[name] = (W, b, f_grad, f_update, split.grad_shared)
    synk.distribute()
    x_data, y_data = synk.data(X), synk.data(Y)
    for name, (W, b, f_grad, f_update, grad_shared) in models.items():
        for k, idx in enumerate(batches):
            loss = f_grad(x_data, y_data, batch=idx)
            # Alternate the ops: the weighted vector gives the same update with either.
            synk.all_reduce(grad_shared, op="sum" if k % 2 else "avg")
            f_update()
        W_np, b_np = numpy_trajectory(name, W0, b0, X, Y, batches)
        for var, expected in ((W, W_np), (b, b_np)):
            assert_close(var.get_value(), expected)
            # Every rank applied the same update.
            for rank in range(n_parallel):
                assert_close(synk.get_value(rank, var), expected)
        assert np.isfinite(loss)


def test_unweighted_is_exact_on_even_splits(forked, problem):
    """Without ``weight`` (the original's behaviour) even splits are still exact."""
    X, Y, W0, b0, _ = problem
    forked(2)
    x, y, W, b, loss = linreg(W0, b0, "plain")
    grad_updates, param_updates, grad_shared = updates.sgd(loss, [W, b], learning_rate=0.05)
    f_grad = synk.function([x, y], loss, updates=grad_updates, mode=FAST)
    f_update = synk.function([], updates=param_updates, mode=FAST)
    synk.distribute()
    batches = [np.arange(0, 16), np.arange(16, 48)]
    for idx in batches:
        f_grad(synk.data(X), synk.data(Y), batch=idx)
        synk.all_reduce(grad_shared, op="avg")
        f_update()
    W_np, b_np = numpy_trajectory("sgd", W0, b0, X, Y, batches)
    assert_close(W.get_value(), W_np)
    assert_close(b.get_value(), b_np)


# ---- the serial twins, no processes -----------------------------------------

@pytest.mark.parametrize("name", RULES)
def test_serial_twin_matches_numpy(problem, name):
    X, Y, W0, b0, batches = problem
    x, y, W, b, loss = linreg(W0, b0, name)
    step = train.make_serial_train_function(loss, [W, b], x, y, update_rule=name,
                                            update_kwargs=HYPER[name], mode=FAST)
    for idx in batches:
        step(X, Y, batch=idx)
    W_np, b_np = numpy_trajectory(name, W0, b0, X, Y, batches)
    assert_close(W.get_value(), W_np)
    assert_close(b.get_value(), b_np)


def test_flat_helpers():
    a = pytensor.shared(np.arange(6, dtype="float32").reshape(2, 3), name="a")
    c = pytensor.shared(np.arange(4, dtype="float32"), name="c")
    assert updates.flat_size([a, c]) == 10
    flat = updates.flatten([a, c])
    np.testing.assert_array_equal(flat.eval(), np.r_[np.arange(6), np.arange(4)])
    back = updates.unflatten(flat, [a, c])
    np.testing.assert_array_equal(back[0].eval(), a.get_value())
    np.testing.assert_array_equal(back[1].eval(), c.get_value())
    # The flat gradient is w * g followed by w; the combined gradient divides.
    v = pt.vector("v")
    grad_shared, grad_updates = updates.make_flat_grad((a.sum() + (c * c).sum()) * v.sum(),
                                                       [a, c], weight=v.shape[0])
    assert grad_updates[0][0] is grad_shared and grad_updates[0][2] == "sum"
    fn = pytensor.function([v], [], updates=[u[:2] for u in grad_updates], mode=FAST)
    fn(np.ones(3, dtype="float32"))
    got = grad_shared.get_value()
    np.testing.assert_allclose(got, np.r_[np.full(6, 9.0), 3 * 3 * 2 * np.arange(4), 3.0])
    g = updates.grads_from_flat(grad_shared, [a, c])
    np.testing.assert_allclose(g[1].eval(), 3 * 2 * np.arange(4))


def test_rule_errors():
    a = pytensor.shared(np.zeros(3, dtype="float32"), name="a")
    wrong = pytensor.shared(np.zeros(7, dtype="float32"), name="wrong")
    with pytest.raises(ValueError, match="flat gradient has 7 elements"):
        updates.apply_sgd(wrong, [a], learning_rate=0.1)
    with pytest.raises(ValueError, match="2 gradients for 1 params"):
        updates.apply_adam([a, a], [a])
    with pytest.raises(TypeError, match="shared variables"):
        updates.adam(a.sum(), [pt.vector()])
    x, y = pt.matrix("x"), pt.matrix("y")
    with pytest.raises(ValueError, match="update_rule must be one of"):
        train.make_serial_train_function(a.sum(), [a], x, y, update_rule="lbfgs")
    with pytest.raises(TypeError, match="both be inputs or both be shared"):
        train.make_serial_train_function(a.sum(), [a], x, a, update_rule="sgd",
                                         update_kwargs={"learning_rate": 1})


# ---- make_train_function ------------------------------------------------------

@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(all_reduce_op="max"), ValueError, "all_reduce_op must be 'sum' or 'avg'"),
    (dict(all_reduce_op="prod"), ValueError, "all_reduce_op"),
    (dict(all_reduce_op=None), ValueError, "all_reduce_op"),
    (dict(weighted="no"), TypeError, "weighted"),
    (dict(overlap="no"), TypeError, "overlap"),
])
def test_train_function_options_are_checked_before_building(forked, kwargs, exc, words):
    forked(2)
    x, y, W, b, loss = linreg(np.zeros((N_IN, N_OUT), "float32"), np.zeros(N_OUT, "float32"),
                              "opts")
    for make in (train.make_train_function, train.make_serial_train_function):
        with pytest.raises(exc, match=f"{make.__name__}: {words}"):
            make(loss, [W, b], x, y, update_rule="sgd", update_kwargs=HYPER["sgd"], **kwargs)
    assert get_runtime().registry.functions == []            # nothing was built


def test_serial_twin_checks_batch_like_the_data_parallel_step(problem):
    X, Y, W0, b0, _ = problem
    x, y, W, b, loss = linreg(W0, b0, "serial_batch")
    step = train.make_serial_train_function(loss, [W, b], x, y, update_rule="sgd",
                                            update_kwargs=HYPER["sgd"])
    for batch, exc in [(True, TypeError), (2.0, TypeError), ([0, True], TypeError),
                       (-1, ValueError)]:
        with pytest.raises(exc, match="serial train function: batch"):
            step(X, Y, batch=batch)
    with pytest.raises(ValueError, match="num_slices"):
        step(X, Y, num_slices=True)
    np.testing.assert_array_equal(W.get_value(), W0)   # no step ran
    # an int k is rows [:k], as in the data-parallel step
    assert np.isclose(step(X, Y, batch=5), np.mean((X[:5] @ W0 + b0 - Y[:5]) ** 2), rtol=1e-5)

def test_train_function_batch_and_slices(forked, problem):
    """The one-call step equals its serial twin, with batch= and with num_slices."""
    X, Y, W0, b0, batches = problem
    forked(3)
    x, y, W, b, loss = linreg(W0, b0, "par")
    step = train.make_train_function(loss, [W, b], x, y, update_rule=updates.adam,
                                     update_kwargs={"learning_rate": 0.01},
                                     outputs=[(pt.sum((pt.dot(x, W) + b - y) ** 2), "sum")],
                                     mode=FAST)
    synk.distribute()
    xs, ys, Ws, bs, loss_s = linreg(W0, b0, "ser")
    serial = train.make_serial_train_function(loss_s, [Ws, bs], xs, ys, update_rule="adam",
                                              update_kwargs={"learning_rate": 0.01}, mode=FAST)
    x_data, y_data = synk.data(X), synk.data(Y)
    for k, idx in enumerate(batches):
        out, sse = step(x_data, y_data, batch=idx, num_slices=1 + k % 3)
        expected = serial(X, Y, batch=idx)
        np.testing.assert_allclose(out, expected, rtol=1e-5)
        np.testing.assert_allclose(sse, expected * len(idx) * N_OUT, rtol=1e-4)
    assert_close(W.get_value(), Ws.get_value())
    assert_close(b.get_value(), bs.get_value())
    assert_close(synk.get_value(2, W), Ws.get_value())


def test_a_step_is_one_command_and_equals_the_three_command_path(forked, problem):
    """The fused step (gradient, all-reduce, update in one command) == the three commands."""
    X, Y, W0, b0, batches = problem
    forked(3)
    x, y, W, b, loss = linreg(W0, b0, "fused")
    fused = train.make_train_function(loss, [W, b], x, y, update_rule="adam",
                                      update_kwargs={"learning_rate": 0.01}, mode=FAST)
    x2, y2, W2, b2, loss2 = linreg(W0, b0, "three")
    three = train.make_train_function(loss2, [W2, b2], x2, y2, update_rule="adam",
                                      update_kwargs={"learning_rate": 0.01}, mode=FAST)
    synk.distribute()
    rt = get_runtime()
    x_data, y_data = synk.data(X), synk.data(Y)
    for idx in batches + [batches[0][:2]]:       # the last: a rank with no rows joins too
        seq = rt.control.seq
        out = fused(x_data, y_data, batch=idx)
        assert rt.control.seq == seq + 1          # one command per step
        out3 = three.f_grad(x_data, y_data, batch=idx)
        synk.all_reduce(three.grad_shared, op="sum")
        three.f_update()
        np.testing.assert_allclose(out, out3, rtol=1e-6)
    for r in range(3):
        np.testing.assert_allclose(synk.get_value(r, W), synk.get_value(r, W2), rtol=1e-6)
        np.testing.assert_allclose(synk.get_value(r, b), synk.get_value(r, b2), rtol=1e-6)
    # Every rank applied the very same update: the replicas agree bit for bit.
    for var in (W, b):
        replicas = synk.gather(var)
        assert all(np.array_equal(replicas[0], r) for r in replicas[1:]), var


def test_fused_steps_keep_big_replicas_identical(forked):
    """A gradient big enough for the split all-reduce: replicas stay equal bit for bit."""
    forked(2)
    rng = np.random.default_rng(3)
    x = pt.matrix("x")
    y = pt.matrix("y")
    W = pytensor.shared(rng.standard_normal((300, 300)).astype("float32"), name="W_big")
    loss = pt.mean((pt.dot(x, W) - y) ** 2)
    step = train.make_train_function(loss, [W], x, y, update_rule="sgd",
                                     update_kwargs={"learning_rate": 0.01}, mode=FAST)
    synk.distribute()
    xd = synk.data(rng.standard_normal((40, 300)).astype("float32"))
    yd = synk.data(rng.standard_normal((40, 300)).astype("float32"))
    for _ in range(8):
        step(xd, yd)
    replicas = synk.gather(W)
    assert np.array_equal(replicas[0], replicas[1])


def test_fused_call_checks_its_arguments(forked):
    forked(2)
    x = pt.matrix("x")
    v = pytensor.shared(np.zeros(3, "float32"), name="v")
    f = synk.function([x], (x.sum(), "sum"), updates=[(v, v + x.sum(axis=0))])
    g = synk.function([x], x.sum())
    h = synk.function([], updates=[(v, v * 0)])
    with pytest.raises(TypeError, match="without inputs"):
        f.then_all_reduce(v, "sum", g)
    with pytest.raises(ValueError, match="op"):
        f.then_all_reduce(v, "mean", h)
    synk.distribute()
    step = f.then_all_reduce(v, "sum", h)
    data = np.ones((5, 3), "float32")
    assert step(synk.data(data)) == 15.0
    np.testing.assert_array_equal(synk.get_value(1, v), np.zeros(3))   # reduced, then zeroed


def test_train_function_batch_s(forked, problem):
    """Data scattered into shared variables and selected per rank with batch_s."""
    X, Y, W0, b0, _ = problem
    forked(2)
    x = pytensor.shared(X[:2], name="x_train")
    y = pytensor.shared(Y[:2], name="y_train")
    W = pytensor.shared(W0.copy(), name="W")
    b = pytensor.shared(b0.copy(), name="b")
    loss = pt.mean((pt.dot(x, W) + b - y) ** 2)
    step = train.make_train_function(loss, [W, b], x, y, update_rule="momentum",
                                     update_kwargs={"learning_rate": 0.05}, mode=FAST)
    synk.distribute()
    synk.scatter([x, y], [X, Y])          # rank 0: rows 0..31, rank 1: rows 32..63
    xs = pytensor.shared(X, name="x_all")
    ys = pytensor.shared(Y, name="y_all")
    Ws = pytensor.shared(W0.copy(), name="Ws")
    bs = pytensor.shared(b0.copy(), name="bs")
    loss_s = pt.mean((pt.dot(xs, Ws) + bs - ys) ** 2)
    serial = train.make_serial_train_function(loss_s, [Ws, bs], xs, ys, update_rule="momentum",
                                              update_kwargs={"learning_rate": 0.05}, mode=FAST)
    for lo, hi in [(0, 10), (5, 32), (20, 23)]:
        step(batch_s=slice(lo, hi))
        serial(batch_s=np.r_[lo:hi, 32 + lo:32 + hi])
    step(batch_s=[[0, 3, 5], [1, 2]])     # one index list per rank: uneven, weighted
    serial(batch_s=[0, 3, 5, 33, 34])
    step()                                # every rank's whole share
    serial()
    assert_close(W.get_value(), Ws.get_value())
    assert_close(synk.get_value(1, b), bs.get_value())


# ---- layers ---------------------------------------------------------------------

def test_layers_forward_match_numpy(rng):
    x4 = pt.tensor4("x4", shape=(None, 7, 6, 3))
    xv = rng.standard_normal((2, 7, 6, 3)).astype("float32")
    conv = L.Conv2D(3, 4, (3, 2), stride=2, pad=1, rng=0)
    conv.b.set_value(rng.standard_normal(4).astype("float32"))
    one = L.Conv2D(3, 5, 1, stride=2, bias=False, rng=1)
    bn = L.BatchNorm(3)
    f = pytensor.function([x4], [conv(x4), one(x4), L.max_pool2d(x4, 3, 2, pad=1),
                                 L.avg_pool2d(x4, 2), L.global_avg_pool(x4), bn(x4),
                                 bn(x4, deterministic=True), L.flatten2d(x4)],
                          updates=bn.updates, mode=FAST)
    y_conv, y_one, y_max, y_avg, y_gap, y_bn, y_bn_det, y_flat = f(xv)
    np.testing.assert_array_equal(y_flat, xv.reshape(2, -1))

    W, bias = conv.W.get_value(), conv.b.get_value()
    xp = np.pad(xv, ((0, 0), (1, 1), (1, 1), (0, 0)))
    ref = np.zeros((2, 4, 4, 4))
    for i in range(4):
        for j in range(4):
            ref[:, i, j] = np.einsum("nhwc,hwcf->nf", xp[:, 2 * i:2 * i + 3, 2 * j:2 * j + 2], W)
    np.testing.assert_allclose(y_conv, ref + bias, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(y_one, xv[:, ::2, ::2] @ one.W.get_value()[0, 0], rtol=1e-4,
                               atol=1e-5)

    xm = np.pad(xv, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=-np.inf)
    ref_max = np.array([[xm[:, 2 * i:2 * i + 3, 2 * j:2 * j + 3].max(axis=(1, 2))
                         for j in range(3)] for i in range(4)]).transpose(2, 0, 1, 3)
    np.testing.assert_array_equal(y_max, ref_max)
    ref_avg = xv[:, :6].reshape(2, 3, 2, 3, 2, 3).mean(axis=(2, 4))
    np.testing.assert_allclose(y_avg, ref_avg, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y_gap, xv.mean(axis=(1, 2)), rtol=1e-5, atol=1e-6)

    mean, var = xv.mean(axis=(0, 1, 2)), xv.var(axis=(0, 1, 2))
    np.testing.assert_allclose(y_bn, (xv - mean) / np.sqrt(var + 1e-4), rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(y_bn_det, xv / np.sqrt(1 + 1e-4), rtol=1e-5)  # initial stats
    np.testing.assert_allclose(bn.mean.get_value(), 0.1 * mean, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(bn.var.get_value(), 0.9 + 0.1 * var, rtol=1e-4)

    x2 = pt.matrix("x2")
    t = pt.lvector("t")
    dense = L.Dense(6, 4, rng=2)
    logits = dense(x2)
    g = pytensor.function([x2, t], [logits, L.softmax(logits), L.relu(x2),
                                    L.softmax_cross_entropy(logits, t),
                                    L.cross_entropy(L.softmax(logits), t),
                                    L.accuracy(logits, t)], mode=FAST)
    xv2 = rng.standard_normal((5, 6)).astype("float32")
    tv = np.array([0, 1, 2, 3, 0])
    lg, sm, rl, ce, ce2, acc = g(xv2, tv)
    ref_lg = xv2 @ dense.W.get_value() + dense.b.get_value()
    np.testing.assert_allclose(lg, ref_lg, rtol=1e-5, atol=1e-6)
    ref_sm = np.exp(ref_lg) / np.exp(ref_lg).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(sm, ref_sm, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(rl, np.maximum(xv2, 0))
    np.testing.assert_allclose(ce, -np.log(ref_sm[np.arange(5), tv]), rtol=1e-4)
    np.testing.assert_allclose(ce2, ce, rtol=1e-4)
    assert acc == pytest.approx(np.mean(ref_lg.argmax(axis=1) == tv))


def test_layer_gradients(rng):
    """Gradients flow through every layer; the convolution's matches finite differences."""
    x = pt.tensor4("x", shape=(None, 4, 4, 2))
    t = pt.lvector("t")
    conv = L.Conv2D(2, 3, 3, pad="same", rng=3)
    bn = L.BatchNorm(3)
    dense = L.Dense(3 * 2 * 2, 4, rng=4)
    h = L.max_pool2d(L.relu(bn(conv(x))), 2)
    h = L.avg_pool2d(h, 1)
    loss = L.softmax_cross_entropy(dense(L.flatten2d(h)), t).mean()
    params = conv.params + bn.params + dense.params
    grads = pytensor.grad(loss, params)
    f = pytensor.function([x, t], [loss] + grads, mode=FAST)
    xv = rng.standard_normal((3, 4, 4, 2)).astype("float32")
    tv = np.array([0, 1, 3])
    out = f(xv, tv)
    for p, gv in zip(params, out[1:]):
        assert gv.shape == p.get_value().shape and np.all(np.isfinite(gv))
        assert np.any(gv != 0), p.name

    # Finite differences of the convolution alone, in float64 for precision.
    x64 = pt.tensor4("x64", dtype="float64", shape=(None, 3, 3, 2))
    W64 = pytensor.shared(rng.standard_normal((2, 2, 2, 3)), name="W64")
    y = L.conv2d(x64, W64, stride=1, pad=1)
    c = rng.standard_normal((1, 4, 4, 3))
    obj = (y * c).sum()
    fg = pytensor.function([x64], pytensor.grad(obj, W64), mode=FAST)
    fo = pytensor.function([x64], obj, mode=FAST)
    xv64 = rng.standard_normal((1, 3, 3, 2))
    analytic = fg(xv64)
    W_val = W64.get_value()
    numeric = np.zeros_like(W_val)
    for k in np.ndindex(W_val.shape):
        for sign in (1, -1):
            Wp = W_val.copy()
            Wp[k] += sign * 1e-5
            W64.set_value(Wp)
            numeric[k] += sign * fo(xv64) / 2e-5
    np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-7)
