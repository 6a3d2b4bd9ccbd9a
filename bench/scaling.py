"""Speedup against ranks: MLP training samples/s, synkhronos on 1..N ranks vs. its serial twin.

In one run: the serial PyTensor step of an MLP 784-1024-1024-10 (batch 512,
SGD, float32) on 1 BLAS thread and on every core's threads, then
``make_train_function`` (one command per step) on 1, 2, ... ranks up to the
usable cores; prints samples/s and the speedups, and with ``--plot`` writes
them as a PNG, like the Synkhronos paper's scaling figures.

Usage: python bench/scaling.py [--steps N] [--max-ranks N] [--plot PNG]
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
import pytensor
from threadpoolctl import threadpool_limits

import synkhronos as synk
from synkhronos.extensions import make_serial_train_function, make_train_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from call_overhead import BATCH, LAYERS, N_DATA, build_mlp  # noqa: E402


def timed(step, n, repeats=3):
    """Median over ``repeats`` of the mean seconds per step over ``n`` steps."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out)


def serial(data_x, data_y, steps, threads):
    x, y, params, loss = build_mlp(np.random.default_rng(1))
    step = make_serial_train_function(loss, params, x, y, update_kwargs={"learning_rate": 0.01})
    rng = np.random.default_rng(0)
    with threadpool_limits(limits=threads):
        def one():
            step(data_x, data_y, batch=rng.integers(0, N_DATA, BATCH))
        one()
        return BATCH / timed(one, steps)


def parallel(data_x, data_y, steps, n):
    synk.fork(n, use_gpu=False)
    try:
        x, y, params, loss = build_mlp(np.random.default_rng(1))
        step = make_train_function(loss, params, x, y, update_kwargs={"learning_rate": 0.01})
        synk.distribute()
        xd, yd = synk.data(data_x), synk.data(data_y)
        rng = np.random.default_rng(0)

        def one():
            step(xd, yd, batch=rng.integers(0, N_DATA, BATCH))
        one()
        return BATCH / timed(one, steps)
    finally:
        synk.close()


def plot(ranks, speedups, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 4.2))
    for label, values in speedups.items():
        ax.plot(ranks, values, "o-", label=label)
    ax.plot(ranks, ranks, "k--", alpha=0.5, label="ideal (vs 1 thread)")
    ax.set_xlabel("ranks (one per core)")
    ax.set_ylabel("speedup in samples/s")
    ax.set_xticks(ranks)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"# wrote {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--max-ranks", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    rng = np.random.default_rng(0)
    data_x = rng.normal(size=(N_DATA, LAYERS[0])).astype("float32")
    data_y = rng.integers(0, LAYERS[-1], N_DATA).astype("int32")
    print(f"# MLP {'-'.join(map(str, LAYERS))}, batch {BATCH}, {cores} cores, "
          f"pytensor {pytensor.__version__}, {time.strftime('%Y-%m-%d')}")
    s1 = serial(data_x, data_y, args.steps, 1)
    sn = serial(data_x, data_y, args.steps, cores)
    print(f"serial, 1 BLAS thread      {s1:8.0f} samples/s")
    print(f"serial, {cores} BLAS threads     {sn:8.0f} samples/s")
    ranks = list(range(1, args.max_ranks + 1))
    rates = []
    for n in ranks:
        rates.append(parallel(data_x, data_y, args.steps, n))
        print(f"synk, {n} rank{'s' if n > 1 else ' '}             {rates[-1]:8.0f} samples/s  "
              f"{rates[-1] / s1:5.2f}x vs 1 thread  {rates[-1] / sn:5.2f}x vs {cores} threads")
    if args.plot:
        plot(ranks, {"vs serial, 1 thread": [r / s1 for r in rates],
                     f"vs serial, {cores} threads": [r / sn for r in rates]},
             args.plot, f"MLP training, batch {BATCH}")


if __name__ == "__main__":
    main()
