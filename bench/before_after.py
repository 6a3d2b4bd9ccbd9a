"""Two versions of synkhronos side by side in one run: call overhead, 4 B all_reduce, MLP step.

For a change that should not move the figures (a refactoring), or one that should
move them: check out the version before it somewhere (``git worktree add /tmp/before
<commit>``; a tree with ``setup.py`` gets its C extension built in place first) and run

    python bench/before_after.py --before /tmp/before [--rounds 3] [--cluster 2x1,2x2]

Each round runs bench/call_overhead.py and the 4-byte all_reduce of
bench/collectives.py once with each version, alternating, so both see the
same machine; the figures printed are the medians over the rounds (the best
for the call overhead, as bench/call_overhead.py reports it).  ``--cluster``
adds, per layout (machines x ranks per machine, on simulated machines: root),
bench/cluster_call.py's call with a 1 MB output, tiny call, 10^5-row call, 4-byte all_reduce and
tiny call after a 20 ms pause.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
AFTER = os.path.dirname(HERE)

PATTERNS = {
    "call overhead, best (us)": r"^overhead\s+(-?[\d.]+) us",
    "call overhead, median (us)": r"^overhead\s+-?[\d.]+ us\s+(-?[\d.]+) us",
    "MLP step, 3 commands (samples/s)": r"^synk, 2 ranks, 3 cmds\s+([\d.]+)",
    "MLP step, fused (samples/s)": r"^synk, 2 ranks, fused\s+([\d.]+)",
    "MLP fused vs serial 1 thread (x)": r"^fused vs 1 thread\s+([\d.]+)x",
    "all_reduce 4 B, shm, median (us)": r"^all_reduce\s+4 B\s+shm\s+([\d.]+) us",
    "all_reduce 4 B, shm, best (us)": r"^all_reduce\s+4 B\s+shm\s+[\d.]+ us\s+([\d.]+) us",
}


def run(tree, script, args, timeout):
    env = dict(os.environ, PYTHONPATH=tree)
    if script == "cluster_call.py":
        # Its outer process uses this tree's test helpers; the MPI jobs run ``tree``.
        env = dict(os.environ, BENCH_TREE=tree)
    out = subprocess.run([sys.executable, os.path.join(HERE, script)] + args, env=env,
                         capture_output=True, text=True, timeout=timeout, cwd=tree)
    if out.returncode != 0:
        raise RuntimeError(f"{script} in {tree} failed:\n{out.stdout}\n{out.stderr}")
    return out.stdout


def figures(tree, steps, calls, cluster):
    text = run(tree, "call_overhead.py", ["--steps", str(steps), "--calls", str(calls)], 900)
    text += run(tree, "collectives.py", ["--backends", "shm", "--sizes", "4", "--no-torch",
                                         "--no-mpi"], 300)
    got = {}
    for name, pattern in PATTERNS.items():
        m = re.search(pattern, text, re.M)
        got[name] = float(m.group(1)) if m else float("nan")
    for layout in cluster:
        machines, local = layout.split("x")
        text = run(tree, "cluster_call.py", ["--machines", machines, "--local", local,
                                              "--rounds", "1"], 1800)
        m = re.search(rf"^\| {machines} x {local} \|(.*)$", text, re.M)
        cells = m.group(1).split("|") if m else []
        for k, name in enumerate(CLUSTER_FIGURES):
            value = float("nan")
            cell = re.match(r"\s*([\d.]+) (us|ms)\s*$", cells[k]) if k < len(cells) else None
            if cell:
                value = float(cell.group(1)) * (1e3 if cell.group(2) == "ms" else 1.0)
            got[f"{layout}: {name} (us)"] = value
    return got


CLUSTER_FIGURES = ("call, 1 MB output", "tiny call", "call, 10^5 rows", "all_reduce 4 B",
                   "tiny call after 20 ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="a checkout of the version before")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=4000)
    ap.add_argument("--cluster", default="",
                    help="layouts on simulated machines, e.g. 2x1,2x2 (machines x ranks each)")
    args = ap.parse_args()
    trees = {"before": os.path.abspath(args.before), "after": AFTER}
    for tree in trees.values():
        if os.path.exists(os.path.join(tree, "setup.py")):
            # A tree with the compiled control path runs from its folder: build it there.
            subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree,
                           check=True, capture_output=True)
    cluster = [v for v in args.cluster.split(",") if v]
    seen = {k: [] for k in trees}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for which in (("before", "after") if r % 2 == 0 else ("after", "before")):
            seen[which].append(figures(trees[which], args.steps, args.calls, cluster))
            print(f"# round {r + 1}: {which} done", file=sys.stderr, flush=True)
    print(f"# {args.rounds} alternating rounds, {time.perf_counter() - t0:.0f} s; "
          f"before = {trees['before']}, after = {trees['after']}")
    print("| figure | before | after | after / before |")
    print("|---|---|---|---|")
    for name in seen["after"][0]:
        b = statistics.median(f[name] for f in seen["before"])
        a = statistics.median(f[name] for f in seen["after"])
        print(f"| {name} | {b:.1f} | {a:.1f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
