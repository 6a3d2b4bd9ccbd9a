"""Speedup against ranks: MLP training, a tiny call, all_reduce and a PyMC gradient on 1..N ranks.

In one run: the serial PyTensor step of an MLP 784-1024-1024-10 (batch 512,
SGD, float32) on 1 BLAS thread and on every core's threads, then, per rank
count (one ``fork`` each): ``make_train_function`` (one command per step),
a tiny call (``x.sum()`` of 8x4 float32, next to the bare PyTensor call) and
``all_reduce`` of 4 B and 64 MB (next to one 64 MB memory copy).  With
``--pymc-rows N`` (needs PyMC) also a logistic regression on N rows in
``pm.Data``: ``dp.logp_dlogp`` on each rank count against PyMC's own serial
(logp, dlogp) call.  Prints per-rank-count figures and speedups, and with
``--plot`` writes the MLP speedups as a PNG, like the Synkhronos paper's
scaling figures.

Usage: python bench/scaling.py [--steps N] [--max-ranks N | --ranks 1,2,4,...]
                               [--batch B] [--pymc-rows N [--no-mlp]] [--plot PNG]
"""

import argparse
import os
import statistics
import time

import numpy as np
import pytensor
import pytensor.tensor as pt
from threadpoolctl import threadpool_limits

import synkhronos as synk
from synkhronos.extensions import make_serial_train_function, make_train_function

from common import (BATCH, LAYERS, build_mlp, calls_for, flat_point, logistic, plot, quiet,
                    serial_pair)

BIG = 1 << 24   # float32 elements: the 64 MB all_reduce


def timed(step, n, repeats=3):
    """Median over ``repeats`` of the mean seconds per step over ``n`` steps."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out)


def serial(data_x, data_y, steps, threads, batch):
    x, y, params, loss = build_mlp(np.random.default_rng(1))
    step = make_serial_train_function(loss, params, x, y, update_kwargs={"learning_rate": 0.01})
    rng = np.random.default_rng(0)
    with threadpool_limits(limits=threads):
        def one():
            step(data_x, data_y, batch=rng.integers(0, len(data_x), batch))
        one()
        return batch / timed(one, steps)


def per_call(fn, seconds=0.3, repeats=5):
    """Median over ``repeats`` of the mean seconds per call, each repeat about ``seconds`` long."""
    fn()
    return timed(fn, calls_for(fn, seconds / repeats), repeats)


def parallel(data_x, data_y, steps, n, batch):
    """One fork of ``n`` ranks: MLP samples/s, then seconds per tiny call and per all_reduce."""
    synk.fork(n, use_gpu=False)
    try:
        x, y, params, loss = build_mlp(np.random.default_rng(1))
        step = make_train_function(loss, params, x, y, update_kwargs={"learning_rate": 0.01})
        tx = pt.matrix("tx")
        f_tiny = synk.function([tx], pt.sum(tx))
        s4 = pytensor.shared(np.ones(1, "float32"), name="s4")
        s64 = pytensor.shared(np.zeros(BIG, "float32"), name="s64")   # sums stay finite
        synk.function([], [s4.sum(), s64.sum()])
        synk.distribute()
        xd, yd = synk.data(data_x), synk.data(data_y)
        tiny = synk.data(np.ones((8, 4), "float32"))
        rng = np.random.default_rng(0)

        def one():
            step(xd, yd, batch=rng.integers(0, len(data_x), batch))
        one()
        out = {"mlp": batch / timed(one, steps),
               "tiny": per_call(lambda: f_tiny(tiny)),
               "ar4": per_call(lambda: synk.all_reduce(s4, op="sum")),
               "ar64": per_call(lambda: synk.all_reduce(s64, op="sum"), seconds=1.0)}
        return out
    finally:
        synk.close()


def pymc_part(rows, ranks, mode=None):
    """dp.logp_dlogp of a logistic regression on ``rows`` rows, per rank count, vs PyMC serial.

    PyMC's serial call is timed in C (CVM, as pm.sample compiles) and in the
    ranks' mode (Numba unless ``mode`` says otherwise).
    """
    quiet()
    from synkhronos.extensions import pymc as synk_pymc
    from synkhronos.extensions.pymc.model import DEFAULT_MODE

    rank_mode = mode or DEFAULT_MODE
    model = logistic(rows)
    q = flat_point(model)
    serial_fns = {m: serial_pair(model, m) for m in dict.fromkeys(["CVM", rank_mode])}
    t_serial = {m: per_call(lambda f=f: f(q), seconds=1.0) for m, f in serial_fns.items()}
    print(f"\n# PyMC logistic regression, {rows} rows: PyMC's serial (logp, dlogp) "
          + ", ".join(f"{t * 1e3:.2f} ms in {m}" for m, t in t_serial.items())
          + f"; the ranks compile in {rank_mode}")
    want = serial_fns["CVM"](q)
    for n in ranks:
        synk.fork(n, use_gpu=False)
        try:
            dp = synk_pymc.data_parallel(model, mode=mode)
            synk.distribute()
            dp.scatter()
            got = dp.logp_dlogp(q)
            assert np.allclose(got[0], want[0], rtol=1e-6), (got[0], want[0])
            t = per_call(lambda: dp.logp_dlogp(q), seconds=1.0)
        finally:
            synk.close()
        print(f"dp.logp_dlogp, {n:2d} rank{'s' if n > 1 else ' '}  {t * 1e3:8.2f} ms  "
              + "  ".join(f"{ts / t:5.2f}x PyMC serial in {m}" for m, ts in t_serial.items()),
              flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--max-ranks", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--batch", type=int, default=BATCH, help="global minibatch size")
    p.add_argument("--ranks", default=None,
                   help="comma-separated rank counts to run (default: 1..--max-ranks)")
    p.add_argument("--pymc-rows", type=int, default=0,
                   help="also a PyMC logistic regression on this many rows (needs PyMC)")
    p.add_argument("--pymc-mode", default=None, choices=["NUMBA", "CVM"],
                   help="the ranks' PyTensor mode for the PyMC part (default: the extension's)")
    p.add_argument("--no-mlp", action="store_true",
                   help="skip the MLP, tiny call and all_reduce (with --pymc-rows: PyMC only)")
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    ranks = ([int(r) for r in args.ranks.split(",")] if args.ranks
             else list(range(1, args.max_ranks + 1)))
    if args.no_mlp:
        if args.pymc_rows:
            pymc_part(args.pymc_rows, ranks, args.pymc_mode)
        return
    rng = np.random.default_rng(0)
    n_data = 16 * args.batch
    data_x = rng.normal(size=(n_data, LAYERS[0])).astype("float32")
    data_y = rng.integers(0, LAYERS[-1], n_data).astype("int32")
    print(f"# MLP {'-'.join(map(str, LAYERS))}, batch {args.batch}, {cores} cores, "
          f"pytensor {pytensor.__version__}, {time.strftime('%Y-%m-%d')}")
    s1 = serial(data_x, data_y, args.steps, 1, args.batch)
    sn = serial(data_x, data_y, args.steps, cores, args.batch)
    tx = pt.matrix("tx")
    bare = pytensor.function([tx], pt.sum(tx))
    small = np.ones((8, 4), "float32")
    t_bare = per_call(lambda: bare(small))
    src, dst = np.ones(BIG, "float32"), np.empty(BIG, "float32")
    t_copy = per_call(lambda: np.copyto(dst, src), seconds=1.0)
    print(f"serial, 1 BLAS thread      {s1:8.0f} samples/s")
    print(f"serial, {cores} BLAS threads     {sn:8.0f} samples/s")
    print(f"bare PyTensor tiny call    {t_bare * 1e6:8.1f} us;  one 64 MB copy "
          f"{t_copy * 1e3:.2f} ms ({4 * BIG / t_copy / 1e9:.1f} GB/s)")
    print("| ranks | MLP samples/s | vs 1 thread | vs all threads | tiny call us (x bare) "
          "| all_reduce 4 B us | all_reduce 64 MB ms (GB/s) |")
    print("|---|---|---|---|---|---|---|")
    rates = []
    for n in ranks:
        r = parallel(data_x, data_y, args.steps, n, args.batch)
        rates.append(r["mlp"])
        print(f"| {n} | {r['mlp']:.0f} | {r['mlp'] / s1:.2f}x | {r['mlp'] / sn:.2f}x | "
              f"{r['tiny'] * 1e6:.1f} ({r['tiny'] / t_bare:.2f}x) | {r['ar4'] * 1e6:.1f} | "
              f"{r['ar64'] * 1e3:.2f} ({4 * BIG / r['ar64'] / 1e9:.2f}) |", flush=True)
    if args.pymc_rows:
        pymc_part(args.pymc_rows, ranks, args.pymc_mode)
    if args.plot:
        plot(ranks, {"vs serial, 1 thread": [r / s1 for r in rates],
                     f"vs serial, {cores} threads": [r / sn for r in rates]},
             args.plot, f"MLP training, batch {args.batch}")


if __name__ == "__main__":
    main()
