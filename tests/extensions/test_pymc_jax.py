"""A PyMC model's rank graphs in JAX (XLA's CPU code), asked for or measured fastest.

Expectations come from PyMC's own (logp, dlogp) on the whole data.  JAX cannot
fork (tests/helpers/child.py): each case runs in a forked child of the pytest
process, which forks its own ranks and is discarded, so the pytest process
never starts JAX (conftest.py leaves JAX out of the modes it measures).
"""

import importlib.util
import os

import numpy as np
import pytest

pm = pytest.importorskip("pymc", reason="PyMC is not installed (pip install -e '.[pymc]')")

import pytensor  # noqa: E402

import synkhronos as synk  # noqa: E402
from helpers import child, pymc_gallery  # noqa: E402
from synkhronos.extensions import pymc as synk_pymc  # noqa: E402
from synkhronos.runtime.devices import jax_initialised  # noqa: E402

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                       reason="needs jax (pip install synkhronos[jax])"),
    pytest.mark.timeout(300),
]


@pytest.fixture(autouse=True)
def _no_runtime(runtime_keeper):
    """The child forks its own ranks: no runtime a module before kept open."""
    runtime_keeper.close()


def _points(model, rng, k=3):
    start = model.initial_point()
    return [{name: np.asarray(v + rng.normal(scale=0.3, size=np.shape(v)), dtype=v.dtype)
             for name, v in start.items()} for _ in range(k)]


def _assert_exact(model, dp, rng):
    """``dp``'s (logp, dlogp) is PyMC's own, at one position and at several in one call."""
    logp, dlogp = model.compile_logp(), model.compile_dlogp()
    points = _points(model, rng)
    for point in points:
        lp, g = dp.logp_dlogp(point)
        ref = dlogp(point)
        np.testing.assert_allclose(lp, logp(point), rtol=1e-10)
        np.testing.assert_allclose(g, ref, rtol=1e-9, atol=1e-9 * np.max(np.abs(ref)))
    logps, grads = dp.logp_dlogp_many(np.stack([dp.ravel(p) for p in points]))
    for point, lp, g in zip(points, logps, grads):
        ref = dlogp(point)
        np.testing.assert_allclose(lp, logp(point), rtol=1e-10)
        np.testing.assert_allclose(g, ref, rtol=1e-9, atol=1e-9 * np.max(np.abs(ref)))


def _case_asked(n, name):
    with pytensor.config.change_flags(floatX="float64"):
        synk.fork(n)
        model = pymc_gallery.MODELS[name]()
        dp = synk_pymc.data_parallel(model, mode="jax", split=True)
        synk.distribute()
        # Nothing JAX ran yet in the master: the workers were forked from it at distribute().
        assert not jax_initialised()
        assert dp.mode == "JAX" and dp.mode_seconds == {}
        _assert_exact(model, dp, np.random.default_rng(5))
        assert jax_initialised()    # the master's share ran in JAX
        idata = dp.sample(60, tune=60, chains=2, random_seed=3, progressbar=False,
                          compute_convergence_checks=False)
        draws = np.concatenate([idata.posterior[v.name].values.ravel() for v in model.free_RVs])
        assert draws.size and np.all(np.isfinite(draws))
        assert dp.batcher.calls > 0     # the chains' gradients were data-parallel calls


@pytest.mark.parametrize("n,name", [(2, "logistic"), (3, "radon"), (2, "censored")])
def test_the_ranks_run_in_jax_where_asked(n, name):
    """mode="JAX": every rank's graphs (one position, several) run on PyTensor's JAX backend,
    built at their first call, and equal PyMC's; dp.sample draws through them."""
    child.run(_case_asked, n, name)


def _case_measured(tmp):
    from synkhronos.extensions.pymc import modes
    from synkhronos.functions.measures import MeasureFile

    os.environ.pop(modes.MODES_ENV, None)          # every mode, as a user's process measures
    modes.KEPT = MeasureFile("modes.json", tmp)    # nothing an earlier run measured
    with pytensor.config.change_flags(floatX="float64"):
        synk.fork(2)
        model = pymc_gallery.logistic(rows=20_000)
        dp = synk_pymc.data_parallel(model)
        synk.distribute()
        _assert_exact(model, dp, np.random.default_rng(6))
        seconds = dp.mode_seconds
        assert set(seconds) == {"NUMBA", "CVM", "JAX"}, seconds
        assert all(0 < s < 1 for s in seconds.values()), seconds
        assert dp.mode == modes.kept(seconds)
        # The master starts JAX only where JAX was kept (the child measuring aside ran it).
        assert jax_initialised() == (dp.mode == "JAX")


def test_jax_is_measured_among_the_modes(tmp_path):
    """mode=None where JAX is installed: JAX is timed with Numba and C on a rank's rows (in
    the child measuring aside), the fastest is kept, and the results equal PyMC's."""
    child.run(_case_measured, str(tmp_path))


def test_which_modes_are_measured(monkeypatch):
    """SYNK_PYMC_MODES names the modes measured; JAX is left out where it started in this
    process (its forked ranks would hang), and a wrong name is refused with the list."""
    from synkhronos.extensions.pymc import model, modes

    monkeypatch.setenv(modes.MODES_ENV, "numba, jax")
    assert modes.measurable(model.MODES) == ("NUMBA", "JAX")
    monkeypatch.setenv(modes.MODES_ENV, "")
    assert modes.measurable(model.MODES) == model.MODES
    monkeypatch.setattr(modes, "jax_initialised", lambda: True)
    assert modes.measurable(model.MODES) == ("NUMBA", "CVM")
    monkeypatch.setenv(modes.MODES_ENV, "JAX")
    assert modes.measurable(model.MODES) == ("NUMBA",)     # said in a warning
    monkeypatch.setenv(modes.MODES_ENV, "NUMBA,GPU")
    with pytest.raises(ValueError, match=r"SYNK_PYMC_MODES must name modes among NUMBA, CVM, "
                                         r"JAX.*'NUMBA,GPU'"):
        modes.measurable(model.MODES)


def _case_erfcx():
    import jax
    import scipy.special

    from synkhronos.extensions.pymc import jax_ops

    jax.config.update("jax_enable_x64", True)
    x = np.concatenate([np.linspace(-26.5, 40, 100_001), [25.999, 26.0, 26.001, 1e3, 1e200,
                                                         -27.0, -0.0, np.inf]])
    got, ref = np.asarray(jax.jit(jax_ops.erfcx)(x)), scipy.special.erfcx(x)
    finite = np.isfinite(ref)
    assert np.array_equal(np.isfinite(got), finite)        # overflows where SciPy's does
    np.testing.assert_allclose(got[finite], ref[finite], rtol=1e-13, atol=0)


def test_erfcx_for_jax_equals_scipys():
    """The erfcx given to PyTensor's JAX backend where it has none (pm.Censored's normal on
    PyMC 5.28 reads it): SciPy's to 1e-13, on both sides of where it turns to its series."""
    child.run(_case_erfcx)
