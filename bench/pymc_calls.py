"""PyMC's (logp, dlogp) call by call: its fixed cost, a sampler's step around it, the cost per row
of each PyTensor mode, and the data-parallel speedup (10^4 rows by default); baselines in the same run.

Four parts, each in child processes of its own (own memory, core pinning):

  overhead  one (logp, dlogp) call on 64 rows, 2 ranks, by every path a user or sampler
            takes (dp.logp_dlogp, PyMC's NUTS hook, nutpie's callback), against a tiny
            synk.function call, the bare PyTensor call and PyMC's serial pair.  The fixed
            cost is a call less its graph's serial run (the tiny call less the bare call).
  steps     one chain sampled by PyMC's NUTS and by nutpie, serial and through synkhronos:
            microseconds per gradient evaluation, cut into the sampler's own work and the
            (logp, dlogp) call it makes (measured alone in the same process).
  modes     the cost per row of PyMC's serial (logp, dlogp) and of the rank's graphs (one
            position; vectorised over 1 and 4) in PyTensor's default mode (C code through
            the cvm linker) and in Numba, for a logistic regression and a radon-style
            hierarchical model.  (The c linker, one C module per graph, cannot compile
            the radon model's vectorised gradient: AdvancedIncSubtensor1 has no C code
            for it.)
  ratio     dp.logp_dlogp on 2 ranks (``--ratio-rows``, ``--ratio-models logistic,radon``,
            ``negbin``, ``robust``, or bench/gallery_more.py's ``splines``, ``poisson``,
            ``truncated``, ``mixture``, ``covariates``, ``missing``)
            against PyMC's serial call, the ranks and
            PyMC each in PyTensor's default mode (CVM) and in Numba, rounds alternating.
  chunk     the rank's graph of one position called serially on a chunk's rows (1024 to
            50,000 of 10^5; ``--ratio-models``), per mode: what a call costs beside its
            rows (the fit's intercept), which every chunk of a chunked call pays
            (synkhronos/functions/pace.py).

With ``--before DIR`` (a checkout of an older tree), the overhead and ratio parts run
alternately on DIR's synkhronos and on this one, each subtracting its own rank graph.

    python bench/pymc_calls.py                          # all parts: about 4 minutes here
    python bench/pymc_calls.py --parts overhead,ratio --before /tmp/pymc-before --rounds 3
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from common import (calls_for, child_env, flat_point, logistic, overhead_table, pymc_mode, quiet, serial_pair,
                    uniform)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PARTS = ("overhead", "steps", "modes", "ratio", "chunk")
CHUNK_ROWS = (1024, 6250, 12500, 25000, 50000)
COUNTIES = 85


# -- models (rows by formula) ------------------------------------------------------------------
def radon(n):
    """Radon-style varying intercepts: 85 counties (non-centred), a floor slope, rows in pm.Data."""
    import numpy as np
    import pymc as pm
    county = (np.arange(n) * 7919) % COUNTIES
    floor = (uniform(n, 1.0) < 0.3).astype("float64")
    effect = np.sin(np.arange(COUNTIES) * 0.37) * 0.4
    y = 1.2 + effect[county] - 0.6 * floor + 0.7 * (uniform(n, 2.0) - 0.5)
    with pm.Model(coords={"county": np.arange(COUNTIES)}) as model:
        c_d, f_d, y_d = pm.Data("county_idx", county), pm.Data("floor", floor), pm.Data("y", y)
        mu_a = pm.Normal("mu_a", 0, 10)
        sigma_a = pm.HalfNormal("sigma_a", 1)
        z = pm.Normal("z", 0, 1, dims="county")
        a = mu_a + sigma_a * z
        b = pm.Normal("b", 0, 1)
        sigma = pm.HalfNormal("sigma", 1)
        pm.Normal("y_obs", a[c_d] + b * f_d, sigma, observed=y_d)
    return model


MODELS = {"logistic": logistic, "radon": radon}


def made(which, n_rows):
    """``MODELS[which]`` at ``n_rows`` rows, or a gallery model of bench/pymc_gallery.py
    (negbin, robust) or bench/gallery_more.py (splines, poisson, truncated, mixture,
    covariates, missing)."""
    if which in MODELS:
        return MODELS[which](n_rows)
    import gallery_more
    import pymc_gallery
    if which in pymc_gallery.MODELS:
        return pymc_gallery.MODELS[which](n_rows)
    return getattr(gallery_more, which)(rows=n_rows)


# -- timing ------------------------------------------------------------------------------------
def paired(fns, calls, rounds=9, warm=100):
    """Best and median microseconds per call of each function, the functions taking turns."""
    for f in fns.values():
        for _ in range(warm):
            f()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            times[k].append((time.perf_counter() - t0) / calls * 1e6)
    return {k: {"best": min(v), "median": statistics.median(v)} for k, v in times.items()}


def _emit(tag, obj):
    print(f"{tag} " + json.dumps(obj), flush=True)


def _rank_graph(model, n_rows, rows, mode=None, k=None):
    """The graph a rank runs, compiled serially, on ``rows`` of the model's ``n_rows``.

    ``k`` None: the graph of one position (the tree's ``graphs.joined`` where it has
    one, else the vectorised graph at one position); else the vectorised graph at k.
    """
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    from synkhronos.extensions.pymc import graphs, internals, terms

    plan = terms.choose(model, terms.model_terms(model))
    inputs = graphs.row_inputs(plan.split)
    n_total = pytensor.shared(np.float64(n_rows))
    split, whole, frac = graphs.rank_terms(model, plan, inputs, {}, n_total)
    logp = graphs.rank_logp(split, whole, frac, "float64")
    point = model.initial_point()
    shapes = [np.shape(point[v.name]) for v in model.value_vars]
    size = int(sum(np.prod(s, dtype=int) for s in shapes))
    pmode = pymc_mode(model, mode)
    data = [np.ascontiguousarray(c.get_value()[:rows]) for c in plan.split]
    if k is None and hasattr(graphs, "joined"):
        q = pt.dvector("q")
        out = graphs.joined(logp, model.value_vars, shapes, q, pregrad=internals.rewrite_pregrad)
        fn = pytensor.function([*inputs, q], out, mode=pmode, on_unused_input="ignore")
        return fn, data, np.zeros(size)
    P = pt.dmatrix("P")
    logps, grads = graphs.batched(logp, model.value_vars, shapes, P,
                                  pregrad=internals.rewrite_pregrad)
    both = pt.concatenate([logps[:, None], grads], axis=1)
    fn = pytensor.function([*inputs, P], both, mode=pmode, on_unused_input="ignore")
    return fn, data, np.zeros((k or 1, size))


# -- overhead ----------------------------------------------------------------------------------
def child_overhead(calls, mode):
    """One (logp, dlogp) call on 64 rows by each path, 2 ranks, with its baselines."""
    quiet()
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk
    from synkhronos.extensions import pymc as synk_pymc
    from synkhronos.extensions.pymc import internals

    model = logistic(64)
    joint = serial_pair(model)
    x0 = pt.dmatrix("x0")
    bare = pytensor.function([x0], pt.sum(x0))
    synk.fork(2)
    kw = {} if mode is None else {"mode": mode}
    dp = synk_pymc.data_parallel(model, **kw)
    # The graph in the mode the ranks run it in (a tree without modes: PyTensor's default).
    graph, rows, qg = _rank_graph(model, 64, 32, getattr(dp, "mode", None))
    x = pt.dmatrix("x")
    tiny = synk.function([x], pt.sum(x), name="tiny")
    # The tiny call with the shape of the model's: a position broadcast, and an output
    # the size of (logp, gradient) instead of a scalar.
    v = pt.dvector("v")
    with_pos = synk.function([x], [(pt.sum(x) + pt.sum(v), "sum")], bcast_inputs=[v],
                             name="tiny_pos")
    with_vec = synk.function([x], [(pt.sum(x) * v, "sum")], bcast_inputs=[v], name="tiny_vec")
    bare_pos = pytensor.function([x0, v], pt.sum(x0) + pt.sum(v))
    bare_vec = pytensor.function([x0, v], pt.sum(x0) * v)
    synk.distribute()
    dp.scatter()
    xd = synk.data(np.ones((2, 1)))
    q = flat_point(model)
    vd = synk.data(np.ones(q.size + 1))
    ones_v = np.ones(q.size + 1)
    qg[...] = q
    P4 = np.tile(q, (4, 1))
    ones = np.ones((2, 1))
    nuts_call = internals.LogpDlogp(dp.batcher, dp.dtype)._pytensor_function
    nutpie_call = internals.nutpie_model(dp, dp.batcher)._make_logp_func()
    fns = {"tiny synk.function": lambda: tiny(xd),
           "bare PyTensor (same tiny graph)": lambda: bare(ones),
           "tiny call + a broadcast vector input": lambda: with_pos(xd, vd),
           "bare PyTensor (same graph)": lambda: bare_pos(ones, ones_v),
           "tiny call + the vector input, vector output": lambda: with_vec(xd, vd),
           "bare PyTensor (same graph, vector out)": lambda: bare_vec(ones, ones_v),
           "dp.logp_dlogp": lambda: dp.logp_dlogp(q),
           "PyMC's NUTS hook (batcher, 1 chain)": lambda: nuts_call(q),
           "nutpie's callback (1 chain)": lambda: nutpie_call(q),
           "dp.logp_dlogp_many (4)": lambda: dp.logp_dlogp_many(P4),
           "PyMC serial (logp, dlogp), as NUTS calls it": lambda: joint(q),
           "the rank's graph, serial on 32 rows": lambda: graph(*rows, qg)}
    out = paired(fns, calls)
    synk.close()
    out["mode"] = getattr(dp, "mode", None) or "CVM"
    _emit("OVERHEAD", out)


# -- a sampler's step --------------------------------------------------------------------------
def _n_steps(idata):
    """The leapfrog steps of every draw, tuning included, and the number of draws."""
    steps = draws = 0
    for group in ("sample_stats", "warmup_sample_stats"):
        if group in idata.groups() and "n_steps" in idata[group]:
            steps += int(idata[group]["n_steps"].sum())
            draws += int(idata[group]["n_steps"].size)
    return steps, draws


def child_steps(system, n_rows, draws, tune):
    """One chain of ``system``: microseconds per gradient evaluation, and the call alone."""
    quiet()
    import numpy as np
    import pymc as pm

    from synkhronos.extensions.pymc import internals
    from synkhronos.extensions.pymc.batching import Batcher

    model = logistic(n_rows)
    q = flat_point(model)
    dp = None
    if system.startswith("synk"):
        import synkhronos as synk
        from synkhronos.extensions import pymc as synk_pymc
        synk.fork(2)
        dp = synk_pymc.data_parallel(model, split=True)  # the data-parallel path, timed
        synk.distribute()
        dp.scatter()
        dp.logp_dlogp(q)     # compiled (Numba compiles at the first call) before the timing
        call = internals.LogpDlogp(dp.batcher, dp.dtype)._pytensor_function
        # The one-position function: dp._calls.fn1 here, dp._fn1 in older trees.
        raw = getattr(getattr(dp, "_calls", None), "fn1", None) or getattr(dp, "_fn1", None)
    else:
        serial = serial_pair(model)

        def one(x):
            lp, g = serial(x)
            return lp, g.copy()

        def many(P):
            out = [one(x) for x in P]
            return np.array([o[0] for o in out]), np.stack([o[1] for o in out])

        # What dp.sample runs around a serial (logp, dlogp): PyMC's function behind our hooks.
        standin = type("StandIn", (), {})()
        standin.model, standin.batcher, standin.dtype = model, Batcher(many, one=one), np.float64
        standin.value_names = [v.name for v in model.value_vars]
        point = model.initial_point()
        standin._shapes = [tuple(np.shape(point[n])) for n in standin.value_names]
        standin.size = q.size

        def unravel(x):
            out, lo = {}, 0
            for name, shape in zip(standin.value_names, standin._shapes):
                size = int(np.prod(shape, dtype=int))
                out[name] = np.asarray(x[lo:lo + size]).reshape(shape)
                lo += size
            return out
        standin.unravel = unravel
        call = serial
    t0 = time.perf_counter()
    if system == "pymc":
        idata = pm.sample(draws, tune=tune, chains=1, cores=1, random_seed=1, model=model,
                          progressbar=False, compute_convergence_checks=False,
                          discard_tuned_samples=False)
        seconds = float(idata.posterior.attrs["sampling_time"])
    elif system == "synk-pymc":
        idata = dp.sample(draws, tune=tune, chains=1, random_seed=1, progressbar=False,
                          compute_convergence_checks=False, discard_tuned_samples=False)
        seconds = float(idata.posterior.attrs["sampling_time"])
    else:
        import nutpie
        if system == "nutpie":
            compiled = nutpie.compile_pymc_model(model)
            nutpie_fn = None
        else:
            target = dp if system == "synk-nutpie" else standin
            compiled = internals.nutpie_model(target, target.batcher)
            nutpie_fn = compiled._make_logp_func()
        t0 = time.perf_counter()
        idata = nutpie.sample(compiled, draws=draws, tune=tune, chains=1, seed=1,
                              progress_bar=False, save_warmup=True)
        seconds = time.perf_counter() - t0
        if nutpie_fn is not None:
            call = nutpie_fn
    steps, n_draws = _n_steps(idata)
    # Gradient evaluations: counted by the batcher where one runs; else PyMC's NUTS
    # evaluates once per leapfrog step and once more at each draw's start
    # (compute_state), and nutpie once per leapfrog step.
    counted = dp.batcher.positions if dp is not None else (
        standin.batcher.positions if system == "nutpie-pyfunc" else None)
    evals = counted or (steps + n_draws if system == "pymc" else steps)
    fns = {"call": lambda: call(q)}
    if system.startswith("synk") and raw is not None:
        args = dp._args.get(0) or dp._call_args(0)
        fns["synk call"] = lambda: raw(*args[0])
    n = calls_for(fns["call"])
    alone = paired(fns, n, rounds=7)
    if dp is not None:
        import synkhronos as synk
        synk.close()
    _emit("STEPS", {"system": system, "rows": n_rows, "evals": evals, "seconds": seconds,
                    "leapfrog_steps": steps, "draws": n_draws,
                    "per_eval_us": seconds / evals * 1e6,
                    "call_us": alone["call"]["best"],
                    "synk_call_us": alone.get("synk call", {}).get("best")})


STEP_SYSTEMS = ("pymc", "synk-pymc", "nutpie", "nutpie-pyfunc", "synk-nutpie")
STEP_WHAT = {"pymc": "pm.sample, PyMC's NUTS, serial (logp, dlogp)",
             "synk-pymc": "dp.sample, PyMC's NUTS through the batcher, 2 ranks",
             "nutpie": "nutpie, its numba (logp, dlogp) in Rust",
             "nutpie-pyfunc": "nutpie with PyMC's serial pair as a Python callback (our hooks)",
             "synk-nutpie": "nutpie with the data-parallel callback, 2 ranks"}


def _steps_table(results):
    print("\n| system (1 chain) | rows | gradient evaluations (leapfrog steps, draws) | us per "
          "evaluation | the (logp, dlogp) call alone, us | the sampler's own, us | of which "
          "the synk call, us |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        call = r["call_us"] if r["system"] != "nutpie" else None
        own = r["per_eval_us"] - call if call is not None else None
        print(f"| {STEP_WHAT[r['system']]} | {r['rows']} | {r['evals']} ({r['leapfrog_steps']}, "
              f"{r['draws']}) | {r['per_eval_us']:.1f} | "
              f"{'-' if call is None else format(call, '.1f')} | "
              f"{'-' if own is None else format(own, '.1f')} | "
              f"{'-' if r['synk_call_us'] is None else format(r['synk_call_us'], '.1f')} |")


# -- PyTensor modes, per row -------------------------------------------------------------------
MODES = ("CVM", "NUMBA")


def child_modes(which, n_rows):
    """Nanoseconds per row of PyMC's serial pair and of the rank's graphs, per mode."""
    quiet()
    model = MODELS[which](n_rows)
    q = flat_point(model)
    half = n_rows // 2
    model_half = MODELS[which](half)
    out = {}
    for mode in MODES:
        fns = {}
        t0 = time.perf_counter()
        serial = serial_pair(model, mode, trust=True)
        fns[f"PyMC serial, {n_rows} rows"] = (lambda f: lambda: f(q))(serial)
        serial_half = serial_pair(model_half, mode, trust=True)
        fns[f"PyMC serial, {half} rows"] = (lambda f: lambda: f(q))(serial_half)
        for k, label in ((None, "one position"), (1, "vectorised, k=1"),
                         (4, "vectorised, k=4")):
            fn, rows, P = _rank_graph(model, n_rows, half, mode, k)
            fn.trust_input = True
            P[...] = q
            fns[f"rank graph, {label}, {half} rows"] = (lambda f, r, p: lambda: f(*r, p))(
                fn, rows, P)
        compile_s = time.perf_counter() - t0
        n = min(calls_for(f) for f in fns.values())
        res = paired(fns, n, rounds=7, warm=5)
        for k, v in res.items():
            rows_k = n_rows if k == f"PyMC serial, {n_rows} rows" else half
            per = 4 if k.endswith(f"k=4, {half} rows") else 1
            out[f"{mode}|{k}"] = {"us": v["best"], "ns_per_row": v["best"] * 1e3 / rows_k / per}
        out[f"{mode}|compile s"] = compile_s
    _emit("MODES", {"model": which, "rows": n_rows, "res": out})


def _modes_table(results):
    for r in results:
        res = r["res"]
        print(f"\n{r['model']}, {r['rows']} rows: ns per row (and per position), best of 7 "
              "rounds; us per call in brackets")
        print("| graph | " + " | ".join(MODES) + " | Numba / CVM |")
        print("| --- |" + " --- |" * (len(MODES) + 1))
        keys = [k.split("|", 1)[1] for k in res if k.startswith(f"{MODES[0]}|")
                and not k.endswith("compile s")]
        for k in keys:
            cells = [f"{res[f'{m}|{k}']['ns_per_row']:.2f} ({res[f'{m}|{k}']['us']:.0f})"
                     for m in MODES]
            ratio = res[f"NUMBA|{k}"]["us"] / res[f"CVM|{k}"]["us"]
            print(f"| {k} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
        k1 = f"rank graph, one position, {r['rows'] // 2} rows"
        k4 = f"rank graph, vectorised, k=4, {r['rows'] // 2} rows"
        print("| 4 positions: vectorised / 4 one-position runs | " + " | ".join(
            f"{res[f'{m}|{k4}']['us'] / (4 * res[f'{m}|{k1}']['us']):.2f}x" for m in MODES)
            + " | |")
        print("| compile (5 functions), s | " + " | ".join(
            f"{res[f'{m}|compile s']:.1f}" for m in MODES) + " | |", flush=True)


# -- the speedup at 10^4 rows ------------------------------------------------------------------
def child_ratio(n_rows, calls, modes, which="logistic"):
    """dp.logp_dlogp on 2 ranks against PyMC's serial call, per mode, rounds alternating."""
    import numpy as np
    quiet()
    import synkhronos as synk
    from synkhronos.extensions import pymc as synk_pymc

    model = made(which, n_rows)
    q = flat_point(model)
    synk.fork(2)
    dps = {}
    for m in modes:
        try:
            dps[m] = synk_pymc.data_parallel(model, name=f"pymc_{m}", mode=m)
        except TypeError:    # a tree without mode=: PyTensor's default (CVM) only
            if m == "CVM":
                dps[m] = synk_pymc.data_parallel(model, name=f"pymc_{m}")
    synk.distribute()
    fns = {}
    for m in modes:
        # np.asarray: JAX returns before it has computed (NumPy's arrays pass as they are).
        fns[f"PyMC serial, {m}"] = (lambda f: lambda: [np.asarray(o) for o in f(q)])(
            serial_pair(model, m))
        if m in dps:
            dps[m].scatter()
            fns[f"dp.logp_dlogp, {m}"] = (lambda d: lambda: d.logp_dlogp(q))(dps[m])
    out = paired(fns, calls, rounds=9, warm=20)
    synk.close()
    _emit("RATIO", {"rows": n_rows, "model": which, "res": out})


def child_chunk(which):
    """Microseconds of the rank's graph on each of ``CHUNK_ROWS`` rows of 10^5, per mode."""
    import numpy as np
    quiet()
    model = made(which, 100_000)
    out = {}
    for mode in MODES:
        fns = {}
        for rows in CHUNK_ROWS:
            fn, data, x = _rank_graph(model, 100_000, rows, mode)
            fn.trust_input = True
            fns[rows] = (lambda f, a: lambda: f(*a))(fn, [*data, x])
        res = paired(fns, min(calls_for(f) for f in fns.values()), rounds=5, warm=50)
        us = [res[r]["best"] for r in CHUNK_ROWS]
        slope, fixed = np.polyfit(CHUNK_ROWS, us, 1)
        out[mode] = {"us": dict(zip(map(str, CHUNK_ROWS), us)), "fixed_us": fixed,
                     "ns_per_row": slope * 1e3}
    _emit("CHUNK", {"model": which, "res": out})


def _chunk_table(results):
    for r in results:
        print(f"\n{r['model']}: the rank's graph (one position) on a chunk's rows, best us")
        print("| mode | " + " | ".join(f"{n} rows" for n in CHUNK_ROWS)
              + " | fixed us (fit) | ns a row |")
        print("| --- " * (len(CHUNK_ROWS) + 3) + "|")
        for mode, v in r["res"].items():
            print(f"| {mode} | " + " | ".join(f"{v['us'][str(n)]:.1f}" for n in CHUNK_ROWS)
                  + f" | {v['fixed_us']:.1f} | {v['ns_per_row']:.2f} |")


def _ratio_table(runs):
    first = runs[0][1]
    print(f"\n| {first.get('model', 'logistic')}, {first['rows']} rows, 2 ranks | " + " | ".join(
        f"{tag} best / median us" for tag, _ in runs) + " |")
    print("| --- |" + " --- |" * len(runs))
    for k in runs[0][1]["res"]:
        print(f"| {k} | " + " | ".join(
            f"{r['res'][k]['best']:.1f} / {r['res'][k]['median']:.1f}" if k in r["res"] else "-"
            for _, r in runs) + " |")
    for tag, r in runs:
        res = r["res"]
        base = res["PyMC serial, CVM"]
        parts = []
        for k, v in res.items():
            if k.startswith("dp."):
                parts.append(f"{k}: {base['best'] / v['best']:.2f}x (median "
                             f"{base['median'] / v['median']:.2f}x)")
                m = k.split(", ")[1]
                own = res.get(f"PyMC serial, {m}")
                if m != "CVM" and own:
                    parts.append(f"{k} over PyMC serial in {m} too: {own['best'] / v['best']:.2f}x")
        print(f"{tag}: over PyMC serial in CVM (PyTensor's default, as pm.sample compiles): "
              + "; ".join(parts), flush=True)


# -- the parent --------------------------------------------------------------------------------
def _run_child(args, tree=ROOT):
    env = child_env()
    env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True,
                       text=True, env=env)
    if p.returncode != 0:
        print(f"child {' '.join(args)} ({tree}) failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}",
              file=sys.stderr)
        return []
    return [json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines()
            if line.split(" ", 1)[0] in ("OVERHEAD", "STEPS", "MODES", "RATIO", "CHUNK")]


def _trees(before, rounds):
    """(tag, tree) per round: this tree alone, or alternating with ``before``."""
    out = []
    for i in range(rounds):
        if before:
            pair = [("before", before), ("after", ROOT)]
            out += pair if i % 2 == 0 else pair[::-1]
        else:
            out.append(("this tree", ROOT))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--before", default=None, help="an older tree, for the overhead and ratio")
    p.add_argument("--rounds", type=int, default=1, help="runs of overhead and ratio per tree")
    p.add_argument("--calls", type=int, default=300, help="calls per round (overhead)")
    p.add_argument("--mode", default=None, help="the rank's mode in the overhead part")
    p.add_argument("--step-rows", type=int, default=1000)
    p.add_argument("--draws", type=int, default=300)
    p.add_argument("--tune", type=int, default=300)
    p.add_argument("--mode-rows", type=int, default=10_000)
    p.add_argument("--ratio-rows", type=int, default=10_000)
    p.add_argument("--ratio-modes", default="CVM,NUMBA", help="ratio: any of CVM, NUMBA, JAX")
    p.add_argument("--ratio-models", default="logistic",
                   help="ratio, chunk: logistic, radon, negbin, robust, or bench/gallery_more.py's "
                        "splines, poisson, truncated, mixture, covariates, missing")
    p.add_argument("--child", nargs="+")
    a = p.parse_args()
    if a.child:
        kind, *rest = a.child
        if kind == "overhead":
            return child_overhead(int(rest[0]), None if rest[1] == "-" else rest[1])
        if kind == "steps":
            return child_steps(rest[0], int(rest[1]), int(rest[2]), int(rest[3]))
        if kind == "modes":
            return child_modes(rest[0], int(rest[1]))
        if kind == "chunk":
            return child_chunk(rest[0])
        if kind == "ratio":
            return child_ratio(int(rest[0]), int(rest[1]), rest[2].split(","),
                               rest[3] if len(rest) > 3 else "logistic")
        raise SystemExit(f"unknown child {kind}")

    parts = a.parts.split(",")
    print(f"# bench/pymc_calls.py, {time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; parts {a.parts}"
          + (f"; before = {a.before}" if a.before else ""), flush=True)
    if "overhead" in parts:
        runs = []
        for tag, tree in _trees(a.before, a.rounds):
            got = _run_child(["--child", "overhead", str(a.calls), a.mode or "-"], tree)
            runs += [(tag, o) for o in got]
            print(f"  overhead, {tag}: done, load {os.getloadavg()[0]:.2f}", flush=True)
        if runs:
            overhead_table(runs)
    if "steps" in parts:
        results = []
        for s in STEP_SYSTEMS:
            results += _run_child(["--child", "steps", s, str(a.step_rows), str(a.draws),
                                   str(a.tune)])
            print(f"  steps, {s}: done, load {os.getloadavg()[0]:.2f}", flush=True)
        _steps_table(results)
    if "modes" in parts:
        results = []
        for which in MODELS:
            results += _run_child(["--child", "modes", which, str(a.mode_rows)])
            print(f"  modes, {which}: done, load {os.getloadavg()[0]:.2f}", flush=True)
        _modes_table(results)
    if "ratio" in parts:
        for which in a.ratio_models.split(","):
            runs = []
            for tag, tree in _trees(a.before, a.rounds):
                extra = [] if which == "logistic" else [which]  # older trees: logistic only
                got = _run_child(["--child", "ratio", str(a.ratio_rows), "100", a.ratio_modes,
                                  *extra], tree)
                runs += [(tag, r) for r in got]
                print(f"  ratio, {which}, {tag}: done, load {os.getloadavg()[0]:.2f}", flush=True)
            if runs:
                _ratio_table(runs)
    if "chunk" in parts:
        results = []
        for which in a.ratio_models.split(","):
            results += _run_child(["--child", "chunk", which])
            print(f"  chunk, {which}: done, load {os.getloadavg()[0]:.2f}", flush=True)
        _chunk_table(results)
    print(f"# load at the end {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
