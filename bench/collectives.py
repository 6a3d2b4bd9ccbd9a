"""Collective latency and bandwidth: synkhronos backends vs. MPICH, gloo and memcpy.

In one run, for float32 shared variables of 4 B, 4 KB, 1 MB, 16 MB, 64 MB and
256 MB on 2 ranks: all_reduce (sum), broadcast and gather (nd_up=1) through
each synkhronos backend, the same three with MPICH (mpi4py ``Allreduce``,
``Bcast``, ``Gather``, 2 processes under ``mpiexec``, pinned like the
synkhronos ranks), with torch.distributed (gloo, 2 processes, 1 thread each),
and a one-process NumPy memory copy of the same size (the limit a copy-based
collective can approach).

Each figure is timed repeatedly; "median" and "best" are per-call times.
Bandwidth is the variable's size over the best time (for gather: the bytes
of one rank's variable); "x gloo" and "% memcpy" compare best with best, so
that other jobs on the machine disturb the comparison least.

Usage: python bench/collectives.py [--backends shm,zmq] [--sizes 4,4096,...]
       [--no-torch] [--no-mpi] [--markdown] [--plot PNG]
torch, mpi4py, mpich and matplotlib are bench-only extras: pip install -e ".[bench]".
"""

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

SIZES = [4, 4 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
OPS = ["all_reduce", "broadcast", "gather"]
N_RANKS = 2


def reps_for(nbytes):
    """Fewer repetitions for big sizes keep the run within a few minutes on 2 cores."""
    if nbytes <= 4096:
        return 2000
    if nbytes <= 1 << 20:
        return 200
    if nbytes <= 16 << 20:
        return 20
    if nbytes <= 64 << 20:
        return 8
    return 4


def label(nbytes):
    for unit, div in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= div:
            return f"{nbytes // div} {unit}"
    return f"{nbytes} B"


def time_calls(fn, reps, warmup):
    """Return (best, median) seconds per call.

    Cheap calls are timed in 10 batches (so the clock costs nothing) and the
    batch means are ranked; expensive ones call by call.  The best is the
    least disturbed figure on a machine shared with other jobs.
    """
    for _ in range(warmup):
        fn()
    if reps >= 100:
        ts = []
        per = reps // 10
        for _ in range(10):
            t0 = time.perf_counter()
            for _ in range(per):
                fn()
            ts.append((time.perf_counter() - t0) / per)
    else:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return min(ts), statistics.median(ts)


# ---- synkhronos ----------------------------------------------------------------
def bench_synk(backend, sizes):
    os.environ["SYNK_BACKEND"] = backend
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk

    synk.fork(N_RANKS, use_gpu=False)
    try:
        shareds = [pytensor.shared(np.zeros(max(n // 4, 1), "float32"), name=f"s{n}")
                   for n in sizes]
        synk.function([], [pt.sum(s) for s in shareds])
        synk.distribute()
        out = {}
        for n, s in zip(sizes, shareds):
            reps = reps_for(n)
            warm = max(2, reps // 20)
            calls = {
                "all_reduce": lambda s=s: synk.all_reduce(s, op="sum"),
                "broadcast": lambda s=s: synk.broadcast(s),
                "gather": lambda s=s: synk.gather(s, nd_up=1),
            }
            for op in OPS:
                out[(op, n)] = time_calls(calls[op], reps, warm)
        return out
    finally:
        synk.close()


# ---- torch.distributed gloo ----------------------------------------------------------
def _gloo_worker(rank, port, sizes, queue):
    import torch
    import torch.distributed as dist

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % os.cpu_count()]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=N_RANKS)
    out = {}
    for n in sizes:
        t = torch.zeros(max(n // 4, 1), dtype=torch.float32)
        bufs = [torch.empty_like(t) for _ in range(N_RANKS)] if rank == 0 else None
        reps = reps_for(n)
        warm = max(2, reps // 20)
        calls = {
            "all_reduce": lambda: dist.all_reduce(t),
            "broadcast": lambda: dist.broadcast(t, 0),
            "gather": lambda: dist.gather(t, bufs, dst=0),
        }
        for op in OPS:
            dist.barrier()
            # Every rank runs the same count, so the collectives pair up.
            out[(op, n)] = time_calls(calls[op], reps, warm)
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def bench_gloo(sizes):
    import socket

    import torch  # noqa: F401 - fail here, not in the children, if it is missing

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, port, sizes, queue))
             for r in range(N_RANKS)]
    for p in procs:
        p.start()
    out = queue.get(timeout=900)
    for p in procs:
        p.join(60)
    return out


def _mpi_worker(sizes):
    """Run under mpiexec: time Allreduce, Bcast and Gather; rank 0 prints the figures as JSON."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % os.cpu_count()]})
    out = {}
    for n in sizes:
        t = np.zeros(max(n // 4, 1), "float32")
        r = np.empty_like(t)
        g = np.empty((comm.Get_size(),) + t.shape, t.dtype) if rank == 0 else None
        reps = reps_for(n)
        warm = max(2, reps // 20)
        calls = {
            "all_reduce": lambda: comm.Allreduce(t, r, op=MPI.SUM),
            "broadcast": lambda: comm.Bcast(t, root=0),
            "gather": lambda: comm.Gather(t, g, root=0),
        }
        for op in OPS:
            comm.Barrier()
            out[f"{op} {n}"] = time_calls(calls[op], reps, warm)
    if rank == 0:
        print(json.dumps(out), flush=True)


def bench_mpi(sizes):
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep
                           + os.environ.get("PATH", ""))
    if mpiexec is None:
        raise ImportError("no mpiexec")
    import mpi4py  # noqa: F401 - fail here, not under mpiexec, if it is missing

    cmd = [mpiexec, "-n", str(N_RANKS), sys.executable, os.path.abspath(__file__),
           "--mpi-worker", "--sizes", ",".join(str(s) for s in sizes)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True)
    raw = json.loads(out.stdout.strip().splitlines()[-1])
    return {(key.split()[0], int(key.split()[1])): tuple(v) for key, v in raw.items()}


# ---- memcpy ------------------------------------------------------------------------
def bench_memcpy(sizes):
    out = {}
    for n in sizes:
        src = np.ones(max(n // 4, 1), "float32")
        dst = np.zeros_like(src)
        reps = reps_for(n)
        out[n] = time_calls(lambda: np.copyto(dst, src), reps, max(2, reps // 20))
    return out


# ---- report ------------------------------------------------------------------------
def fmt_time(t):
    return f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"


def report(results, peers, memcpy, sizes, backends, markdown):
    """Print the table; ``peers`` maps "mpich" / "gloo" to their figures (or is empty)."""
    gloo, mpich = peers.get("gloo"), peers.get("mpich")
    cols = ["op", "size", "backend", "median", "best", "GB/s", "x mpich", "x gloo", "% memcpy"]
    rows = []
    for op in OPS:
        for n in sizes:
            nb = max(n, 4)
            entries = [(b, results[b][(op, n)]) for b in backends]
            entries += [(name, figs[(op, n)]) for name, figs in peers.items()]
            for name, (best, med) in entries:
                xm = f"{mpich[(op, n)][0] / best:.2f}" if mpich and name != "mpich" else ""
                xg = f"{gloo[(op, n)][0] / best:.2f}" if gloo and name not in peers else ""
                rows.append([op, label(n), name, fmt_time(med), fmt_time(best),
                             f"{nb / best / 1e9:.2f}", xm, xg,
                             f"{100 * memcpy[n][0] / best:.0f}%"])
    rows += [["memcpy", label(n), "numpy", fmt_time(memcpy[n][1]), fmt_time(memcpy[n][0]),
              f"{max(n, 4) / memcpy[n][0] / 1e9:.2f}", "", "", "100%"] for n in sizes]
    if markdown:
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def plot(results, peers, memcpy, sizes, path):
    """Write all_reduce bandwidth against size, every backend and peer, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    series = {f"synk {b}": figs for b, figs in results.items()} | peers
    for name, figs in series.items():
        ax.plot(sizes, [max(n, 4) / figs[("all_reduce", n)][0] / 1e9 for n in sizes], "o-",
                label=name)
    ax.plot(sizes, [max(n, 4) / memcpy[n][0] / 1e9 for n in sizes], "k--", label="memcpy")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("GB/s (size / best time)")
    ax.set_title(f"all_reduce, {N_RANKS} ranks, float32")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"# wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="shm,zmq")
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-mpi", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--plot", default=None, help="write all_reduce GB/s vs size to this PNG")
    ap.add_argument("--mpi-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.mpi_worker:
        _mpi_worker(sizes)
        return
    backends = args.backends.split(",")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{N_RANKS} ranks, float32")
    t0 = time.perf_counter()
    memcpy = bench_memcpy(sizes)
    results = {b: bench_synk(b, sizes) for b in backends}
    peers = {}
    if not args.no_mpi:
        try:
            peers["mpich"] = bench_mpi(sizes)
        except (ImportError, subprocess.CalledProcessError) as exc:
            print(f"# MPICH not measured ({exc}): pip install -e '.[bench]' (mpi4py, mpich)")
    if not args.no_torch:
        try:
            peers["gloo"] = bench_gloo(sizes)
        except ImportError:
            print("# torch not installed: pip install -e '.[bench]' for the gloo columns")
    report(results, peers, memcpy, sizes, backends, args.markdown)
    if args.plot:
        plot(results, peers, memcpy, sizes, args.plot)
    print(f"# total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
