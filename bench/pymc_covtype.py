"""numpyro's own benchmark shape, in PyMC: a logistic regression on 581,012 rows x 55 covariates.

numpyro's CPU benchmark samples a logistic regression on the covtype data set
(581,012 rows, 54 covariates and an intercept; numpyro reports about 28 ms a
gradient on its CPU).  The data set is not downloaded here: the rows are made
by the script, with covtype's shape (standard normal covariates, a column of
ones, labels drawn from known coefficients).  The model is written as a PyMC
user writes it (NumPy arrays as ``observed=`` and in the linear predictor).
Each system runs in a fresh process, in one run:

  gradient  one (logp, dlogp) at a position a sampler visits, best of a few:
            PyMC's serial call compiled in C (the cvm linker) and in Numba, the
            JAX function PyMC hands numpyro (jit of value_and_grad), and
            ``dp.logp_dlogp`` on 2 ranks in the mode measured fastest (and in
            each mode forced).
  sample    gradient evaluations per second while sampling, one chain:
            ``dp.sample`` (PyMC's NUTS on the data-parallel gradient; every
            position it evaluated over its sampling time) against numpyro's NUTS
            on PyMC's JAX function (``pm.sample(nuts_sampler="numpyro")``'s path:
            its NUTS kernel jitted once and stepped draw by draw: its integration
            steps over the time of its draws, timed apart from the warm-up, whose
            first step compiles).

    python bench/pymc_covtype.py                      # both parts, about 10 minutes here
    python bench/pymc_covtype.py --parts gradient --rows 100000

numpyro and JAX come from ``pip install -e ".[numpyro]"``; PyMC 6 (the
current-stack environment, ``.venv-current``) or 5.27-5.28.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import common

ROWS, COLS = 581_012, 55


def make_model(n_rows, seed=0):
    """The model, its rows made here: covtype's shape, labels from known coefficients."""
    import numpy as np
    import pymc as pm

    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n_rows, COLS))
    X[:, 0] = 1.0
    beta = rng.normal(0, 0.3, COLS)
    y = (rng.random(n_rows) < 1 / (1 + np.exp(-(X @ beta)))).astype("int64")
    with pm.Model() as model:
        b = pm.Normal("b", 0, 1, shape=COLS)
        pm.Bernoulli("y", logit_p=X @ b, observed=y)
    return model


def best_s(fn, n=5):
    """Best seconds of ``n`` calls of ``fn`` after one warm-up."""
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def child_gradient(system, n_rows):
    common.quiet()
    import numpy as np
    model = make_model(n_rows)
    q = common.flat_point(model)
    out = {}
    if system == "pymc":
        for mode in ("CVM", "NUMBA"):
            fn = common.serial_pair(model, mode)
            out[f"PyMC serial, {mode}"] = best_s(lambda: fn(q))
    elif system == "jax":
        import jax
        from pymc.sampling.jax import get_jaxified_logp
        logp = get_jaxified_logp(model)
        sizes = [int(np.prod(np.shape(model.initial_point()[v.name]))) for v in model.value_vars]
        shapes = [np.shape(model.initial_point()[v.name]) for v in model.value_vars]

        def flat_logp(x):
            parts, lo = [], 0
            for size, shape in zip(sizes, shapes):
                parts.append(x[lo:lo + size].reshape(shape))
                lo += size
            return logp(parts)

        vg = jax.jit(jax.value_and_grad(flat_logp))
        xj = jax.numpy.asarray(q)
        out["JAX (numpyro's path)"] = best_s(lambda: jax.block_until_ready(vg(xj)))
    else:
        import synkhronos as synk
        from synkhronos.extensions import pymc as synk_pymc
        synk.fork(2)
        try:
            dps = {m: synk_pymc.data_parallel(model, name=f"covtype_{m}", mode=m, split=True)
                   for m in (None, "CVM", "NUMBA")}
            synk.distribute()
            for m, dp in dps.items():
                t0 = time.perf_counter()
                dp.logp_dlogp(q)
                first = time.perf_counter() - t0
                key = f"dp.logp_dlogp, 2 ranks, {m or 'measured'}"
                out[key] = best_s(lambda: dp.logp_dlogp(q))
                if m is None:
                    out["mode measured"] = dp.mode
                    out["measuring and building, s"] = first
        finally:
            synk.close()
    print("GRADIENT " + json.dumps(out), flush=True)


def child_sample(system, n_rows, draws, tune):
    common.quiet()
    model = make_model(n_rows)
    if system == "numpyro":
        import jax
        from numpyro.infer.hmc import hmc
        from pymc.sampling.jax import get_jaxified_logp

        logp = get_jaxified_logp(model, negative_logp=True)
        point = model.initial_point()
        names = [v.name for v in model.value_vars]
        init = {n: jax.numpy.asarray(point[n]) for n in names}
        # numpyro's NUTS kernel, jitted once and stepped from Python (what its MCMC runs
        # in a loop), so that no run recompiles: the first step compiles, in the warm-up.
        init_kernel, sample_kernel = hmc(potential_fn=lambda p: logp([p[n] for n in names]),
                                         algo="NUTS")
        state = init_kernel(init, num_warmup=tune, target_accept_prob=0.8,
                            rng_key=jax.random.PRNGKey(1))
        step = jax.jit(sample_kernel)
        t0, warm_steps = time.perf_counter(), 0
        for _ in range(tune):
            state = step(state)
            warm_steps += int(state.num_steps)
        warm_s = time.perf_counter() - t0
        t0, steps = time.perf_counter(), 0
        for _ in range(draws):
            state = step(state)
            steps += int(state.num_steps)
        res = {"evals": steps, "seconds": time.perf_counter() - t0, "warmup_evals": warm_steps,
               "warmup_s": warm_s}
    else:
        import synkhronos as synk
        from synkhronos.extensions import pymc as synk_pymc
        synk.fork(2)
        try:
            dp = synk_pymc.data_parallel(model, split=True)
            synk.distribute()
            idata = dp.sample(draws, tune=tune, chains=1, random_seed=1, progressbar=False,
                              nuts_sampler="pymc", compute_convergence_checks=False)
            res = {"evals": dp.batcher.positions,
                   "seconds": float(idata.posterior.attrs["sampling_time"]),
                   "mode": dp.mode}
        finally:
            synk.close()
    print("SAMPLE " + json.dumps({"system": system, **res}), flush=True)


def _run(args):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *map(str, args)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=common.ROOT,
                         env=common.child_env())
    found = [line for line in out.stdout.splitlines() if line.startswith(("GRADIENT ", "SAMPLE "))]
    if out.returncode or not found:
        sys.stderr.write(f"child {args} failed ({out.returncode}):\n{out.stderr[-3000:]}\n")
        return None
    return json.loads(found[-1].split(" ", 1)[1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="gradient,sample")
    p.add_argument("--rows", type=float, default=ROWS)
    p.add_argument("--draws", type=int, default=30)
    p.add_argument("--tune", type=int, default=30)
    p.add_argument("--child", nargs="+")
    a = p.parse_args()
    if a.child:
        kind, system, *rest = a.child
        if kind == "gradient":
            child_gradient(system, int(rest[0]))
        else:
            child_sample(system, int(rest[0]), int(rest[1]), int(rest[2]))
        return
    import platform

    import pymc
    n = int(a.rows)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {common.cpu_model()}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, PyMC {pymc.__version__}; "
          f"{n} rows x {COLS} covariates", flush=True)
    if "gradient" in a.parts:
        grads = {}
        for system in ("pymc", "jax", "synk"):
            res = _run(["gradient", system, n])
            if res:
                grads.update(res)
        print("\n### One (logp, dlogp), best of 5 after a warm-up\n")
        print("| system | ms | over JAX (numpyro's path) |")
        print("|---|---:|---:|")
        jax_s = grads.get("JAX (numpyro's path)")
        for k, v in grads.items():
            if isinstance(v, float) and not k.endswith(", s"):
                print(f"| {k} | {v * 1e3:.1f} | {jax_s / v if jax_s else float('nan'):.2f}x |")
        print(f"\nmode measured: {grads.get('mode measured')}; the first call (measuring both "
              f"modes, building the ranks' graph): {grads.get('measuring and building, s', 0):.1f} s")
    if "sample" in a.parts:
        runs = {s: _run(["sample", s, n, a.draws, a.tune]) for s in ("numpyro", "synk")}
        print(f"\n### Gradient evaluations per second while sampling ({a.tune} tuning steps, "
              f"{a.draws} draws, 1 chain)\n")
        print("| system | evaluations | seconds | evaluations/s |")
        print("|---|---:|---:|---:|")
        rate = {}
        for s, r in runs.items():
            if r:
                rate[s] = r["evals"] / r["seconds"]
                print(f"| {s} | {r['evals']} | {r['seconds']:.1f} | {rate[s]:.2f} |")
        if runs.get("numpyro"):
            r = runs["numpyro"]
            print(f"\nnumpyro's warm-up (compiling included): {r['warmup_evals']} evaluations "
                  f"in {r['warmup_s']:.1f} s")
        if len(rate) == 2:
            print(f"\ndp.sample / numpyro: {rate['synk'] / rate['numpyro']:.2f}x "
                  f"(the ranks' mode: {runs['synk'].get('mode')})")


if __name__ == "__main__":
    main()
