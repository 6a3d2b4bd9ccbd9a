"""The headline ratios measured quiet and beside busy processes, alternating, in one run.

    python bench/busy.py [--rounds 15] [--busy 1] [--rows 10000,100000] [--parts pymc,calls] [--raw]

Per round, each state in turn: ``quiet``, then ``busy`` (``--busy`` processes
spinning ``while True: pass``, not pinned, started before and killed after the
state's measurements):

  pymc   PyMC's logistic regression (5 covariates, ``pm.Data``): (logp, dlogp) on
         2 ranks (``dp.logp_dlogp``) with chunks (this tree's default) and with
         the static split (``SYNK_CHUNK_ROWS=0``, what the tree did before chunks),
         against PyMC's serial call in a process of its own, not pinned, with one
         BLAS thread (its best beside a busy core; the default two threads are
         shown too): each in a child process of its own, at every ``--rows``.
         The ceiling: two serial processes (1 BLAS thread) at once, each on half
         the rows, timed over the same wall-clock window, no communication; their
         rows per second together over the serial process's is what any split of
         the call across two processes could reach in that state (beside a busy
         process on 2 cores, three runnable threads share two cores: about 4/3).
  calls  bench/call_overhead.py: a tiny call against the bare PyTensor call, a
         4-byte all_reduce against MPICH's, the MLP's fused step against the
         serial step on one BLAS thread (one run per state every 5 rounds).

``BUSY_VARIANTS="name:VAR=value,VAR=value;..."`` adds data-parallel children run with
those settings (``SYNK_CHUNK_ROWS=2500``, ``SYNK_SPIN_S=0``) beside the others.

Ratios above 1 are synkhronos faster than its baseline (the tiny call's and the
all_reduce's are times over the baseline's: lower is better).  The CPU model
comes first: figures differ between VM kinds.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from common import cpu_model

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CALL_PATTERNS = {
    "tiny call / bare (x)": r"^ratio\s+([\d.]+)x",
    "tiny call overhead (us)": r"^overhead\s+(-?[\d.]+) us",
    "4 B all_reduce / MPICH (x)": r"^(?:== all_reduce.*\n(?:.*\n)*?)ratio\s+([\d.]+)x",
    "MLP fused / serial 1 thread (x)": r"^fused vs 1 thread\s+([\d.]+)x",
}


def child_pymc(n_rows, which):
    """Serve timing requests: each stdin line ``calls`` runs them and prints microseconds per call.

    The children of one row count stay alive side by side, each idle (blocked on its
    pipe) while another measures, so that their rounds alternate finely.
    """
    from common import flat_point, logistic, quiet, serial_pair
    quiet()
    model = logistic(n_rows)
    q = flat_point(model)
    if which == "dp":
        import synkhronos as synk
        from synkhronos.extensions import pymc as synk_pymc
        synk.fork(int(os.environ.get("BUSY_RANKS", "2")))
        dp = synk_pymc.data_parallel(model)
        synk.distribute()
        dp.scatter()
        f = lambda: dp.logp_dlogp(q)  # noqa: E731
    else:
        fn = serial_pair(model)
        f = lambda: fn(q)  # noqa: E731
    for _ in range(20):
        f()
    print("READY", flush=True)
    for line in sys.stdin:
        if line.startswith("until"):
            # The ceiling's halves: calls until a wall-clock deadline both share, so
            # that neither runs any part of its window alone.
            start, end = (float(x) for x in line.split()[1:])
            while time.time() < start:
                pass
            n = 0
            while time.time() < end:
                f()
                n += 1
            print(json.dumps((end - start) / max(n, 1) * 1e6), flush=True)
            continue
        calls = int(line)
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        print(json.dumps((time.perf_counter() - t0) / calls * 1e6), flush=True)


class Child:
    """A timing child (``child_pymc``) started once, asked for a round at a time."""

    def __init__(self, args, env):
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", *args],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=env)
        line = self.p.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(f"child {args} did not start: {line!r}")

    def round(self, calls):
        self.p.stdin.write(f"{calls}\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def ask(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def answer(self):
        return json.loads(self.p.stdout.readline())

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=60)


class Pair:
    """The ceiling: two serial children on half the rows each, timed over one window.

    ``round`` returns the microseconds per call of the whole rows that the two
    halves' throughput together amounts to, comparable with a serial call's.
    """

    def __init__(self, n, env):
        self.halves = [Child(["pymc", str(n // 2), "serial"], env) for _ in range(2)]

    def round(self, calls, per_call_us):
        start = time.time() + 0.02
        end = start + calls * per_call_us * 1e-6
        for h in self.halves:
            h.ask(f"until {start} {end}")
        us = [h.answer() for h in self.halves]
        rows_per_us = sum(0.5 / u for u in us)     # whole calls' worth of rows per us
        return 1 / rows_per_us

    def close(self):
        for h in self.halves:
            h.close()


def _calls(env):
    p = subprocess.run([sys.executable, os.path.join(HERE, "call_overhead.py"), "--steps", "8",
                        "--calls", "3000"], capture_output=True, text=True, env=env, timeout=900)
    got = {}
    for name, pattern in CALL_PATTERNS.items():
        m = re.search(pattern, p.stdout, re.M)
        got[name] = float(m.group(1)) if m else None
    return got


PYMC_KINDS = ("serial 1 thread", "serial default threads", "dp chunks", "dp static split")
CEILING = "ceiling: 2 serial processes, half the rows each"


def _env():
    """This tree first on the children's path."""
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _pymc_children(n):
    base = _env()
    one = dict(base, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    envs = {"serial 1 thread": ("serial", one), "serial default threads": ("serial", base),
            "dp chunks": ("dp", base), "dp static split": ("dp", dict(base, SYNK_CHUNK_ROWS="0"))}
    for extra in os.environ.get("BUSY_VARIANTS", "").split(";"):
        if extra:
            name, _, sets = extra.partition(":")
            envs[name] = ("dp", dict(base, **dict(kv.split("=") for kv in sets.split(","))))
    children = {k: Child(["pymc", str(n), which], env) for k, (which, env) in envs.items()}
    children[CEILING] = Pair(n, one)
    return children


def _busy(n):
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    time.sleep(0.3)
    return procs


def _stop(procs):
    for q in procs:
        q.kill()
        q.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--busy", type=int, default=1, help="busy processes in the busy state")
    p.add_argument("--rows", default="10000,100000")
    p.add_argument("--parts", default="pymc,calls")
    p.add_argument("--raw", action="store_true", help="print every round's figures too")
    p.add_argument("--child", nargs="*")
    args = p.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "pymc":
            child_pymc(int(rest[0]), rest[1])
        return
    rows = [int(r) for r in args.rows.split(",")]
    parts = args.parts.split(",")
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, {cpu_model()}, {os.cpu_count()} cores, "
          f"{args.rounds} rounds per state, busy = {args.busy} spinning process(es)", flush=True)
    print("\n| figure | quiet | beside busy |\n| --- | --- | --- |", flush=True)
    for n in rows if "pymc" in parts else ():
        children = _pymc_children(n)
        calls = max(10, int(0.15 / (n * 60e-9)))  # about 0.15 s of serial calls a round
        got = {s: {k: [] for k in children} for s in ("quiet", "busy")}
        try:
            order = list(children)
            for r in range(args.rounds):
                for state in ("quiet", "busy"):
                    procs = _busy(args.busy) if state == "busy" else []
                    try:
                        # A new order each round, and a pause before each child: OpenBLAS's
                        # threads spin a while after a call (2^28 cycles, about 0.1 s) and
                        # slowed whichever child came next (with 0.05 s, the one after the
                        # serial call on default threads took 3.1 ms at 10^5 rows, 2.3 alone).
                        for k in order[r % len(order):] + order[:r % len(order)]:
                            time.sleep(0.3)
                            if k == CEILING:
                                last = got[state]["serial 1 thread"]
                                got[state][k].append(children[k].round(
                                    calls, last[-1] if last else 60e-3 * n))
                            else:
                                got[state][k].append(children[k].round(calls))
                    finally:
                        _stop(procs)
        finally:
            for c in children.values():
                c.close()
        med = {s: {k: statistics.median(v) for k, v in got[s].items()} for s in got}
        if args.raw:
            print(json.dumps({s: {k: [round(x) for x in v] for k, v in got[s].items()} for s in got}))
        for k in children:
            print(f"| PyMC (logp, dlogp), {n} rows: {k}, us (median) | {med['quiet'][k]:.0f} | "
                  f"{med['busy'][k]:.0f} |")
        for k in [k for k in children if k not in PYMC_KINDS[:2]]:
            r = {s: statistics.median([a / b for a, b in zip(got[s]["serial 1 thread"], got[s][k])])
                 for s in got}
            print(f"| {n} rows: PyMC serial (1 thread) / {k} (x, median of paired rounds) | "
                  f"{r['quiet']:.2f} | {r['busy']:.2f} |", flush=True)
    if "calls" in parts:
        base = _env()
        got = {"quiet": [], "busy": []}
        for _ in range(max(1, args.rounds // 5)):
            for state in ("quiet", "busy"):
                procs = _busy(args.busy) if state == "busy" else []
                try:
                    got[state].append(_calls(base))
                finally:
                    _stop(procs)
        for k in CALL_PATTERNS:
            v = {s: [g[k] for g in got[s] if g[k] is not None] for s in got}
            print(f"| {k} | " + " | ".join(f"{statistics.median(v[s]):.2f}" if v[s] else "-"
                                            for s in ("quiet", "busy")) + " |", flush=True)


if __name__ == "__main__":
    main()
