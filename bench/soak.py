"""Soak: many calls, each with a fresh Data object; resources must stay flat.

Prints, for the master and every worker, resident memory (RSS) and open file
descriptors, and the run's shared-memory segments in /dev/shm, before and
after N calls (default 10^5) that each make a new ``synk.data`` and drop it;
then the calls per second.  Before synkhronos freed dropped Data, each call
leaked one segment and one descriptor per rank (``OSError: Too many open
files`` after about 1000 steps under ``ulimit -n 1024``).

Usage: python bench/soak.py [--calls N] [--n-parallel N]
"""

import argparse
import os
import platform
import time

import numpy as np
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.runtime.state import get_runtime


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def snapshot(pids):
    return {
        "rss": [rss_mb(p) for p in pids],
        "fds": [len(os.listdir(f"/proc/{p}/fd")) for p in pids],
        "segments": len([n for n in os.listdir("/dev/shm")
                         if n.startswith(f"synk_{os.getpid()}_")]),
    }


def show(label, snap):
    rss = " ".join(f"{r:.0f}" for r in snap["rss"])
    fds = " ".join(str(n) for n in snap["fds"])
    print(f"{label:>7}: RSS MB per rank [{rss}]  fds per rank [{fds}]  "
          f"segments {snap['segments']}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=100_000)
    p.add_argument("--n-parallel", type=int, default=2)
    args = p.parse_args()
    print(f"soak: {args.calls} calls with a fresh Data each, {args.n_parallel} ranks, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{time.strftime('%Y-%m-%d')}")
    synk.fork(args.n_parallel, use_gpu=False)
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(axis=0), "sum"))
    synk.distribute()
    pids = [os.getpid()] + [proc.pid for proc in get_runtime().processes.procs.values()]
    rows = np.ones((8, 4))
    for _ in range(100):  # warm up: compile, grow the message area, settle the caches
        f(synk.data(rows))
    before = snapshot(pids)
    t0 = time.perf_counter()
    for step in range(args.calls):
        out = f(synk.data(rows))
        if step % 10_000 == 0:
            assert out[0] == 8.0
    dt = time.perf_counter() - t0
    f(synk.data(rows))  # the workers unmap what the last calls dropped
    after = snapshot(pids)
    show("before", before)
    show("after", after)
    print(f"{args.calls / dt:.0f} calls/s (each with synk.data + call); "
          f"fds {'flat' if after['fds'] == before['fds'] else 'CHANGED'}, "
          f"segments {'flat' if after['segments'] == before['segments'] else 'CHANGED'}")
    synk.close()


if __name__ == "__main__":
    main()
