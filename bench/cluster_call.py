"""A call with a large output, a tiny call and a 4-byte all_reduce, on simulated machines.

    sudo python bench/cluster_call.py [--machines 2,3] [--local 1,2] [--output-bytes 1048576]
                                      [--rounds 3] [--pauses 30]

On simulated machines (tests/helpers/machines.py; needs root), one MPI process
per machine forks ``--local`` ranks and the controller times, per call:

- ``call, N output``: ``f(x)`` whose output, ``sum(x, axis=0)`` under op
  "sum", holds ``--output-bytes`` bytes (float32) on every rank; every rank's
  (or, combined, every machine's) result travels to the controller;
- ``tiny call``: a call with a 0-d output, the latency of one CALL;
- ``call, 10^5 rows``: small reductions (a sum over rows of 5 columns, a mean) of
  10^5 x 5 float64 rows that every machine holds: a call that runs in chunks, spread
  over the ranks in a cluster (synkhronos/functions/spread.py) since 2026-12-05;
- ``all_reduce 4 B``: ``synk.all_reduce`` of a one-element float32 variable;
- ``tiny call after 20 ms``: the tiny call again, each after the program paused
  20 ms (``--pauses`` calls): what a command costs once the node masters
  stopped spinning (cluster/doorbell.py).

Printed: the median over ``--rounds`` jobs of each job's median, per layout.
``bench/before_after.py --cluster`` runs it with two versions side by side.
Machines share this host's cores where there are more ranks than cores:
figures compare versions, not what separate hosts would reach.
"""

import argparse
import json
import os
import statistics
import sys
import time

from common import ROOT, harness

FIGURES = ("call, output", "tiny call", "call, 10^5 rows", "all_reduce 4 B", "tiny call after 20 ms")
PAUSE_S = 0.02


def job(local, output_bytes, reps, pauses):
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk

    n = synk.fork(local, use_gpu=False)
    width = max(output_bytes // 4, 1)
    x = pt.matrix("x", dtype="float32")
    big = synk.function([x], (pt.sum(x, axis=0), "sum"))
    tiny = synk.function([x], (pt.sum(x), "sum"))
    r = pt.dmatrix("r")
    rows_f = synk.function([r], [(pt.sum(pt.exp(pt.sin(r)), axis=0), "sum"), (pt.mean(r), "avg")])
    s = pytensor.shared(np.ones(1, "float32"), name="s")
    synk.function([], pt.sum(s))
    synk.distribute()
    data = synk.data(np.ones((2 * n, width), "float32"))
    small = synk.data(np.ones((2 * n, 1), "float32"))
    R = np.sin(np.arange(500_000.0)).reshape(100_000, 5)
    rows = synk.data(R)
    np.testing.assert_allclose(big(data), np.full(width, 2.0 * n))
    np.testing.assert_allclose(rows_f(rows)[0], np.exp(np.sin(R)).sum(axis=0), rtol=1e-10)
    out = {}
    for name, fn in (("call, output", lambda: big(data)), ("tiny call", lambda: tiny(small)),
                     ("call, 10^5 rows", lambda: rows_f(rows)),
                     ("all_reduce 4 B", lambda: synk.all_reduce(s, op="sum"))):
        for _ in range(max(3, reps // 10)):
            fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    times = []
    for _ in range(pauses):
        time.sleep(PAUSE_S)
        t0 = time.perf_counter()
        tiny(small)
        times.append(time.perf_counter() - t0)
    out["tiny call after 20 ms"] = statistics.median(times)
    synk.close()
    print("JSON " + json.dumps(out), flush=True)


def measure(n_machines, local, output_bytes, rounds, reps, pauses):
    """{figure: median seconds over the rounds} for one layout."""
    cluster_jobs = harness("cluster_jobs")
    got = {k: [] for k in FIGURES}
    with cluster_jobs.machines(n_machines) as m:
        for _ in range(rounds):
            args = [os.path.abspath(__file__), "--job", "--local", str(local),
                    "--output-bytes", str(output_bytes), "--reps", str(reps),
                    "--pauses", str(pauses)]
            # The version under test: BENCH_TREE (set by before_after.py), else this one.
            tree = os.environ.get("BENCH_TREE") or ROOT
            rc, out, _ = cluster_jobs.mpirun(m, n_machines, args, timeout=900, PYTHONPATH=tree)
            lines = [ln for ln in out.splitlines() if ln.startswith("JSON ")]
            if rc != 0 or not lines:
                sys.exit(f"job on {n_machines} machines x {local} failed (exit {rc}):\n"
                         + out[-3000:])
            for k, v in json.loads(lines[-1][5:]).items():
                got[k].append(v)
    return {k: statistics.median(v) for k, v in got.items()}


def _fmt(t):
    return f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machines", default="2,3")
    ap.add_argument("--local", default="1,2", help="ranks per machine")
    ap.add_argument("--output-bytes", type=int, default=1 << 20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--pauses", type=int, default=30, help="tiny calls after a pause, per job")
    ap.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        return job(int(args.local), args.output_bytes, args.reps, args.pauses)
    cluster_jobs = harness("cluster_jobs")
    FLAVOR, NO_MACHINES = cluster_jobs.FLAVOR, cluster_jobs.NO_MACHINES
    if NO_MACHINES or not FLAVOR:
        sys.exit(f"bench/cluster_call.py: {NO_MACHINES or 'no mpiexec'}")
    print(f"# {FLAVOR}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{args.rounds} rounds, load {os.getloadavg()[0]:.2f}", flush=True)
    print("| machines x ranks | " + " | ".join(FIGURES) + " |")
    print("|---" * (len(FIGURES) + 1) + "|")
    for n_machines in [int(v) for v in args.machines.split(",")]:
        for local in [int(v) for v in args.local.split(",")]:
            got = measure(n_machines, local, args.output_bytes, args.rounds, args.reps,
                          args.pauses)
            print(f"| {n_machines} x {local} | " + " | ".join(_fmt(got[k]) for k in FIGURES)
                  + " |", flush=True)


if __name__ == "__main__":
    main()
