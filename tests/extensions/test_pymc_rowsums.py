"""A rank graph's elementwise loop over rows and its sums, run as one loop in Numba (``rowsums``).

Under PyTensor 2 (PyMC 5.27-5.28) the Numba mode of a rank's graph replaces
each loop whose outputs only full sums read by ``RowSums``; the values must
equal the loop's summed by NumPy, in Numba and in Python, and a model's
(logp, dlogp) must equal PyMC's own, with a switch's costly branch computed only
on the rows that take it.  Under PyTensor 3, which fuses such loops itself, the
mode is left as it is.  Skipped where PyMC is not installed.
"""

import numpy as np
import pytest

pm = pytest.importorskip("pymc", reason="PyMC is not installed (pip install -e '.[pymc]')")
pytest.importorskip("numba", reason="Numba is not installed")

import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402
from pytensor.compile.mode import Mode, get_mode  # noqa: E402
from pytensor.tensor.math import Sum  # noqa: E402

from synkhronos.extensions.pymc import internals, rowsums  # noqa: E402

pytestmark = pytest.mark.timeout(300)

own_fusion = pytest.mark.skipif(rowsums.fuses_itself(),
                                reason="this PyTensor fuses loops and sums itself (3.0 on)")


def _nodes(fn, op_type):
    return [n for n in fn.maker.fgraph.apply_nodes if isinstance(n.op, op_type)]


def _graph():
    """Two sums over a loop of three outputs (a log1p, a division by a per-row denominator,
    a product with a broadcast scalar) and the NumPy values it must give."""
    x, y = pt.dvector("x"), pt.dvector("y")
    s = pt.dscalar("s")
    d = 1.0 + (x - s) ** 2
    outs = [pt.log1p((x * y) ** 2).sum(), (x / d).sum(), (y * s / d).sum()]

    def expected(xv, yv, sv):
        dv = 1.0 + (xv - sv) ** 2
        return [np.log1p((xv * yv) ** 2).sum(), (xv / dv).sum(), (yv * sv / dv).sum()]
    return [x, y, s], outs, expected


@own_fusion
@pytest.mark.parametrize("n", [1, 7, 10_001])
def test_sums_in_one_loop_equal_numpy(n):
    """In Numba the loops and their sums become RowSums (one per loop PyTensor fused), with
    NumPy's values on any rows."""
    inputs, outs, expected = _graph()
    fn = pytensor.function(inputs, outs, mode=rowsums.with_row_sums(get_mode("NUMBA")))
    assert _nodes(fn, rowsums.RowSums)
    assert not _nodes(fn, Sum), "a sum over rows was left beside the one loop"
    rng = np.random.default_rng(n)
    xv, yv = rng.normal(size=n), rng.normal(size=n)
    np.testing.assert_allclose(fn(xv, yv, 0.3), expected(xv, yv, 0.3), rtol=1e-12)
    with pytest.raises(ValueError):      # rows of unequal lengths, as PyTensor's loop refuses
        fn(xv, np.append(yv, 1.0), 0.3)


@own_fusion
def test_python_fallback_equals_numpy():
    """Outside Numba (Python's linker) the op runs the loop and sums it."""
    inputs, outs, expected = _graph()
    mode = Mode(linker="py", optimizer="fast_run").register((rowsums.FuseRowSums(),
                                                             rowsums.POSITION))
    fn = pytensor.function(inputs, outs, mode=mode)
    assert _nodes(fn, rowsums.RowSums)
    rng = np.random.default_rng(5)
    values = [rng.normal(size=50), rng.normal(size=50), -0.4]
    np.testing.assert_allclose(fn(*values), expected(*values), rtol=1e-12)


@own_fusion
def test_a_loop_read_elsewhere_is_left_whole():
    """Where a loop's output is also read row by row, the loop stays PyTensor's."""
    x = pt.dvector("x")
    e = pt.exp(x) / (1.0 + x ** 2)
    fn = pytensor.function([x], [e.sum(), e], mode=rowsums.with_row_sums(get_mode("NUMBA")))
    assert not _nodes(fn, rowsums.RowSums)
    xv = np.linspace(-2, 2, 9)
    total, rows = fn(xv)
    np.testing.assert_allclose(rows, np.exp(xv) / (1 + xv ** 2), rtol=1e-14)
    assert total == pytest.approx(rows.sum(), rel=1e-14)


def _lazy(fn):
    """The generated source of each RowSums' scalar function whose branches run only where
    taken (None for one without)."""
    return [rowsums._lazy_source(n.op.scalar_op.fgraph, lambda node: None)
            if isinstance(n.op.scalar_op, rowsums.Composite) else None
            for n in _nodes(fn, rowsums.RowSums)]


@own_fusion
def test_branches_run_only_where_taken_and_equal_numpy():
    """A loop whose switches pick a costly branch by row (a log-CDF's two forms, one switch
    nested in another branch, a second output reading the same branch) computes each
    branch only where taken, with NumPy's values on rows taking every branch."""
    from scipy import special

    x, s = pt.dvector("x"), pt.dscalar("s")
    inner = pt.switch(x > 2 * s, pt.exp(-x), pt.log1p(x ** 2))
    lcdf = pt.switch(x < s, pt.log(pt.erfc(-x)), inner)
    grad = pt.switch(x < s, -pt.exp(-(x ** 2)) / pt.erfc(-x), 1.0)
    fn = pytensor.function([x, s], [lcdf.sum(), grad.sum()],
                           mode=rowsums.with_row_sums(get_mode("NUMBA")))
    sources = _lazy(fn)
    assert len(sources) == 1 and sources[0] is not None and " if " in sources[0][0]
    rng = np.random.default_rng(3)
    xv, sv = rng.normal(size=1001), 0.4
    inner_v = np.where(xv > 2 * sv, np.exp(-xv), np.log1p(xv ** 2))
    want = [np.where(xv < sv, np.log(special.erfc(-xv)), inner_v).sum(),
            np.where(xv < sv, -np.exp(-(xv ** 2)) / special.erfc(-xv), 1.0).sum()]
    np.testing.assert_allclose(fn(xv, sv), want, rtol=1e-12)
    assert np.any(xv < sv) and np.any(xv > 2 * sv) and np.any((xv >= sv) & (xv <= 2 * sv))


def test_truncated_model_equals_pymc():
    """A truncated regression's (logp, dlogp) (its normal log-CDFs switch by row between two
    forms) in the rank's Numba mode equals PyMC's own; under PyTensor 2 each form is
    computed only where its rows take it."""
    rng = np.random.default_rng(12)
    x = rng.uniform(-10, 10, 6000)
    y = rng.normal(0.8 * x + 1.0, 2.0)
    keep = (y > -5) & (y < 5)
    with pm.Model() as model:
        a = pm.Normal("a", 0, 5)
        b = pm.Normal("b", 0, 5)
        s = pm.HalfNormal("s", 5)
        pm.Truncated("y", pm.Normal.dist(mu=a + b * x[keep], sigma=s), lower=-5, upper=5,
                     observed=y[keep])
    numba = internals.pymc_mode(model, base="NUMBA")
    ours = model.logp_dlogp_function(ravel_inputs=True, mode=rowsums.with_row_sums(numba))
    theirs = model.logp_dlogp_function(ravel_inputs=True, mode=numba)
    ours.set_extra_values({})
    theirs.set_extra_values({})
    if not rowsums.fuses_itself():
        assert any(src is not None for src in _lazy(ours._pytensor_function))
    for q in ([1.0, 0.8, 0.7], [0.0, 0.0, 0.0], [-2.0, 1.5, 1.2]):
        (lp, g), (lp0, g0) = ours._pytensor_function(np.array(q)), theirs._pytensor_function(
            np.array(q))
        assert lp == pytest.approx(lp0, rel=1e-12)
        np.testing.assert_allclose(g, g0, rtol=1e-10, atol=1e-10)


def test_only_numba_under_pytensor_2_is_rewritten():
    """C and JAX modes, and every mode where PyTensor fuses itself, are returned as they are."""
    c_mode = get_mode("FAST_RUN")
    assert rowsums.with_row_sums(c_mode) is c_mode
    numba = get_mode("NUMBA")
    got = rowsums.with_row_sums(numba)
    assert (got is numba) == rowsums.fuses_itself()
    assert isinstance(got, Mode)
