"""Reduced-precision all-reduce against NumPy, on 1-3 ranks and the shm and zmq backends."""

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk

pytestmark = pytest.mark.timeout(100)

# Relative precision of one rounding (unit roundoff) and the two roundings a value goes through.
EPS = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


@pytest.fixture(params=["shm", "zmq"])
def backend(request, monkeypatch):
    monkeypatch.setenv("SYNK_BACKEND", request.param)
    return request.param


def _setup(n, big=50_001):
    v = pytensor.shared(np.zeros(big, "float32"), name="v")
    m = pytensor.shared(np.zeros((3, 4)), name="m")  # float64
    i = pytensor.shared(np.zeros(3, "int32"), name="i")
    synk.function([], v.sum() + m.sum() + i.sum(), mode="FAST_COMPILE")
    synk.distribute()
    return v, m, i


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_matches_numpy_within_the_small_types_precision(forked, backend, n, dtype):
    forked(n)
    v, m, _ = _setup(n)
    rng = np.random.default_rng(n)
    vals = [rng.normal(size=50_001).astype("float32") for _ in range(n)]
    mats = [rng.normal(size=(3, 4)) * 1e3 for _ in range(n)]
    for r in range(n):
        synk.set_value(r, [v, m], [vals[r], mats[r]])
    synk.all_reduce([v, m], op="sum", dtype=dtype)
    want_v, want_m = np.sum(vals, axis=0), np.sum(mats, axis=0)
    # Each addend is off by one rounding (relative to the largest), the sum by another.
    tol_v = 3 * EPS[dtype] * n * np.max(np.abs(vals))
    for r in range(n):
        got_v = synk.get_value(r, v)
        assert got_v.dtype == np.float32
        np.testing.assert_allclose(got_v, want_v, atol=tol_v, rtol=0)
        np.testing.assert_allclose(synk.get_value(r, m), want_m,
                                   atol=3 * EPS[dtype] * n * np.max(np.abs(mats)), rtol=0)
    assert np.array_equal(synk.get_value(0, v), synk.get_value(n - 1, v))  # replicas agree


def test_float16_neither_overflows_nor_underflows(forked):
    forked(3)
    v, m, _ = _setup(3, big=4)
    for r in range(3):
        synk.set_value(r, v, np.array([60000.0, -60000.0, 30000.0, 0.0], "float32") * (r + 1))
    synk.all_reduce(v, op="avg", dtype="float16")  # a float16 sum would reach 360000
    np.testing.assert_allclose(synk.get_value(1, v), [120000.0, -120000.0, 60000.0, 0.0],
                               rtol=2 * EPS["float16"])
    for r in range(3):
        synk.set_value(r, v, np.array([3e-6, 1e-7, 5e-8, 0.0], "float32"))
    synk.all_reduce(v, op="sum", dtype="float16")  # below float16's normal range unscaled
    np.testing.assert_allclose(synk.get_value(2, v), [9e-6, 3e-7, 1.5e-7, 0.0],
                               rtol=2 * EPS["float16"])


def test_misuse_is_refused_before_any_rank_runs(forked):
    forked(2)
    v, m, i = _setup(2, big=4)
    with pytest.raises(ValueError, match="'bfloat16' or 'float16'"):
        synk.all_reduce(v, op="sum", dtype="int8")
    with pytest.raises(ValueError, match="op 'sum' or 'avg'"):
        synk.all_reduce(v, op="max", dtype="float16")
    with pytest.raises(TypeError, match="compresses floats"):
        synk.all_reduce(i, op="sum", dtype="float16")
    synk.all_reduce(v, op="sum", dtype="bfloat16")  # still usable


def test_train_function_with_compressed_all_reduce(forked):
    from synkhronos.extensions import layers as L
    from synkhronos.extensions import train

    forked(2)
    x, y = pt.matrix("x"), pt.ivector("y")
    d = L.Dense(5, 3, rng=np.random.default_rng(0), init="glorot")
    loss = L.softmax_cross_entropy(d(x), y).mean()
    step = train.make_train_function(loss, d.params, x, y, update_rule="sgd",
                                     update_kwargs={"learning_rate": 0.1},
                                     all_reduce_dtype="bfloat16", mode="FAST_COMPILE")
    xs, ys = pt.matrix("xs"), pt.ivector("ys")
    ds = L.Dense(5, 3, rng=np.random.default_rng(0), init="glorot")
    serial = train.make_serial_train_function(L.softmax_cross_entropy(ds(xs), ys).mean(),
                                              ds.params, xs, ys, update_rule="sgd",
                                              update_kwargs={"learning_rate": 0.1},
                                              mode="FAST_COMPILE")
    synk.distribute()
    rng = np.random.default_rng(1)
    x_data = rng.normal(size=(30, 5)).astype("float32")
    y_data = rng.integers(0, 3, size=30).astype("int32")
    for _ in range(5):
        np.testing.assert_allclose(step(x_data, y_data), serial(x_data, y_data), rtol=2e-2)
    np.testing.assert_allclose(d.W.get_value(), ds.W.get_value(), atol=2e-2)
    assert step.all_reduce_dtype == "bfloat16"
