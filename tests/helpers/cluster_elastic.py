"""A job whose machines come and go (SYNK_LISTEN / SYNK_JOIN), run by tests/cluster/test_elastic.py.

    SYNK_LISTEN=HOST:PORT SYNK_MACHINES=N python cluster_elastic.py MODE ...   # the controller
    SYNK_JOIN=HOST:PORT python cluster_elastic.py MODE ...                     # each node master

check RANKS: calls (every op), collectives, Data and produced Data against NumPy.
train STEPS PLAN: a training run (make_train_function, Adam, Data inputs, plus a produced
    Data evaluated every step); PLAN is a comma list of STEP:WANT, after step STEP the
    controller prints "PAUSE STEP" and waits for the file PAUSE_DIR/STEP (the test does a
    fault or starts a machine meanwhile), then waits until the run has WANT machines (0:
    no wait, after a fault the next step finds the loss);
    a step that raises MachineLostError is made again when it did not happen.  Prints
    every step's loss and the produced Data's sum; with SYNK_CLUSTER=0 it is the serial twin.
allreduce N: times all_reduce of 4 B and 1 MB (N rounds each), for bench/faults.py.
"""

import logging
import os
import sys
import time

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.runtime.state import get_runtime

from ckpt_train import build

EVENTS = []


def _watch(event, machine, layout):
    EVENTS.append(event)
    print(f"EVENT {event} {machine} -> {layout.n_machines} machines {layout.n_parallel} ranks "
          f"generation {layout.generation} at {time.monotonic():.3f}", flush=True)


def _pids():
    rt = get_runtime()
    pids = rt.peers.pids if rt.peers.layout is not None else [os.getpid()]
    print("PIDS", " ".join(map(str, pids)), rt.config.prefix, flush=True)


def _rows(part):
    """Rows of a produced Data: row i is (i, i^2 mod 7), wherever it is made."""
    i = np.arange(part.lo if part.lo is not None else 0,
                  part.hi if part.hi is not None else 30, dtype="float64")
    return np.stack([i, i ** 2 % 7], axis=1).astype(pytensor.config.floatX)


def check(local):
    synk.fork(local)
    _pids()
    x = pt.matrix("x")
    w = pytensor.shared(np.ones(3, dtype=pytensor.config.floatX), name="w")
    f = {op: synk.function([x], (pt.sum(x * w, axis=0), op)) for op in ("sum", "avg", "max")}
    f_all = synk.function([x], (pt.sum(x), "sum"))
    synk.distribute()
    X = np.arange(60, dtype=pytensor.config.floatX).reshape(20, 3)
    d = synk.data(X)
    np.testing.assert_allclose(f["sum"](d), X.sum(0), rtol=1e-6)
    lay = synk.layout()
    print("LAYOUT", lay.n_machines, lay.n_parallel, lay.n_local, flush=True)
    np.testing.assert_allclose(f_all(X), X.sum(), rtol=1e-6)  # a NumPy input, sent by rows
    print("OK calls", flush=True)
    n = lay.n_parallel
    for r in range(n):
        synk.set_value(r, w, np.full(3, r + 1, dtype=w.dtype))
    synk.all_reduce(w, op="sum")
    np.testing.assert_allclose(synk.get_value(n - 1, w), np.full(3, n * (n + 1) / 2), rtol=1e-6)
    synk.broadcast(w, np.arange(3, dtype=w.dtype))
    assert all(np.array_equal(synk.get_value(r, w), np.arange(3)) for r in range(n))
    got = synk.gather(w, nd_up=1)
    np.testing.assert_array_equal(got, np.tile(np.arange(3), (n, 1)))
    print("OK collectives", flush=True)
    d[2:4] = -1
    Y = X.copy()
    Y[2:4] = -1
    np.testing.assert_allclose(f_all(d), Y.sum(), rtol=1e-6)
    p = synk.data(produce=_rows, length=30)
    np.testing.assert_allclose(f_all(p), _rows(type("P", (), {"lo": 0, "hi": 30})).sum(),
                               rtol=1e-6)
    print("OK data", flush=True)
    synk.close()
    print("CLOSED", flush=True)


def _fork_or_say_refused(n_parallel):
    """fork(); a joiner prints when it knocked and when it was refused, on its own clock.

    The door's answer is timed from these two lines, not from the process's start: a loaded
    machine takes seconds to import torch and fork, which says nothing of the door.
    """
    knock = logging.getLogger("synkhronos.cluster.elastic.join")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("LOG %(monotonic).3f %(message)s"))
    handler.addFilter(_stamp)
    knock.addHandler(handler)
    knock.setLevel(logging.INFO)
    try:
        synk.fork(n_parallel, use_gpu=False)
    except synk.SynkError as exc:
        if "refused this machine" in str(exc):
            print(f"REFUSED at {time.monotonic():.3f}", flush=True)
        raise
    finally:
        knock.removeHandler(handler)


def _stamp(record):
    record.monotonic = time.monotonic()
    return True


def train(n_steps, plan, pause_dir):
    cluster = os.environ.get("SYNK_CLUSTER") != "0"
    _fork_or_say_refused(1 if not cluster else None)
    synk.on_machines(_watch)
    step, x_data, y_data = build(dropout=False)
    x = pt.matrix("x")
    total = synk.function([x], (pt.sum(x), "sum"))
    synk.distribute()
    _pids()
    x_data, y_data = synk.data(x_data), synk.data(y_data)
    produced = synk.data(produce=_rows, length=30)
    k = 0
    while k < n_steps:
        idx = np.random.default_rng((7, k)).choice(64, size=21, replace=False)
        t0 = time.monotonic()
        try:
            loss = float(step(x_data, y_data, batch=idx))
            s = float(total(produced))
        except synk.MachineLostError as exc:
            print("CAUGHT", type(exc).__name__, "at step", k, "completed", exc.completed,
                  f"at {time.monotonic():.3f}", str(exc).splitlines()[0], flush=True)
            assert exc.survived and exc.completed is not None, exc
            if exc.completed:  # made on every machine left; only its outputs are lost
                print(f"step {k} lost", flush=True)
                k += 1
            continue
        lay = synk.layout() if cluster else None
        where = f" on {lay.n_machines} machines {lay.n_parallel} ranks" if lay else ""
        print(f"step {k} {loss!r} sum {s!r}{where} took {time.monotonic() - t0:.3f} "
              f"at {time.monotonic():.3f}", flush=True)
        if cluster and str(k) in plan:
            print(f"PAUSE {k}", flush=True)
            path = os.path.join(pause_dir, str(k))
            while not os.path.exists(path):
                time.sleep(0.02)
            want = plan[str(k)]
            deadline = time.monotonic() + 60
            # A join is admitted at a public call (synk.layout() here); a loss is found by the
            # next command, which raises MachineLostError (want 0: nothing to wait for).
            while want and synk.layout().n_machines != want and time.monotonic() < deadline:
                time.sleep(0.02)
            print(f"RESUME {k} machines {synk.layout().n_machines} at {time.monotonic():.3f}",
                  flush=True)
        k += 1
    synk.close()
    print("CLOSED", flush=True)


def allreduce(rounds):
    synk.fork(1)
    v = {n: pytensor.shared(np.ones(n // 4, dtype="float32"), name=f"v{n}")
         for n in (4, 1 << 20)}
    synk.function([], [], updates=[(s, s * 1) for s in v.values()])
    synk.distribute()
    _pids()
    for n, s in v.items():
        for _ in range(20):
            synk.all_reduce(s, op="avg")
        ts = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            synk.all_reduce(s, op="avg")
            ts.append(time.perf_counter() - t0)
        print(f"ALLREDUCE {n} {np.median(ts) * 1e6:.1f} us", flush=True)
    synk.close()
    print("CLOSED", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "check":
        check(int(sys.argv[2]))
    elif mode == "train":
        plan = dict(p.split(":") for p in sys.argv[3].split(",") if p)
        train(int(sys.argv[2]), {k: int(v) for k, v in plan.items()},
              os.environ.get("PAUSE_DIR", "."))
    else:
        allreduce(int(sys.argv[2]))
