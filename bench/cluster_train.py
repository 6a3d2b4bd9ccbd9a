"""MLP training step on simulated machines: 2 machines x 1 rank against 1 machine x 2 ranks.

    sudo .venv/bin/python bench/cluster_train.py [--rates none,10gbit,1gbit] [--rounds 3]
        [--steps 40] [--variants plain,overlap,bfloat16] [--burst auto] [--quiet-wait 300]
        [--batch 512] [--root TREE]

The training step of bench/scaling.py (MLP 784-1024-1024-10, batch 512, SGD,
float32, ``make_train_function``: gradient, one all-reduce of the 7.1 MiB flat
gradient, update, in one command per step; Data inputs of 8192 rows drawn
with ``batch=`` random index lists, as a training loop draws them) runs on
simulated machines (tests/helpers/machines.py: own network namespace, host
name, /dev/shm and cores; needs root):

- 1x2: one machine with both cores, ``python train.py`` with ``synk.fork(2)``
  (no mpiexec: what a user runs on one machine; ``mpiexec -n 1`` is the same
  code path, since a one-process job is not a cluster);
- 2x1: two machines with a core each, ``mpiexec -n 2`` (MPICH, TCP over the
  machines' veth links and bridge) with ``synk.fork(1)`` on each, its links
  unlimited ("none") or shaped with ``tc tbf`` to each rate of ``--rates``
  (bucket ``--burst``: "auto" is 1 ms at the rate; Machines.limit's 64 KiB
  lets a "10gbit" link carry only ~4 Gbit/s here).  Each link is checked
  once with one TCP stream (printed), and each round also times bare mpi4py
  ``Allreduce`` of a buffer the gradient's size among the same two machines.

The jobs alternate over ``--rounds`` rounds (1x2 first in even rounds, last in
odd ones).  Each job times ``--steps`` steps one by one after 3 warm-up steps,
then, apart from the timed steps: the gradient function alone (``f_grad``:
gather + compute), the all-reduce of the flat gradient alone, and a
``synk.profile()`` of 10 steps (per rank: control, gather, compute,
collective, wait).  ``--batch`` changes the rows per step (compute grows
with it, the gradient's bytes do not); ``--root TREE`` imports synkhronos
from another tree (e.g. ``git archive`` of a commit) to compare versions.

Before each job the parent waits (``--quiet-wait``) until the host's cores are
idle, and it measures the share of the cores something else used during the
job (busy CPU time less the job's own); rounds with 10% or more of it are
marked and left out of the medians (unless every round has it).

Printed: per configuration the median step time over the quiet rounds,
samples/s, the per-round samples/s, the ratio (2x1)/(1x2) of samples/s
(target >= 0.9x on 10gbit, issue 24), f_grad alone, synk all_reduce alone and
bare MPI Allreduce, then where a step's time goes.  ``--variants`` adds the
same runs with ``make_train_function(overlap=True)`` ("overlap": each step
all-reduces the previous step's gradient while computing its own) or with
``all_reduce_dtype="bfloat16"`` ("bfloat16": half the bytes on the link).
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

from common import (BATCH, LAYERS, N_DATA, ROOT, Foreign, build_mlp, burst_for, harness, link_gbit,
                    shape, wait_quiet)

WARMUP = 3
PROFILED = 10


def _emit(obj):
    print("JSON " + json.dumps(obj), flush=True)


def _per_call(fn, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# ---- the job (on the machines) ----------------------------------------------------------
VARIANTS = {"plain": {}, "overlap": {"overlap": True},
            "bfloat16": {"all_reduce_dtype": "bfloat16"}}


def job(n_local, steps, variant, batch=None):
    """fork(n_local) (per MPI process under mpiexec), train, time; the controller prints JSON."""
    import numpy as np

    import synkhronos as synk
    from synkhronos.extensions import make_train_function

    batch = batch or BATCH

    synk.fork(n_local, use_gpu=False)
    try:
        layout = synk.layout()
        x, y, params, loss = build_mlp(np.random.default_rng(1))
        step = make_train_function(loss, params, x, y, update_kwargs={"learning_rate": 0.01},
                                   **VARIANTS[variant])
        synk.distribute()
        rng = np.random.default_rng(0)
        data_x = rng.normal(size=(N_DATA, LAYERS[0])).astype("float32")
        data_y = rng.integers(0, LAYERS[-1], N_DATA).astype("int32")
        xd, yd = synk.data(data_x), synk.data(data_y)

        def one():
            step(xd, yd, batch=rng.integers(0, N_DATA, batch))
        _per_call(one, WARMUP)
        t_step = _per_call(one, steps)
        step.flush()
        # The parts of a step, apart: gather + compute, then the all-reduce alone.
        t_grad = _per_call(lambda: step.f_grad(xd, yd, batch=rng.integers(0, N_DATA, batch)),
                           max(steps // 2, 5))
        dtype = VARIANTS[variant].get("all_reduce_dtype")
        t_ar = _per_call(lambda: synk.all_reduce(step.grad_shared, op="sum", dtype=dtype),
                         max(steps // 2, 5))
        with synk.profile() as prof:
            _per_call(one, PROFILED)
            step.flush()
        totals = {str(r): per for r, per in prof.totals().items()}
        n_grad = int(step.grad_shared.get_value(borrow=True).size)
        _emit({"step": t_step, "grad": t_grad, "all_reduce": t_ar, "profile": totals,
               "batch": batch, "layers": list(LAYERS), "grad_values": n_grad,
               "layout": f"{layout.n_machines} machine(s) x {layout.n_local} ranks",
               "affinity": sorted(os.sched_getaffinity(0)), "synk": synk.__file__})
    finally:
        synk.close()


def job_bare(steps):
    """Bare mpi4py Allreduce (sum) of a float32 buffer the size of the flat gradient."""
    import numpy as np
    from mpi4py import MPI

    n = sum(a * b + b for a, b in zip(LAYERS[:-1], LAYERS[1:]))
    comm = MPI.COMM_WORLD
    src = np.ones(n, "float32")
    dst = np.empty_like(src)
    for _ in range(WARMUP):
        comm.Allreduce(src, dst, op=MPI.SUM)
    comm.Barrier()
    times = _per_call(lambda: comm.Allreduce(src, dst, op=MPI.SUM), steps)
    if comm.Get_rank() == 0:
        _emit({"bare": times})


# ---- the parent (on the host) -----------------------------------------------------------
def _job_args(kind, steps, variant="plain"):
    return [os.path.abspath(__file__), "--job", kind, "--steps", str(steps), "--variants",
            variant] + (["--batch", str(_BATCH[0])] if _BATCH[0] else [])


_BATCH = [None]   # --batch, for the jobs


def _parse(name, rc, out):
    lines = [ln for ln in out.splitlines() if ln.startswith("JSON ")]
    if rc != 0 or not lines:
        sys.exit(f"{name} job failed (exit {rc}):\n{out[-4000:]}")
    return json.loads(lines[-1][5:])


def _pythonpath(root):
    return os.pathsep.join([root or ROOT, ROOT] + [p for p in [os.environ.get("PYTHONPATH")]
                                                    if p])


def run_one_machine(m1, steps, variant, root=None):
    """python job on the one machine (both cores), no mpiexec."""
    env = dict(os.environ, PYTHONPATH=_pythonpath(root))
    env.pop("SYNK_CLUSTER", None)
    p = m1.popen(0, [sys.executable, *_job_args("2", steps, variant)],
                 cwd=harness("cluster_jobs").TESTS, env=env,
                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        sys.exit(f"1x2 job ran past 900 s:\n{out[-4000:]}")
    return _parse("1x2", p.returncode, out)


def run_two_machines(m2, kind, steps, variant="plain", root=None):
    mpirun = harness("cluster_jobs").mpirun
    rc, out, _ = mpirun(m2, 2, _job_args(kind, steps, variant), timeout=900,
                        PYTHONPATH=_pythonpath(root))
    return _parse(f"2x1 job {kind}", rc, out)


def run_two_machines_elastic(m2, steps, variant="plain", root=None):
    """The 2x1 job on machines started on their own (SYNK_LISTEN / SYNK_JOIN, gloo), no mpiexec."""
    Job = harness("elastic_jobs").Job
    args = _job_args("1", steps, variant)
    job = Job(m2, args[1:], 2, script=args[0], SYNK_SPIN_S=None, PYTHONPATH=_pythonpath(root))
    try:
        job.join(1)
        rc = job.wait(900)
    finally:
        job.close()
    return _parse("2x1 elastic", rc, job.out)


def _fmt(t):
    return f"{t * 1e3:.1f} ms"


def _breakdown(res_list):
    """Mean ms per step by category, per rank, over the profiled steps of every round."""
    acc = {}
    for res in res_list:
        for rank, per in res["profile"].items():
            for what, row in per.items():
                a = acc.setdefault((rank, what), {})
                for k, v in row.items():
                    a[k] = a.get(k, 0) + v
    out = []
    for (rank, what), row in sorted(acc.items()):
        n = row["calls"]
        cats = [c for c in ("control", "gather", "compute", "collective", "wait", "reduce")
                if row.get(c, 0) / n > 5e-5]
        out.append(f"rank {rank} {what} x{n // len(res_list)}: " + ", ".join(
            f"{c} {1e3 * row[c] / n:.1f}" for c in cats) + f", wall {1e3 * row['wall'] / n:.1f}"
            " ms")
    return out


FOREIGN_MAX = 0.10


def _quiet(rs):
    """The rounds with little foreign CPU (< FOREIGN_MAX), or all if none."""
    q = [res for res in rs if res.get("foreign", 0) < FOREIGN_MAX]
    return q or rs


def _median(rs, key):
    return statistics.median(t for res in _quiet(rs) for t in res[key])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="none,10gbit,1gbit")
    ap.add_argument("--burst", default="auto",
                    help="tc tbf bucket: 'auto' (1 ms at the rate, >= 64 KiB) or a tc size")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--variants", default="plain",
                    help="training steps to run, of: " + ", ".join(VARIANTS))
    ap.add_argument("--root", default=None,
                    help="import synkhronos from this tree (e.g. a `git archive` of a commit)")
    ap.add_argument("--batch", type=int, default=None,
                    help="rows per step (default: scaling.py's, 512)")
    ap.add_argument("--quiet-wait", type=float, default=300,
                    help="seconds to wait before a job for the host to be idle")
    ap.add_argument("--elastic", action="store_true",
                    help="also 2x1 on machines started on their own (gloo, unlimited link)")
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job == "bare":
        return job_bare(args.steps)
    if args.job is not None:
        return job(int(args.job), args.steps, args.variants, args.batch)
    cluster_jobs = harness("cluster_jobs")
    FLAVOR, NO_MACHINES = cluster_jobs.FLAVOR, cluster_jobs.NO_MACHINES
    # Killed (SIGTERM): unwind, so the machines' teardown leaves no namespace or process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    Machines = harness("machines").Machines
    if NO_MACHINES or not FLAVOR:
        sys.exit(f"bench/cluster_train.py: {NO_MACHINES or 'no mpiexec'}")
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("bench/cluster_train.py: needs 2 cores (one per machine)")
    rates = args.rates.split(",")
    _BATCH[0] = args.batch
    variants = args.variants.split(",")
    if any(v not in VARIANTS for v in variants):
        sys.exit(f"--variants: each of {', '.join(VARIANTS)}")
    print(f"# {FLAVOR} (TCP over veth + bridge), {os.cpu_count()} cores, "
          f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {args.rounds} rounds x "
          f"{args.steps} steps, load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"# synkhronos from {args.root or 'this working tree'}", flush=True)
    got = {}   # (config, variant) -> [result per round]; (config, "bare") -> [...]
    links = {}
    t_start = time.monotonic()
    with Machines(1) as m1, Machines(2, cores=sorted(os.sched_getaffinity(0))[:2]) as m2:
        print(f"# 1x2: machine cores {m1.cores[0]}; 2x1: machine cores {m2.cores}", flush=True)
        for rate in rates:
            shape(m2, rate, args.burst)
            links[rate] = link_gbit(m2, rate)
            print(f"# link {rate}" + ("" if rate == "none" else
                                       f" (tbf burst {burst_for(rate, args.burst)} B)")
                  + f": one TCP stream carries {links[rate]:.2f} Gbit/s", flush=True)
        for r in range(args.rounds):
            configs = ["1x2"] + [f"2x1 {rate}" for rate in rates] + (
                ["2x1 elastic"] if args.elastic else [])
            if r % 2:
                configs.reverse()
            for c in configs:
                if c == "2x1 elastic":
                    shape(m2, "none", args.burst)
                elif c != "1x2":
                    shape(m2, c.split()[1], args.burst)
                    wait_quiet(args.quiet_wait)
                    with Foreign() as fg:
                        res = run_two_machines(m2, "bare", args.steps)
                    res["foreign"] = fg.share
                    got.setdefault((c, "bare"), []).append(res)
                for ov in variants:
                    busy = wait_quiet(args.quiet_wait)
                    with Foreign() as fg:
                        if c == "1x2":
                            res = run_one_machine(m1, args.steps, ov, args.root)
                        elif c == "2x1 elastic":
                            res = run_two_machines_elastic(m2, args.steps, ov, args.root)
                        else:
                            res = run_two_machines(m2, "1", args.steps, ov, args.root)
                    res["foreign"] = fg.share
                    got.setdefault((c, ov), []).append(res)
                    print(f"# round {r}: {c}{'' if ov == 'plain' else ' ' + ov}: median step "
                          f"{_fmt(statistics.median(res['step']))}, host busy before "
                          f"{busy:.0%}, foreign CPU during {fg.share:.0%} ({res['layout']}, "
                          f"{res['synk']})", flush=True)
    load_end = os.getloadavg()[0]
    first = got[("1x2", variants[0])][0]
    batch = first["batch"]
    configs = ["1x2"] + [f"2x1 {rate}" for rate in rates] + (
        ["2x1 elastic"] if args.elastic else [])
    print(f"\n# MLP {'-'.join(map(str, first['layers']))}, batch {batch}, SGD, float32, "
          f"flat gradient {first['grad_values'] * 4 / 2**20:.1f} MiB; {args.rounds} rounds, "
          f"{time.monotonic() - t_start:.0f} s, load at the end {load_end:.2f}")
    print("| config | link (measured) | step | median step | samples/s | per-round samples/s "
          "| (2x1)/(1x2) | vs 1x2 plain | f_grad alone | synk all_reduce alone "
          "| bare MPI Allreduce |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    plain = batch / _median(got[("1x2", variants[0])], "step")
    for ov in variants:
        base = batch / _median(got[("1x2", ov)], "step")
        for c in configs:
            rs = got[(c, ov)]
            med = _median(rs, "step")
            rate = batch / med
            rounds = ", ".join(f"{batch / statistics.median(res['step']):.0f}"
                               + ("" if res["foreign"] < FOREIGN_MAX else
                                  f" ({res['foreign']:.0%} foreign)") for res in rs)
            ratio = "-" if c == "1x2" else f"{rate / base:.2f}x"
            vs_plain = f"{rate / plain:.2f}x"
            if c == "1x2":
                name, link, bare = c, "- (shared memory)", "-"
            elif c == "2x1 elastic":
                name, bare = "2x1, machines on their own (gloo)", "-"
                link = f"none ({links['none']:.1f} Gbit/s)" if "none" in links else "none"
            else:
                name, link = c.split()
                link = f"{link} ({links[link]:.1f} Gbit/s)"
                bare = _fmt(_median(got[(c, "bare")], "bare"))
            print(f"| {name} | {link} | {ov} | {_fmt(med)} | {rate:.0f} | "
                  f"{rounds} | {ratio} | {vs_plain} | {_fmt(_median(rs, 'grad'))} | "
                  f"{_fmt(_median(rs, 'all_reduce'))} | {bare} |")
    for ov in variants:
        for c in configs:
            quiet = _quiet(got[(c, ov)])
            print(f"\nwhere a step goes, {c}{'' if ov == 'plain' else ' ' + ov} (synk.profile, mean ms "
                  f"per call over {PROFILED} steps x {len(quiet)} rounds):")
            for line in _breakdown(quiet):
                print("  " + line)
    if "10gbit" in rates:
        print()
        for ov in variants:
            ratio = (_median(got[("1x2", variants[0])], "step")
                     / _median(got[("2x1 10gbit", ov)], "step"))
            print(f"target (2x1 {ov} on 10gbit >= 0.9x of 1x2 {variants[0]}): "
                  f"{ratio:.2f}x, {'met' if ratio >= 0.9 else 'missed'}")


if __name__ == "__main__":
    main()
