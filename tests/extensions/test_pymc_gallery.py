"""PyMC's gallery models as their notebooks write them: accepted, exact, and sampled as pm.sample samples.

The models (tests/helpers/pymc_gallery.py) pass NumPy arrays as observed data,
covariates and index arrays, with no ``pm.Data`` added.  On 3 ranks (uneven
splits, eight schools' 8 rows 3/3/2) each is accepted, its (logp, dlogp)
equals PyMC's own on the whole data, and ``dp.sample`` gives the posterior
``pm.sample`` gives with the same seed.  The likelihoods of other notebooks
(``pymc_gallery.LIKELIHOODS``: ordered logistic, zero-inflated Poisson, LKJ with a
multivariate normal, a random walk with a value a row, Dirichlet-multinomial, a
``pm.Potential`` over rows, a pandas DataFrame) are accepted as written and exact.
Skipped where PyMC is not installed.
"""

import types

import numpy as np
import pytest

pm = pytest.importorskip("pymc", reason="PyMC is not installed (pip install -e '.[pymc]')")

import pytensor  # noqa: E402

from helpers import pymc_gallery, pymc_models  # noqa: E402
from synkhronos.extensions import pymc as synk_pymc  # noqa: E402

pytestmark = pytest.mark.timeout(300)

DRAWS = 200


@pytest.fixture(scope="module")
def gallery(runtime_keeper):
    with pytensor.config.change_flags(floatX="float64"):
        every = {**pymc_gallery.MODELS, **pymc_gallery.LIKELIHOODS}
        e = types.SimpleNamespace(models={k: make() for k, make in every.items()})
        # split=True: the posteriors tested are the data-parallel sampler's, whatever the
        # crossover measured on these small data sets would choose.
        def build():
            # The other likelihoods compile in one mode (no C compile measured against
            # Numba: a minute a model on PyMC 5.28), but LKJ's, whose OpFromGraph the two
            # modes once shared (compat.private_inner_graphs).
            return {k: synk_pymc.data_parallel(
                        m, name=f"gallery_{k}", split=True,
                        mode="NUMBA" if k in pymc_gallery.LIKELIHOODS and k != "lkj" else None)
                    for k, m in e.models.items()}

        with runtime_keeper.distributed(3, build) as e.dps:
            yield e


def _points(model, rng, k=3):
    start = model.initial_point()
    return [{name: np.asarray(v + rng.normal(scale=0.3, size=np.shape(v)), dtype=v.dtype)
             for name, v in start.items()} for _ in range(k)]


@pytest.mark.parametrize("name", list(pymc_gallery.MODELS))
def test_as_written_and_exact(gallery, name):
    model, dp = gallery.models[name], gallery.dps[name]
    assert not model.data_vars, "the notebook's model has no pm.Data"
    assert dp.n_rows == len(np.asarray(model.rvs_to_values[model.observed_RVs[0]].data))
    _assert_exact(model, dp, np.random.default_rng(3))


def _assert_exact(model, dp, rng):
    """``dp``'s (logp, dlogp) is PyMC's own on the whole data, at points near the start."""
    logp, dlogp = model.compile_logp(), model.compile_dlogp()
    for point in _points(model, rng):
        np.testing.assert_allclose(dp.logp(point), logp(point), rtol=1e-10)
        g, ref = dp.dlogp(point), dlogp(point)
        np.testing.assert_allclose(g, ref, rtol=1e-9, atol=1e-9 * max(1.0, np.max(np.abs(ref))))


# The rows each notebook's data set has (its docstring), split over the ranks.
LIKELIHOOD_ROWS = {"ordinal": 300, "zip": 250, "lkj": 10_000, "stochvol": 400, "dirmult": 20,
                   "potential": 200, "dataframe": 300}


@pytest.mark.parametrize("name", list(pymc_gallery.LIKELIHOODS))
def test_other_likelihoods_as_written_and_exact(gallery, name):
    model, dp = gallery.models[name], gallery.dps[name]
    assert not model.data_vars, "the notebook's model has no pm.Data"
    assert dp.n_rows == LIKELIHOOD_ROWS[name]
    _assert_exact(model, dp, np.random.default_rng(4))


@pytest.mark.parametrize("name", list(pymc_gallery.MODELS))
def test_posterior_is_pm_samples(gallery, name):
    model, dp = gallery.models[name], gallery.dps[name]
    idata = dp.sample(DRAWS, tune=DRAWS, chains=2, random_seed=11, progressbar=False,
                      compute_convergence_checks=False)
    with model:
        ref = pm.sample(DRAWS, tune=DRAWS, chains=2, cores=1, random_seed=11, progressbar=False,
                        compute_convergence_checks=False)
    assert set(idata.posterior.data_vars) == set(ref.posterior.data_vars)
    z = pymc_models.z_scores(idata, ref, [v.name for v in model.free_RVs])
    assert all(zm < 4.5 and zs < 4.5 for _, zm, zs in z), z
