"""The PyMC gallery's models: the rank's graph against PyMC's own, and sampling against
pm.sample and nutpie, in one run.

The models, typed as a PyMC user would, keep their rows in ``pm.Data`` containers;
rows are made by formulas of the row number (no random state), so any process, or
any machine, makes the same rows:

  logistic  logistic regression, 5 covariates and an intercept
  radon     non-centred hierarchical intercepts, 85 counties indexed per row, a floor slope
  negbin    negative binomial GLM, 3 covariates, log link
  robust    robust regression: a Student-t likelihood with unknown degrees of freedom
  predict   a linear regression on pm.Data, sampled, then pm.set_data and
            pm.sample_posterior_predictive on new rows
  schools   eight schools (non-centred): 8 rows, the small model

The parts, each model in a child process of its own (own memory, a quiet start):

  graphs    microseconds per position of PyMC's own (logp, dlogp)
            (``model.logp_dlogp_function(ravel_inputs=True)``, as its NUTS calls it, in
            PyTensor's default mode, C code through the cvm linker, and in Numba) against
            the graph a rank runs on the same rows (all of them, as one rank would), in
            the rank's mode: one position (PyMC's own graph, split), and k = 2 and 4
            positions both vectorised over the positions and as a loop (a Scan) of the
            one-position graph.  The rank's values are checked against PyMC's first.
  sample    draws/s of pm.sample, nutpie, and dp.sample with PyMC's NUTS and with nutpie
            (2 ranks), 1 and 2 chains, per model and row count.
  startup   seconds to the first draw, cold (empty PyTensor and Numba caches) then warm
            (the same caches again), each in a fresh process: pm.sample against
            synk.fork(2) + data_parallel() + distribute() + dp.sample, as it decides and
            with split=True, PyMC's NUTS, one chain of one tuning step and one draw
            (compiling is all but all of it).
  e2e       seconds from the model built to the draws, every step included (fork,
            data_parallel, distribute, compiling, sampling), each run in a fresh process,
            on the PyMC example gallery's models as their notebooks write them, at their
            own sizes (tests/helpers/pymc_gallery.py): pm.sample as PyMC runs it by
            default against dp.sample with the split measured (the default) and forced;
            --e2e-systems nutpie,synk-nutpie: each with nutpie (ratio against nutpie);
            --rows 1e5: every gallery model with rows, its rows bootstrapped to 10^5;
            --more: eight other gallery models as a new user writes them
            (bench/gallery_more.py), none of them in the tests (with --rows, the six
            whose data take a row count, made at that many rows); --likelihoods: other
            notebooks' likelihoods (pymc_gallery.LIKELIHOODS, tested exact only: ordered
            logistic, zero-inflated Poisson, LKJ, stochastic volatility, Dirichlet-multinomial,
            a pm.Potential, a DataFrame).  dp.sample's decision is
            kept on disk (pymc/decision.py): a run after the first of a model takes it, as
            a user's second run does; --measure-decisions measures it (and the rank
            graph's modes) in every run, as a user's first run does.
  compile   seconds nutpie compiles each gallery model in a fresh process, and PyMC its
            (logp, dlogp): what crossover.SAMPLER_COMPILE_S stands for.
  crossover what dp.sample decides for each gallery model with rows, bootstrapped to
            --rows (default 1e3,3e3,1e4,3e4,1e5), with PyMC's NUTS and nutpie (--chains,
            --draws, --tune): the crossover, the first size at which it splits.

    python bench/pymc_gallery.py --parts graphs                  # about 3 minutes here
    python bench/pymc_gallery.py --parts graphs --rows 1e5 --models radon,logistic
    python bench/pymc_gallery.py --parts sample --rows 1e4,1e5 --draws 200 --tune 200
    python bench/pymc_gallery.py --parts startup --rows 1e3           # about 10 minutes here
    python bench/pymc_gallery.py --parts e2e --draws 500 --tune 500 --chains 2
    python bench/pymc_gallery.py --parts e2e --more --draws 500 --tune 500 --chains 2
    python bench/pymc_gallery.py --parts e2e --likelihoods --draws 500 --tune 500 --chains 2
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

import common

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PARTS = ("graphs", "sample", "startup", "e2e", "compile", "crossover")
SYSTEMS = ("pymc", "nutpie", "synk-pymc", "synk-nutpie")


# -- the models (rows by formula) ------------------------------------------------------------------
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


# -- the parts ------------------------------------------------------------------------------------


def _quiet():
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    for name in ("pymc", "pytensor", "synkhronos"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _emit(tag, obj):
    print(f"{tag} " + json.dumps(obj), flush=True)


def _flat_point(model, shift=0.0):
    """A position as a sampler visits them: the initial point moved off its zeros."""
    import numpy as np
    point = model.initial_point()
    q = np.concatenate([np.asarray(point[v.name], dtype=np.float64).ravel()
                        for v in model.value_vars])
    return q + 0.3 * np.sin(1.0 + shift + np.arange(q.size))


def best_us(fn, seconds=0.4, rounds=7):
    """Best of ``rounds`` of the mean microseconds per call of ``fn`` (about ``seconds`` in all)."""
    fn()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds / rounds:
        fn()
        n += 1
    n = max(n, 3)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return min(times)


# -- graphs --------------------------------------------------------------------------------------
def _rank_fns(model, mode):
    """The rank's graphs on all the model's rows (one rank's view of a split over one rank):
    ``(one, vectorised, loop, data)``, compiled as DataParallelModel compiles them."""
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    from synkhronos.extensions.pymc import graphs, internals, modes, terms

    plan = terms.choose(model, terms.model_terms(model))
    inputs = graphs.row_inputs(plan.split)
    n_rows = len(plan.split[0].get_value())
    n_total = pytensor.shared(np.float64(n_rows))
    split, whole, frac = graphs.rank_terms(model, plan, inputs, {}, n_total)
    logp = graphs.rank_logp(split, whole, frac, "float64")
    point = model.initial_point()
    shapes = [np.shape(point[v.name]) for v in model.value_vars]
    pmode = modes.rank_mode(model, mode)
    q, P = pt.dvector("q"), pt.dmatrix("P")
    one = graphs.joined(logp, model.value_vars, shapes, q, pregrad=internals.rewrite_pregrad)
    logps, grads = graphs.batched(logp, model.value_vars, shapes, P,
                                  pregrad=internals.rewrite_pregrad)
    both = pt.concatenate([logps[:, None], grads], axis=1)
    loop = graphs.scanned(one, q, P, mode=pmode)
    kw = dict(mode=pmode, on_unused_input="ignore", trust_input=True)
    fns = [pytensor.function([*inputs, x], out, **kw) for x, out in ((q, one), (P, both),
                                                                     (P, loop))]
    data = [np.ascontiguousarray(c.get_value()) for c in plan.split]
    return (*fns, data)


def _pymc_own(model, mode=None):
    """PyMC's (logp, dlogp) of the raveled position, as its NUTS calls it."""
    from synkhronos.extensions.pymc import internals
    kw = {} if mode is None else {"mode": internals.pymc_mode(model, base=mode)}
    joint = model.logp_dlogp_function(ravel_inputs=True, **kw)
    joint.set_extra_values({})
    fn = joint._pytensor_function
    fn.trust_input = True
    return fn


def child_graphs(which, n_rows, mode):
    import numpy as np

    _quiet()
    model = MODELS[which](n_rows)
    rows = n_rows if which in HAS_ROWS else 8
    t0 = time.perf_counter()
    own = {"CVM": _pymc_own(model), "NUMBA": _pymc_own(model, "NUMBA")}
    one, vec, loop, data = _rank_fns(model, mode)
    compile_s = time.perf_counter() - t0
    Q = np.stack([_flat_point(model, s) for s in range(4)])

    # The rank's values against PyMC's own at each position (one rank holds every row).
    ref = [own["CVM"](q) for q in Q]
    ref = np.array([np.concatenate([[lp], g]) for lp, g in ref])
    got = {"one": np.stack([one(*data, q) for q in Q]), "vec": vec(*data, Q),
           "loop": loop(*data, Q)}
    err = max(float(np.max(np.abs(g - ref) / (1 + np.abs(ref)))) for g in got.values())

    res = {"rows": rows, "compile_s": compile_s, "max_rel_err": err}
    q = Q[0]
    for m, f in own.items():
        res[f"pymc {m}"] = best_us(lambda f=f: f(q))
    res["rank k=1"] = best_us(lambda: one(*data, q))
    for k in (2, 4):
        Pk = np.ascontiguousarray(Q[:k])
        res[f"vec k={k}"] = best_us(lambda P=Pk: vec(*data, P)) / k
        res[f"loop k={k}"] = best_us(lambda P=Pk: loop(*data, P)) / k
        res[f"{k} calls k={k}"] = res["rank k=1"]
    _emit("GRAPHS", {"model": which, "mode": mode, "res": res})


def _graphs_table(results):
    print("\n### The rank's graph per position against PyMC's own, same rows "
          "(us per position, best of 7 rounds)\n")
    print("| model | rows | PyMC own, C (default) | PyMC own, Numba | rank, k=1 | k=2 vectorised "
          "| k=2 loop | k=4 vectorised | k=4 loop | rank's best / PyMC's default, k=1 / 2 / 4 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        x = r["res"]
        base = x["pymc CVM"]
        best = [x["rank k=1"], min(x["vec k=2"], x["loop k=2"]), min(x["vec k=4"], x["loop k=4"])]
        print(f"| {r['model']} | {x['rows']} | {base:.0f} | {x['pymc NUMBA']:.0f} | "
              f"{x['rank k=1']:.0f} | {x['vec k=2']:.0f} | {x['loop k=2']:.0f} | "
              f"{x['vec k=4']:.0f} | {x['loop k=4']:.0f} | "
              + " / ".join(f"{b / base:.2f}x" for b in best) + " |")
    print("\nmax relative error of the rank's (logp, dlogp) against PyMC's: "
          + ", ".join(f"{r['model']} {r['res']['max_rel_err']:.1e}" for r in results)
          + f"; rank mode {results[0]['mode']}", flush=True)


# -- sampling ------------------------------------------------------------------------------------
def child_sample(system, which, n_rows, chains, draws, tune):
    """One sampling run.  Seconds of sampling as PyMC counts them (``sampling_time``: after
    the set-up, tuning included) where the result has them, else from the call to the
    result; the data-parallel model's graphs compiled and its batching tried first (in
    ``setup_s``: Numba compiles at the first call)."""
    import numpy as np

    _quiet()
    model = MODELS[which](n_rows)
    kw = dict(draws=draws, tune=tune, chains=chains, random_seed=1, progressbar=False,
              compute_convergence_checks=False, discard_tuned_samples=False)
    setup_s = 0.0
    if system in ("pymc", "nutpie"):
        import pymc as pm
        with model:
            t0 = time.perf_counter()
            idata = pm.sample(**kw, nuts_sampler=system, cores=chains)
            wall = time.perf_counter() - t0
    else:
        import synkhronos as synk
        from synkhronos.extensions import pymc as synk_pymc
        t_setup = time.perf_counter()
        synk.fork(2)
        try:
            dp = synk_pymc.data_parallel(model)
            synk.distribute()
            x = dp.initial_x()
            dp.logp_dlogp(x)
            if chains > 1:
                P = np.stack([x + 0.01 * i for i in range(chains)])
                for _ in range(2 * 6 + 1):       # both ways at k = chains, the faster kept
                    dp.logp_dlogp_many(P)
            setup_s = time.perf_counter() - t_setup
            t0 = time.perf_counter()
            idata = dp.sample(**kw, nuts_sampler=system.split("-")[1])
            wall = time.perf_counter() - t0
        finally:
            synk.close()
    secs = float(idata.posterior.attrs.get("sampling_time", wall))
    # Gradient evaluations (NUTS's leapfrog steps, tuning included): draws/s depends on the
    # trees the sampler happened to build; evaluations/s compares the systems' speed.
    groups = idata.groups() if callable(idata.groups) else [g.strip("/") for g in idata.groups]
    steps = sum(int(idata[g]["n_steps"].sum()) for g in ("sample_stats", "warmup_sample_stats")
                if g in groups and "n_steps" in idata[g])
    _emit("SAMPLE", {"system": system, "model": which, "rows": n_rows, "chains": chains,
                     "secs": secs, "wall_s": wall, "draws_s": draws * chains / secs,
                     "steps": steps, "steps_s": steps / secs, "setup_s": setup_s})


def _sample_table(results, draws, tune):
    print(f"\n### Sampling: draws/s and gradient evaluations/s ({draws} draws after {tune} "
          "tuning steps per chain; the time PyMC reports, tuning in, compiling out)\n")
    print("| model | rows | chains | " + " | ".join(f"{s} draws/s (evals/s)" for s in SYSTEMS)
          + " | synk-pymc / pymc, evals/s | synk-nutpie / nutpie, evals/s |")
    print("|---|---:|---:|" + "---:|" * (len(SYSTEMS) + 2))
    keys = []
    for r in results:
        k = (r["model"], r["rows"], r["chains"])
        if k not in keys:
            keys.append(k)
    by = {(r["model"], r["rows"], r["chains"], r["system"]): r for r in results}
    for m, n, c in keys:
        cells = [by.get((m, n, c, s)) for s in SYSTEMS]
        txt = [f"{x['draws_s']:.0f} ({x['steps_s']:.0f})" if x else "-" for x in cells]

        def ratio(a, b):
            return f"{a['steps_s'] / b['steps_s']:.2f}x" if a and b else "-"
        print(f"| {m} | {n} | {c} | " + " | ".join(txt)
              + f" | {ratio(cells[2], cells[0])} | {ratio(cells[3], cells[1])} |")
    print(flush=True)


# -- time to the first draw ----------------------------------------------------------------------
def child_startup(system, which, n_rows):
    """Seconds from nothing compiled to one draw (the caches are the parent's to say)."""
    _quiet()
    model = MODELS[which](n_rows)
    kw = dict(draws=1, tune=1, chains=1, random_seed=1, progressbar=False,
              compute_convergence_checks=False, nuts_sampler="pymc")
    t0 = time.perf_counter()
    if system == "pymc":
        import pymc as pm
        with model:
            pm.sample(cores=1, **kw)
        parts = {}
    else:
        import synkhronos as synk
        from synkhronos.extensions import pymc as synk_pymc
        synk.fork(2)
        try:
            dp = synk_pymc.data_parallel(model, split=True if system == "synk-split" else None)
            t1 = time.perf_counter()
            synk.distribute()
            t2 = time.perf_counter()
            dp.sample(**kw)
            parts = {"data_parallel_s": t1 - t0, "distribute_s": t2 - t1,
                     "split": dp.decision.split, "mode": dp.mode}
        finally:
            synk.close()
    _emit("STARTUP", {"system": system, "model": which, "rows": n_rows,
                      "secs": time.perf_counter() - t0, **parts})


WARM_RUNS = 3
"""Runs from warm caches after the cold one, of each system on each model: the median is kept."""


def _startup(models, n_rows):
    import tempfile
    results = []
    with tempfile.TemporaryDirectory(prefix="synk-startup-") as tmp:
        for m in models:
            row = {"model": m, "rows": n_rows}
            for system in ("pymc", "synk", "synk-split"):
                cache = os.path.join(tmp, f"{m}-{system}")
                env = dict(os.environ, PYTENSOR_FLAGS=f"base_compiledir={cache}",
                           NUMBA_CACHE_DIR=os.path.join(cache, "numba"))
                for when in ("cold",) + ("warm",) * WARM_RUNS:
                    r = _run_child(["startup", system, m, n_rows], env=env)
                    row.setdefault(f"{system} {when}", []).append(r)
                    if r is not None:
                        print(f"# {system} {m} {when}: {r['secs']:.1f} s "
                              f"({time.strftime('%H:%M:%S', time.gmtime())}, load "
                              f"{os.getloadavg()[0]:.1f})", flush=True)
                # Warm starts take about a second: one run's spread is a third of that.
                for when in ("cold", "warm"):
                    runs = [r for r in row[f"{system} {when}"] if r is not None]
                    row[f"{system} {when}"] = (sorted(runs, key=lambda r: r["secs"])[len(runs) // 2]
                                               if runs else None)
            results.append(row)
    print(f"\n### Seconds to the first draw, {n_rows} rows (warm: the median of {WARM_RUNS} "
          "runs; pm.sample; synkhronos: fork(2), "
          "data_parallel, distribute, dp.sample, as decided (synk) and split=True "
          "(synk-split, the ranks' mode measured at its first call); PyMC's NUTS, 1 chain)\n")
    print("| model | caches | pm.sample | synk (data_parallel + distribute) | synk / pm | "
          "synk-split (data_parallel + distribute, mode) | synk-split / pm |")
    print("|---|---|---:|---:|---:|---:|---:|")

    def cell(r, mode=False):
        if r is None:
            return "-"
        return (f"{r['secs']:.1f} ({r['data_parallel_s']:.1f} + {r['distribute_s']:.1f}"
                + (f", {r['mode']})" if mode else ")"))

    def ratio(a, b):
        return f"{a['secs'] / b['secs']:.2f}x" if a and b else "-"
    for row in results:
        for when in ("cold", "warm"):
            p, s1, s2 = (row[f"{k} {when}"] for k in ("pymc", "synk", "synk-split"))
            print(f"| {row['model']} | {when} | {p['secs'] if p else float('nan'):.1f} | "
                  f"{cell(s1)} | {ratio(s1, p)} | {cell(s2, True)} | {ratio(s2, p)} |")
    print(flush=True)


# -- driver --------------------------------------------------------------------------------------
E2E_SYSTEMS = ("pymc", "synk", "synk-split")
SOURCES = {"gallery": "", "more": "; bench/gallery_more.py", "likelihoods": "; pymc_gallery.LIKELIHOODS"}
"""Where an e2e run's models come from (``child_e2e``'s ``source``), as its table's title says."""
E2E_WHAT = {"pymc": "pm.sample as the installed PyMC runs it by default (its sampler, its cores)",
            "synk": "synk.fork(2) + data_parallel(model) + distribute() + dp.sample, the "
                    "default (split measured)",
            "synk-split": "the same with data_parallel(model, split=True)",
            "nutpie": "pm.sample(nuts_sampler=\"nutpie\")",
            "synk-nutpie": "synk's default with dp.sample(nuts_sampler=\"nutpie\")"}
# What each system's ratio is taken against: its own sampler's pm.sample.
E2E_AGAINST = {"synk-nutpie": "nutpie"}


def child_e2e(system, which, chains, draws, tune, rows=0, source="gallery", measure=0):
    """One run end to end: from the model built to the draws, set-up and compiling included.

    ``rows``: the gallery model's rows bootstrapped to that many (0: its own);
    ``source``: where the model is ("gallery": the tests' gallery, "more":
    bench/gallery_more.py, "likelihoods": ``pymc_gallery.LIKELIHOODS``); ``measure``: dp.sample
    measures its decision, whatever an earlier run kept.
    """
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from helpers import pymc_gallery

    _quiet()
    import pymc as pm
    import pytensor
    with pytensor.config.change_flags(floatX="float64"):
        if source == "more":
            import gallery_more
            model = gallery_more.MODELS[which](**({"rows": rows} if rows else {}))
        elif source == "likelihoods":
            model = pymc_gallery.LIKELIHOODS[which]()
        else:
            model = pymc_gallery.MODELS[which](**({"rows": rows} if rows else {}))
    kw = dict(draws=draws, tune=tune, chains=chains, random_seed=1, progressbar=False,
              compute_convergence_checks=False)
    decision, parts = None, {}
    t0 = time.perf_counter()
    if system in ("pymc", "nutpie"):
        with model:
            pm.sample(**kw, **({"nuts_sampler": "nutpie"} if system == "nutpie" else {}))
    else:
        if system == "synk-nutpie":
            kw["nuts_sampler"] = "nutpie"
        import synkhronos as synk
        from synkhronos.extensions import pymc as synk_pymc
        from synkhronos.extensions.pymc import crossover
        decide, spent = crossover.decide, []
        if measure:   # files of this run's own: no earlier run's decision or modes read
            import tempfile

            from synkhronos.functions.measures import MeasureFile
            from synkhronos.extensions.pymc import decision as decision_mod
            from synkhronos.extensions.pymc import modes as modes_mod
            aside = tempfile.TemporaryDirectory()   # removed when this child ends
            decision_mod.KEPT = MeasureFile("decisions.json", aside.name)
            modes_mod.KEPT = MeasureFile("modes.json", aside.name)

        def timed_decide(*args, **kwargs):   # what deciding costs, within dp.sample
            t = time.perf_counter()
            try:
                return decide(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - t)
        crossover.decide = timed_decide
        synk.fork(2)
        try:
            dp = synk_pymc.data_parallel(model, split=True if system == "synk-split" else None)
            t1 = time.perf_counter()
            synk.distribute()
            t2 = time.perf_counter()
            dp.sample(**kw)
            decision = dp.decision.describe()
            parts = {"data_parallel_s": t1 - t0, "distribute_s": t2 - t1,
                     "sample_s": time.perf_counter() - t2, "decide_s": sum(spent),
                     "serial_compile_s": None if dp.decision.kept else dp.decision.compile_s,
                     "kept": dp.decision.kept}
        finally:
            synk.close()
    _emit("E2E", {"system": system, "model": which, "chains": chains,
                  "secs": time.perf_counter() - t0, "decision": decision, **parts})


def child_crossover(which, rows, chains, draws, tune):
    """A fresh process: what ``dp.sample`` would decide for a gallery model at ``rows`` rows
    (bootstrapped), with PyMC's NUTS and with nutpie; nothing is sampled."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from helpers import pymc_gallery

    _quiet()
    import pytensor

    import synkhronos as synk
    from synkhronos.extensions import pymc as synk_pymc
    from synkhronos.extensions.pymc import crossover
    with pytensor.config.change_flags(floatX="float64"):
        model = pymc_gallery.MODELS[which](rows=rows)
    synk.fork(2)
    try:
        dp = synk_pymc.data_parallel(model)
        synk.distribute()
        out = {}
        for sampler in ("pymc", "nutpie"):
            d = crossover.decide(dp, sampler, chains, None, draws, tune)
            out[sampler] = {"split": d.split, "callback": d.callback, "serial_us": d.serial_s * 1e6,
                            "parallel_us": d.parallel_s * 1e6, "predicted": d.predicted}
    finally:
        synk.close()
    _emit("CROSSOVER", {"model": which, "rows": rows, **out})


def _crossover(models, rows, chains, draws, tune):
    """The decision per model and row count; the crossover is the first size that splits."""
    results = [r for m in models for n in rows
               if (r := _run_child(["crossover", m, n, chains, draws, tune])) is not None]
    print(f"\n### What dp.sample decides ({chains} chains, {draws} draws after {tune} tuning "
          f"steps, 2 ranks): split (S) or not (-; c: nutpie on PyMC's compiled function); "
          f"PyMC's serial call / the data-parallel call, us\n")
    print("| model | " + " | ".join(f"{n} rows" for n in rows) + " | crossover, PyMC's NUTS | "
          "crossover, nutpie |")
    print("|---|" + "---|" * (len(rows) + 2))
    for m in models:
        got = {r["rows"]: r for r in results if r["model"] == m}

        def cell(r):
            if r is None:
                return "failed"
            return " / ".join(
                ("S" if r[s]["split"] else "c" if r[s]["callback"] else "-")
                + f" {r[s]['serial_us']:.0f}/{'<=' if r[s]['predicted'] else ''}"
                  f"{r[s]['parallel_us']:.0f}" for s in ("pymc", "nutpie"))

        def first(s):
            return next((f"{n}" for n in rows if got.get(n) and got[n][s]["split"]),
                        f"> {rows[-1]}")
        print(f"| {m} | " + " | ".join(cell(got.get(n)) for n in rows)
              + f" | {first('pymc')} | {first('nutpie')} |", flush=True)


def child_compile(which):
    """A fresh process: seconds nutpie compiles a gallery model (``compile_pymc_model``, what
    ``pm.sample(nuts_sampler="nutpie")`` does first) and PyMC compiles its (logp, dlogp)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from helpers import pymc_gallery

    _quiet()
    import nutpie
    import pytensor
    with pytensor.config.change_flags(floatX="float64"):
        model = pymc_gallery.MODELS[which]()
    t0 = time.perf_counter()
    nutpie.compile_pymc_model(model)
    t1 = time.perf_counter()
    f = model.logp_dlogp_function(ravel_inputs=True)
    f.set_extra_values({})
    f._pytensor_function(_flat_point(model))   # Numba compiles at the first call
    _emit("COMPILE", {"model": which, "nutpie_s": t1 - t0,
                      "pymc_s": time.perf_counter() - t1})


def _e2e(models, chains, systems, draws, tune, rounds, rows=0, source="gallery", measure=False):
    """Every system on every model, rounds alternating the systems' order; medians."""
    import statistics
    runs = {}
    for r in range(rounds):
        for m in models:
            order = systems if r % 2 == 0 else systems[::-1]
            for s in order:
                res = _run_child(["e2e", s, m, chains, draws, tune, rows, source,
                                  int(measure)])
                if res is None:
                    continue
                runs.setdefault((m, s), []).append(res)
                compiled = res.get("serial_compile_s")
                extra = (f"; data_parallel {res['data_parallel_s']:.1f} s, distribute "
                         f"{res['distribute_s']:.1f} s, sample {res['sample_s']:.1f} s (deciding "
                         f"{res.get('decide_s', 0):.1f} s"
                         + (f", of which compiling PyMC's function {compiled:.1f} s"
                            if compiled is not None else "")
                         + (", the decision kept from an earlier run" if res.get("kept") else "")
                         + f"); {res['decision']}" if "sample_s" in res else "")
                print(f"# round {r + 1}: {s} {m}: {res['secs']:.1f} s{extra} (load "
                      f"{os.getloadavg()[0]:.1f})", flush=True)
    print(f"\n### End to end: seconds from the model built to the draws ({chains} chains, "
          f"{draws} draws after {tune} tuning steps, median of {rounds} rounds; "
          f"{'rows bootstrapped to %d' % rows if rows else 'the gallery sizes'}"
          f"{SOURCES[source]}"
          f"{'; every decision and mode measured' if measure else ''})\n")
    for s in systems:
        print(f"- {s}: {E2E_WHAT[s]}")
    rated = [s for s in systems if s.startswith("synk")]
    against = {s: E2E_AGAINST.get(s, "pymc") for s in rated}
    print("\n| model | " + " | ".join(f"{s} s" for s in systems) + " | "
          + " | ".join(f"{s} / {against[s]}" for s in rated) + " |")
    print("|---|" + "---:|" * (len(systems) + len(rated)))
    for m in models:
        med = {s: statistics.median(x["secs"] for x in runs.get((m, s), [])) if runs.get((m, s))
               else None for s in systems}
        cells = [f"{med[s]:.1f}" if med[s] else "-" for s in systems]
        ratios = [f"{med[s] / med[against[s]]:.2f}x" if med[s] and med.get(against[s]) else "-"
                  for s in rated]
        print(f"| {m} | " + " | ".join(cells + ratios) + " |")


def _run_child(args, env=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *map(str, args)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                         env=common.child_env(env))
    found = [line for line in out.stdout.splitlines()
             if line.startswith(("GRAPHS ", "SAMPLE ", "STARTUP ", "E2E ", "COMPILE ",
                                         "CROSSOVER "))]
    if out.returncode or not found:
        sys.stderr.write(f"child {args} failed ({out.returncode}):\n{out.stderr[-3000:]}\n")
        return None
    return json.loads(found[-1].split(" ", 1)[1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="graphs")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--rows", default=None, help="graphs: 2e4; sample: 1e4,1e5")
    p.add_argument("--mode", default="NUMBA", help="the rank's mode (graphs)")
    p.add_argument("--chains", default="1,2")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--draws", type=int, default=200)
    p.add_argument("--tune", type=int, default=200)
    p.add_argument("--e2e-systems", default=",".join(E2E_SYSTEMS))
    p.add_argument("--rounds", type=int, default=2, help="e2e: rounds, systems alternating")
    p.add_argument("--more", action="store_true",
                   help="e2e: bench/gallery_more.py's models (none in the tests)")
    p.add_argument("--likelihoods", action="store_true",
                   help="e2e: other notebooks' likelihoods (pymc_gallery.LIKELIHOODS)")
    p.add_argument("--measure-decisions", action="store_true",
                   help="e2e: every dp.sample measures its decision and the rank graph's "
                        "modes (by default a run after the first of a model takes those kept "
                        "on disk, as a user's does)")
    p.add_argument("--child", nargs="+")
    a = p.parse_args()
    if a.child:
        kind, *rest = a.child
        if kind == "graphs":
            child_graphs(rest[0], int(rest[1]), rest[2])
        elif kind == "startup":
            child_startup(rest[0], rest[1], int(rest[2]))
        elif kind == "compile":
            child_compile(rest[0])
        elif kind == "crossover":
            child_crossover(rest[0], int(rest[1]), int(rest[2]), int(rest[3]), int(rest[4]))
        elif kind == "e2e":
            child_e2e(rest[0], rest[1], int(rest[2]), int(rest[3]), int(rest[4]), int(rest[5]),
                      rest[6], int(rest[7]))
        else:
            child_sample(rest[0], rest[1], int(rest[2]), int(rest[3]), int(rest[4]), int(rest[5]))
        return
    import numpy
    import pymc
    import pytensor
    models = a.models.split(",")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {common.cpu_model()}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, PyMC {pymc.__version__}, "
          f"PyTensor {pytensor.__version__}, NumPy {numpy.__version__}", flush=True)
    parts = a.parts.split(",")
    if "graphs" in parts:
        rows = [int(float(r)) for r in (a.rows or "2e4").split(",")]
        results = [r for n in rows for m in models
                   if (r := _run_child(["graphs", m, n, a.mode])) is not None]
        _graphs_table(results)
    if "sample" in parts:
        rows = [int(float(r)) for r in (a.rows or "1e4,1e5").split(",")]
        results = []
        for n in rows:
            for m in models:
                if m not in HAS_ROWS and n != rows[0]:
                    continue
                for c in [int(c) for c in a.chains.split(",")]:
                    for s in a.systems.split(","):
                        r = _run_child(["sample", s, m, n, c, a.draws, a.tune])
                        if r is not None:
                            results.append(r)
                            print(f"# {s} {m} {n} rows, {c} chains: {r['draws_s']:.0f} draws/s, "
                                  f"{r['steps_s']:.0f} evals/s ({r['secs']:.1f} s; "
                                  f"{time.strftime('%H:%M:%S', time.gmtime())}, load "
                                  f"{os.getloadavg()[0]:.1f})", flush=True)
        _sample_table(results, a.draws, a.tune)
    if "startup" in parts:
        _startup(models, int(float(a.rows or "1e3")))
    if "compile" in parts:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from helpers import pymc_gallery
        names = list(pymc_gallery.MODELS) if a.models == ",".join(MODELS) else models
        print("\n### Compiling, seconds in a fresh process: nutpie's compile_pymc_model "
              "(pm.sample with nutpie) and PyMC's logp_dlogp_function (its NUTS)\n")
        print("| model | nutpie | PyMC |\n|---|---:|---:|")
        for m in names:
            r = _run_child(["compile", m])
            if r is not None:
                print(f"| {m} | {r['nutpie_s']:.2f} | {r['pymc_s']:.2f} |", flush=True)
    if "crossover" in parts:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from helpers import pymc_gallery
        rows = [int(float(r)) for r in (a.rows or "1e3,3e3,1e4,3e4,1e5").split(",")]
        names = pymc_gallery.WITH_ROWS if a.models == ",".join(MODELS) else models
        _crossover(names, rows, int(a.chains.split(",")[-1]), a.draws, a.tune)
    if "e2e" in parts:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from helpers import pymc_gallery
        rows = int(float(a.rows)) if a.rows else 0
        every = pymc_gallery.WITH_ROWS if rows else list(pymc_gallery.MODELS)
        source = "more" if a.more else "likelihoods" if a.likelihoods else "gallery"
        if a.more:
            import gallery_more
            every = list(gallery_more.WITH_ROWS if rows else gallery_more.MODELS)
        elif a.likelihoods:
            every = list(pymc_gallery.LIKELIHOODS)
        names = every if a.models == ",".join(MODELS) else models
        _e2e(names, int(a.chains.split(",")[-1]), a.e2e_systems.split(","), a.draws, a.tune,
             a.rounds, rows, source, a.measure_decisions)


if __name__ == "__main__":
    main()
