"""Sampling a PyMC model: serial pm.sample and nutpie against synkhronos (dp.sample), in one run.

A logistic regression (5 covariates, rows made by a formula so that every
machine can make its own) sampled at each row count and chain count by:

  pymc         pm.sample with its default chain processes (cores=min(4, CPUs))
  nutpie       nutpie.sample(nutpie.compile_pymc_model(model)) (numba, threads)
  synk-pymc    dp.sample(...): PyMC's NUTS, chains as threads, one call per step
  synk-nutpie  dp.sample(..., nuts_sampler="nutpie")

Printed per run: draws/s (post-tuning draws of all chains over the sampling
time, tuning included), bulk ESS/s (the smallest ``arviz.ess`` over the
parameters, over the same time), positions per data-parallel call, and the
peak memory (PSS, so shared memory counts once; sampled every 250 ms by a
process of its own) of all the run's processes;
then ratios against pm.sample and nutpie from this run.  Then the fixed cost
of one data-parallel (logp, dlogp) call against a tiny ``synk.function`` call
and PyMC's serial pair, and synk-pymc on 2 simulated machines (1 rank each,
data produced on each machine) against 1 machine with 2 ranks.

Each system runs in a child process of its own (own memory, threads, core pinning).

    python bench/pymc_sampling.py               # 1e4 and 1e5 rows, 1/2/4 chains: ~8 minutes here
    python bench/pymc_sampling.py --rows 1e6 --chains 2 --draws 25 --tune 25 --cluster-rows 1e5
    python bench/pymc_sampling.py --rows 1e4,1e5,1e6 --chains 1,2,4 --draws 500 --tune 500
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time

from common import harness, logistic_model, overhead_table

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SYSTEMS = ("pymc", "nutpie", "synk-pymc", "synk-nutpie")
FEATURES = 5


# -- the model -------------------------------------------------------------------------------------
def rows_x(lo, hi):
    """Rows lo:hi of the covariates (a formula: any machine makes any rows)."""
    import numpy as np
    i = np.arange(lo, hi, dtype=np.float64)[:, None]
    return np.sin(i * np.array([0.731, 1.917, 2.377, 0.0913, 3.141]) + 0.5)


def rows_y(lo, hi):
    import numpy as np
    i = np.arange(lo, hi, dtype=np.float64)
    u = np.abs(np.sin(i * 12.9898) * 43758.5453) % 1.0
    eta = 0.3 + rows_x(lo, hi) @ np.array([0.8, -0.5, 0.3, 0.0, 0.2])
    return (u < 1 / (1 + np.exp(-eta))).astype("int64")


make_model = logistic_model  # the same model as bench/pymc_calls.py's, on these rows


# -- memory of a process tree ------------------------------------------------------------------
def _tree(pid):
    out = [pid]
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                for child in f.read().split():
                    out.extend(_tree(int(child)))
    except OSError:
        pass
    return out


def _pss_kib(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class PeakMemory:
    """The peak PSS of a process and all its descendants: sampled every 250 ms and when read.

    Sampling costs: reading smaps_rollup walks a process's page tables.  Every
    20 ms in a thread of the measured process (as before) it held the GIL and
    slowed dp.sample's chain threads by up to a third, and not pm.sample's
    chain processes nor nutpie's Rust threads; so it runs rarely, in a
    process of its own (memory is flat while a model samples).
    """

    def __init__(self):
        self._proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--memory-of", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _ask(self, what):
        self._proc.stdin.write(what + "\n")
        self._proc.stdin.flush()
        return self._proc.stdout.readline()

    def reset(self):
        self._ask("reset")

    def mib(self):
        return int(self._ask("peak")) / 1024


def memory_monitor(pid):
    """The other side of PeakMemory: sample ``pid``'s tree, answer "reset" and "peak"."""
    peak = [0]
    me = os.getpid()

    lock = threading.Lock()

    def sample():
        now = sum(_pss_kib(p) for p in _tree(pid) if p != me)
        with lock:
            peak[0] = max(peak[0], now)

    def loop():
        while True:
            time.sleep(0.25)
            sample()

    threading.Thread(target=loop, daemon=True).start()
    for line in sys.stdin:
        if line.strip() == "reset":
            with lock:
                peak[0] = 0
            print("ok", flush=True)
        elif line.strip() == "peak":
            sample()
            print(peak[0], flush=True)


# -- one system in a child process -------------------------------------------------------------
def child_run(system, n_rows, chains_list, draws, tune, n_parallel=None, produce=False):
    import warnings
    warnings.filterwarnings("ignore")
    import numpy as np
    import pytensor
    pytensor.config.floatX = "float64"
    import arviz as az
    import pymc as pm

    mem = PeakMemory()
    dp = None
    if system.startswith("synk"):
        import synkhronos as synk
        from synkhronos.extensions import pymc as synk_pymc
        synk.fork(n_parallel)
        if produce:
            model = make_model(rows_x(0, 64), rows_y(0, 64))
            # The Data take the containers' dtypes (pm.Data stores int64 labels as int32).
            y_dtype = model["y"].dtype    # not model itself in the closure: fn is pickled
            data = {"X": synk.data(produce=lambda p: rows_x(p.lo, p.hi), length=n_rows,
                                   dtype=model["X"].dtype, ndim=2),
                    "y": synk.data(produce=lambda p: rows_y(p.lo, p.hi).astype(y_dtype),
                                   length=n_rows, dtype=y_dtype, ndim=1)}
            dp = synk_pymc.data_parallel(model, data=data, split=True)
        else:
            model = make_model(rows_x(0, n_rows), rows_y(0, n_rows))
            dp = synk_pymc.data_parallel(model, split=True)  # the data-parallel path
        synk.distribute()
        dp.scatter()
        # Compile (Numba compiles at the first call) outside the timed sampling.
        dp.logp_dlogp(dp.initial_x())
        dp.logp_dlogp_many(np.tile(dp.initial_x(), (2, 1)))
    else:
        model = make_model(rows_x(0, n_rows), rows_y(0, n_rows))
    compiled = None
    if system == "nutpie":
        import nutpie
        compiled = nutpie.compile_pymc_model(model)
    for chains in chains_list:
        mem.reset()
        if dp is not None:
            dp.batcher.calls = dp.batcher.positions = 0
        t0 = time.perf_counter()
        if system == "pymc":
            idata = pm.sample(draws, tune=tune, chains=chains, random_seed=1, model=model,
                              progressbar=False, compute_convergence_checks=False)
        elif system == "nutpie":
            idata = nutpie.sample(compiled, draws=draws, tune=tune, chains=chains, seed=1,
                                  progress_bar=False)
        else:
            idata = dp.sample(draws, tune=tune, chains=chains, random_seed=1, progressbar=False,
                              compute_convergence_checks=False,
                              nuts_sampler="nutpie" if system == "synk-nutpie" else "pymc")
        wall = time.perf_counter() - t0
        seconds = float(idata.posterior.attrs.get("sampling_time", wall))
        ess = az.ess(idata, method="bulk", var_names=["a", "b"])
        min_ess = float(min(float(ess[v].min()) for v in ess.data_vars))
        print("RESULT " + json.dumps({
            "system": system, "rows": n_rows, "chains": chains, "seconds": seconds,
            "draws_s": chains * draws / seconds, "ess_s": min_ess / seconds, "ess": min_ess,
            "peak_mib": mem.mib(),
            "per_call": (dp.batcher.positions / dp.batcher.calls
                         if dp is not None and dp.batcher.calls else None),
            "machines": _n_machines() if dp is not None else 1}), flush=True)
    if dp is not None:
        import synkhronos as synk
        synk.close()


def _n_machines():
    import synkhronos as synk
    return synk.layout().n_machines


# -- the parent --------------------------------------------------------------------------------
def _run_child(args, env=None, cmd=None):
    cmd = cmd or [sys.executable, os.path.abspath(__file__), *args]
    env = dict(env or os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        print(f"child {' '.join(args)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}",
              file=sys.stderr)
        return []
    return [json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines()
            if line.startswith(("RESULT ", "OVERHEAD "))]


def _cluster(rows, chains, draws, tune):
    jobs = harness("cluster_jobs")
    if harness("machines").mpi_flavor() is None:
        return None, "no mpiexec in this environment (pip install -e '.[mpi]')"
    if jobs.NO_MACHINES:
        return None, jobs.NO_MACHINES
    out = []
    args = [os.path.abspath(__file__), "--child", "synk-pymc", str(rows),
            ",".join(map(str, chains)), str(draws), str(tune), "--n-parallel", "1", "--produce"]
    with jobs.machines(2) as m:
        rc, text, _ = jobs.mpirun(m, 2, args, timeout=1800, PYTHONPATH=ROOT)
        if rc != 0:
            return None, f"mpiexec failed: {text[-2000:]}"
        out += [json.loads(line.split(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("RESULT ")]
    return out, None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1e4,1e5", help="1e6 too: a few minutes per system")
    p.add_argument("--chains", default="1,2,4")
    p.add_argument("--draws", type=int, default=100)
    p.add_argument("--tune", type=int, default=100)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--calls", type=int, default=500, help="calls per round of the overhead test")
    p.add_argument("--cluster-rows", default="1e5")
    p.add_argument("--cluster-chains", default=None, help="default: --chains")
    p.add_argument("--no-machines", action="store_true", help="skip the 2-machine runs")
    p.add_argument("--child", nargs=5, metavar=("SYSTEM", "ROWS", "CHAINS", "DRAWS", "TUNE"))
    p.add_argument("--n-parallel", type=int, default=None)
    p.add_argument("--produce", action="store_true")
    p.add_argument("--memory-of", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.memory_of:
        return memory_monitor(a.memory_of)
    if a.child:
        s, r, c, d, t = a.child
        return child_run(s, int(float(r)), [int(x) for x in c.split(",")], int(d), int(t),
                         a.n_parallel, a.produce)

    rows = [int(float(r)) for r in a.rows.split(",")]
    chains = [int(c) for c in a.chains.split(",")]
    systems = a.systems.split(",")
    print(f"# bench/pymc_sampling.py, {time.strftime('%Y-%m-%d')}, {platform.node()}, "
          f"{os.cpu_count()} CPUs; draws {a.draws}, tune {a.tune}; logistic regression, "
          f"{FEATURES} covariates", flush=True)
    results = []
    for n in rows:
        for s in systems:
            t0 = time.perf_counter()
            got = _run_child(["--child", s, str(n), ",".join(map(str, chains)), str(a.draws),
                              str(a.tune)])
            results += got
            for r in got:
                print(f"  {s:12s} rows {n:>8d} chains {r['chains']}: {r['draws_s']:8.1f} draws/s "
                      f"{r['ess_s']:7.1f} ESS/s  peak {r['peak_mib']:7.0f} MiB  positions/call "
                      f"{'-' if r['per_call'] is None else format(r['per_call'], '.2f')}", flush=True)
            print(f"    ({s}, {n} rows: {time.perf_counter() - t0:.0f} s with start-up)",
                  flush=True)
    _table(results, rows, chains, systems)
    # The fixed cost per call: bench/pymc_calls.py's overhead part (2 ranks, 64 rows), run as
    # that script's own child.
    over = _run_child(["overhead"], cmd=[sys.executable, os.path.join(HERE, "pymc_calls.py"),
                                         "--child", "overhead", str(a.calls), "-"])
    if over:
        overhead_table([("this tree", over[0])])
    if not a.no_machines:
        c_chains = [int(c) for c in (a.cluster_chains or a.chains).split(",")]
        for n in [int(float(r)) for r in a.cluster_rows.split(",")]:
            one = _run_child(["--child", "synk-pymc", str(n), ",".join(map(str, c_chains)),
                              str(a.draws), str(a.tune), "--n-parallel", "2", "--produce"])
            two, why = _cluster(n, c_chains, a.draws, a.tune)
            _machines_table(n, one, two, why)


def _table(results, rows, chains, systems):
    by = {(r["system"], r["rows"], r["chains"]): r for r in results}
    print("\n| rows | chains | " + " | ".join(f"{s} draws/s, ESS/s, MiB" for s in systems)
          + " | synk-pymc / pymc (draws/s, ESS/s, MiB) | synk-nutpie / nutpie | synk-nutpie / pymc |")
    print("|" + " --- |" * (2 + len(systems) + 3))
    for n in rows:
        for c in chains:
            cells = []
            for s in systems:
                r = by.get((s, n, c))
                cells.append("-" if r is None else
                             f"{r['draws_s']:.1f}, {r['ess_s']:.1f}, {r['peak_mib']:.0f}")
            ratios = []
            for num, den in (("synk-pymc", "pymc"), ("synk-nutpie", "nutpie"),
                             ("synk-nutpie", "pymc")):
                x, y = by.get((num, n, c)), by.get((den, n, c))
                ratios.append("-" if not (x and y) else
                              f"{x['draws_s'] / y['draws_s']:.2f}x, {x['ess_s'] / y['ess_s']:.2f}x, "
                              f"{x['peak_mib'] / y['peak_mib']:.2f}x")
            print(f"| {n:.0e} | {c} | " + " | ".join(cells + ratios) + " |")


def _machines_table(n, one, two, why):
    print(f"\nsynk-pymc, {n} rows, data produced on each machine:")
    if why:
        print(f"  2 simulated machines: not run ({why})")
    print("| chains | 1 machine x 2 ranks: draws/s, ESS/s | 2 machines x 1 rank: draws/s, ESS/s "
          "| 2 machines / 1 machine (draws/s) |")
    print("| --- | --- | --- | --- |")
    two = {r["chains"]: r for r in (two or [])}
    for r in one:
        t = two.get(r["chains"])
        print(f"| {r['chains']} | {r['draws_s']:.1f}, {r['ess_s']:.1f} | "
              + ("-" if t is None else f"{t['draws_s']:.1f}, {t['ess_s']:.1f}") + " | "
              + ("-" if t is None else f"{t['draws_s'] / r['draws_s']:.2f}x") + " |", flush=True)


if __name__ == "__main__":
    main()
