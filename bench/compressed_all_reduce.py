"""Reduced-precision all-reduce: float32 vs. bfloat16 / float16 transport, per backend.

In one run, for float32 shared variables of 1 MB, 16 MB and 64 MB on 2 ranks:
``synk.all_reduce(v, "sum")`` and the same with ``dtype="bfloat16"`` and
``dtype="float16"``, through each backend (shm, zmq).  Prints the best and
median time per call, the effective bandwidth (the float32 variable's bytes
over the best time) and the speedup of each 16-bit transport over float32,
all measured in this run; and the load average, since the machine is shared.

Usage: python bench/compressed_all_reduce.py [--backends shm,zmq] [--sizes 1,16,64] [--reps 10]
"""

import argparse
import os
import statistics
import time

import numpy as np

DTYPES = [None, "bfloat16", "float16"]


def run_backend(backend, sizes_mb, reps):
    os.environ["SYNK_BACKEND"] = backend
    import pytensor

    import synkhronos as synk

    synk.fork(2, use_gpu=False)
    shareds = {mb: pytensor.shared(np.zeros(mb << 18, "float32"), name=f"v{mb}")
               for mb in sizes_mb}
    synk.function([], sum(v.sum() for v in shareds.values()), mode="FAST_COMPILE")
    synk.distribute()
    rows = []
    try:
        for mb, v in shareds.items():
            for r in range(2):
                synk.set_value(r, v, np.random.default_rng(r).normal(size=mb << 18)
                               .astype("float32"))
            best = {}
            for dtype in DTYPES:
                times = []
                for k in range(reps + 2):
                    t0 = time.perf_counter()
                    synk.all_reduce(v, op="avg", dtype=dtype)
                    if k >= 2:
                        times.append(time.perf_counter() - t0)
                best[dtype] = min(times)
                rows.append((backend, mb, dtype or "float32", min(times),
                             statistics.median(times)))
            for dtype in DTYPES[1:]:
                rows.append((backend, mb, f"{dtype} speedup", best[None] / best[dtype], None))
    finally:
        synk.close()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="shm,zmq")
    ap.add_argument("--sizes", default="1,16,64")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}")
    print("| backend | size | transport | best | median | GB/s (float32 bytes / best) |")
    print("|---|---|---|---|---|---|")
    for backend in args.backends.split(","):
        for be, mb, what, best, median in run_backend(backend, [int(s) for s in
                                                                 args.sizes.split(",")],
                                                      args.reps):
            if median is None:
                print(f"| {be} | {mb} MB | {what} | {best:.2f}x | | |")
            else:
                print(f"| {be} | {mb} MB | {what} | {best * 1e3:.2f} ms | {median * 1e3:.2f} ms "
                      f"| {(mb << 20) / best / 1e9:.2f} |")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
