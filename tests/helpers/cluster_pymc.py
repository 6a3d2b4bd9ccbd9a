"""dp.sample on data produced where it is used: ``mpiexec -n M python cluster_pymc.py L``.

Each machine makes its own rows (``synk.data(produce=...)``); the
controller's model holds only a few rows.  Checked against PyMC on the
whole data, made on the controller: logp and dlogp, and the posterior of
``dp.sample`` against serial ``pm.sample`` (z-scores of means and sds).
Also runs without mpiexec (one machine).  Prints ``OK <name>`` per check
and ``ALL OK``; tests/extensions/test_pymc.py runs it.
"""

import sys

import numpy as np
import pytensor

pytensor.config.floatX = "float64"

import arviz as az  # noqa: E402
import pymc as pm  # noqa: E402

import synkhronos as synk  # noqa: E402
from synkhronos.extensions import pymc as synk_pymc  # noqa: E402
from synkhronos.runtime.state import get_runtime  # noqa: E402

L = int(sys.argv[1])
DRAWS = int(sys.argv[2]) if len(sys.argv) > 2 else 300
N = 901


def rows_x(lo, hi):
    """Rows lo:hi of the covariates: a formula, so every machine makes its own."""
    i = np.arange(lo, hi, dtype=np.float64)
    return np.column_stack([np.sin(0.7 * i), np.cos(1.3 * i)])


def rows_y(lo, hi):
    i = np.arange(lo, hi, dtype=np.float64)
    return rows_x(lo, hi) @ np.array([1.0, -0.5]) + 0.8 * np.sin(12.9898 * i) * np.cos(78.233 * i)


def model_on(X, y):
    with pm.Model() as m:
        X_d, y_d = pm.Data("X", X), pm.Data("y", y)
        b = pm.Normal("b", 0, 1, shape=2)
        s = pm.HalfNormal("s", 1)
        pm.Normal("y_obs", mu=X_d @ b, sigma=s, observed=y_d)
    return m


synk.fork(L)
rt = get_runtime()
if rt.peers.layout is not None:
    print("PIDS", " ".join(str(p) for p in rt.peers.pids), rt.config.prefix, flush=True)
print("MACHINES", synk.layout().n_machines, flush=True)
template = model_on(rows_x(0, 40), rows_y(0, 40))     # the controller's model: 40 rows
x_data = synk.data(produce=lambda p: rows_x(p.lo, p.hi), length=N, dtype="float64", ndim=2, name="X")
y_data = synk.data(produce=lambda p: rows_y(p.lo, p.hi), length=N, dtype="float64", ndim=1, name="y")
dp = synk_pymc.data_parallel(template, data={"X": x_data, "y": y_data})
synk.distribute()

full = model_on(rows_x(0, N), rows_y(0, N))
logp, dlogp = full.compile_logp(), full.compile_dlogp()
rng = np.random.default_rng(0)
for _ in range(2):
    point = {k: v + rng.normal(scale=0.3, size=np.shape(v)) for k, v in full.initial_point().items()}
    np.testing.assert_allclose(dp.logp(point), logp(point), rtol=1e-10)
    np.testing.assert_allclose(dp.dlogp(point), dlogp(point), rtol=1e-9, atol=1e-10)
print("OK logp", flush=True)

# The same seed as the reference: the chains take the same random numbers, so the two
# posteriors differ by far less than their Monte Carlo error unless something is wrong.
idata = dp.sample(DRAWS, tune=DRAWS, chains=2, random_seed=3, progressbar=False)
ref = pm.sample(DRAWS, tune=DRAWS, chains=2, cores=1, random_seed=3, model=full,
                progressbar=False, compute_convergence_checks=False)
for v in ("b", "s"):
    xa, xb = idata.posterior[v], ref.posterior[v]
    # Each estimate's own effective sample size (nutpie's draws give the mean more, the sd less).
    ea, eb = (np.asarray(az.ess(d, var_names=[v], method="mean")[v]) for d in (idata, ref))
    fa, fb = (np.asarray(az.ess(d, var_names=[v], method="sd")[v]) for d in (idata, ref))
    sa, sb = np.asarray(xa.std(("chain", "draw"))), np.asarray(xb.std(("chain", "draw")))
    dm = np.asarray(xa.mean(("chain", "draw")) - xb.mean(("chain", "draw")))
    z_mean = np.max(np.abs(dm) / np.sqrt(sa ** 2 / ea + sb ** 2 / eb))
    z_sd = np.max(np.abs(sa - sb) / np.sqrt(sa ** 2 / (2 * fa) + sb ** 2 / (2 * fb)))
    print(f"Z {v} mean {z_mean:.2f} sd {z_sd:.2f}", flush=True)
    assert z_mean < 4.5 and z_sd < 4.5, (v, z_mean, z_sd)
print("OK posterior", dp.batcher.positions, dp.batcher.calls, flush=True)
synk.close()
print("ALL OK", flush=True)
