"""Where each microsecond of a tiny call and a 4-byte all_reduce goes, on the master and a rank.

    python bench/breakdown.py [--ranks 2] [--calls 20000] [--rounds 5]

Two child processes, one after the other, each forking ``--ranks`` ranks:

1. untraced: a tiny call (``synk.function`` of ``(x * 2).sum()`` on an 8x4
   float32 Data) and a 4-byte ``synk.all_reduce`` against the bare PyTensor
   call of the same graph (default, and with ``trust_input``) and against
   MPICH's ``Allreduce`` of 4 bytes between two processes (mpi4py, when
   installed), rounds alternating, best and median of the per-round means;
2. traced (``SYNK_TRACE=1``, synkhronos/runtime/trace.py): after every
   command, the stamps each process left at each phase, on one clock, cut
   into intervals; medians over the calls.  Stamps cost about 0.1 us each, so
   the traced total is a little above the untraced one.

The phases, in the order one command passes them:

    master  entry -> checked (arguments and plan) -> posted (message out)
            -> share_start -> share_done (its own PyTensor call or reduction)
            -> waited (every rank done) -> combined (outputs reduced) -> return
    rank    woke (saw the message) -> share_start (message read, inputs mapped)
            -> share_done -> finished (its result left, done flag next)

Before and after a change: run it in both trees (``PYTHONPATH=TREE``), or
through ``bench/before_after.py``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from common import mpich_4b


def _rounds(fns, n, rounds):
    out = [[] for _ in fns]
    for _ in range(rounds):
        for fn, times in zip(fns, out):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t0) / n * 1e6)
    return out


def _setup(ranks):
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk

    x = pt.matrix("x", dtype="float32")
    bare = pytensor.function([x], (x * 2).sum())
    trusted = pytensor.function([x], (x * 2).sum())
    trusted.trust_input = True
    synk.fork(ranks, use_gpu=False)
    f = synk.function([x], (x * 2).sum())
    s = pytensor.shared(np.ones(1, "float32"), name="s")
    synk.function([], s.sum())
    synk.distribute()
    a = np.random.default_rng(0).random((8, 4), dtype=np.float32)
    d = synk.data(a)
    return synk, bare, trusted, f, s, a, d


def untraced(ranks, calls, rounds):
    synk, bare, trusted, f, s, a, d = _setup(ranks)
    fns = [lambda: bare(a), lambda: trusted(a), lambda: f(d),
           lambda: synk.all_reduce(s, op="sum")]
    for fn in fns:
        for _ in range(1000):
            fn()
    got = _rounds(fns, calls, rounds)
    synk.close()
    names = ("bare", "bare_trusted", "call", "all_reduce")
    return {k: (min(v), statistics.median(v)) for k, v in zip(names, got)}


def traced(ranks, calls):
    from synkhronos.runtime import trace

    synk, bare, trusted, f, s, a, d = _setup(ranks)
    out = {}
    for name, fn in (("call", lambda: f(d)), ("all_reduce", lambda: synk.all_reduce(s, op="sum"))):
        for _ in range(1000):
            fn()
        rows = []
        clock = time.perf_counter_ns
        for _ in range(calls):
            trace.clear(ranks)
            t0 = clock()
            fn()
            t1 = clock()
            st = trace.snapshot(ranks)
            rows.append((t0, t1, st))
        out[name] = _intervals(rows, ranks)
    synk.close()
    return out


# (label, where, from, to): "m" the master's row, "r" each rank's; "entry"/"return" the
# caller's own clock around the call.
INTERVALS = (
    ("master: entry -> checked (arguments, plan)", "m", "entry", "checked"),
    ("master: checked -> posted (message out)", "m", "checked", "posted"),
    ("master: posted -> its share starts", "m", "posted", "share_start"),
    ("master: its share (PyTensor call / reduction)", "m", "share_start", "share_done"),
    ("master: share done -> every rank done (wait)", "m", "share_done", "waited"),
    ("master: waited -> outputs combined", "m", "waited", "combined"),
    ("master: combined -> return", "m", "combined", "return"),
    ("rank: master posted -> rank woke", "r", "m.posted", "woke"),
    ("rank: woke -> its share starts (read, map)", "r", "woke", "share_start"),
    ("rank: its share (PyTensor call / reduction)", "r", "share_start", "share_done"),
    ("rank: share done -> finished (result left)", "r", "share_done", "finished"),
    ("rank: finished -> master saw every rank done", "r", "finished", "m.waited"),
)


def _intervals(rows, ranks):
    from synkhronos.runtime.trace import PHASES

    col = {p: i for i, p in enumerate(PHASES)}
    res = {}
    totals = [(t1 - t0) / 1e3 for t0, t1, _ in rows]
    res["total"] = statistics.median(totals)
    for label, where, a, b in INTERVALS:
        vals = []
        for t0, t1, st in rows:
            m = st[0]

            def at(name, row):
                if name == "entry":
                    return t0
                if name == "return":
                    return t1
                if name.startswith("m."):
                    return m[col[name[2:]]]
                return row[col[name]]
            targets = [m] if where == "m" else list(st[1:])
            for row in targets:
                x, y = at(a, row), at(b, row)
                if x and y:
                    vals.append((y - x) / 1e3)
        res[label] = statistics.median(vals) if vals else float("nan")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--child", choices=("untraced", "traced"))
    args = ap.parse_args()
    if args.child == "untraced":
        print("JSON", json.dumps(untraced(args.ranks, args.calls, args.rounds)))
        return
    if args.child == "traced":
        print("JSON", json.dumps(traced(args.ranks, args.calls)))
        return

    def child(kind, trace):
        env = dict(os.environ, SYNK_TRACE="1" if trace else "0")
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kind,
                              "--ranks", str(args.ranks), "--calls", str(args.calls),
                              "--rounds", str(args.rounds)], env=env, capture_output=True,
                             text=True, timeout=1800)
        for line in out.stdout.splitlines():
            if line.startswith("JSON "):
                return json.loads(line[5:])
        raise RuntimeError(f"{kind} child failed:\n{out.stdout}\n{out.stderr}")

    plain = child("untraced", False)
    mpi = mpich_4b(args.calls, args.rounds)
    if mpi is not None:
        mpi = (min(mpi), statistics.median(mpi))
    parts = child("traced", True)
    import synkhronos
    print(f"# bench/breakdown.py, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, {args.ranks} ranks, "
          f"synkhronos from {os.path.dirname(synkhronos.__file__)}")
    print("\n| untraced, us per call | best | median | ratio (median) |")
    print("|---|---|---|---|")
    b = plain["bare"][1]
    rows = [("bare PyTensor call", plain["bare"], 1.0),
            ("bare PyTensor call, trust_input", plain["bare_trusted"], plain["bare_trusted"][1] / b),
            ("synk call", plain["call"], plain["call"][1] / b)]
    for label, (best, med), ratio in rows:
        print(f"| {label} | {best:.2f} | {med:.2f} | {ratio:.2f}x bare |")
    ar = plain["all_reduce"]
    if mpi is not None:
        print(f"| MPICH Allreduce 4 B, 2 processes | {mpi[0]:.2f} | {mpi[1]:.2f} | 1.00x MPICH |")
        print(f"| synk.all_reduce 4 B | {ar[0]:.2f} | {ar[1]:.2f} | {ar[1] / mpi[1]:.2f}x MPICH |")
    else:
        print(f"| synk.all_reduce 4 B | {ar[0]:.2f} | {ar[1]:.2f} | (no MPICH here) |")
    for name in ("call", "all_reduce"):
        res = parts[name]
        print(f"\n| traced {name}: phase | us (median) |")
        print("|---|---|")
        print(f"| total, traced | {res['total']:.2f} |")
        for label, *_ in INTERVALS:
            print(f"| {label} | {res[label]:.2f} |")


if __name__ == "__main__":
    main()
