"""The same bits on any number of ranks and machines: ``python same_bits.py KIND R[,R...]``.

For each rank count R (ranks per machine under mpiexec) the script forks, runs
KIND and prints ``BITS R <sha256>`` of the result's bytes, then ``MEANS [...]``
of the last run and ``ALL OK``.  KIND is ``function`` (a ``synk.function``
of small reductions: sum, mean, max, a scalar sum of squares) or ``logistic``
/ ``radon`` (``dp.sample`` with a fixed seed, the model as its notebook writes
it: NumPy arrays, rows indexed by a NumPy group array for radon).  The test
compares the hashes of runs on one machine and on simulated machines
(tests/extensions/test_pymc.py, tests/cluster/test_cluster.py).
"""

import hashlib
import json
import sys

import numpy as np
import pytensor
import pytensor.tensor as pt

pytensor.config.floatX = "float64"

import synkhronos as synk  # noqa: E402
from synkhronos.runtime.state import get_runtime  # noqa: E402

KIND = sys.argv[1]
RANKS = [int(r) for r in sys.argv[2].split(",")]
N = 4096  # 4 chunks of 1024 rows by the rows' rule, fewer where cheap (functions/pace.py)
i = np.arange(N, dtype=np.float64)
x = np.sin(i[:, None] * np.array([0.731, 1.917]) + 0.5)
u = np.abs(np.sin(i * 12.9898) * 43758.5453) % 1.0


def digest(arrays):
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()


def run_function(_):
    X = pt.matrix("X")
    f = synk.function([X], [(X.sum(axis=0), "sum"), (X.mean(axis=0), "avg"),
                            (X.max(axis=0), "max"), ((X ** 2).sum(), "sum")])
    # 72 kB an output: in a cluster it keeps the static split, combined machine by machine.
    big = synk.function([X], (pt.outer(X.sum(axis=0), pt.ones(3000)), "sum"))
    synk.distribute()
    rows = np.column_stack([x, u]) * 1e3 + 1e-3
    data = synk.data(rows)
    out = f(data)
    again = f(data)   # the kept call: the same bits
    assert digest(out) == digest(again), "a repeated call changed its bits"
    np.testing.assert_allclose(big(data), np.outer(rows.sum(axis=0), np.ones(3000)), rtol=1e-12)
    if synk.layout().n_machines > 1:
        assert f._chunks.plan is not None and big._chunks.plan is None
        print("OK large outputs keep the static split", flush=True)
    return digest(out), [float(v) for v in out[0]]


def run_sample(kind):
    import pymc as pm

    from synkhronos.extensions import pymc as synk_pymc

    if kind == "logistic":
        y = (u < 1 / (1 + np.exp(-(0.3 + x @ [0.8, -0.5])))).astype("int64")
        with pm.Model() as model:
            a = pm.Normal("a", 0, 2)
            b = pm.Normal("b", 0, 1, shape=2)
            pm.Bernoulli("obs", logit_p=a + pm.math.dot(x, b), observed=y)
        watch = ["a", "b"]
    else:
        g = (np.arange(N) * 7) % 20
        y = 0.5 + 0.05 * g + 0.8 * x[:, 0] + 0.3 * (u - 0.5)
        with pm.Model() as model:
            mu = pm.Normal("mu", 0, 2)
            sa = pm.HalfNormal("sa", 1)
            a = pm.Normal("a", mu, sa, shape=20)
            b = pm.Normal("b", 0, 1)
            s = pm.HalfNormal("s", 1)
            pm.Normal("obs", a[g] + b * x[:, 0], s, observed=y)
        watch = ["b", "mu"]
    # mode fixed: where measured, the faster backend can differ from run to run.
    dp = synk_pymc.data_parallel(model, split=True, mode="NUMBA")
    synk.distribute()
    idata = dp.sample(40, tune=40, chains=1, random_seed=11, nuts_sampler="pymc",
                      progressbar=False, compute_convergence_checks=False)
    post = idata.posterior
    means = [float(m) for v in watch for m in np.ravel(post[v].mean(("chain", "draw")))]
    return digest(post[v].values for v in sorted(post.data_vars)), means


means = None
for ranks in RANKS:
    synk.fork(ranks, use_gpu=False)
    if synk.layout().n_machines > 1:
        rt = get_runtime()
        print("PIDS", " ".join(str(p) for p in rt.peers.pids), rt.config.prefix, flush=True)
        print("MACHINES", synk.layout().n_machines, flush=True)
    bits, means = (run_function if KIND == "function" else run_sample)(KIND)
    synk.close()
    print("BITS", ranks, bits, flush=True)
print("MEANS " + json.dumps(means), flush=True)
print("ALL OK", flush=True)
