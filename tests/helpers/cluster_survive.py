"""Run under ``mpirun --with-ft ulfm``: a machine is lost mid-run and the run goes on without it.

    python cluster_survive.py calls RANKS_PER_MACHINE [--rank]
    python cluster_survive.py train STEPS KILL_AT [--data]

calls: machine (the last) loses its node master between two calls (with --rank:
    its last rank dies inside a call instead, its node master alive); the controller
    prints what it caught, the layout after, and checks calls, collectives and Data
    against NumPy on the machines left.
train: a training run (make_train_function, Adam) loses the last machine after
    step KILL_AT, retries the step that raised if it did not happen, and prints
    every step's loss (NumPy inputs, or Data with --data);
    with SYNK_CLUSTER=0 and no mpirun the same script is its serial twin.
"""

import os
import signal
import sys
import time

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.runtime.state import get_runtime

from ckpt_train import build
from procs import FailInRank


def lose_last_machine():
    """SIGKILL the last machine's node master (its workers and sentinel then end by themselves)."""
    rt = get_runtime()
    os.kill(rt.peers.pids[-1], signal.SIGKILL)
    return time.monotonic()


def _ranges(n, k):
    base, extra = divmod(n, k)
    lo = 0
    for r in range(k):
        hi = lo + base + (r < extra)
        yield lo, hi
        lo = hi


def calls(per_machine, rank_dies):
    synk.fork(per_machine)
    rt = get_runtime()
    print("PIDS", " ".join(str(p) for p in rt.peers.pids), rt.config.prefix, flush=True)
    x = pt.matrix("x")
    w = pytensor.shared(np.zeros(3, dtype=pytensor.config.floatX), name="w")
    f_avg = synk.function([x], (pt.mean(x, axis=0), "avg"))
    f_sum = synk.function([x], (pt.sum(x), "sum"))
    g = synk.function([x], updates=[(w, w + pt.sum(x, axis=0))])
    n_before = synk.layout().n_parallel
    die = synk.function([x], (pt.sum(FailInRank(n_before - 1, "kill")(x)), "sum"))
    synk.distribute()
    X = np.arange(60, dtype=pytensor.config.floatX).reshape(20, 3)
    d = synk.data(X)
    f_sum(d)
    t0 = time.monotonic() if rank_dies else lose_last_machine()
    try:
        for _ in range(100000):
            (die if rank_dies else f_sum)(d)
    except synk.MachineLostError as exc:
        print("CAUGHT AT", f"{time.time():.6f}", flush=True)
        print("CAUGHT", type(exc).__name__, f"{time.monotonic() - t0:.2f}",
              "survived" if exc.survived else "ended", "completed", exc.completed,
              str(exc).splitlines()[0], flush=True)
        if not exc.survived:
            print("CLOSED", flush=True)
            return
    lay = synk.layout()
    print("LAYOUT", lay.n_machines, lay.n_parallel, lay.n_local, n_before, flush=True)
    # Every row still counts, on the ranks left: sums and avgs over all 20 rows.
    np.testing.assert_allclose(f_sum(d), X.sum(), rtol=1e-6)
    np.testing.assert_allclose(f_avg(d), X.mean(0), rtol=1e-6)
    print("OK calls", flush=True)
    # Shared variables: each rank left keeps its own value; updates and collectives span them.
    for r in range(lay.n_parallel):
        synk.set_value(r, w, np.full(3, r, dtype=w.dtype))
    g(d)
    per_rank = [synk.get_value(r, w) for r in range(lay.n_parallel)]
    rows = [np.arange(20)[lo:hi] for lo, hi in _ranges(20, lay.n_parallel)]
    for r in range(lay.n_parallel):
        np.testing.assert_allclose(per_rank[r], r + X[rows[r]].sum(0), rtol=1e-6)
    synk.all_reduce(w, op="avg")
    np.testing.assert_allclose(synk.get_value(lay.n_parallel - 1, w),
                               np.mean(per_rank, axis=0), rtol=1e-6)
    print("OK shared", flush=True)
    # Data made, written and freed after the loss reach the machines left.
    d2 = synk.data(X * 2)
    np.testing.assert_allclose(f_sum(d2), 2 * X.sum(), rtol=1e-6)
    d2[3:5] = 0
    np.testing.assert_allclose(f_sum(d2), 2 * X.sum() - 2 * X[3:5].sum(), rtol=1e-6)
    d2.free_memory()
    print("OK data", flush=True)
    synk.close()
    print("CLOSED", flush=True)


def train(n_steps, kill_at, use_data):
    cluster = os.environ.get("SYNK_CLUSTER") != "0"
    synk.fork(1 if not cluster else None, use_gpu=False)
    step, x_data, y_data = build(dropout=False)
    if cluster:
        rt = get_runtime()
        print("PIDS", " ".join(str(p) for p in rt.peers.pids), rt.config.prefix, flush=True)
    synk.distribute()
    if use_data:  # the loss is then noticed inside the call, not while sending its inputs
        x_data, y_data = synk.data(x_data), synk.data(y_data)
    for k in range(n_steps):
        idx = np.random.default_rng((7, k)).choice(64, size=21, replace=False)
        try:
            loss = float(step(x_data, y_data, batch=idx))
        except synk.MachineLostError as exc:
            print("CAUGHT", type(exc).__name__, "at step", k, "completed", exc.completed,
                  str(exc).splitlines()[0], flush=True)
            assert exc.completed is not None, exc
            if exc.completed:  # the step was made on every machine left; its loss is lost
                print(f"step {k} lost", flush=True)
                continue
            loss = float(step(x_data, y_data, batch=idx))  # it did not happen: again
        print(f"step {k} {loss!r}", flush=True)
        if cluster and k == kill_at:
            lose_last_machine()
    synk.close()
    print("CLOSED", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "calls":
        calls(int(sys.argv[2]), "--rank" in sys.argv)
    else:
        train(int(sys.argv[2]), int(sys.argv[3]), "--data" in sys.argv)
