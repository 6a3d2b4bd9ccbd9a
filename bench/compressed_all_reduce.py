"""Reduced-precision all-reduce: float32 vs. bfloat16 / float16 transport, per backend and rank count.

In one run, for each backend (shm, zmq), rank count (2, 3, 4) and size of a
float32 shared variable (1 MB and 32 MB): ``synk.all_reduce(v, "avg")`` with
float32 transport and with ``dtype="bfloat16"`` and ``dtype="float16"``.
Each transport runs in blocks of calls in a row, as a training loop calls
it (one call to warm up, then ``--reps`` timed), and the transports take
turns block by block for ``--rounds`` rounds, in a rotated order, so a
change in the machine's load hits them alike.  (Alternating transports call
by call slowed whichever came right after a float32 call: bfloat16 over
ZeroMQ, 3 ranks, 32 MB, took 54 ms best that way and 32-39 ms in a row.)
Prints the best and median time per call, the bytes each rank sends (the
formulas of docs/compressed.md), the speedup of each 16-bit transport over
float32 (best over best, medians in brackets), all measured in this run,
and the load average, since the machine may be shared.

Usage: python bench/compressed_all_reduce.py [--backends shm,zmq] [--ranks 2,3,4]
       [--sizes 1,32] [--reps 8] [--rounds 3]
"""

import argparse
import os
import platform
import statistics
import time

import numpy as np

DTYPES = [None, "bfloat16", "float16"]


def run(backend, n, sizes_mb, reps, rounds):
    """Fork n ranks on ``backend``; return rows (size, transport, best s, median s)."""
    os.environ["SYNK_BACKEND"] = backend
    import pytensor

    import synkhronos as synk

    synk.fork(n, use_gpu=False)
    shareds = {mb: pytensor.shared(np.zeros(mb << 18, "float32"), name=f"v{mb}")
               for mb in sizes_mb}
    synk.function([], sum(v.sum() for v in shareds.values()), mode="FAST_COMPILE")
    synk.distribute()
    rows = []
    try:
        for mb, v in shareds.items():
            for r in range(n):
                synk.set_value(r, v, np.random.default_rng(r).normal(size=mb << 18)
                               .astype("float32"))
            synk.all_reduce(v, op="avg", dtype="bfloat16")  # compile the kernels
            synk.all_reduce(v, op="avg", dtype="float16")
            times = {d: [] for d in DTYPES}
            for k in range(rounds):
                for dtype in DTYPES[k % 3:] + DTYPES[:k % 3]:
                    for j in range(reps + 1):
                        t0 = time.perf_counter()
                        synk.all_reduce(v, op="avg", dtype=dtype)
                        if j:
                            times[dtype].append(time.perf_counter() - t0)
            for dtype in DTYPES:
                rows.append((mb, dtype or "float32", min(times[dtype]),
                             statistics.median(times[dtype])))
    finally:
        synk.close()
    return rows


def sent_mb(mb, n, transport):
    """Megabytes each rank sends: 8N(n-1)/n bytes for float32, 4N(n-1)/n for 16 bits."""
    per_value = 8 if transport == "float32" else 4
    return mb / 4 * per_value * (n - 1) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="shm,zmq")
    ap.add_argument("--ranks", default="2,3,4")
    ap.add_argument("--sizes", default="1,32")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, load average before {os.getloadavg()}")
    print("| backend | ranks | size | float32 | bfloat16 | float16 | sent per rank "
          "(f32 / 16-bit) | bfloat16 speedup | float16 speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for backend in args.backends.split(","):
        for n in [int(r) for r in args.ranks.split(",")]:
            rows = run(backend, n, sizes, args.reps, args.rounds)
            for mb in sizes:
                got = {what: (best, med) for m, what, best, med in rows if m == mb}
                f32 = got["float32"]
                cells = [f"{got[d][0] * 1e3:.2f} ms ({got[d][1] * 1e3:.2f})"
                         for d in ("float32", "bfloat16", "float16")]
                speed = [f"{f32[0] / got[d][0]:.2f}x ({f32[1] / got[d][1]:.2f}x)"
                         for d in ("bfloat16", "float16")]
                sent = f"{sent_mb(mb, n, 'float32'):.1f} / {sent_mb(mb, n, 'bfloat16'):.1f} MB"
                print(f"| {backend} | {n} | {mb} MB | " + " | ".join(cells) + f" | {sent} | "
                      + " | ".join(speed) + " |", flush=True)
    print(f"# load average after {os.getloadavg()}; times: best (median) of "
          f"{args.reps * args.rounds} calls")


if __name__ == "__main__":
    main()
