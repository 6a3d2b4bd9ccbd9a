"""Models from PyMC's example gallery (pymc-examples), in their notebooks' own code, for tests/extensions.

Each model is written as its notebook writes it: NumPy arrays as ``observed=``,
covariates and index arrays, coords and dims where the notebook names them, no
``pm.Data`` added.  The notebooks' data sets are not downloaded here (no network
at run time): eight schools' eight rows are public and given as they are; the
others are made with the same columns and sizes by a seeded generator, from the
parameters the notebooks report.

  radon       multilevel modelling: varying intercepts for 85 counties, 919 rows
  schools     eight schools, non-centred: one parameter per row
  linear      GLM linear regression on generated data: 200 rows
  robust      GLM robust regression (Student-t) with outliers: 103 rows
  logistic    logistic regression, three covariates and an intercept: 500 rows
  censored    censored regression (pm.Censored): 500 rows
  rugby       rugby analytics: attack and defence per team, 60 matches, 6 teams

``LIKELIHOODS``: likelihoods of other gallery notebooks that the seven above do not
have, each in its notebook's form (tested for exactness only; none takes ``rows=``):

  ordinal     ordered categorical outcomes: pm.OrderedLogistic, ordered cutpoints, 300 rows
  zip         zero-inflated Poisson regression: 250 rows
  lkj         LKJ Cholesky covariance, pm.MvNormal observed: 10,000 rows of 2
  stochvol    stochastic volatility: a Gaussian random walk with a value a row, Student-t
              returns, 400 rows
  dirmult     Dirichlet-multinomial counts: 20 rows of 5 categories
  potential   a likelihood written as pm.Potential over the rows (black-box likelihoods)
  dataframe   logistic regression on a pandas DataFrame, observed= a pandas Series: 300 rows

Every model with rows (all but eight schools, whose rows each have a parameter of their
own) takes ``rows=``: that many rows drawn with replacement from the notebook's (a
bootstrap), for the bench's figures at 10^5 rows (``bench/pymc_gallery.py --parts e2e
--rows 1e5``).
"""

import numpy as np
import pymc as pm
import pytensor.tensor as pt


def _boot(n, rows, seed=1):
    """Indices of ``rows`` rows drawn with replacement from ``n`` (all ``n``, in order, for None)."""
    if rows is None:
        return np.arange(n)
    return np.random.default_rng(seed).integers(0, n, int(rows))


def radon(seed=0, rows=None):
    """A Primer on Bayesian Methods for Multilevel Modeling: partial pooling on county."""
    rng = np.random.default_rng(seed)
    n, n_counties = 919, 85
    mn_counties = [f"county_{i}" for i in range(n_counties)]
    county = np.sort(rng.integers(0, n_counties, size=n))
    floor_measure = (rng.random(n) < 0.17).astype("int64")
    log_radon = 1.5 + rng.normal(0, 0.3, n_counties)[county] - 0.66 * floor_measure \
        + rng.normal(0, 0.73, n)
    i = _boot(n, rows)
    county, floor_measure, log_radon = county[i], floor_measure[i], log_radon[i]
    coords = {"county": mn_counties, "obs_id": np.arange(len(i))}
    with pm.Model(coords=coords) as varying_intercept:
        mu_a = pm.Normal("mu_a", mu=0.0, sigma=10.0)
        sigma_a = pm.Exponential("sigma_a", 1)
        alpha = pm.Normal("alpha", mu=mu_a, sigma=sigma_a, dims="county")
        beta = pm.Normal("beta", mu=0.0, sigma=10.0)
        sd_y = pm.Exponential("sd_y", 1)
        y_hat = alpha[county] + beta * floor_measure
        pm.Normal("y_like", mu=y_hat, sigma=sd_y, observed=log_radon, dims="obs_id")
    return varying_intercept


def schools():
    """Eight schools, non-centred (Diagnosing Biased Inference with Divergences)."""
    J = 8
    y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
    sigma = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
    with pm.Model() as NonCentered_eight:  # noqa: N806 - the notebook's name
        mu = pm.Normal("mu", mu=0, sigma=5)
        tau = pm.HalfCauchy("tau", beta=5)
        theta_tilde = pm.Normal("theta_t", mu=0, sigma=1, shape=J)
        theta = pm.Deterministic("theta", mu + tau * theta_tilde)
        pm.Normal("obs", mu=theta, sigma=sigma, observed=y)
    return NonCentered_eight


def linear(seed=0, rows=None):
    """GLM: Linear regression (its generated data: intercept 1, slope 2, noise 0.5)."""
    rng = np.random.default_rng(seed)
    size = 200
    true_intercept, true_slope = 1, 2
    x = np.linspace(0, 1, size)
    true_regression_line = true_intercept + true_slope * x
    y = true_regression_line + rng.normal(scale=0.5, size=size)
    i = _boot(size, rows)
    x, y = x[i], y[i]
    with pm.Model() as model:
        sigma = pm.HalfCauchy("sigma", beta=10)
        intercept = pm.Normal("Intercept", 0, sigma=20)
        slope = pm.Normal("slope", 0, sigma=20)
        pm.Normal("y", mu=intercept + slope * x, sigma=sigma, observed=y)
    return model


def robust(seed=0, rows=None):
    """GLM: Robust Linear Regression: a Student-t likelihood against three outliers."""
    rng = np.random.default_rng(seed)
    size = 100
    x = np.linspace(0, 1, size)
    y = 1 + 2 * x + rng.normal(scale=0.5, size=size)
    x_out = np.append(x, [0.1, 0.15, 0.2])
    y_out = np.append(y, [8, 6, 9])
    i = _boot(size + 3, rows)
    x_out, y_out = x_out[i], y_out[i]
    with pm.Model() as robust_model:
        sigma = pm.HalfNormal("sigma", 10)
        intercept = pm.Normal("Intercept", 0, sigma=20)
        slope = pm.Normal("slope", 0, sigma=20)
        nu = pm.Gamma("nu", alpha=2, beta=0.1)
        pm.StudentT("y", mu=intercept + slope * x_out, sigma=sigma, nu=nu, observed=y_out)
    return robust_model


def logistic(seed=0, rows=None):
    """GLM: Logistic Regression: income over 50K from age, education and hours (made rows)."""
    rng = np.random.default_rng(seed)
    n = 500
    age = rng.integers(17, 90, n)
    educ = rng.integers(1, 16, n)
    hours = rng.integers(1, 99, n)
    x = np.column_stack([(age - age.mean()) / age.std(), (educ - educ.mean()) / educ.std(),
                         (hours - hours.mean()) / hours.std()])
    p = 1 / (1 + np.exp(-(-1.2 + x @ np.array([0.6, 0.8, 0.4]))))
    income = (rng.random(n) < p).astype("int64")
    i = _boot(n, rows)
    x, income = x[i], income[i]
    labels = ["age", "educ", "hours"]
    with pm.Model(coords={"coeffs": labels}) as logistic_model:
        b = pm.Normal("b", 0, 10, dims="coeffs")
        a = pm.Normal("Intercept", 0, 10)
        p = pm.math.invlogit(a + pm.math.dot(x, b))
        pm.Bernoulli("income", p=p, observed=income)
    return logistic_model


def censored(seed=0, rows=None):
    """Censored Data Models: a regression whose outcome is clipped to [-1.5, 1.5]."""
    rng = np.random.default_rng(seed)
    n = 500
    x = rng.normal(size=n)
    y = -0.2 + 1.2 * x + rng.normal(scale=0.5, size=n)
    low, high = -1.5, 1.5
    y_censored = np.clip(y, low, high)
    i = _boot(n, rows)
    x, y_censored = x[i], y_censored[i]
    with pm.Model() as censored_model:
        a = pm.Normal("a", mu=0, sigma=1)
        b = pm.Normal("b", mu=0, sigma=1)
        sigma = pm.HalfNormal("sigma", sigma=1)
        y_latent = pm.Normal.dist(mu=a + b * x, sigma=sigma)
        pm.Censored("obs", y_latent, lower=low, upper=high, observed=y_censored)
    return censored_model


def rugby(seed=0, rows=None):
    """A Hierarchical model for Rugby prediction: Six Nations, 60 matches, 6 teams."""
    rng = np.random.default_rng(seed)
    teams = ["Wales", "France", "Ireland", "Scotland", "Italy", "England"]
    pairs = [(h, a) for h in range(6) for a in range(6) if h != a]
    games = [pairs[i % len(pairs)] for i in range(60)]
    home_idx = np.array([h for h, _ in games])
    away_idx = np.array([a for _, a in games])
    att, dfn = rng.normal(0, 0.2, 6), rng.normal(0, 0.2, 6)
    home_score = rng.poisson(np.exp(3.0 + 0.2 + att[home_idx] + dfn[away_idx]))
    away_score = rng.poisson(np.exp(3.0 + att[away_idx] + dfn[home_idx]))
    i = _boot(60, rows)
    home_idx, away_idx, home_score, away_score = home_idx[i], away_idx[i], home_score[i], away_score[i]
    coords = {"team": teams, "match": np.arange(len(i))}
    with pm.Model(coords=coords) as model:
        home = pm.Normal("home", mu=0, sigma=1)
        sd_att = pm.HalfNormal("sd_att", sigma=2)
        sd_def = pm.HalfNormal("sd_def", sigma=2)
        intercept = pm.Normal("intercept", mu=3, sigma=1)
        atts_star = pm.Normal("atts_star", mu=0, sigma=sd_att, dims="team")
        defs_star = pm.Normal("defs_star", mu=0, sigma=sd_def, dims="team")
        atts = pm.Deterministic("atts", atts_star - pt.mean(atts_star), dims="team")
        defs = pm.Deterministic("defs", defs_star - pt.mean(defs_star), dims="team")
        home_theta = pt.exp(intercept + home + atts[home_idx] + defs[away_idx])
        away_theta = pt.exp(intercept + atts[away_idx] + defs[home_idx])
        pm.Poisson("home_points", mu=home_theta, observed=home_score, dims="match")
        pm.Poisson("away_points", mu=away_theta, observed=away_score, dims="match")
    return model


MODELS = {"radon": radon, "schools": schools, "linear": linear, "robust": robust,
          "logistic": logistic, "censored": censored, "rugby": rugby}
# The models that take rows= (eight schools has a parameter per row).
WITH_ROWS = [k for k in MODELS if k != "schools"]


def ordinal(seed=0):
    """Regression models with ordered categorical outcomes: an ordered-logistic regression."""
    rng = np.random.default_rng(seed)
    n = 300
    X = rng.normal(size=(n, 2))
    y = np.digitize(X @ [1.0, -0.5] + rng.logistic(size=n), [-1.0, 0.0, 1.0])
    with pm.Model() as model:
        beta = pm.Normal("beta", 0, 2, shape=2)
        cutpoints = pm.Normal("cutpoints", mu=[-1, 0, 1], sigma=2, shape=3,
                              transform=pm.distributions.transforms.ordered)
        pm.OrderedLogistic("y", eta=pm.math.dot(X, beta), cutpoints=cutpoints, observed=y)
    return model


def zero_inflated(seed=0):
    """Zero-inflated Poisson regression (GLM: count data with structural zeros)."""
    rng = np.random.default_rng(seed)
    n = 250
    x = rng.normal(size=n)
    y = rng.poisson(np.exp(0.3 + 0.5 * x)) * (rng.random(n) > 0.3)
    with pm.Model() as model:
        psi = pm.Beta("psi", 1, 1)
        a = pm.Normal("a", 0, 2)
        b = pm.Normal("b", 0, 2)
        pm.ZeroInflatedPoisson("y", psi=psi, mu=pm.math.exp(a + b * x), observed=y)
    return model


def lkj(seed=0):
    """LKJ Cholesky covariance priors for multivariate normal models: 10,000 draws of 2."""
    rng = np.random.default_rng(seed)
    n = 10_000
    mu_actual = np.array([1.0, -2.0])
    sigmas = np.array([0.7, 1.5])
    corr = np.array([[1.0, -0.4], [-0.4, 1.0]])
    x = rng.multivariate_normal(mu_actual, np.diag(sigmas) @ corr @ np.diag(sigmas), size=n)
    with pm.Model() as model:
        chol, corr, stds = pm.LKJCholeskyCov("chol", n=2, eta=2.0,
                                             sd_dist=pm.Exponential.dist(1.0, shape=2),
                                             compute_corr=True)
        mu = pm.Normal("mu", 0.0, sigma=1.5, shape=2)
        pm.MvNormal("obs", mu, chol=chol, observed=x)
    return model


def stochvol(seed=0):
    """Stochastic volatility: log-volatility a Gaussian random walk, one value a day."""
    rng = np.random.default_rng(seed)
    n = 400
    returns = rng.standard_t(5, n) * 0.02 * np.exp(np.cumsum(rng.normal(0, 0.05, n)))
    with pm.Model(coords={"time": np.arange(n)}) as model:
        step_size = pm.Exponential("step_size", 10)
        volatility = pm.GaussianRandomWalk("volatility", sigma=step_size, dims="time",
                                           init_dist=pm.Normal.dist(0, 100))
        nu = pm.Exponential("nu", 0.1)
        pm.StudentT("returns", nu=nu, lam=np.exp(-2 * volatility), observed=returns, dims="time")
    return model


def dirmult(seed=0):
    """Dirichlet-multinomial: tree counts of 5 species in 20 forests."""
    rng = np.random.default_rng(seed)
    k, n, total = 5, 20, 50
    frac = rng.dirichlet(np.ones(k))
    counts = np.stack([rng.multinomial(total, rng.dirichlet(frac * 10)) for _ in range(n)])
    with pm.Model(coords={"tree": np.arange(k), "forest": np.arange(n)}) as model:
        frac = pm.Dirichlet("frac", a=np.ones(k), dims="tree")
        conc = pm.Lognormal("conc", mu=1, sigma=1)
        pm.DirichletMultinomial("counts", n=total, a=frac * conc, observed=counts,
                                dims=("forest", "tree"))
    return model


def potential(seed=0):
    """A likelihood written as a pm.Potential over the rows (as black-box likelihoods are)."""
    rng = np.random.default_rng(seed)
    n = 200
    x = rng.normal(size=n)
    y = 1.0 + 2.0 * x + rng.normal(size=n)
    with pm.Model() as model:
        a = pm.Normal("a", 0, 5)
        b = pm.Normal("b", 0, 5)
        sigma = pm.HalfNormal("sigma", 2)
        pm.Potential("likelihood", pm.logp(pm.Normal.dist(a + b * x, sigma), y))
    return model


def dataframe(seed=0):
    """Logistic regression on a pandas DataFrame, observed= a pandas Series."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    n = 300
    df = pd.DataFrame({"x1": rng.normal(size=n), "x2": rng.normal(size=n)})
    df["y"] = (rng.random(n) < 1 / (1 + np.exp(-(df.x1 - df.x2)))).astype(int)
    with pm.Model() as model:
        intercept = pm.Normal("Intercept", 0, 2)
        beta = pm.Normal("beta", 0, 2, shape=2)
        pm.Bernoulli("y", logit_p=intercept + pm.math.dot(df[["x1", "x2"]].values, beta),
                     observed=df["y"])
    return model


LIKELIHOODS = {"ordinal": ordinal, "zip": zero_inflated, "lkj": lkj, "stochvol": stochvol,
               "dirmult": dirmult, "potential": potential, "dataframe": dataframe}
