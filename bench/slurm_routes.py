"""Every Slurm launch route on simulated nodes: pass/fail, layout, sbatch to job end, leftovers; faults.

    sudo python bench/slurm_routes.py [--rounds 2] [--no-faults] [--netmod-runs N]   # MPICH
    sudo .venv-openmpi/bin/python bench/slurm_routes.py [--rounds 2]                # Open MPI

A real Slurm (tests/helpers/slurm.py: munge, slurmctld on a head node, one
slurmd on each of 2 simulated nodes; needs root and Slurm's Debian packages,
which `make test` installs) runs the routes of tests/helpers/slurm_jobs.py for
this interpreter's MPI: each with 1 and 2 MPI processes per node (one rank
each; helpers/slurm_job.py checks a call and an all_reduce against NumPy),
then the routes the library refuses at fork(), then (unless --no-faults) the
faults of tests/test_cluster.py under the recommended route and the srun
route: node 1's processes killed, node 1 crashed (slurmd too), node 1's link
cut (SYNK_HEARTBEAT_S=3; mended after), the controller killed.  With
--netmod-runs N (MPICH): N runs of srun --mpi=pmi2 with each of MPICH's network
modules set explicitly (UCX, what MPICH picks by itself; OFI, what synkhronos
picks under srun), counting passes and the errors Slurm and UCX printed.

Printed per run: PASS or FAIL, the layout the controller saw (MPI processes per
node), each rank's cores (bit masks), seconds from sbatch (salloc) to the
job's end in Slurm (out of squeue), and what was left on any node (processes
besides Slurm's daemons, /dev/shm entries); per fault: the controller's error
and when, when every process of the job was gone, when the job ended.  Slurm
here: SlurmdTimeout=5, MessageTimeout=3 (a lost node is taken for down after
about 10 s; Slurm's defaults are 300 s and 10 s).  The same runs are asserted
in tests/cluster/test_slurm.py.
"""

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys

from common import harness

mpi_flavor = harness("machines").mpi_flavor
slurm = harness("slurm")
Slurm, why_no_pmix, why_no_slurm = slurm.Slurm, slurm.why_no_pmix, slurm.why_no_slurm
slurm_jobs = harness("slurm_jobs")
FAULTS_KINDS, JOB, RECOMMENDED = slurm_jobs.FAULTS_KINDS, slurm_jobs.JOB, slurm_jobs.RECOMMENDED
REFUSED, ROUTES, SRUN = slurm_jobs.REFUSED, slurm_jobs.ROUTES, slurm_jobs.SRUN
fault_run, refused, run_route = slurm_jobs.fault_run, slurm_jobs.refused, slurm_jobs.run_route
settle, start = slurm_jobs.settle, slurm_jobs.start


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--netmod-runs", type=int, default=0,
                    help="MPICH: also run srun --mpi=pmi2 this many times with each of MPICH's "
                         "network modules (ucx, ofi), each run bounded to 40 s")
    args = ap.parse_args()
    why = why_no_slurm()
    if why:
        sys.exit(f"slurm_routes.py: {why}")
    flavor = mpi_flavor()
    version = subprocess.run(["slurmd", "-V"], capture_output=True, text=True).stdout.strip()
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
    if args.netmod_runs and flavor == "mpich":
        with Slurm(2) as s:
            netmods(s, args.netmod_runs)
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


# What a run under srun --mpi=pmi2 can print when MPICH's PMI-1 lines are too long.
SIGNS = {"Slurm: value not properly terminated": "value not properly terminated",
         "UCX: failed to unpack address": "failed to unpack address",
         "ran into the 40 s timeout": "LAUNCHER EXIT 124"}


def netmods(s, runs):
    """srun --mpi=pmi2 with MPICH's UCX and OFI network modules, chosen explicitly."""
    for netmod in ("ucx", "ofi"):
        passed, signs = 0, dict.fromkeys(SIGNS, 0)
        for _ in range(runs):
            job = start(s, SRUN["mpich"], 2, [JOB, "1"], limit=40, MPIR_CVAR_CH4_NETMOD=netmod)
            out = job.wait()
            passed += "ALL OK" in out
            for name, text in SIGNS.items():
                signs[name] += text in out
            settle(s)
        print(f"srun --mpi=pmi2, 2 nodes x 2, MPIR_CVAR_CH4_NETMOD={netmod}: {passed} of {runs} "
              "passed; runs showing " + ", ".join(f"{k}: {v}" for k, v in signs.items()),
              flush=True)


if __name__ == "__main__":
    main()
