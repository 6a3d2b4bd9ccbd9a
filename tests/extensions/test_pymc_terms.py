"""PyMC models, data-parallel: every case that used to be silently wrong is now exact or refused.

Refusals name the variable (pm.Minibatch, a term combining rows, masks that
select rows); total_size, a centred term kept whole, an observed time series
kept whole, and models as their users write them (NumPy arrays as observed
data, covariates, index arrays and pm.Censored bounds, a likelihood in a
pm.Potential, parts of the likelihood that read NumPy arrays alone, such as
a Poisson's gammaln(y + 1), computed once in the master) are exact on 3 ranks
(uneven split) against PyMC's own functions; a float32 model stays float32.
Skipped where PyMC is not installed.
"""

import types

import numpy as np
import pytest

pm = pytest.importorskip("pymc", reason="PyMC is not installed (pip install -e '.[pymc]')")

import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402
from pytensor.graph.basic import Constant  # noqa: E402

import synkhronos as synk  # noqa: E402
from helpers import pymc_models  # noqa: E402
from synkhronos import compat  # noqa: E402
from synkhronos.extensions import pymc as synk_pymc  # noqa: E402
from synkhronos.extensions.pymc import branches, graphs  # noqa: E402

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


def _random_walk_model(numpy=False):
    y = np.cumsum(np.random.default_rng(4).normal(size=N_ROWS))
    X, y2 = _regression()
    with pm.Model() as m:
        X_d, y2_d = pm.Data("X", X), pm.Data("y2", y2)
        series = y if numpy else pm.Data("series", y)
        b = pm.Normal("b", 0, 1, shape=2)
        s = pm.HalfNormal("s", 1)
        pm.Normal("y_obs", mu=X_d @ b, sigma=1.0, observed=y2_d)
        pm.GaussianRandomWalk("walk", sigma=s, init_dist=pm.Normal.dist(0, 10),
                              observed=series, steps=N_ROWS - 1)
    return m


# -- models as their users write them: NumPy arrays where the rows are ------------------------
def _numpy_model():
    """observed= and the covariates NumPy arrays, no pm.Data at all."""
    X, y = _regression()
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1, shape=2)
        s = pm.HalfNormal("s", 1)
        pm.Normal("y_obs", mu=X @ b, sigma=s, observed=y)
    return m


def _indexed_model(wrapped=False):
    """Rows indexed by a NumPy array of groups, dims named for the rows (as the radon notebook
    writes it); ``wrapped``: only the observed array in a pm.Data container."""
    rng = np.random.default_rng(6)
    county = rng.integers(0, 12, size=N_ROWS)
    y = np.linspace(-1, 1, 12)[county] + rng.normal(size=N_ROWS)
    with pm.Model(coords={"county": np.arange(12), "obs_id": np.arange(N_ROWS)}) as m:
        a = pm.Normal("a", 0, 1, dims="county")
        s = pm.HalfNormal("s", 1)
        obs = pm.Data("y", y, dims="obs_id") if wrapped else y
        pm.Normal("y_obs", mu=a[county], sigma=s, observed=obs, dims="obs_id")
    return m


def _censored_model():
    """pm.Censored with NumPy bounds and NumPy observed data."""
    X, y = _regression()
    upper = np.where(np.arange(N_ROWS) % 3 == 0, 0.5, 1.5)
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Censored("y_obs", pm.Normal.dist(X @ b, 1.0), lower=-np.full(N_ROWS, 2.0),
                    upper=upper, observed=np.clip(y, -2.0, upper))
    return m


def _potential_model():
    """The likelihood as a pm.Potential over rows of NumPy arrays: no observed variable."""
    X, y = _regression()
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1, shape=2)
        s = pm.HalfNormal("s", 1)
        pm.Potential("lik", pm.logp(pm.Normal.dist(X @ b, s), y).sum())
    return m


def _poisson_model():
    """A Poisson GLM as its users write it: NumPy counts, a log-exposure offset, and a
    covariate standardised in the graph, over all rows (its mean and deviation)."""
    rng = np.random.default_rng(7)
    x = rng.normal(2.0, 3.0, N_ROWS)
    exposure = rng.uniform(0.5, 2.0, N_ROWS)
    y = rng.poisson(exposure * np.exp(0.3 + 0.2 * (x - 2.0) / 3.0))
    with pm.Model() as m:
        a = pm.Normal("a", 0, 2)
        b = pm.Normal("b", 0, 1)
        xt = pt.as_tensor(x)
        z = (xt - xt.mean()) / xt.std()
        pm.Poisson("y_obs", mu=pm.math.exp(a + b * z + pm.math.log(exposure)), observed=y)
    return m


def _schools_model():
    """Eight schools, non-centred, as PyMC's gallery writes it: one parameter per row."""
    y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
    sigma = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
    with pm.Model() as m:
        mu = pm.Normal("mu", mu=0, sigma=5)
        tau = pm.HalfCauchy("tau", beta=5)
        theta_tilde = pm.Normal("theta_t", mu=0, sigma=1, shape=8)
        theta = pm.Deterministic("theta", mu + tau * theta_tilde)
        pm.Normal("obs", mu=theta, sigma=sigma, observed=y)
    return m


def _schools_indexed_model(numpy=False):
    """Eight schools with each row's effect picked by an index (``theta[school]``): as
    many effects as rows, but read through the index, not by position."""
    y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
    sigma = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
    school = np.array([3, 1, 0, 2, 7, 5, 4, 6])
    with pm.Model() as m:
        idx = school if numpy else pm.Data("school_idx", school)
        y_d, s_d = (y, sigma) if numpy else (pm.Data("y", y), pm.Data("sigma", sigma))
        mu = pm.Normal("mu", 0, 5)
        tau = pm.HalfCauchy("tau", 5)
        theta_z = pm.Normal("theta_z", 0, 1, shape=8)
        theta = pm.Deterministic("theta", mu + tau * theta_z)
        pm.Normal("y_obs", theta[idx], s_d, observed=y_d)
    return m


def _mixture_model():
    """A NormalMixture observed on a NumPy array (the gallery's Gaussian mixture): its logp
    broadcasts the rows against the components, (rows, 3), inside PyTensor 3.3's LogSumExp,
    an op built for its input's static shape (the whole data set's rows)."""
    rng = np.random.default_rng(4)
    x = rng.normal(np.array([-3.0, 0.0, 4.0])[rng.integers(0, 3, N_ROWS)], 0.8)
    with pm.Model() as m:
        w = pm.Dirichlet("w", np.ones(3))
        mu = pm.Normal("mu", np.array([-2.0, 0.0, 2.0]), 5, shape=3,
                       transform=pm.distributions.transforms.ordered)
        sd = pm.HalfNormal("sd", 2, shape=3)
        pm.NormalMixture("x", w=w, mu=mu, sigma=sd, observed=x)
    return m


def _truncated_model():
    """pm.Truncated over a NumPy covariate and observed data (the gallery's truncated
    regression)."""
    rng = np.random.default_rng(5)
    x = rng.uniform(-5, 5, N_ROWS)
    y = np.clip(rng.normal(0.8 * x + 1.0, 2.0), -4.9, 4.9)
    with pm.Model() as m:
        a, b = pm.Normal("a", 0, 5), pm.Normal("b", 0, 5)
        s = pm.HalfNormal("s", 5)
        pm.Truncated("y", pm.Normal.dist(mu=a + b * x, sigma=s), lower=-5, upper=5, observed=y)
    return m


def _missing_model(indexed=False):
    """observed= with missing values (NaN): PyMC imputes them, and the likelihood of the rows
    present selects the covariates' rows by a mask, ``(X @ b)[mask]`` (``theta[group][mask]``
    where ``indexed``)."""
    X, y = _regression()
    y = y.copy()
    y[np.random.default_rng(6).random(N_ROWS) < 0.1] = np.nan
    group = np.arange(N_ROWS) % 7
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1, shape=2)
        s = pm.HalfNormal("s", 1)
        mu = X @ b
        if indexed:
            theta = pm.Normal("theta", 0, 1, shape=7)
            mu = mu + theta[group]
        pm.Normal("y_obs", mu=mu, sigma=s, observed=y)
    return m


def _missing_covariates_model():
    """Covariates with missing values, imputed (PyMC's imputation notebook): ``X`` observed
    with NaNs, joined with its imputed values, then read by the likelihood of ``y``."""
    X, y = _regression()
    X = X.copy()
    X[np.random.default_rng(8).random(X.shape) < 0.1] = np.nan
    with pm.Model() as m:
        mx = pm.Normal("mx", 0, 1, shape=2)
        X_v = pm.Normal("X", mx, pm.HalfNormal("sx", 1, shape=2), observed=X)
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y_obs", mu=X_v @ b, sigma=pm.HalfNormal("s", 1), observed=y)
    return m


def test_a_product_of_few_columns_written_out_as_their_sum():
    """A rows-by-columns matrix times a parameter vector (``pm.math.dot`` and ``@``) becomes
    the sum of its columns, with the same value and gradient; more than ``MAX_COLUMNS``
    columns, or a matrix of no rows, stay a product."""
    import pytensor
    import pytensor.tensor as pt

    rng = np.random.default_rng(5)
    for k, dot in ((2, pt.dot), (5, pt.matmul), (graphs.MAX_COLUMNS + 1, pt.dot)):
        X, b = pt.matrix("X", shape=(None, k)), pt.vector("b", shape=(k,))
        expr = pt.sum(pt.exp(-0.5 * dot(X, b)))
        out = graphs.unrolled_products(expr, [X])
        ops = {type(getattr(n.op, "core_op", n.op)).__name__
               for n in pytensor.graph.basic.io_toposort([X, b], [out])}
        if k > graphs.MAX_COLUMNS:
            assert out is expr
            continue
        assert not ops & {"Dot", "Matmul"}, ops
        fns = [pytensor.function([X, b], [e, pytensor.grad(e, b)]) for e in (expr, out)]
        Xv, bv = rng.normal(size=(40, k)), rng.normal(size=k)
        for want, got in zip(fns[0](Xv, bv), fns[1](Xv, bv)):
            np.testing.assert_allclose(got, want, rtol=1e-12)
    W = pt.matrix("W", shape=(3, 2))   # no rows: a parameter matrix times a parameter vector
    expr = pt.sum(pt.dot(W, pt.vector("b", shape=(2,))))
    assert graphs.unrolled_products(expr, [X]) is expr


def test_imputed_values_read_by_position_are_refused(exact, monkeypatch):
    """Where the join of observed and imputed values is not made a gather by rows, a rank's
    rows could not pick their imputed values: refused, naming the variable and the fix."""
    from synkhronos.extensions.pymc import selections
    monkeypatch.setattr(selections, "_gathered", lambda var, joins=None: None)
    with pytest.raises(ValueError, match=r"'y_obs' reads 'X', whose missing values PyMC "
                                         r"imputes.*Give 'X' without missing values"):
        synk_pymc.data_parallel(_missing_covariates_model())


def test_imputed_cells_joined_with_their_prior_or_left():
    """A variable with missing values: its observed cells' term and its imputed values' prior
    are one term over its cells, by its rows (their sum as PyMC computes it); where the
    imputed values have a transform (a Jacobian the observed cells have not), their prior
    stays whole and the observed cells alone are read by rows."""
    from synkhronos.extensions.pymc import terms
    rng = np.random.default_rng(3)
    X = np.abs(_regression()[0]) + 0.1
    X[rng.random(X.shape) < 0.1] = np.nan
    for dist, joined in ((pm.Normal, True), (pm.LogNormal, False)):
        with pm.Model() as m:
            mu = pm.Normal("mu", 0, 1, shape=2)
            dist("X", mu, pm.HalfNormal("sx", 1, shape=2), observed=X)
        found = terms.model_terms(m)
        total = pytensor.function(m.value_vars, pt.add(*[t.graph for t in found]),
                                  on_unused_input="ignore")
        logp = m.compile_logp()
        for _ in range(3):
            point = {k: v + rng.normal(0, 0.3, np.shape(v)) for k, v in m.initial_point().items()}
            np.testing.assert_allclose(total(**point), logp(point), rtol=1e-12)
        imputed = next(v for v in m.value_vars if v.name.startswith("X_unobserved"))
        in_prior = imputed in set(compat.ancestors([found[-1].graph]))
        if joined:
            assert [t.name for t in found] == ["X", "prior"] and found[0].rows == N_ROWS
            assert not in_prior
            # Where present, the observed values, at which imputed value: the parameters of
            # each column broadcast, not read through each cell's column.
            grids = [v for v in compat.ancestors([found[0].graph])
                     if isinstance(v, Constant) and np.shape(v.data) == X.shape]
            assert sorted(np.asarray(v.data).dtype.kind for v in grids) == ["b", "f", "i"]
        else:
            assert [t.name for t in found] == ["X_observed", "prior"] and not found[0].rows
            assert in_prior


def test_observed_cells_read_by_rows_or_left_whole():
    """An imputed variable's observed cells (a flattened vector) summed elementwise are
    summed by the variable's rows instead, with the same value; where a column has no
    observed cell, or the cells are read otherwise than elementwise, the term is left as
    it is (whole)."""
    from synkhronos.extensions.pymc import cells
    mask = np.array([[True, False], [True, True], [False, True], [True, True]])
    values = np.array([0.5, -1.0, 2.0, 3.0, 1.5, -0.25])          # the 6 cells, row by row
    column = np.nonzero(mask)[1]
    mu, sd = pt.dvector("mu"), pt.dvector("sd")
    logps = (pt.constant(values) - pt.expand_dims(mu, 0)[0, pt.constant(column)]) / sd[column]
    term = pt.sum(-0.5 * logps ** 2 - pt.log(sd[column]))
    by_rows = cells.spread(term, mask)
    assert by_rows is not None
    arrays = [np.asarray(v.data) for v in compat.ancestors([by_rows])
              if isinstance(v, Constant) and np.ndim(v.data) == 2]
    assert arrays and all(a.shape == mask.shape for a in arrays)
    at = {mu: np.array([0.3, -0.7]), sd: np.array([1.3, 0.6])}
    z = (values - at[mu][column]) / at[sd][column]
    expected = np.sum(-0.5 * z ** 2 - np.log(at[sd][column]))
    np.testing.assert_allclose(by_rows.eval(at), expected, rtol=1e-14)
    np.testing.assert_allclose(term.eval(at), expected, rtol=1e-14)
    empty = mask.copy()
    empty[:, 1] = False                                            # column 1: no cell
    assert cells.spread(pt.sum(pt.constant(values[:3]) * mu[0]), empty) is None
    assert cells.spread(pt.sum(pt.cumsum(pt.constant(values))), mask) is None


def _two_lengths_model():
    """Two observed NumPy arrays of different lengths: the longer is split, the other whole."""
    X, y = _regression()
    y2 = np.random.default_rng(7).normal(1.0, 2.0, 40)
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1, shape=2)
        s = pm.HalfNormal("s", 1)
        pm.Normal("y_obs", mu=X @ b, sigma=s, observed=y)
        pm.Normal("y2", mu=b[0], sigma=2 * s, observed=y2)
    return m


AS_WRITTEN = {"missing": (_missing_model, {}),
              "missing_indexed": (lambda: _missing_model(indexed=True), {}),
              "missing_covariates": (_missing_covariates_model, {}),
              "two_lengths": (_two_lengths_model, {}),
"schools": (_schools_model, {}), "schools_indexed": (_schools_indexed_model, {}),
              "schools_indexed_numpy": (lambda: _schools_indexed_model(numpy=True), {}),
              "numpy": (_numpy_model, {}), "indexed": (_indexed_model, {}),
              "indexed_wrapped": (lambda: _indexed_model(wrapped=True), {}),
              "censored": (_censored_model, {}), "potential": (_potential_model, {}),
              "mixture": (_mixture_model, {}), "truncated": (_truncated_model, {}),
              "poisson": (_poisson_model, {}),
              "walk_numpy": (lambda: _random_walk_model(numpy=True), {"unsplit": ["walk_data"]})}


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
    # A NumPy time series: lifted like a container, refused the same way, its name given.
    cases.append((_random_walk_model(numpy=True), {}, r"'walk' fails on its first rows.*"
                  r"unsplit.*'walk_data'"))
    with pm.Model() as m:     # rows made elsewhere (data= Data) beside a NumPy observed array
        X_d = pm.Data("X", X)
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y_obs", mu=X_d @ b, sigma=1.0, observed=y)
    cases.append((m, {"data": {"X": synk.data(X)}},
                  r"observed data of 'y_obs' is a NumPy array.*observed=pm.Data"))
    mask = rng.random(N_ROWS) < 0.7
    with pm.Model() as m:     # observed rows a masked subset of the covariate rows
        X_d, y_d = pm.Data("X", X), pm.Data("y", y[mask])
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y_obs", mu=(X_d @ b)[mask], sigma=1.0, observed=y_d)
    cases.append((m, {}, r"'y_obs'.*select them before building the model"))
    with pm.Model() as m:     # a time series alone: nothing would be left to split
        rho, s = pm.Normal("rho", 0, 1), pm.HalfNormal("s", 1)
        pm.AR("y", rho=[rho], sigma=s, init_dist=pm.Normal.dist(0, 10),
              observed=np.cumsum(rng.normal(size=N_ROWS)))
    cases.append((m, {}, r"'y' combines rows.*reads every array split by rows \(\['y_data'\]\)"
                  r".*Sample it with pm\.sample"))
    with pm.Model() as m:     # missing counts: PyMC imputes them as discrete variables
        counts = rng.poisson(3.0, N_ROWS).astype(float)
        counts[:5] = np.nan
        pm.Poisson("y", pm.math.exp(pm.Normal("b0", 0, 2) + X[:, 0]), observed=counts)
    cases.append((m, {}, r"\['y'\] have missing values.*\['y_unobserved'\].*Leave the rows "
                  r"with missing values out"))
    for model, kw, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            synk_pymc.data_parallel(model, **kw)


def test_no_likelihood_is_refused(exact):
    with pm.Model() as m:
        pm.Normal("b", 0, 1)
    with pytest.raises(ValueError, match=r"no likelihood \(no observed variables and no "
                                         r"pm.Potential\)"):
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
        e.models.update({k: make() for k, (make, _) in AS_WRITTEN.items()})

        def build():
            dps = {"total_size": synk_pymc.data_parallel(e.models["total_size"]),
                   "centred": synk_pymc.data_parallel(e.models["centred"], unsplit=["X", "y"]),
                   "walk": synk_pymc.data_parallel(e.models["walk"], unsplit=["series"])}
            dps.update({k: synk_pymc.data_parallel(e.models[k], name=f"pymc_{k}", **kw)
                        for k, (_, kw) in AS_WRITTEN.items()})
            return dps

        with runtime_keeper.distributed(3, build) as e.dps:
            yield e


@pytest.mark.parametrize("name", ["total_size", "centred", "walk", *AS_WRITTEN])
def test_now_exact_on_uneven_ranks(exact, name):
    model, dp = exact.models[name], exact.dps[name]
    logp, dlogp = model.compile_logp(), model.compile_dlogp()
    for point in _points(model, np.random.default_rng(1)):
        np.testing.assert_allclose(dp.logp(point), logp(point), rtol=1e-10)
        np.testing.assert_allclose(dp.dlogp(point), dlogp(point), rtol=1e-9, atol=1e-10)
    whole_terms = {"total_size": ["prior"], "centred": ["y_obs", "prior"],
                   "walk": ["walk", "prior"], "walk_numpy": ["walk", "prior"],
                   "two_lengths": ["y2", "prior"]}.get(name, ["prior"])
    assert [t.name for t in dp._plan.whole_terms] == whole_terms
    joined = {"missing": ["y_obs"], "missing_indexed": ["y_obs"],
              "missing_covariates": ["X", "y_obs"]}
    if name in joined:   # the imputed values' prior is in the variable's split term
        assert [t.name for t in dp._plan.split_terms] == joined[name]
        imputed = {v for v in model.value_vars if v.name.endswith("_unobserved")}
        assert imputed and not imputed & set(compat.ancestors([dp._plan.whole_terms[0].graph]))
    if name in ("missing", "missing_indexed"):
        # Every array a NumPy one: the rows put in the groups' order (the missing first),
        # each group a slice, nothing picked by position.
        masks = [c.get_value(borrow=True) for c in dp.containers if c.dtype == "bool"]
        assert len(masks) == 1 and not masks[0][0] and masks[0][-1]
        assert np.all(np.diff(masks[0].astype(int)) >= 0)
        assert branches.picks_rows(dp.rank_logp)
    # What is split: the NumPy arrays with the rows as well as the containers.
    split = {"numpy": ["y_obs_array1", "y_obs_data"], "indexed": ["y_obs_array1", "y_obs_data"],
             "indexed_wrapped": ["y", "y_obs_array1"], "potential": ["lik_array1", "lik_array2"],
             "censored": ["y_obs_array1", "y_obs_array2", "y_obs_array3", "y_obs_data"],
             # log(sigma), computed once in the master, as PyMC folds it.
             "schools": ["obs_array1", "obs_data", "obs_folded1", "row_ids"],
             "mixture": ["x_data"],
             "truncated": ["y_array1", "y_data"],
             "schools_indexed": ["school_idx", "sigma", "y"],
             "schools_indexed_numpy": ["y_obs_array1", "y_obs_array2", "y_obs_data",
                                       "y_obs_folded1"],
             # gammaln(y + 1), computed once over all rows (PyMC folds the standardised
             # covariate and the log exposure itself when it builds the graph).
             "poisson": ["y_obs_array1", "y_obs_array2", "y_obs_data", "y_obs_folded1"],
             # y's observed rows and its imputed values as one term over every row (each
             # array a term reads: the present rows' and the missing rows' in place): the
             # covariates, y's values where present, where y is missing, at which imputed
             # value (and the group index).
             "missing": ["y_obs_array1", "y_obs_array2", "y_obs_array3", "y_obs_array4"],
             "missing_indexed": ["y_obs_array1", "y_obs_array2", "y_obs_array3",
                                 "y_obs_array4", "y_obs_array5"],
             "two_lengths": ["y_obs_array1", "y_obs_data"],
             # X's observed cells and its imputed values' prior as one term by rows, on the
             # joined covariates the likelihood of y reads too (one gather): where present,
             # the observed values at their cells, at which imputed value (the parameters
             # of each column broadcast, not read through each cell's column).
             "missing_covariates": ["X_array1", "X_array2", "X_array3", "y_obs_data"]}
    if name in split:
        assert sorted(c.name for c in dp.containers) == split[name]
        rows = 8 if name.startswith("schools") else N_ROWS
        assert dp.n_rows == rows
    if name == "poisson":   # the ranks compute no part of the data alone: PyMC folds them
        ops = {type(getattr(v.owner.op, "scalar_op", v.owner.op)).__name__
               for v in compat.ancestors([dp.rank_logp]) if v.owner is not None}
        assert "Gammaln" not in ops, ops


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
