"""Synthetic versions of PyMC's example models, for tests/extensions/test_pymc.py and bench/pymc_sampling.py.

Each function returns a ``pm.Model`` with its data in ``pm.Data`` containers:
the radon multilevel model (non-centred county intercepts), a logistic
regression, a negative-binomial GLM, a censored survival model (``pm.Censored``,
``pm.CustomDist`` and ``pm.Potential``), and a Student-t regression with
named dims and a container used whole.
"""

import arviz as az
import numpy as np
import pymc as pm
import pytensor.tensor as pt


def radon(n, n_counties=12, seed=0):
    rng = np.random.default_rng(seed)
    county = rng.integers(0, n_counties, size=n)
    floor = rng.integers(0, 2, size=n).astype("float64")
    a = rng.normal(1.5, 0.5, size=n_counties)
    y = a[county] - 0.6 * floor + rng.normal(0, 0.7, size=n)
    with pm.Model(coords={"county": np.arange(n_counties)}) as model:
        county_d = pm.Data("county_idx", county)
        floor_d = pm.Data("floor", floor)
        y_d = pm.Data("log_radon", y)
        mu_a = pm.Normal("mu_a", 0, 5)
        sigma_a = pm.HalfNormal("sigma_a", 2)
        z_a = pm.Normal("z_a", 0, 1, dims="county")
        a_c = pm.Deterministic("a", mu_a + sigma_a * z_a, dims="county")
        b = pm.Normal("b", 0, 2)
        sigma_y = pm.HalfNormal("sigma_y", 2)
        pm.Normal("y_obs", mu=a_c[county_d] + b * floor_d, sigma=sigma_y, observed=y_d)
    return model


def logistic(n, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 3))
    p = 1 / (1 + np.exp(-(0.3 + X @ np.array([1.0, -0.5, 0.25]))))
    y = rng.binomial(1, p)
    with pm.Model() as model:
        X_d = pm.Data("X", X)
        y_d = pm.Data("y", y)
        a = pm.Normal("a", 0, 2)
        b = pm.Normal("b", 0, 1, shape=3)
        pm.Bernoulli("y_obs", logit_p=a + X_d @ b, observed=y_d)
    return model


def negbin(n, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 3))
    mu = np.exp(0.5 + X @ np.array([0.3, -0.2, 0.1]))
    y = rng.negative_binomial(5, 5 / (5 + mu))
    with pm.Model() as model:
        X_d = pm.Data("X", X)
        y_d = pm.Data("y", y)
        a = pm.Normal("a", 0, 2)
        b = pm.Normal("b", 0, 1, shape=3)
        alpha = pm.Exponential("alpha", 0.5)
        pm.NegativeBinomial("y_obs", mu=pm.math.exp(a + X_d @ b), alpha=alpha, observed=y_d)
    return model


def _weibull_logp(value, mu, k):
    # log-pdf of a Weibull with shape k and scale exp(mu)
    z = value * pt.exp(-mu)
    return pt.log(k) - mu + (k - 1) * pt.log(z) - z ** k


def survival(n, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 2))
    mu = 1.0 + X @ np.array([0.4, -0.3])
    t = np.exp(mu) * rng.weibull(1.5, size=n)
    limit = rng.uniform(1.0, 6.0, size=n)
    event = (t <= limit).astype("float64")
    t_seen = np.minimum(t, limit)
    log_t = np.log(t_seen)
    with pm.Model() as model:
        X_d = pm.Data("X", X)
        t_d = pm.Data("t", t_seen)
        event_d = pm.Data("event", event)
        upper_d = pm.Data("log_limit", np.log(limit))
        log_t_d = pm.Data("log_t", log_t)
        a = pm.Normal("a", 0, 2)
        b = pm.Normal("b", 0, 1, shape=2)
        k = pm.Gamma("k", 2, 1)
        mu_t = a + X_d @ b
        # Weibull AFT: events through a CustomDist, censored rows through a Potential.
        pm.CustomDist("t_obs", mu_t, k, logp=lambda v, m, kk: event_d * _weibull_logp(v, m, kk),
                      observed=t_d)
        pm.Potential("censored", pt.sum((1 - event_d) * -((t_d * pt.exp(-mu_t)) ** k)))
        # The same log-times, right-censored at the study's limit, in a log-normal model.
        c = pm.Normal("c", 0, 2)
        s = pm.HalfNormal("s", 1)
        pm.Censored("log_t_obs", pm.Normal.dist(c + X_d @ b, s), lower=None, upper=upper_d,
                    observed=log_t_d)
    return model


def studentt_dims(n, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 3))
    y = X @ np.array([0.5, -1.0, 0.25]) + rng.standard_t(4, size=n)
    with pm.Model(coords={"obs": np.arange(n), "feat": ["u", "v", "w"]}) as model:
        X_d = pm.Data("X", X, dims=("obs", "feat"))
        y_d = pm.Data("y", y, dims="obs")
        scale = pm.Data("scale", np.array([1.0, 2.0, 0.5]), dims="feat")   # used whole
        b = pm.Normal("b", 0, scale, dims="feat")
        nu = pm.Gamma("nu", 2, 0.1)
        pm.StudentT("y_obs", nu=nu, mu=X_d @ b, sigma=1.0, observed=y_d, dims="obs")
    return model


MODELS = {"radon": radon, "logistic": logistic, "negbin": negbin, "survival": survival,
          "studentt_dims": studentt_dims}


def _kurtosis(x):
    """Each element's kurtosis (3 for a normal) over all chains' draws."""
    x = np.asarray(x)
    c = x.reshape(-1, *x.shape[2:]) - x.reshape(-1, *x.shape[2:]).mean(0)
    return (c ** 4).mean(0) / (c ** 2).mean(0) ** 2


def z_scores(a, b, var_names):
    """|mean difference| and |sd difference| over their Monte Carlo standard errors."""
    out = []
    for v in var_names:
        xa, xb = a.posterior[v], b.posterior[v]
        # Each estimate's own effective sample size: NUTS's anticorrelated draws can
        # give the mean more than the draws, the sd fewer.
        ea, eb = (np.asarray(az.ess(d, var_names=[v], method="mean")[v]) for d in (a, b))
        fa, fb = (np.asarray(az.ess(d, var_names=[v], method="sd")[v]) for d in (a, b))
        ma, mb = np.asarray(xa.mean(("chain", "draw"))), np.asarray(xb.mean(("chain", "draw")))
        sa, sb = np.asarray(xa.std(("chain", "draw"))), np.asarray(xb.std(("chain", "draw")))
        z_mean = np.abs(ma - mb) / np.sqrt(sa ** 2 / ea + sb ** 2 / eb)
        # The sd's standard error with each posterior's kurtosis k, sd^2 (k - 1) / (4 ESS):
        # a hierarchical scale (rugby's sd_att, k up to 27) has tails that the normal
        # theory's sd^2 / (2 ESS) understates two- to threefold.
        ka, kb = _kurtosis(xa), _kurtosis(xb)
        z_sd = np.abs(sa - sb) / np.sqrt(sa ** 2 * (ka - 1) / (4 * fa) + sb ** 2 * (kb - 1) / (4 * fb))
        out.append((v, float(np.max(z_mean)), float(np.max(z_sd))))
    return out
