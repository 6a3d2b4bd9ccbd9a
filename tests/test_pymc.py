"""PyMC models, data-parallel: logp and dlogp on n ranks equal PyMC's own on the whole data.

Expectations come from PyMC itself (``model.compile_logp()``,
``model.compile_dlogp()``) on the full data set, never from synkhronos.  One
runtime per rank count (1, 2, 3; 11 rows split 6+5 and 4+4+3) serves every
model of the module.  Skipped where PyMC is not installed.
"""

import types

import numpy as np
import pytest

pm = pytest.importorskip("pymc", reason="PyMC is not installed (pip install 'synkhronos[pymc]')")

import pytensor  # noqa: E402

import synkhronos as synk  # noqa: E402
from synkhronos.extensions import pymc as synk_pymc  # noqa: E402

# PyMC graphs compile to C on PyTensor 2.x: a cold cache makes the first test of
# each runtime (which builds five models) slow on a small CI machine.
pytestmark = pytest.mark.timeout(240)

N_ROWS = 11


def _models(rng):
    """Several likelihood families, each with its data in pm.Data containers."""
    n = N_ROWS
    X = rng.normal(size=(n, 3))
    beta = np.array([0.5, -1.0, 0.25])
    models = {}

    with pm.Model() as m:
        Xd = pm.Data("X", X)
        yd = pm.Data("y", (rng.random(n) < 1 / (1 + np.exp(-X @ beta))).astype("int64"))
        b = pm.Normal("b", 0, 2, shape=3)
        a = pm.Normal("a", 0, 2)
        pm.Bernoulli("y_obs", logit_p=a + Xd @ b, observed=yd)
    models["logistic"] = m

    with pm.Model() as m:
        Xd = pm.Data("X", X)
        yd = pm.Data("y", rng.poisson(np.exp(0.3 * X @ beta)).astype("int64"))
        b = pm.Normal("b", 0, 1, shape=3)
        pm.Poisson("y_obs", mu=pm.math.exp(Xd @ b), observed=yd)
    models["poisson"] = m

    with pm.Model() as m:
        Xd = pm.Data("X", X)
        yd = pm.Data("y", X @ beta + rng.normal(size=n))
        b = pm.Normal("b", 0, 1, shape=3)
        sigma = pm.HalfNormal("sigma", 1)             # log transform: Jacobian once
        pm.Normal("y_obs", mu=Xd @ b, sigma=sigma, observed=yd)
        pm.Potential("shrink", -0.5 * (b ** 2).sum())  # counted once too
    models["normal"] = m

    # Rows named by coords: the "obs" length is a shared variable, not data.
    with pm.Model(coords={"obs": np.arange(n), "feat": ["u", "v", "w"]}) as m:
        Xd = pm.Data("X", X, dims=("obs", "feat"))
        yd = pm.Data("y", X @ beta + rng.standard_t(4, size=n), dims="obs")
        scale = pm.Data("scale", np.array([1.0, 2.0, 0.5]), dims="feat")  # used whole
        b = pm.Normal("b", 0, scale, dims="feat")
        nu = pm.Gamma("nu", 2, 0.1)
        pm.StudentT("y_obs", nu=nu, mu=Xd @ b, sigma=1.0, observed=yd, dims="obs")
    models["studentt_dims"] = m

    # Two observed variables sharing the rows, one of them a Gamma.
    with pm.Model() as m:
        Xd = pm.Data("X", X)
        y1 = pm.Data("y1", np.exp(rng.normal(size=n)))
        y2 = pm.Data("y2", rng.normal(size=n))
        b = pm.Normal("b", 0, 1, shape=3)
        alpha = pm.Exponential("alpha", 1)
        pm.Gamma("g_obs", alpha=alpha, beta=pm.math.exp(-(Xd @ b)), observed=y1)
        pm.Normal("n_obs", mu=Xd @ b, sigma=2.0, observed=y2)
    models["two_observed"] = m
    return models


# Misuse first: these run without a runtime (the module's runtimes come after).
def test_refuses_observed_data_outside_containers():
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1)
        pm.Normal("y_obs", mu=b, sigma=1.0, observed=np.zeros(5))
    with pytest.raises(ValueError, match="pm.Data"):
        synk_pymc.data_parallel(m)


def test_refuses_discrete_free_variables():
    with pm.Model() as m:
        k = pm.Poisson("k", 3.0)
        pm.Normal("y_obs", mu=k, sigma=1.0, observed=pm.Data("y", np.zeros(5)))
    with pytest.raises(ValueError, match="discrete"):
        synk_pymc.data_parallel(m)


def test_needs_fork_first():
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1)
        pm.Normal("y_obs", mu=b, sigma=1.0, observed=pm.Data("y", np.zeros(5)))
    with pytest.raises(synk.SynkStateError, match="fork"):
        synk_pymc.data_parallel(m)


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}ranks")
def env(request, runtime_keeper):
    """Fork n ranks, build every model's data-parallel functions, distribute once."""
    with pytensor.config.change_flags(floatX="float64"):
        n = request.param
        e = types.SimpleNamespace(n=n)
        e.models = _models(np.random.default_rng(7))
        runtime_keeper.fork(n)
        try:
            e.dps = {k: synk_pymc.data_parallel(m) for k, m in e.models.items()}
            synk.distribute()
        except BaseException:
            runtime_keeper.close()
            raise
        yield e
        runtime_keeper.close()


def _points(model, rng, k=2):
    """A few random points in the transformed space, away from the initial point."""
    start = model.initial_point()
    return [{name: np.asarray(v + rng.normal(scale=0.5, size=np.shape(v)), dtype=v.dtype)
             for name, v in start.items()} for _ in range(k)]


MODELS = ["logistic", "poisson", "normal", "studentt_dims", "two_observed"]


@pytest.mark.parametrize("name", MODELS)
def test_logp_and_dlogp_equal_pymc(env, name):
    model, dp = env.models[name], env.dps[name]
    logp, dlogp = model.compile_logp(), model.compile_dlogp()
    for point in _points(model, np.random.default_rng(11)):
        np.testing.assert_allclose(dp.logp(point), logp(point), rtol=1e-10)
        np.testing.assert_allclose(dp.dlogp(point), dlogp(point), rtol=1e-9, atol=1e-12)
        lp, g = dp.logp_dlogp(dp.ravel(point))
        np.testing.assert_allclose(lp, logp(point), rtol=1e-10)
        np.testing.assert_allclose(g, dlogp(point), rtol=1e-9, atol=1e-12)


def test_data_split_and_kept_whole(env):
    dp = env.dps["studentt_dims"]
    assert [c.name for c in dp.containers] == ["X", "y"]   # "scale" has other rows
    assert dp.n_rows == N_ROWS
    lengths = synk.get_lengths(dp._shards[0])
    assert list(lengths) == [len(a) for a in np.array_split(np.arange(N_ROWS), env.n)]
    # The model keeps its whole data set.
    assert len(env.models["studentt_dims"]["X"].get_value()) == N_ROWS


def test_map_equals_serial_scipy_fit(env):
    from scipy.optimize import minimize

    model, dp = env.models["normal"], env.dps["normal"]
    point, res = dp.find_map()
    assert res.success
    logp, dlogp = model.compile_logp(), model.compile_dlogp()
    ref = minimize(lambda x: -logp(dp.unravel(x)), dp.initial_x(),
                   jac=lambda x: -dlogp(dp.unravel(x)), method="L-BFGS-B")
    np.testing.assert_allclose(dp.ravel(point), ref.x, rtol=1e-4, atol=1e-5)
    f, g = dp.neg_logp_dlogp(ref.x)
    assert isinstance(f, float) and g.dtype == np.float64
    np.testing.assert_allclose(f, -logp(dp.unravel(ref.x)), rtol=1e-10)


def test_set_data_then_scatter_again(env):
    model, dp = env.models["poisson"], env.dps["poisson"]
    old = {c.name: c.get_value() for c in dp.containers}
    try:
        rng = np.random.default_rng(3)
        with model:
            pm.set_data({"y": rng.poisson(2.0, size=N_ROWS).astype("int64")})
        dp.scatter()
        point = _points(model, rng, k=1)[0]
        np.testing.assert_allclose(dp.logp(point), model.compile_logp()(point), rtol=1e-10)
    finally:
        with model:
            pm.set_data(old)
        dp.scatter()


def test_demo_runs_small():
    """demos/pymc/map_regression.py end to end, on a few rows (its figures are not checked)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "demos/pymc/map_regression.py", "--family", "poisson",
                           "--rows", "3000", "--features", "3", "--evals", "2", "--rounds", "1",
                           "--n-parallel", "2"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "synkhronos, 2 ranks" in proc.stdout and "evaluations/s" in proc.stdout
    diff = float(proc.stdout.rsplit("MAP estimates:", 1)[1].split()[0])
    assert diff < 1e-6
