"""In-graph collectives (synkhronos.ingraph) against NumPy, on 1, 2 and 3 ranks.

Every rank's share of the rows is known (rank_rows.rank_range), so what each
rank's graph computes is written in NumPy from those shares.  Uneven splits
and a call that leaves a rank without rows are included: that rank still
joins every collective.
"""

import functools

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.raise_op import Assert

import synkhronos as synk
from synkhronos import ingraph
from synkhronos.inputs import rank_rows

pytestmark = pytest.mark.timeout(100)

MODE = "FAST_COMPILE"
ROWS = [7, 6, 2, 1]  # uneven, even, fewer rows than ranks


def pad_max(x):
    """Column maxima with -100 for a rank with no rows."""
    return pt.concatenate([x, pt.constant(np.full((1, 3), -100.0, "float32"))]).max(axis=0)


def pad_min(x):
    return pt.concatenate([x, pt.constant(np.full((1, 3), 100.0, "float32"))]).min(axis=0)


def shares(x, n):
    return [x[slice(*rank_rows.rank_range(len(x), n, r))] for r in range(n)]


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}ranks")
def built(request, runtime_keeper):
    n = request.param
    runtime_keeper.fork(n)
    x = pt.matrix("x")
    s = pytensor.shared(np.zeros((1, 3), "float32"), shape=(None, 3), name="s")
    fns = {
        "sliced": synk.function([], [(ingraph.psum(s.sum(axis=0)), "max")],
                                sliceable_shareds=[s], mode=MODE),
        "reduce": synk.function([x], [(ingraph.psum(x.sum(axis=0)), None),
                                      (ingraph.pmean(x.sum(axis=0)), None),
                                      (ingraph.pmax(pad_max(x)), None),
                                      (ingraph.pmin(pad_min(x)), None),
                                      (ingraph.psum(x.sum(axis=0)), "avg")], mode=MODE),
        "gather": synk.function([x], [(ingraph.all_gather(2 * x), None)], mode=MODE),
        "grads": synk.function([x], [(pytensor.grad((ingraph.psum(x.sum(axis=0)) ** 2).sum(), x),
                                      "gather"),
                                     (pytensor.grad(ingraph.pmax(pad_max(x))
                                                    .sum(), x), "gather"),
                                     (pytensor.grad((ingraph.all_gather(x) ** 2).sum(), x),
                                      "gather")], mode=MODE),
        "raises": synk.function([x], ingraph.psum(Assert("too many rows")(
            x, pt.lt(x.shape[0], 3)).sum()), mode=MODE),
        "plain": synk.function([x], (x.sum(), "sum"), mode=MODE),
        # The default (Numba) backend runs the Op in object mode.
        "default": synk.function([x], [(ingraph.psum(x.sum(axis=0)), "max")]),
        "every_grad": every_grad_function(),
    }
    synk.distribute()
    fns["s"] = s
    yield n, fns
    runtime_keeper.close()


COLLECTIVES = ["psum", "pmean", "pmax", "pmin", "all_gather"]


def rank_objectives(x, c):
    """Per collective, one rank's objective mixing its own rows with the combined value.

    ``x``: this rank's rows; ``c``: a weight per row of all ranks (broadcast).
    """
    t, s = x.sum(axis=0), pt.sqr(x).sum(axis=0)
    objectives = {name: (getattr(ingraph, name)(s) * t).sum() for name in COLLECTIVES[:4]}
    objectives["all_gather"] = (ingraph.all_gather(pt.sqr(x)) * c).sum() * x.sum()
    return objectives


def every_grad_function(mode=None, names=COLLECTIVES):
    """The gradient of each collective's objective w.r.t. this rank's rows, gathered.

    Mode None: the default (Numba) backend.
    """
    x, c = pt.dmatrix("x"), pt.dmatrix("c")
    objectives = rank_objectives(x, c)
    return synk.function([x], [(pytensor.grad(objectives[k], x), "gather") for k in names],
                         bcast_inputs=[c], mode=mode, on_unused_input="ignore")


@functools.lru_cache(maxsize=None)
def serial_grads(n):
    """Serial PyTensor: the gradients of the sum of every rank's objective w.r.t. all rows.

    With ``bounds`` the ranks' row ranges, the collectives are written out
    over the ranks' shares; each rank's gathered gradient must equal its rows
    of these (jax.pmap's convention: grad(psum(x)) = psum(grad)).
    """
    x, c, bounds = pt.dmatrix("x"), pt.dmatrix("c"), pt.lvector("bounds")
    shares = [x[bounds[q]:bounds[q + 1]] for q in range(n)]
    s = pt.stack([pt.sqr(p).sum(axis=0) for p in shares])
    combined = {"psum": s.sum(axis=0), "pmean": s.mean(axis=0), "pmax": s.max(axis=0),
                "pmin": s.min(axis=0)}
    totals = {k: sum((v * p.sum(axis=0)).sum() for p in shares) for k, v in combined.items()}
    totals["all_gather"] = sum((pt.sqr(x) * c).sum() * p.sum() for p in shares)
    fn = pytensor.function([x, c, bounds], [pytensor.grad(totals[k], x) for k in COLLECTIVES],
                           mode=MODE)
    return lambda xv, cv: fn(xv, cv, [0] + [rank_rows.rank_range(len(xv), n, r)[1]
                                            for r in range(n)])


def grad_data(rows, salt=0):
    rng = np.random.default_rng(100 + rows + salt)  # no ties for pmax and pmin
    return rng.standard_normal((rows, 3)), rng.standard_normal((rows, 3))


def data(rows, salt=0):
    rng = np.random.default_rng(rows + salt)
    return rng.integers(-5, 6, size=(rows, 3)).astype("float32")


@pytest.mark.parametrize("rows", ROWS)
def test_all_reduce_kinds(built, rows):
    n, fns = built
    x = data(rows)
    got = fns["reduce"](x)
    parts = shares(x, n)
    sums = [p.sum(axis=0) for p in parts]
    maxs = [p.max(axis=0, initial=-100.0) for p in parts]
    mins = [p.min(axis=0, initial=100.0) for p in parts]
    expected = [np.sum(sums, axis=0), np.mean(sums, axis=0), np.max(maxs, axis=0),
                np.min(mins, axis=0)]
    for k, want in enumerate(expected):
        for r, value in enumerate(got[k]):
            if len(parts[r]) == 0:
                assert value is None  # no rows: no result, but it took part
            else:
                np.testing.assert_allclose(value, want, rtol=1e-6)
    # Every rank holds the same psum, so averaging over ranks is exact.
    np.testing.assert_array_equal(got[4], got[0][0])


@pytest.mark.parametrize("rows", ROWS)
def test_all_gather_gives_every_rank_all_rows(built, rows):
    n, fns = built
    x = data(rows, 1)
    got = fns["gather"](x)[0]
    for r, value in enumerate(got):
        if rows > r:
            np.testing.assert_array_equal(value, 2 * x)


@pytest.mark.parametrize("rows", ROWS)
def test_gradients_sum_over_ranks(built, rows):
    # Each rank differentiates its own copy of the objective; as in jax.pmap,
    # the gradient of psum is the psum of the gradients.
    n, fns = built
    x = data(rows, 2)
    g_sum, g_max, g_gather = fns["grads"](x)
    np.testing.assert_allclose(g_sum, np.broadcast_to(n * 2 * x.sum(axis=0), x.shape), rtol=1e-6)
    is_max = (x == x.max(axis=0)).astype("float32")
    np.testing.assert_allclose(g_max, n * is_max)
    np.testing.assert_allclose(g_gather, n * 2 * x, rtol=1e-6)


@pytest.mark.parametrize("rows", ROWS)
def test_every_gradient_on_the_default_backend(built, rows):
    n, fns = built
    x, c = grad_data(rows)
    got = fns["every_grad"](x, c)
    want = serial_grads(n)(x, c)
    for name, g, w in zip(COLLECTIVES, got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=name)


def test_identity_outside_a_call(built):
    n, fns = built
    x = data(7)
    y = pt.matrix("y")
    serial = pytensor.function([y], [ingraph.psum(y), ingraph.pmean(y), ingraph.pmax(y),
                                     ingraph.pmin(y), ingraph.all_gather(y)], mode=MODE)
    for value in serial(x):
        np.testing.assert_array_equal(value, x)
    got = fns["reduce"].as_theano(x)
    np.testing.assert_allclose(got[0], x.sum(axis=0))
    assert ingraph.n_ranks() == 1 and ingraph.in_call() is None


def test_a_failing_rank_does_not_hang_the_others(built):
    n, fns = built
    x = data(7)
    if n == 1:
        with pytest.raises(Exception, match="too many rows"):
            fns["raises"](x)
    else:
        # Rank 0 gets 4 (or 3) rows and fails before the collective; the others wait
        # in it until the abort reaches them.
        with pytest.raises(synk.WorkerError, match="too many rows"):
            fns["raises"](x)
    assert fns["raises"](x[:2]) == x[:2].sum()
    np.testing.assert_allclose(fns["plain"](x), x.sum(), rtol=1e-6)


def test_num_slices_is_refused(built):
    n, fns = built
    x = data(6)
    with pytest.raises(ValueError, match="in-graph collectives"):
        fns["reduce"](x, num_slices=2)
    np.testing.assert_allclose(fns["plain"](x, num_slices=2), x.sum(), rtol=1e-6)


def test_default_mode_runs_the_op(built):
    n, fns = built
    x = data(5)
    np.testing.assert_allclose(fns["default"](x)[0], x.sum(axis=0), rtol=1e-6)


def test_batch_s_and_a_rank_without_shared_rows(built):
    n, fns = built
    x = data(8, 3)
    synk.scatter(fns["s"], x)
    parts = shares(x, n)
    got = fns["sliced"](batch_s=slice(0, 2))
    np.testing.assert_allclose(got[0], sum(p[:2].sum(axis=0) for p in parts), rtol=1e-6)
    # Rank 0 selects no rows; it still joins the psum.
    per_rank = [[]] + [[0, 1]] * (n - 1)
    got = fns["sliced"](batch_s=per_rank)
    want = sum(p[:2].sum(axis=0) for p in parts[1:]) if n > 1 else None
    if n > 1:
        np.testing.assert_allclose(got[0], want, rtol=1e-6)
