"""all_reduce across simulated machines, against bare MPI Allreduce among the same processes.

    sudo python bench/cluster_allreduce.py [--machines 2,3,4] [--rates none,10gbit,1gbit]
                                           [--sizes 4,65536,1048576,16777216,268435456]
                                           [--rounds 2] [--gloo]

For each number of machines and each link rate (``tc tbf`` on every machine's
link; "none": unlimited), on simulated machines (tests/helpers/machines.py:
each its own network namespace, host name, /dev/shm and cores; needs root),
two jobs of one MPI process per machine run alternately, ``--rounds`` times:

- bare: mpi4py ``comm.Allreduce`` (sum) of a float32 buffer of each size;
- synk: ``synk.fork(1)`` on each machine and ``synk.all_reduce`` (sum) of a
  float32 shared variable of each size (the leaders' ``Iallreduce`` on their
  own communicator, comm/mpi_leaders.py, polled with the liveness checks).

With ``--gloo`` two more jobs run in each round, for machines that come and go:

- gloo: bare ``torch.distributed.all_reduce`` (sum, gloo) among one process per
  machine (started by mpiexec only to place them; a TCP rendezvous on machine 0);
- elastic: the synk job on machines started on their own (``SYNK_LISTEN`` /
  ``SYNK_JOIN``, no launcher), whose leaders reduce through gloo.

Printed: the median seconds per call of each, their ratio and difference, for
every (machines, rate, size).  Machines share the host's cores when there are
more machines than cores (3-4 machines on 2 cores here): figures then say how
the two compare on the same processes, not what separate hosts would reach.
Issue 24 (MPI's own collectives between machines) was measured with it,
before (leaders sent their partials to each other) and after.  Sizes of
64 MB and more get 2 timed calls after 2 warm-ups per job and round.
"""

import argparse
import json
import os
import statistics
import sys
import time

from common import harness


HUGE = 1 << 26


def reps_for(nbytes, rate):
    """Calls per size: a second or two each at the link's rate (2 for huge sizes)."""
    if nbytes >= HUGE:
        return 2
    bytes_per_s = {"none": 1e9, "10gbit": 5e8, "1gbit": 6e7}.get(rate, 1e9)
    est = max(nbytes * 4 / bytes_per_s, 2e-5)
    return int(min(2000, max(3, 1.5 / est)))


def warmups(nbytes, reps):
    return max(2, reps // 10)  # two: synk reduces into two buffers in turn, each faulted in once


def _emit(obj):
    print("JSON " + json.dumps(obj), flush=True)


def job_bare(sizes, rate):
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    out = {}
    for n in sizes:
        src = np.ones(max(n // 4, 1), "float32")
        dst = np.empty_like(src)
        reps = reps_for(n, rate)
        for _ in range(warmups(n, reps)):
            comm.Allreduce(src, dst, op=MPI.SUM)
        comm.Barrier()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            comm.Allreduce(src, dst, op=MPI.SUM)
            times.append(time.perf_counter() - t0)
        out[str(n)] = times
    if comm.Get_rank() == 0:
        _emit(out)


def job_synk(sizes, rate):
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk

    synk.fork(1, use_gpu=False)
    shareds = [pytensor.shared(np.ones(max(n // 4, 1), "float32"), name=f"s{n}") for n in sizes]
    synk.function([], [pt.sum(s) for s in shareds])
    synk.distribute()
    out = {}
    for n, s in zip(sizes, shareds):
        reps = reps_for(n, rate)
        for _ in range(warmups(n, reps)):
            synk.all_reduce(s, op="sum")
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            synk.all_reduce(s, op="sum")
            times.append(time.perf_counter() - t0)
        out[str(n)] = times
    synk.close()
    _emit(out)


def job_gloo(sizes, rate, master):
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    dist.init_process_group("gloo", init_method=f"tcp://{master}:29519",
                            rank=comm.Get_rank(), world_size=comm.Get_size())
    out = {}
    for n in sizes:
        t = torch.ones(max(n // 4, 1), dtype=torch.float32)
        reps = reps_for(n, rate)
        for _ in range(warmups(n, reps)):
            dist.all_reduce(t)
        dist.barrier()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        out[str(n)] = times
    dist.destroy_process_group()
    if comm.Get_rank() == 0:
        _emit(out)


def _elastic(m, n_machines, sizes, rate):
    """The synk job on machines started on their own: (exit status, output)."""
    Job = harness("elastic_jobs").Job
    job = Job(m, ["--job", "synk", "--sizes", ",".join(map(str, sizes)), "--rates", rate],
              n_machines, script=os.path.abspath(__file__), SYNK_SPIN_S=None)
    try:
        for i in range(1, n_machines):
            job.join(i)
        rc = job.wait(1800)
    finally:
        job.close()
    return rc, job.out


def _label(n):
    for unit, div in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def _fmt(t):
    return f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"


def run(n_machines, rate, sizes, rounds, gloo=False, only=None):
    cluster_jobs = harness("cluster_jobs")
    jobs = ("bare", "synk", "gloo", "elastic") if gloo else ("bare", "synk")
    jobs = tuple(j for j in jobs if j in (only or jobs))
    got = {job: {str(n): [] for n in sizes} for job in jobs}
    with cluster_jobs.machines(n_machines) as m:
        if rate != "none":
            for i in range(n_machines):
                m.limit(i, rate)
        for r in range(rounds):
            for job in (jobs if r % 2 == 0 else jobs[::-1]):
                args = [os.path.abspath(__file__), "--job", job, "--sizes",
                        ",".join(map(str, sizes)), "--rates", rate, "--master", m.addresses[0]]
                if job == "elastic":
                    rc, out = _elastic(m, n_machines, sizes, rate)
                else:
                    rc, out, _ = cluster_jobs.mpirun(m, n_machines, args, timeout=1800)
                lines = [ln for ln in out.splitlines() if ln.startswith("JSON ")]
                if rc != 0 or not lines:
                    sys.exit(f"{job} job on {n_machines} machines failed (exit {rc}):\n"
                             + out[-3000:])
                for k, v in json.loads(lines[-1][5:]).items():
                    got[job][k] += v
    rows = []
    for n in sizes:
        med = {job: statistics.median(got[job][str(n)]) for job in jobs}
        rows.append((n_machines, rate, n, med))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machines", default="2,3,4")
    ap.add_argument("--rates", default="none,10gbit,1gbit")
    ap.add_argument("--sizes", default="4,65536,1048576,16777216,268435456")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--plot", default=None,
                    help="draw synk/bare against size, a panel per link rate, to this PNG")
    ap.add_argument("--gloo", action="store_true",
                    help="also bare gloo and synk on machines started on their own (needs torch)")
    ap.add_argument("--only", default=None,
                    help="comma list of the jobs to run (bare, synk, gloo, elastic)")
    ap.add_argument("--job", choices=["bare", "synk", "gloo"], help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    if args.job == "bare":
        return job_bare(sizes, args.rates)
    if args.job == "synk":
        return job_synk(sizes, args.rates)
    if args.job == "gloo":
        return job_gloo(sizes, args.rates, args.master)
    cluster_jobs = harness("cluster_jobs")
    FLAVOR, NO_MACHINES = cluster_jobs.FLAVOR, cluster_jobs.NO_MACHINES
    if NO_MACHINES or not FLAVOR:
        sys.exit(f"bench/cluster_allreduce.py: {NO_MACHINES or 'no mpiexec'}")
    print(f"# {FLAVOR}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{args.rounds} rounds, load {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for n_machines in [int(x) for x in args.machines.split(",")]:
        for rate in args.rates.split(","):
            rows += run(n_machines, rate, sizes, args.rounds, args.gloo,
                        args.only.split(",") if args.only else None)
            print(f"# done: {n_machines} machines, rate {rate}", flush=True)
    print(f"# load at the end {os.getloadavg()[0]:.2f}")
    if args.gloo:
        print("| machines | link | size | bare MPI Allreduce | synk all_reduce (MPI) | bare gloo "
              "all_reduce | synk all_reduce (machines on their own, gloo) | synk gloo / synk MPI "
              "| synk gloo / bare gloo |")
        print("|---|---|---|---|---|---|---|---|---|")
        nan = float("nan")
        for n_machines, rate, n, med in rows:
            g = {k: med.get(k, nan) for k in ("bare", "synk", "gloo", "elastic")}
            print(f"| {n_machines} | {rate} | {_label(n)} | {_fmt(g['bare'])} | "
                  f"{_fmt(g['synk'])} | {_fmt(g['gloo'])} | {_fmt(g['elastic'])} | "
                  f"{g['elastic'] / g['synk']:.2f}x | {g['elastic'] / g['gloo']:.2f}x |")
    else:
        print("| machines | link | size | bare Allreduce | synk all_reduce | ratio | difference |")
        print("|---|---|---|---|---|---|---|")
        for n_machines, rate, n, med in rows:
            b, s = med["bare"], med["synk"]
            print(f"| {n_machines} | {rate} | {_label(n)} | {_fmt(b)} | {_fmt(s)} | {s / b:.2f}x "
                  f"| {'+' if s >= b else '-'}{_fmt(abs(s - b))} |")
    if args.plot:
        plot(args.plot, [(k, r, n, med["bare"], med["synk"]) for k, r, n, med in rows])


def plot(path, rows):
    """synk all_reduce time over bare Allreduce's, against size: one line per machine count."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(dict.fromkeys(r[1] for r in rows))
    fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates), 3.8), sharey=True,
                             squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for m in sorted({r[0] for r in rows}):
            pts = [(n, s / b) for mm, rr, n, b, s in rows if mm == m and rr == rate]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{m} machines")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(1.1, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes all-reduced")
        ax.set_title(f"link: {rate}")
    axes[0][0].set_ylabel("synk all_reduce / bare MPI Allreduce")
    axes[0][0].legend()
    fig.suptitle("all_reduce across simulated machines (MPICH over TCP), time ratio")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
