"""Running a call: each rank's rows, slices within a rank, and the results combined by op,
checked against NumPy on the whole input for every op, dtype and rank count.

One runtime per rank count (2 and 3: 3 ranks split 11 rows 4+4+3, and 1 or 2
rows leave ranks with none) serves the module.  Row-count and dtype edges are
here; the API around a call (batch forms, batch_s, updates, misuse) is in
test_function.py.
"""

import types

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.compile.builders import OpFromGraph

import synkhronos as synk
from synkhronos import ingraph

pytestmark = pytest.mark.timeout(120)

OPS = ["sum", "prod", "max", "min", "avg"]
DTYPES = ["float64", "float32", "int64"]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def env(request, runtime_keeper):
    """Fork n ranks, build every function of this module, distribute once."""
    runtime_keeper.fork(request.param)
    try:
        e = _build_env(request.param)
    except BaseException:
        runtime_keeper.close()
        raise
    yield e
    runtime_keeper.close()


def _prod_base(x):
    """What ``prod`` multiplies: near 1 for floats (no overflow), the small ints themselves."""
    # x / 10, not 0.1 * x: PyTensor may make the constant 0.1 a float32.
    return x if x.dtype.startswith("int") else 1 + x / 10


def _reduce(x, op, axis):
    return {"sum": x.sum(axis=axis), "prod": _prod_base(x).prod(axis=axis), "max": x.max(axis=axis),
            "min": x.min(axis=axis), "avg": x.mean(axis=axis)}[op]


def _build_env(n):
    e = types.SimpleNamespace(n=n, rows={}, scalar={})
    for dtype in DTYPES:
        x = pt.matrix("x", dtype=dtype)
        # Several outputs: every op per column, and the rows themselves gathered.
        e.rows[dtype] = synk.function([x], [(_reduce(x, op, 0), op) for op in OPS]
                                      + [(2 * x, "gather")], name=f"rows_{dtype}")
        # One scalar output each: the master combines it straight from the ranks' slots.
        for op in OPS:
            e.scalar[dtype, op] = synk.function([x], (_reduce(x, op, None), op))
    x = pt.dmatrix("x")
    e.f_gather = synk.function([x], [(x.sum(), "gather"), (x.sum(axis=1), "gather")])
    e.f_sum_max = synk.function([x], [(x.sum(axis=0), "sum"), (x.max(axis=0), "max")])
    e.f_empty = synk.function([x], [(x.sum(axis=0), "sum"), (x.sum(), "avg")])
    e.serial_empty = pytensor.function([x], [x.sum(axis=0), x.sum()])
    # An in-graph collective inside an inner graph: every rank must still run it.
    v = pt.dvector("v")
    e.f_nested = synk.function([x], (OpFromGraph([v], [ingraph.psum(v)])(x.sum(axis=0)), "avg"))
    synk.distribute()
    return e


def _data(rng, dtype, rows):
    if dtype.startswith("int"):
        return rng.integers(-3, 4, size=(rows, 3)).astype(dtype)
    return rng.standard_normal((rows, 3)).astype(dtype)


def _want(x, op, axis):
    """NumPy's result of ``op`` over the whole input, in NumPy's dtype."""
    base = x if x.dtype.kind == "i" else 1 + x / 10
    return {"sum": x.sum(axis=axis), "prod": base.prod(axis=axis), "max": x.max(axis=axis),
            "min": x.min(axis=axis), "avg": x.mean(axis=axis)}[op]


def _assert_equal(got, want, what):
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if want.dtype.kind == "i":
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        rtol = 1e-5 if want.dtype == np.float32 else 1e-12
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol, err_msg=what)


# ---- every op equals NumPy over the whole input -------------------------------------------

@pytest.mark.parametrize("num_slices", [1, 3], ids=lambda k: f"{k}slices")
@pytest.mark.parametrize("rows", [1, 2, 11], ids=lambda r: f"{r}rows")
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_op_over_columns_equals_numpy(env, rng, dtype, rows, num_slices):
    x = _data(rng, dtype, rows)
    got = env.rows[dtype](synk.data(x), num_slices=num_slices)
    assert len(got) == len(OPS) + 1
    for op, g in zip(OPS, got):
        _assert_equal(g, _want(x, op, 0), f"{op} over columns")
    _assert_equal(got[-1], 2 * x, "gather")                  # every row, in order


@pytest.mark.parametrize("num_slices", [1, 3], ids=lambda k: f"{k}slices")
@pytest.mark.parametrize("rows", [1, 2, 11], ids=lambda r: f"{r}rows")
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_op_of_a_scalar_equals_numpy(env, rng, dtype, rows, num_slices):
    x = _data(rng, dtype, rows)
    d = synk.data(x)
    for op in OPS:
        got = env.scalar[dtype, op](d, num_slices=num_slices)
        assert np.ndim(got) == 0
        _assert_equal(got, _want(x, op, None), f"scalar {op}")


def test_numpy_inputs_and_data_give_the_same_results(env, rng):
    x = _data(rng, "float64", 9)
    from_data = env.rows["float64"](synk.data(x))
    from_array = env.rows["float64"](x)
    for a, b in zip(from_data, from_array):
        np.testing.assert_array_equal(a, b)


# ---- gather: one result per rank -------------------------------------------------------------

def test_gather_of_a_scalar_is_one_value_per_rank(env, rng):
    x = _data(rng, "float64", 11)
    per_rank, per_row = env.f_gather(synk.data(x))
    want = [part.sum() for part in np.array_split(x, env.n)]
    np.testing.assert_allclose(per_rank, want, rtol=1e-12)
    np.testing.assert_allclose(per_row, x.sum(axis=1), rtol=1e-12)


@pytest.mark.parametrize("rows, num_slices", [(11, 3), (7, 2), (2, 5)])
def test_gather_of_a_scalar_does_not_depend_on_num_slices(env, rng, rows, num_slices):
    """A rank's 0-d result has no rows to concatenate: its slices add up to one value."""
    x = _data(rng, "float64", rows)
    d = synk.data(x)
    per_rank, per_row = env.f_gather(d, num_slices=num_slices)
    np.testing.assert_allclose(per_row, x.sum(axis=1), rtol=1e-12)
    want = [p.sum() for p in np.array_split(x, env.n) if len(p)]   # ranks with rows
    assert np.shape(per_rank) == (len(want),)
    np.testing.assert_allclose(per_rank, want, rtol=1e-12)
    # 2 ranks, 7 rows of 0..13 in 2 slices: [28, 63], not one value per slice ([6, 22, 38, 25])
    if env.n == 2:
        got = env.f_gather(synk.data(np.arange(14.0).reshape(7, 2)), num_slices=2)[0]
        np.testing.assert_array_equal(got, [28.0, 63.0])


def test_an_in_graph_collective_inside_an_inner_graph_runs_on_every_rank(env, rng):
    assert env.f_nested.spec.collective
    for rows in (11, 1):                            # with 1 row, the other ranks have none
        x = _data(rng, "float64", rows)
        _assert_equal(env.f_nested(synk.data(x)), x.sum(axis=0), f"psum of {rows} rows")


# ---- output_subset, with batch and slices ---------------------------------------------------

@pytest.mark.parametrize("num_slices", [1, 2])
def test_output_subset_with_batch_and_slices(env, rng, num_slices):
    x = _data(rng, "float64", 11)
    d = synk.data(x)
    f = env.rows["float64"]
    idx = [9, 2, 2, 7, 0, 4, 10]
    sel = x[idx]
    got = f(d, output_subset=[5, 4, 0], batch=idx, num_slices=num_slices)
    assert isinstance(got, list) and len(got) == 3
    _assert_equal(got[0], 2 * sel, "gather")
    _assert_equal(got[1], sel.mean(axis=0), "avg")
    _assert_equal(got[2], sel.sum(axis=0), "sum")
    got = f(d, output_subset=[3], batch=slice(2, 9), num_slices=num_slices)
    _assert_equal(got[0], x[2:9].min(axis=0), "min")


# ---- more slices than rows, and no rows at all ------------------------------------------------

def test_num_slices_past_the_rows_costs_no_more_than_rows(env, rng):
    data = rng.standard_normal((10, 3))
    d = synk.data(data)
    want = [data.sum(axis=0), data.max(axis=0)]
    for num_slices in (10, 10 ** 7, 10 ** 10):
        got = env.f_sum_max(d, num_slices=num_slices)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
        np.testing.assert_array_equal(got[1], want[1])


def test_an_empty_selection_reduces_like_pytensor(env):
    d = synk.data(np.ones((5, 3)))
    empty = np.ones((0, 3))
    want = env.serial_empty(empty)
    for got in (env.f_empty(d, batch=[]), env.f_empty(d, batch=slice(2, 2)), env.f_empty(empty)):
        np.testing.assert_array_equal(got[0], want[0])
        assert got[1] == want[1] == 0.0
