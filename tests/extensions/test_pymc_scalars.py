"""``log1p``, ``log``, ``exp``, ``softplus`` and ``sigmoid`` in a rank's Numba graph as
loops of their own that the compiler vectorises (``scalars``).

Each swapped op must give glibc's value (SciPy's for ``sigmoid``) within a few ulp
over the whole range of float64 arguments and the same at the special ones, and a
model's (logp, dlogp) must equal PyMC's own; only Numba modes are rewritten.  Skipped
where PyMC is not installed.
"""

import numpy as np
import pytest

pm = pytest.importorskip("pymc", reason="PyMC is not installed (pip install -e '.[pymc]')")
pytest.importorskip("numba", reason="Numba is not installed")

import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402
from pytensor.compile.mode import get_mode  # noqa: E402
from pytensor.scalar import Composite  # noqa: E402
from pytensor.tensor.elemwise import Elemwise  # noqa: E402

from synkhronos.extensions.pymc import internals, modes, rowsums, scalars  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _swapped(fn, kinds=tuple(scalars.SWAPS.values())):
    """The compiled graph's nodes running a stand-in of ``kinds``: an elementwise loop of
    it, or one of PyTensor 3's fused loops (an inner graph) holding it."""
    def runs(op):
        if isinstance(op, Elemwise):
            return runs(op.scalar_op)
        if isinstance(op, Composite) or hasattr(op, "fgraph"):
            return any(runs(n.op) for n in op.fgraph.apply_nodes)
        return isinstance(op, kinds)
    return [n for n in fn.maker.fgraph.apply_nodes if runs(n.op)]


def _logaddexp0(v):
    return np.logaddexp(0.0, v)


def _expit(v):
    from scipy import special
    return special.expit(v)


@pytest.mark.parametrize("name, op, reference, ulps", [
    ("log1p", pt.log1p, np.log1p, 1), ("log", pt.log, np.log, 1), ("exp", pt.exp, np.exp, 1),
    ("softplus", pt.softplus, _logaddexp0, 2), ("sigmoid", pt.sigmoid, _expit, 3)])
def test_within_ulps_of_the_c_library(name, op, reference, ulps):
    """Over the float64 range (each side of zero, and where most rows' arguments lie), and
    equal to the reference at zeros, subnormals, the ends of the range, inf and nan."""
    rng = np.random.default_rng(3)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, -1.0, -2.0, -1.0 + 2**-53, 5e-324, -5e-324,
               2**-30, -0.2928932188134524, 0.41421356237309503, 709.78, 709.79, -745.13,
               -745.14, -708.4, 1.7e308]
    v = np.concatenate([np.geomspace(5e-324, 1.7e308, 300_000),
                        -np.geomspace(5e-324, 1.7e308, 300_000),
                        rng.uniform(-1, 5, 300_000), rng.uniform(-800, 800, 300_000),
                        rng.standard_t(3, 300_000) ** 2, special])
    t = pt.dvector("t")
    fn = pytensor.function([t], op(t), mode=scalars.in_numba(get_mode("NUMBA")))
    swapped = name == "log1p" or rowsums.fuses_itself()
    assert len(_swapped(fn)) == swapped
    if not swapped:
        pytest.skip("PyTensor 2 runs its own (scalars.SWAPS_PYTENSOR_2)")
    with np.errstate(all="ignore"):
        got, want = fn(v), reference(v)
    normal = np.isfinite(want) & (np.abs(want) >= np.finfo(np.float64).tiny)
    off = np.abs(got[normal] - want[normal]) / np.spacing(np.abs(want[normal]))
    assert off.max() <= ulps, f"{name}: {off.max()} ulp at {v[normal][off.argmax()]!r}"
    rest = ~normal     # nan equal nan; inf, zeros and subnormals within the least subnormal
    np.testing.assert_allclose(got[rest], want[rest], rtol=0, atol=5e-324)
    zeros = want == 0
    assert np.array_equal(np.signbit(got[zeros]), np.signbit(want[zeros]))   # log1p(-0) is -0


def test_log1p_runs_as_a_loop_of_its_own():
    """Not fused with the terms around it (the reason is in ``scalars``' docstring), and
    equal to NumPy there."""
    x, y = pt.dvector("x"), pt.dvector("y")
    out = (pt.log1p((x - y) ** 2) * y).sum()
    fn = pytensor.function([x, y], out, mode=scalars.in_numba(get_mode("NUMBA")))
    (node,) = _swapped(fn)
    assert len(node.inputs) == 1 and node.inputs[0].owner is not None
    rng = np.random.default_rng(4)
    xv, yv = rng.normal(size=10_001), rng.normal(size=10_001)
    assert fn(xv, yv) == pytest.approx(float((np.log1p((xv - yv) ** 2) * yv).sum()), rel=1e-12)


def test_only_numba_is_rewritten():
    """C and JAX modes are returned as they are; in those, PyTensor's own log1p runs."""
    c_mode = get_mode("CVM")
    assert scalars.in_numba(c_mode) is c_mode
    t = pt.dvector("t")
    fn = pytensor.function([t], pt.log1p(t), mode=scalars.in_numba(c_mode))
    assert not _swapped(fn)
    numba = get_mode("NUMBA")
    assert scalars.in_numba(numba) is not numba


def test_student_t_model_equals_pymc():
    """A robust regression's (logp, dlogp) in a rank's Numba mode (``scalars`` and, under
    PyTensor 2, one ``rowsums.RowSums``) equals PyMC's own at several positions.  The
    gradient's tolerance is the summation's: the loop around the log1p now vectorises, so
    its sums are added in another order, and the gradient in log(nu) is a difference of
    sums 10^4 times larger.  PyMC's own runs in Numba too: its C function differs from its
    Numba one from the ninth digit."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=5000)
    y = 1 + 2 * x + rng.standard_t(3, size=5000)
    with pm.Model() as model:
        a = pm.Normal("a", 0, 5)
        b = pm.Normal("b", 0, 5)
        sigma = pm.HalfNormal("sigma", 2)
        nu = pm.Gamma("nu", 2, 0.1)
        pm.StudentT("y", nu=nu, mu=a + b * x, sigma=sigma, observed=y)
    ours = model.logp_dlogp_function(ravel_inputs=True, mode=modes.rank_mode(model, "NUMBA"))
    theirs = model.logp_dlogp_function(ravel_inputs=True,
                                       mode=internals.pymc_mode(model, base="NUMBA"))
    ours.set_extra_values({})
    theirs.set_extra_values({})
    assert len(_swapped(ours._pytensor_function, scalars.Log1p)) == 1
    assert not _swapped(theirs._pytensor_function)
    fused = [n for n in ours._pytensor_function.maker.fgraph.apply_nodes
             if isinstance(n.op, rowsums.RowSums)]
    assert len(fused) == (0 if rowsums.fuses_itself() else 1)
    for shift in (0.0, 0.5, -1.3):
        q = np.array([1.0, 2.0, 0.1, 1.5]) + shift
        (lp, g), (lp0, g0) = ours._pytensor_function(q), theirs._pytensor_function(q)
        assert lp == pytest.approx(lp0, rel=1e-12)
        np.testing.assert_allclose(g, g0, rtol=1e-9, atol=1e-9 * np.abs(g0).max())
