"""Clusters over MPI: MLP training and all_reduce on 2 MPI processes, vs. one machine and bare MPI.

A cluster run (``mpiexec -n 2 python train.py``, one controller and one node
master, one rank each) pays for what one machine does not: every command
travels to the node master and its report back, and collectives between
machines go through MPI point-to-point messages among the leaders.  This
script measures that price on one host, where "machines" are MPI processes:

  (a) samples/s of the MLP of bench/call_overhead.py (784-1024-1024-10, batch
      512, SGD, float32, synthetic data) trained with ``make_train_function``
      on 2 MPI processes x 1 rank, against plain ``fork(2)`` (1 process x 2
      ranks, shared memory); target >= 0.9x;
  (b) ``synk.all_reduce`` (op "sum") of a float32 shared variable of 4 B, 1 MB
      and 64 MB on 2 MPI processes x 1 rank, against mpi4py's bare
      ``comm.Allreduce`` of the same buffer in a job of the same shape
      (2 processes, one core each); targets: within 1.2x for >= 1 MB, within
      +10 us for 4 B.  1 process x 2 ranks (shared memory) is printed beside.

MPI must not start before ``synk.fork()``, and after it the node master never
returns to the script, so the bare MPI figures cannot come from the synk job:
the parent (``python bench/multinode.py``) launches back-to-back jobs, alternated
over ``--rounds`` rounds, with the ``mpiexec`` next to ``sys.executable``:
``mpiexec -n 2 ... --mpi-bare`` (mpi4py only), ``mpiexec -n 2 ... --synk-cluster``
and ``... --synk-local`` (plain fork(2), no mpiexec).  Each prints one JSON line
of per-call (per-step) times; the parent pools every round's samples and
prints medians and the ratios.  Run it on a quiet machine.

Usage: python bench/multinode.py [--quick] [--rounds N] [--steps N]
mpi4py and mpich are bench extras: pip install -e ".[bench]" (or ".[mpi]").
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

from common import BATCH, LAYERS, N_DATA, build_mlp

SIZES = [4, 1 << 20, 64 << 20]
N_PROCS = 2


def reps_for(nbytes, quick):
    """Calls timed per size and job: enough for a stable median, a few seconds at most."""
    reps = 3000 if nbytes <= 4096 else 300 if nbytes <= 1 << 20 else 20
    return max(reps // 4, 5) if quick else reps


def label(nbytes):
    for unit, div in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= div:
            return f"{nbytes // div} {unit}"
    return f"{nbytes} B"


def per_call(fn, reps, warmup):
    """Seconds of each of ``reps`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    clock = time.perf_counter
    out = []
    for _ in range(reps):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def emit(obj):
    """One JSON line on stdout: what the parent reads (the last line of the job's output)."""
    print(json.dumps(obj), flush=True)


# ---- the jobs the parent launches ----------------------------------------------------
def job_mpi_bare(quick):
    """Under mpiexec, no synkhronos: time comm.Allreduce per size; rank 0 prints the times."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    # One core each, as synkhronos gives each MPI process on a host its share of the cores.
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % os.cpu_count()]})
    out = {}
    for n in SIZES:
        src = np.zeros(max(n // 4, 1), "float32")
        dst = np.empty_like(src)
        reps = reps_for(n, quick)
        comm.Barrier()
        # Every process makes the same number of calls, so the collectives pair up.
        out[str(n)] = per_call(lambda: comm.Allreduce(src, dst, op=MPI.SUM), reps,
                               max(2, reps // 20))
    if rank == 0:
        emit({"all_reduce": out})


def _build_mlp(synk):
    """The MLP step (make_train_function) and its data; call after distribute() to get the Data."""
    import numpy as np

    from synkhronos.extensions import make_train_function

    x, y, params, loss = build_mlp(np.random.default_rng(1))
    step = make_train_function(loss, params, x, y, update_kwargs={"learning_rate": 0.01})

    def timed(steps):
        """Seconds of each step; the data goes into synk.data (to every machine) first."""
        rng = np.random.default_rng(0)
        data_x = rng.normal(size=(N_DATA, LAYERS[0])).astype("float32")
        data_y = rng.integers(0, LAYERS[-1], N_DATA).astype("int32")
        xd, yd = synk.data(data_x), synk.data(data_y)

        def one():
            step(xd, yd, batch=rng.integers(0, N_DATA, BATCH))
        return per_call(one, steps, 3)
    return timed, BATCH, LAYERS


def _build_all_reduce():
    """One float32 shared variable per size, used by a synk function (so distribute() has it)."""
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk

    shareds = [pytensor.shared(np.zeros(max(n // 4, 1), "float32"), name=f"s{n}")
               for n in SIZES]
    synk.function([], [pt.sum(s) for s in shareds])
    return shareds


def job_synk(n_parallel, steps, quick):
    """fork(n_parallel) (under mpiexec: per MPI process), all_reduce per size, then the MLP.

    Under mpiexec only the controller gets past fork() and prints.
    """
    import synkhronos as synk

    n = synk.fork(n_parallel, use_gpu=False)
    try:
        layout = synk.layout()
        res = {"n_parallel": n, "n_local": layout.n_local,
               "affinity": sorted(os.sched_getaffinity(0))}
        shareds = _build_all_reduce()
        mlp, res["batch"], res["layers"] = _build_mlp(synk)
        synk.distribute()  # once per fork(): every function above
        t0 = time.perf_counter()
        res["all_reduce"] = {}
        for n_bytes, s in zip(SIZES, shareds):
            reps = reps_for(n_bytes, quick)
            res["all_reduce"][str(n_bytes)] = per_call(
                lambda s=s: synk.all_reduce(s, op="sum"), reps, max(2, reps // 20))
        res["all_reduce_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        res["mlp"] = mlp(steps)
        res["mlp_s"] = time.perf_counter() - t0
    finally:
        synk.close()
    emit(res)


# ---- the parent -----------------------------------------------------------------------
def _mpiexec():
    found = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep
                         + os.environ.get("PATH", ""))
    if found is None:
        sys.exit("no mpiexec next to the interpreter or on PATH: pip install -e '.[bench]' "
                 "(mpi4py, mpich)")
    return found


def run_job(argv, timeout):
    """Run one job; return its JSON line and its wall time."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("SYNK_BACKEND", None)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        sys.exit(f"job failed (exit {proc.returncode}): {' '.join(argv)}")
    return json.loads(lines[-1]), wall


def fmt_time(t):
    return f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round, fewer calls and steps")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds of the three jobs, alternated (default 3; 1 with --quick)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed MLP steps per job (default 30; 8 with --quick)")
    ap.add_argument("--mpi-bare", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--synk-cluster", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--synk-local", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    steps = args.steps or (8 if args.quick else 30)
    if args.mpi_bare:
        return job_mpi_bare(args.quick)
    if args.synk_cluster:
        return job_synk(1, steps, args.quick)
    if args.synk_local:
        return job_synk(N_PROCS, steps, args.quick)

    mpiexec = _mpiexec()
    me = [sys.executable, os.path.abspath(__file__)] + (["--quick"] if args.quick else []) \
        + ["--steps", str(steps)]
    mpi = [mpiexec, "-n", str(N_PROCS)]
    jobs = {"bare": mpi + me + ["--mpi-bare"],
            "cluster": mpi + me + ["--synk-cluster"],
            "local": me + ["--synk-local"]}
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{rounds} round(s), load {os.getloadavg()[0]:.2f}")
    t_start = time.perf_counter()
    got = {k: [] for k in jobs}
    walls = {k: [] for k in jobs}
    for r in range(rounds):
        # Alternate the order so that drift on the machine does not favour one job.
        order = ["bare", "cluster", "local"] if r % 2 == 0 else ["local", "cluster", "bare"]
        for name in order:
            res, wall = run_job(jobs[name], timeout=600)
            got[name].append(res)
            walls[name].append(wall)
    load_end = os.getloadavg()[0]

    cl, lo = got["cluster"][0], got["local"][0]
    print(f"# cluster job: {cl['n_parallel']} ranks, n_local {cl['n_local']}, controller "
          f"affinity {cl['affinity']}; local job: n_local {lo['n_local']}, master affinity "
          f"{lo['affinity']}")
    print(f"# job wall times (s, per round): bare {_fmt_list(walls['bare'])}, cluster "
          f"{_fmt_list(walls['cluster'])}, local {_fmt_list(walls['local'])}")

    def pooled(name, key, sub=None):
        xs = []
        for res in got[name]:
            xs.extend(res[key] if sub is None else res[key][sub])
        return statistics.median(xs)

    def per_round(name, key, sub=None):
        return [statistics.median(res[key] if sub is None else res[key][sub])
                for res in got[name]]

    batch, layers = cl["batch"], cl["layers"]
    print(f"\n== (a) MLP {'-'.join(map(str, layers))}, batch {batch}, make_train_function: "
          "samples/s (median step) ==")
    rate_c = batch / pooled("cluster", "mlp")
    rate_l = batch / pooled("local", "mlp")
    print(f"2 MPI processes x 1 rank   {rate_c:8.0f}   per round "
          f"{_fmt_list([batch / t for t in per_round('cluster', 'mlp')], '.0f')}")
    print(f"1 process x 2 ranks        {rate_l:8.0f}   per round "
          f"{_fmt_list([batch / t for t in per_round('local', 'mlp')], '.0f')}")
    ratio = rate_c / rate_l
    print(f"cluster / one machine      {ratio:8.3f}x  (target >= 0.9x: "
          f"{'met' if ratio >= 0.9 else 'missed'})")

    print("\n== (b) all_reduce, op sum, float32, 2 MPI processes (median per call) ==")
    cols = ["size", "synk 2 procs x 1", "bare mpi4py", "synk / bare", "synk - bare",
            "target", "synk 1 proc x 2 (shm)"]
    rows = []
    for n in SIZES:
        s = pooled("cluster", "all_reduce", str(n))
        b = pooled("bare", "all_reduce", str(n))
        loc = pooled("local", "all_reduce", str(n))
        if n >= 1 << 20:
            target = f"<= 1.2x: {'met' if s / b <= 1.2 else 'missed'}"
        else:
            target = f"<= +10 us: {'met' if s - b <= 10e-6 else 'missed'}"
        rows.append([label(n), fmt_time(s), fmt_time(b), f"{s / b:.2f}x",
                     ("+" if s >= b else "-") + fmt_time(abs(s - b)), target, fmt_time(loc)])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
    print("per-round medians (synk cluster | bare):")
    for n in SIZES:
        print(f"  {label(n):>6}: {_fmt_list(per_round('cluster', 'all_reduce', str(n)), 't')}"
              f" | {_fmt_list(per_round('bare', 'all_reduce', str(n)), 't')}")
    print(f"# total {time.perf_counter() - t_start:.0f} s, load at the end {load_end:.2f}")


def _fmt_list(xs, spec=".1f"):
    if spec == "t":
        return ", ".join(fmt_time(x) for x in xs)
    return ", ".join(format(x, spec) for x in xs)


if __name__ == "__main__":
    main()
