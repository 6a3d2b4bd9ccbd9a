"""Where a command between machines spends its time: a tiny call and a 4-byte all_reduce on 2 x 1.

    sudo python bench/cluster_breakdown.py [--tree DIR ...] [--calls 2000]

On 2 simulated machines (tests/helpers/machines.py; needs root) of one rank
each, the controller runs ``--calls`` tiny calls (a ``synk.function`` with a
0-d output) and as many 4-byte ``synk.all_reduce``; both processes note
``perf_counter`` stamps (one clock: the machines share this host's kernel) at
the steps of each command, by wrapping the functions that make them:

controller: the call, the command's message sent (``MpiLink.send_bytes``), its
own collective (``Leaders``), the report's arrival (a probe that found it),
the wait for reports (``Controller.finish``); node master: the command's
arrival, its share (``_run_alone``), its collective, its report sent.

Printed per tree (``--tree``, several to compare versions; default this
one): the median time of each step from the call's start, over the calls.
Each wrapper costs ~0.3 us, so the total is a few microseconds above
bench/cluster_call.py's; steps a version lacks are left out.
"""

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time

from common import ROOT, harness

EVENTS = []
LINK = [None]
TAGS = {1: "command", 2: "report", 5: "report", 6: "report"}  # link.CMD, REPORT, DONE, OUTPUTS


def _seq():
    link = LINK[0]
    return -1 if link is None else link.seq


def _wrap(owner, name, label, found_only=False):
    """Stamp entering and leaving ``owner.name`` (or, ``found_only``, a probe that found a message)."""
    f = getattr(owner, name, None)
    if f is None:
        return
    clock = time.perf_counter

    @functools.wraps(f)
    def stamped(*args, **kw):
        if found_only:
            got = f(*args, **kw)
            if got is not None:
                tag = got[2] if len(got) > 2 else args[2]
                EVENTS.append((f"{TAGS.get(tag, tag)} found", _seq(), clock()))
            return got
        EVENTS.append((label + " >", _seq(), clock()))
        got = f(*args, **kw)
        EVENTS.append((label + " <", _seq(), clock()))
        return got
    setattr(owner, name, stamped)


def _install(out_dir):
    from synkhronos.cluster import controller, mpi_link, node
    from synkhronos.comm import mpi_leaders

    made = mpi_link.MpiLink.__init__

    def init(self, *args, **kw):
        made(self, *args, **kw)
        LINK[0] = self
    mpi_link.MpiLink.__init__ = init
    _wrap(mpi_link.MpiLink, "probe", None, found_only=True)
    _wrap(mpi_link.MpiLink, "probe_any", None, found_only=True)
    _wrap(mpi_link.MpiLink, "send_bytes", "send")
    _wrap(controller.Controller, "forward", "forward")
    _wrap(controller.Controller, "finish", "wait for reports")
    _wrap(node, "_run_alone", "share")
    _wrap(node.NodeMaster, "report", "report")
    _wrap(mpi_leaders.Leaders, "all_reduce", "collective")
    _wrap(mpi_leaders.Leaders, "all_reduce_kept", "collective")
    leave = node.exit_finalized

    def exit_finalized(code):
        _dump(os.path.join(out_dir, "node.json"))
        leave(code)
    node.exit_finalized = exit_finalized


def _dump(path):
    with open(path, "w") as f:
        json.dump(EVENTS, f)


def job(calls, out_dir):
    _install(out_dir)
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk

    synk.fork(1, use_gpu=False)
    x = pt.matrix("x", dtype="float32")
    tiny = synk.function([x], (pt.sum(x), "sum"))
    s = pytensor.shared(np.ones(1, "float32"), name="s")
    synk.function([], pt.sum(s))
    synk.distribute()
    small = synk.data(np.ones((4, 1), "float32"))
    clock = time.perf_counter
    for name, fn in (("tiny call", lambda: tiny(small)),
                     ("all_reduce 4 B", lambda: synk.all_reduce(s, op="sum"))):
        for _ in range(200):
            fn()
        EVENTS.append(("begin " + name, _seq(), clock()))
        for _ in range(calls):
            EVENTS.append(("call >", _seq(), clock()))
            fn()
            EVENTS.append(("call <", _seq(), clock()))
    EVENTS.append(("end", _seq(), clock()))
    synk.close()
    _dump(os.path.join(out_dir, "controller.json"))


def _by_command(events, opens):
    """{command number: [(step, t)]}, and each command's phase, from one process's stamps."""
    cmds, phase_of, cur, phase = {}, {}, None, None
    for label, seq, t in events:
        if label.startswith("begin ") or label == "end":
            phase = label[6:] if label != "end" else None
            continue
        if label == opens:
            cur = seq + 1  # stamped before the command is numbered
            cmds[cur] = []
            phase_of[cur] = phase
        if cur is not None:
            cmds[cur].append((label, t))
    return cmds, phase_of


def breakdown(out_dir):
    """{figure: [(step, median us from the call's start)]} from the two processes' stamps."""
    with open(os.path.join(out_dir, "controller.json")) as f:
        ctl, phases = _by_command(json.load(f), "call >")
    with open(os.path.join(out_dir, "node.json")) as f:
        node, _ = _by_command(json.load(f), "command found")
    got = {}
    for figure in ("tiny call", "all_reduce 4 B"):
        steps = {}
        keys = [k for k in ctl if phases[k] == figure and k in node]
        for k in keys:
            t0 = ctl[k][0][1]
            for who, events in (("controller", ctl[k]), ("node master", node[k])):
                seen = set()
                for label, t in events:
                    if label not in seen:  # the first of each step
                        seen.add(label)
                        steps.setdefault(f"{who}: {label}", []).append(t - t0)
        rows = [(s, statistics.median(v) * 1e6) for s, v in steps.items()
                if len(v) >= len(keys) // 2]
        got[figure] = sorted(rows, key=lambda r: r[1])
    return got


def run_tree(tree, calls):
    cluster_jobs = harness("cluster_jobs")
    with tempfile.TemporaryDirectory(prefix="synk-breakdown-") as out_dir:
        with cluster_jobs.machines(2) as m:
            rc, out, _ = cluster_jobs.mpirun(m, 2, [os.path.abspath(__file__), "--job", "--calls",
                                                    str(calls), "--out", out_dir],
                                             timeout=600, PYTHONPATH=tree)
        if rc != 0:
            sys.exit(f"job with {tree} failed (exit {rc}):\n{out[-3000:]}")
        return breakdown(out_dir)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", help="a checkout to measure (repeatable)")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        return job(args.calls, args.out)
    cluster_jobs = harness("cluster_jobs")
    FLAVOR, NO_MACHINES = cluster_jobs.FLAVOR, cluster_jobs.NO_MACHINES
    if NO_MACHINES or not FLAVOR:
        sys.exit(f"bench/cluster_breakdown.py: {NO_MACHINES or 'no mpiexec'}")
    trees = [os.path.abspath(t) for t in (args.tree or [ROOT])]
    print(f"# {FLAVOR}, 2 machines x 1 rank, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"load {os.getloadavg()[0]:.2f}; median us from the call's start", flush=True)
    for tree in trees:
        for figure, rows in run_tree(tree, args.calls).items():
            print(f"\n{tree}: {figure}\n")
            print("| step | us |")
            print("|---|---|")
            for step, us in rows:
                print(f"| {step} | {us:.1f} |")
    print(f"\n# load at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
