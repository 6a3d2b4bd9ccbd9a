"""PyMC models, data-parallel: every case that used to be silently wrong is now exact or refused.

Refusals name the variable (pm.Minibatch, a term combining rows, per-row NumPy
arrays outside pm.Data, NumPy observed data, masks); total_size, a centred
term kept whole and an observed time series kept whole are exact on 3 ranks
(uneven split) against PyMC's own functions; a float32 model stays float32.
Skipped where PyMC is not installed.
"""

import types

import numpy as np
import pytest

pm = pytest.importorskip("pymc", reason="PyMC is not installed (pip install -e '.[pymc]')")

import pytensor  # noqa: E402

import synkhronos as synk  # noqa: E402
from helpers import pymc_models  # noqa: E402
from synkhronos.extensions import pymc as synk_pymc  # noqa: E402

pytestmark = pytest.mark.timeout(300)

N_ROWS = 301          # no rank count here divides it


def _points(model, rng, k=2):
    """A few random points in the transformed space, away from the initial point."""
    start = model.initial_point()
    return [{name: np.asarray(v + rng.normal(scale=0.5, size=np.shape(v)), dtype=v.dtype)
             for name, v in start.items()} for _ in range(k)]


# -- the cases that used to be silently wrong ---------------------------------------------------
def _regression(n=N_ROWS, seed=2):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 2))
    return X, X @ np.array([1.0, -0.5]) + rng.normal(size=n)


def _total_size_model():
    X, y = _regression()
    with pm.Model() as m:
        X_d, y_d = pm.Data("X", X), pm.Data("y", y)
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y_obs", mu=X_d @ b, sigma=1.0, observed=y_d, total_size=50_000)
    return m


def _centred_model(second=False):
    """Centring with a mean over rows; ``second``: plus a regression on other containers."""
    X, y = _regression()
    X2, y2 = _regression(seed=9)
    with pm.Model() as m:
        X_d, y_d = pm.Data("X", X), pm.Data("y", y)
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y_obs", mu=(X_d - X_d.mean(0)) @ b, sigma=1.0, observed=y_d)
        if second:
            X2_d, y2_d = pm.Data("X2", X2), pm.Data("y2", y2)
            pm.Normal("y2_obs", mu=X2_d @ b, sigma=1.0, observed=y2_d)
    return m


def _random_walk_model():
    y = np.cumsum(np.random.default_rng(4).normal(size=N_ROWS))
    X, y2 = _regression()
    with pm.Model() as m:
        X_d, y2_d = pm.Data("X", X), pm.Data("y2", y2)
        series = pm.Data("series", y)
        b = pm.Normal("b", 0, 1, shape=2)
        s = pm.HalfNormal("s", 1)
        pm.Normal("y_obs", mu=X_d @ b, sigma=1.0, observed=y2_d)
        pm.GaussianRandomWalk("walk", sigma=s, init_dist=pm.Normal.dist(0, 10),
                              observed=series, steps=N_ROWS - 1)
    return m


def test_refusals_name_the_variable(exact):
    """Misuse found at data_parallel time, before anything is built."""
    rng = np.random.default_rng(0)
    X, y = _regression()
    cases = []
    with pm.Model() as m:     # pm.Minibatch: each rank would draw its own batch
        X_d, y_d = pm.Data("X", X), pm.Data("y", y)
        Xb, yb = pm.Minibatch(X_d, y_d, batch_size=20)
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y_obs", mu=Xb @ b, sigma=1.0, observed=yb, total_size=N_ROWS)
    cases.append((m, {}, r"'y_obs'.*pm.Minibatch"))
    # Centring: the first refusal names the fix that works (NumPy first), before unsplit.
    cases.append((_centred_model(), {},
                  r"'y_obs' combines rows.*silently wrong\. If it centres.*compute them with "
                  r"NumPy before building the model, pm\.Data\(\"X\", X - X\.mean\(0\)\)"))
    cases.append((_centred_model(), {"unsplit": ["X", "y"]}, r"no pm.Data container to split"))
    cases.append((_random_walk_model(), {}, r"'walk' fails on its first rows.*unsplit"))
    with pm.Model() as m:     # a NumPy covariate
        y_d = pm.Data("y", y)
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y_obs", mu=X @ b, sigma=1.0, observed=y_d)
    cases.append((m, {}, r"'y_obs' reads a NumPy array of float64 .*\(301, 2\)"))
    with pm.Model() as m:     # NumPy observed next to pm.Data covariates
        X_d = pm.Data("X", X)
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y_obs", mu=X_d @ b, sigma=1.0, observed=y)
    cases.append((m, {}, r"observed data of \['y_obs'\] are NumPy arrays.*pm.Data\(\"y_obs_data\""))
    with pm.Model() as m:     # a NumPy upper= of pm.Censored
        X_d, y_d = pm.Data("X", X), pm.Data("y", np.minimum(y, 1.0))
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Censored("y_obs", pm.Normal.dist(X_d @ b, 1.0), lower=None,
                    upper=np.full(N_ROWS, 1.0) + 0 * rng.random(N_ROWS), observed=y_d)
    cases.append((m, {}, r"'y_obs' reads a NumPy array.*pm.Censored"))
    mask = rng.random(N_ROWS) < 0.7
    with pm.Model() as m:     # observed rows a masked subset of the covariate rows
        X_d, y_d = pm.Data("X", X), pm.Data("y", y[mask])
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y_obs", mu=(X_d @ b)[mask], sigma=1.0, observed=y_d)
    cases.append((m, {}, r"'y_obs'.*select them before building the model"))
    for model, kw, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            synk_pymc.data_parallel(model, **kw)


def test_numpy_observed_names_the_fix(exact):
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1)
        pm.Normal("y_like", mu=b, sigma=1.0, observed=np.zeros(5))
    with pytest.raises(ValueError, match=r'pm.Data\("y_like_data", values\)'):
        synk_pymc.data_parallel(m)


def test_refuses_discrete_free_variables(exact):
    with pm.Model() as m:
        k = pm.Poisson("k", 3.0)
        pm.Normal("y_obs", mu=k, sigma=1.0, observed=pm.Data("y", np.zeros(5)))
    with pytest.raises(ValueError, match=r"\['k'\] are discrete.*Marginalize them out.*"
                                         r"or sample this model with pm.sample"):
        synk_pymc.data_parallel(m)


@pytest.fixture(scope="module")
def exact(runtime_keeper):
    """A 3-rank runtime (uneven split) for the cases now exact."""
    with pytensor.config.change_flags(floatX="float64"):
        e = types.SimpleNamespace()
        e.models = {"total_size": _total_size_model(), "centred": _centred_model(second=True),
                    "walk": _random_walk_model()}
        runtime_keeper.close()       # any runtime a module before left open
        runtime_keeper.fork(3)
        try:
            e.dps = {"total_size": synk_pymc.data_parallel(e.models["total_size"]),
                     "centred": synk_pymc.data_parallel(e.models["centred"], unsplit=["X", "y"]),
                     "walk": synk_pymc.data_parallel(e.models["walk"], unsplit=["series"])}
            synk.distribute()
        except BaseException:
            runtime_keeper.close()
            raise
        yield e
        runtime_keeper.close()


@pytest.mark.parametrize("name", ["total_size", "centred", "walk"])
def test_now_exact_on_uneven_ranks(exact, name):
    model, dp = exact.models[name], exact.dps[name]
    logp, dlogp = model.compile_logp(), model.compile_dlogp()
    for point in _points(model, np.random.default_rng(1)):
        np.testing.assert_allclose(dp.logp(point), logp(point), rtol=1e-10)
        np.testing.assert_allclose(dp.dlogp(point), dlogp(point), rtol=1e-9, atol=1e-10)
    whole_terms = {"total_size": ["prior"], "centred": ["y_obs", "prior"],
                   "walk": ["walk", "prior"]}[name]
    assert [t.name for t in dp._plan.whole_terms] == whole_terms


def test_float32_model_keeps_its_precision(runtime_keeper):
    """A model built in float32 runs in float32 and matches PyMC's float32 functions."""
    with pytensor.config.change_flags(floatX="float32"):
        model = pymc_models.negbin(N_ROWS)
        runtime_keeper.close()
        runtime_keeper.fork(2)
        try:
            dp = synk_pymc.data_parallel(model)
            synk.distribute()
            assert dp.dtype == np.float32
            point = model.initial_point()
            lp, g = dp.logp_dlogp(point)
            assert g.dtype == np.float32
            np.testing.assert_allclose(lp, model.compile_logp()(point), rtol=1e-5)
            np.testing.assert_allclose(g, model.compile_dlogp()(point), rtol=1e-4, atol=1e-3)
        finally:
            runtime_keeper.close()
