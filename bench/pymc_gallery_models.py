"""The PyMC gallery's models, typed as a PyMC user would, with rows made by a formula.

Shared by bench/pymc_gallery.py (sampling) and bench/pymc_calls.py (per row, per call).
Every model keeps its rows in ``pm.Data`` containers; rows are made by formulas of
the row number (no random state), so any process, or any machine, makes the same rows.

  logistic  logistic regression, 5 covariates and an intercept
  radon     non-centred hierarchical intercepts, 85 counties indexed per row, a floor slope
  negbin    negative binomial GLM, 3 covariates, log link
  robust    robust regression: a Student-t likelihood with unknown degrees of freedom
  predict   a linear regression on pm.Data, sampled, then pm.set_data and
            pm.sample_posterior_predictive on new rows
  schools   eight schools (non-centred): 8 rows, the small model
"""

import numpy as np

COUNTIES = 85
FEATURES = 5


def _u(lo, hi, seed):
    """Uniform-looking numbers in [0, 1) for rows lo:hi (a hash of the row number)."""
    i = np.arange(lo, hi, dtype=np.float64)
    return np.abs(np.sin(i * 12.9898 + seed * 78.233) * 43758.5453) % 1.0


def _normal(lo, hi, seed):
    """Standard-normal-looking numbers for rows lo:hi (Box-Muller on two hashes)."""
    u1 = np.clip(_u(lo, hi, seed), 1e-12, 1.0)
    u2 = _u(lo, hi, seed + 0.5)
    return np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)


def _x(lo, hi, k):
    i = np.arange(lo, hi, dtype=np.float64)[:, None]
    return np.sin(i * np.array([0.731, 1.917, 2.377, 0.0913, 3.141])[:k] + 0.5)


def logistic(n):
    """Logistic regression: 5 covariates and an intercept, rows in pm.Data."""
    import pymc as pm
    x = _x(0, n, FEATURES)
    y = (_u(0, n, 0.0) < 1 / (1 + np.exp(-(0.3 + x @ np.array([0.8, -0.5, 0.3, 0.0, 0.2])))))
    with pm.Model() as model:
        X_d, y_d = pm.Data("X", x), pm.Data("y", y.astype("int64"))
        a = pm.Normal("a", 0, 2)
        b = pm.Normal("b", 0, 1, shape=FEATURES)
        pm.Bernoulli("y_obs", logit_p=a + X_d @ b, observed=y_d)
    return model


def radon(n):
    """Radon: varying intercepts for 85 counties (non-centred), a floor slope, rows in pm.Data."""
    import pymc as pm
    county = (np.arange(n) * 7919) % COUNTIES
    floor = (_u(0, n, 1.0) < 0.3).astype("float64")
    effect = np.sin(np.arange(COUNTIES) * 0.37) * 0.4
    y = 1.2 + effect[county] - 0.6 * floor + 0.7 * _normal(0, n, 2.0)
    with pm.Model(coords={"county": np.arange(COUNTIES)}) as model:
        c_d = pm.Data("county_idx", county)
        f_d = pm.Data("floor", floor)
        y_d = pm.Data("log_radon", y)
        mu_a = pm.Normal("mu_a", 0, 10)
        sigma_a = pm.HalfNormal("sigma_a", 1)
        z = pm.Normal("z", 0, 1, dims="county")
        a = pm.Deterministic("a", mu_a + sigma_a * z, dims="county")
        b = pm.Normal("b", 0, 1)
        sigma = pm.HalfNormal("sigma", 1)
        pm.Normal("y_obs", a[c_d] + b * f_d, sigma, observed=y_d)
    return model


def negbin(n):
    """Negative binomial GLM: counts on 3 covariates, log link, unknown dispersion."""
    import pymc as pm
    x = _x(0, n, 3)
    mu = np.exp(0.5 + x @ np.array([0.3, -0.2, 0.1]))
    # Counts by inverting a Poisson-gamma mixture's quantiles: deterministic, overdispersed.
    lam = mu * np.exp(0.4 * _normal(0, n, 3.0) - 0.08)
    y = np.floor(lam + np.sqrt(lam) * _normal(0, n, 4.0)).clip(0).astype("int64")
    with pm.Model() as model:
        X_d, y_d = pm.Data("X", x), pm.Data("y", y)
        a = pm.Normal("a", 0, 2)
        b = pm.Normal("b", 0, 1, shape=3)
        alpha = pm.Exponential("alpha", 0.5)
        pm.NegativeBinomial("y_obs", mu=pm.math.exp(a + X_d @ b), alpha=alpha, observed=y_d)
    return model


def robust(n):
    """Robust regression: a Student-t likelihood (unknown nu) on a line, with outliers."""
    import pymc as pm
    x = _x(0, n, 1)[:, 0]
    noise = 0.5 * _normal(0, n, 5.0)
    outlier = _u(0, n, 6.0) < 0.05
    y = 1.0 + 2.0 * x + np.where(outlier, 8.0 * noise, noise)
    with pm.Model() as model:
        x_d, y_d = pm.Data("x", x), pm.Data("y", y)
        a = pm.Normal("intercept", 0, 5)
        b = pm.Normal("slope", 0, 5)
        sigma = pm.HalfNormal("sigma", 2)
        nu = pm.Gamma("nu", 2, 0.1)
        pm.StudentT("y_obs", nu=nu, mu=a + b * x_d, sigma=sigma, observed=y_d)
    return model


def predict(n):
    """A linear regression on pm.Data with dims, ready for pm.set_data and posterior predictions."""
    import pymc as pm
    x = _x(0, n, 2)
    y = 0.5 + x @ np.array([1.5, -0.7]) + 0.3 * _normal(0, n, 7.0)
    with pm.Model(coords={"obs": np.arange(n), "feat": ["u", "v"]}) as model:
        X_d = pm.Data("X", x, dims=("obs", "feat"))
        y_d = pm.Data("y", y, dims="obs")
        a = pm.Normal("a", 0, 2)
        b = pm.Normal("b", 0, 1, dims="feat")
        sigma = pm.HalfNormal("sigma", 1)
        # shape= from the data: pm.set_data with new rows resizes the prediction.
        pm.Normal("y_obs", a + X_d @ b, sigma, observed=y_d, shape=X_d.shape[0], dims="obs")
    return model


def predict_after(model, idata, n_new=100):
    """The gallery's second half: new rows through pm.set_data, then posterior predictions."""
    import pymc as pm
    x_new = _x(10**7, 10**7 + n_new, 2)
    with model:
        pm.set_data({"X": x_new, "y": np.zeros(n_new)}, coords={"obs": np.arange(n_new)})
        return pm.sample_posterior_predictive(idata, var_names=["y_obs"], progressbar=False,
                                              random_seed=1)


def schools(n=8):
    """Eight schools, non-centred: 8 rows (the effects and their standard errors).

    Each school's effect is picked by a pm.Data index (``theta[school]``), so that each
    rank picks the effects of its own rows: written as ``mu=theta`` (one effect per
    row, by position), the rows could not be split.
    """
    import pymc as pm
    y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
    sigma = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
    with pm.Model(coords={"school": np.arange(8)}) as model:
        i_d = pm.Data("school_idx", np.arange(8))
        y_d = pm.Data("y", y)
        s_d = pm.Data("sigma", sigma)
        mu = pm.Normal("mu", 0, 5)
        tau = pm.HalfCauchy("tau", 5)
        theta_z = pm.Normal("theta_z", 0, 1, dims="school")
        theta = pm.Deterministic("theta", mu + tau * theta_z, dims="school")
        pm.Normal("y_obs", theta[i_d], s_d, observed=y_d)
    return model


MODELS = {"logistic": logistic, "radon": radon, "negbin": negbin, "robust": robust,
          "predict": predict, "schools": schools}
"""Every gallery model by name; ``schools`` has its 8 rows whatever ``n`` is."""

HAS_ROWS = ("logistic", "radon", "negbin", "robust", "predict")
