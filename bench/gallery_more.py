"""Eight more models of PyMC's example gallery, written as a new user writes them: NumPy arrays
as observed data and covariates, no pm.Data (none of them is in the tests' gallery,
tests/helpers/pymc_gallery.py).  The data are made here with each notebook's columns and
sizes (a fixed seed per model: every process makes the same rows).

  poisson    GLM: Poisson regression, 250 rows, 3 covariates, log link
  rats       hierarchical binomial (rat tumours): 71 groups, one effect a row
  baseball   hierarchical partial pooling (Efron-Morris): 18 players, Beta-Binomial
  mixture    marginalized Gaussian mixture: 1000 rows, 3 ordered components
  truncated  regression on truncated data: the rows of 700 kept in [-5, 5]
  splines    splines (cherry blossoms' shape): 827 rows, 17 basis functions
  missing    automatic imputation (PyMC's overview): a regression whose observed values
             have NaNs, 500 rows, 2 covariates, 10% missing, imputed by PyMC
  covariates imputation of covariates (PyMC's missing-data notebook): the covariates
             have NaNs, modelled and imputed, 500 rows, 2 covariates, 10% missing

Used by ``bench/pymc_gallery.py --parts e2e --more`` (with ``--rows``, the models of
``WITH_ROWS`` made at that many rows).
"""

import numpy as np
import pymc as pm


def poisson(rows=None):
    """GLM: Poisson regression (fish-like counts: 250 rows, 3 covariates)."""
    rng = np.random.default_rng(4)
    n = rows or 250
    X = rng.normal(size=(n, 3))
    y = rng.poisson(np.exp(0.5 + X @ [0.3, -0.2, 0.1]))
    with pm.Model() as m:
        b0 = pm.Normal("b0", 0, 5)
        b = pm.Normal("b", 0, 1, shape=3)
        pm.Poisson("y", mu=pm.math.exp(b0 + pm.math.dot(X, b)), observed=y)
    return m


def rats():
    """Hierarchical binomial (rat tumours): 71 groups, Beta-Binomial via logit-normal."""
    rng = np.random.default_rng(5)
    n = 71
    N = rng.integers(15, 50, n)
    p = rng.beta(2, 12, n)
    y = rng.binomial(N, p)
    with pm.Model() as m:
        mu = pm.Normal("mu", -2, 1)
        sd = pm.HalfNormal("sd", 1)
        z = pm.Normal("z", 0, 1, shape=n)
        pm.Binomial("y", n=N, logit_p=mu + sd * z, observed=y)
    return m


def baseball():
    """Hierarchical partial pooling (Efron-Morris baseball): 18 players."""
    rng = np.random.default_rng(6)
    n = 18
    at_bats = np.full(n, 45)
    hits = rng.binomial(at_bats, 0.26)
    with pm.Model() as m:
        phi = pm.Uniform("phi", 0, 1)
        kappa_log = pm.Exponential("kappa_log", 1.5)
        kappa = pm.Deterministic("kappa", pm.math.exp(kappa_log))
        theta = pm.Beta("theta", alpha=phi * kappa, beta=(1 - phi) * kappa, shape=n)
        pm.Binomial("y", n=at_bats, p=theta, observed=hits)
    return m


def mixture(rows=None):
    """Gaussian mixture (Marginalized Gaussian Mixture Model): 1000 rows, 3 components."""
    rng = np.random.default_rng(7)
    n = rows or 1000
    comp = rng.integers(0, 3, n)
    x = rng.normal(np.array([-3., 0., 4.])[comp], 0.8)
    with pm.Model() as m:
        w = pm.Dirichlet("w", np.ones(3))
        mu = pm.Normal("mu", np.array([-2., 0., 2.]), 5, shape=3,
                       transform=pm.distributions.transforms.ordered)
        sd = pm.HalfNormal("sd", 2, shape=3)
        pm.NormalMixture("x", w=w, mu=mu, sigma=sd, observed=x)
    return m


def truncated(rows=None):
    """Bayesian regression with truncated data: the rows of 700 kept in [-5, 5]."""
    rng = np.random.default_rng(8)
    n = 700 if rows is None else 3 * rows     # about 41% are kept
    x = rng.uniform(-10, 10, n)
    y = rng.normal(x * 0.8 + 1.0, 2.0)
    keep = (y > -5) & (y < 5)
    x, y = x[keep][:rows], y[keep][:rows]
    with pm.Model() as m:
        a = pm.Normal("a", 0, 5)
        b = pm.Normal("b", 0, 5)
        s = pm.HalfNormal("s", 5)
        pm.Truncated("y", pm.Normal.dist(mu=a + b * x, sigma=s), lower=-5, upper=5, observed=y)
    return m


def splines(rows=None):
    """Splines (cherry blossoms' shape): 827 rows, 17 basis functions (the basis made here)."""
    rng = np.random.default_rng(9)
    n, k = rows or 827, 17
    t = np.linspace(0, 1, n)
    knots = np.linspace(0, 1, k)
    B = np.exp(-((t[:, None] - knots[None]) ** 2) / 0.005)
    y = np.sin(6 * t) + rng.normal(0, 0.3, n)
    with pm.Model() as m:
        a = pm.Normal("a", 0, 3)
        w = pm.Normal("w", 0, 3, shape=k)
        s = pm.Exponential("s", 1)
        pm.Normal("D", a + pm.math.dot(B, w), s, observed=y)
    return m


def _regression(seed, n=500):
    """(the generator, X, y) of a regression on 2 covariates, for the missing-value models."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 2))
    return rng, X, 1.0 + X @ [0.8, -0.4] + rng.normal(0, 0.5, n)


def missing(rows=None):
    """Automatic imputation: observed= a NumPy array with NaNs, PyMC imputes them (500 rows)."""
    rng, X, y = _regression(10, rows or 500)
    y[rng.random(len(y)) < 0.1] = np.nan
    with pm.Model() as m:
        a = pm.Normal("a", 0, 5)
        b = pm.Normal("b", 0, 2, shape=2)
        s = pm.HalfNormal("s", 2)
        pm.Normal("y", a + pm.math.dot(X, b), s, observed=y)
    return m


def covariates(rows=None):
    """Imputed covariates: X observed with NaNs under a model of its own, y ~ X @ b (500 rows)."""
    rng, X, y = _regression(11, rows or 500)
    X[rng.random(X.shape) < 0.1] = np.nan
    with pm.Model() as m:
        mx = pm.Normal("mx", 0, 2, shape=2)
        sx = pm.HalfNormal("sx", 2, shape=2)
        X_v = pm.Normal("X", mx, sx, observed=X)
        a = pm.Normal("a", 0, 5)
        b = pm.Normal("b", 0, 2, shape=2)
        s = pm.HalfNormal("s", 2)
        pm.Normal("y", a + pm.math.dot(X_v, b), s, observed=y)
    return m


MODELS = dict(poisson=poisson, rats=rats, baseball=baseball, mixture=mixture,
              truncated=truncated, splines=splines, missing=missing, covariates=covariates)

WITH_ROWS = ("poisson", "mixture", "truncated", "splines", "missing", "covariates")
"""The models whose data take ``rows=``: made at that many rows (``--more --rows 1e5``), the
notebook's columns and seed kept; rats and baseball have a parameter a row."""
