"""Clusters under a real Slurm on simulated nodes: every launch route, the refused ones, faults.

helpers/slurm.py brings up munge, slurmctld and one slurmd per simulated node
(helpers/machines.py: own network, host name, /dev/shm); jobs are submitted
from a head node as from a login node.  Each route of helpers/slurm_jobs.py
runs helpers/slurm_job.py on 2 nodes x 1 and 2 nodes x 2 MPI processes: the
controller checks a call and an all_reduce against NumPy and prints the
layout and each rank's cores, which must show the real nodes and, for two MPI
processes on a node, disjoint cores.  A route the library cannot read must
end at fork() with the reason in every process, never run as separate
one-machine programs.  Faults run under each MPI's recommended route (and
its srun route): nothing of the job may be left on any node, and the job
must leave Slurm's queue.  ``SYNK_SLURM_ALL=1`` adds every fault under srun.

Each environment holds one MPI: the main one runs MPICH's routes, `make
test-openmpi` Open MPI's.  Needs root and Slurm's Debian packages (`make
test` installs them where apt works); skipped with the reason otherwise.
"""

import os
import re
import secrets
import time

import pytest

from helpers.machines import mpi_flavor
from helpers.slurm import Slurm, why_no_pmix, why_no_slurm
from helpers.slurm_jobs import (FAULTS_KINDS, RECOMMENDED, REFUSED, ROUTES, SRUN, fault_run,
                                fork_once, refused, run_route, sbatch, settle, start)

WHY = why_no_slurm()
FLAVOR = mpi_flavor()
pytestmark = [pytest.mark.skipif(WHY is not None, reason=WHY or ""), pytest.mark.timeout(300)]
HEARTBEAT_S = 3


def _skip_without_pmix(route):
    if "pmix" in route and why_no_pmix():
        pytest.skip(why_no_pmix())


@pytest.fixture(scope="module")
def slurm():
    with Slurm(2) as s:
        yield s


@pytest.mark.parametrize("route,per_node", [(r, k) for r, (f, _) in ROUTES.items()
                                            if f == FLAVOR for k in (1, 2)])
def test_route_runs_on_the_real_nodes(slurm, route, per_node):
    _skip_without_pmix(route)
    r = run_route(slurm, route, per_node)
    print(r.line())
    assert r.ok, r.out
    n = 2 * per_node
    m = re.search(r"^LAYOUT (\d+) (.*)$", r.out, re.M)
    fields = m.group(2).split()
    assert int(m.group(1)) == n and fields[:n] == ["1"] * n, r.out
    assert fields[n:] == [slurm.nodes[0]] * per_node + [slurm.nodes[1]] * per_node, r.out
    # The MPI processes on one node take disjoint cores (one rank each here).
    for node in range(2):
        masks = [r.cores[node * per_node + k][0] for k in range(per_node)]
        assert all(masks), r.out
        for a in range(per_node):
            for b in range(a + 1, per_node):
                assert masks[a] & masks[b] == 0, (masks, r.out)
    assert r.state == "COMPLETED" and not r.left, r.line()
    assert slurm.squeue() == []


def test_cluster_contract_under_srun(slurm):
    """The whole contract of tests/test_cluster.py (helpers/cluster_checks.py) through srun,
    whose placement only Slurm's variables give: 2 nodes x 2 MPI processes."""
    route = SRUN[FLAVOR]
    _skip_without_pmix(route)
    out = start(slurm, route, 2, ["helpers/cluster_checks.py", "1"]).wait()
    assert "ALL OK" in out and "AFTER CLOSE OK" in out, out
    assert out.count("OK all_reduce and reduce") == 5, out
    assert not settle(slurm) and slurm.squeue() == [], out


@pytest.mark.parametrize("name", [n for n, (f, _, _) in REFUSED.items() if f in (None, FLAVOR)])
def test_route_the_library_cannot_read_is_refused_at_fork(slurm, name):
    _skip_without_pmix(REFUSED[name][1])
    out, took, left = refused(slurm, name)
    print(f"{name}: refused, sbatch to job end {took:.1f} s, left: {left or 'nothing'}")
    # Both processes raised at fork(), saying why; neither ran as a one-machine program.
    assert len(re.findall(r"SynkError: fork: .*" + REFUSED[name][2], out)) == 2, out
    assert "LAYOUT" not in out and "PIDS" not in out, out
    assert not left and slurm.squeue() == [], (left, out)


# Every fault under the recommended route; under srun (the controller's parent is then
# slurmstepd) the cut link in `make test`, every fault with SYNK_SLURM_ALL=1 (about a
# minute more per MPI; bench/slurm_routes.py runs them all).
FAULTS = [(RECOMMENDED[FLAVOR], f) for f in FAULTS_KINDS] + \
         [(SRUN[FLAVOR], f) for f in FAULTS_KINDS
          if f == "link cut" or os.environ.get("SYNK_SLURM_ALL") == "1"]


@pytest.mark.parametrize("route,fault", FAULTS)
def test_fault_leaves_nothing_and_ends_the_job(route, fault):
    _skip_without_pmix(route)
    with Slurm(2) as s:
        f = fault_run(s, route, fault, HEARTBEAT_S)
        queue = s.squeue()
        # Open MPI may abort through PMIx before the controller raises; Slurm then
        # SIGKILLs the whole step, the controller's janitor too, whose segments stay
        # until the next fork on that node sweeps them (docs/slurm.md).
        slurm_killed = (route == "srun --mpi=pmix" and "task 0: Killed" in f.out
                        and set(f.left) == {0} and not f.left[0][0])
        swept = fork_once(s, 0) if slurm_killed else None
    print(f.line())
    if slurm_killed:
        print(f"Slurm killed the step; a fork on node 0 then left: {swept or 'nothing'}")
        assert not swept, swept
    else:
        assert f.t_gone is not None and not f.left, f.line() + f.out
    assert f.t_end is not None and queue == [], f.line() + f.out
    if fault == "link cut":
        assert f.error and f.error.startswith("WorkerStalledError") and f.named, f
        # The cut node ends its share by itself within 2 heartbeats (its sentinel).
        assert f.t_error < 2 * HEARTBEAT_S and f.t_node < 2 * HEARTBEAT_S, f.line()
        assert f.t_mended is not None, f.line()
    elif fault in ("processes killed", "node crashed") and route.startswith("srun"):
        # srun leaves the controller running: it names the machine (in its error, or in
        # its log line where Open MPI aborts the step first). Hydra and PRRTE end the
        # job at once and may end the controller before it can (bench/slurm_routes.py).
        assert f.named, f
    if route == "sbatch + mpirun --with-ft ulfm" and fault == "processes killed":
        # ULFM: the run goes on with the machine left, as under mpirun without Slurm.
        assert f.error.startswith("MachineLostError") and "the run goes on" in f.error, f
        assert f.named and f.t_error < 2.0 and "CLOSED" in f.out, f


# docs/slurm.md's batch scripts for a job that grows and shrinks (machines that come and
# go), with the training run of tests/cluster/test_elastic.py as the program.
GROWING_FIRST = """#!/bin/sh
#SBATCH -N 1 --exclusive
# The first allocation runs the controller; allocations that join find it by its host name.
export SYNK_LISTEN=29517 SYNK_MACHINES=1
hostname > "$JOB_DIR/controller"
timeout 150 python helpers/cluster_elastic.py train 8 2:2,4:0
"""
GROWING_MORE = """#!/bin/sh
#SBATCH -N 1 --exclusive
# Each further allocation adds its node to the running job; scancel takes it away again.
export SYNK_JOIN=$(cat "$JOB_DIR/controller"):29517
timeout 150 python helpers/cluster_elastic.py train 8 ""
"""


def test_job_grown_by_a_second_allocation_and_shrunk_by_scancel():
    """sbatch of a second allocation adds its node to the running job; scancel of it takes the
    node away; every step equals the serial twin's, nothing is left, the queue empties."""
    from helpers.elastic_jobs import losses, serial_losses, why_no_elastic

    if why_no_elastic():
        pytest.skip(why_no_elastic())
    steps = 8
    with Slurm(2) as s:
        d = os.path.join(s.dir, "elastic")
        os.makedirs(d)
        with open(os.path.join(d, "secret"), "w") as f:
            f.write(secrets.token_hex(16))
        env = s.env(SYNK_SECRET_FILE=os.path.join(d, "secret"), JOB_DIR=d, PAUSE_DIR=d,
                    SYNK_SPIN_S="0", SYNK_HEARTBEAT_S=str(HEARTBEAT_S))
        first = sbatch(s, GROWING_FIRST, 1, 1, env=env)
        grown = None
        try:
            assert first.wait_output(r"^PAUSE 2$", 120), first.output() + s.logs()
            t0 = time.monotonic()
            grown = sbatch(s, GROWING_MORE, 1, 1, env=env)
            open(os.path.join(d, "2"), "w").close()
            assert first.wait_output(r"^RESUME 2 machines 2 ", 90), first.output() + s.logs()
            t_grown = time.monotonic() - t0
            assert first.wait_output(r"^PAUSE 4$", 60), first.output()
            s.run_head(["scancel", grown.id], timeout=20)
            open(os.path.join(d, "4"), "w").close()
            out = first.wait()
            grown.wait(60)
        finally:
            for job in (first, grown):
                if job is not None and not job.ended():
                    s.run_head(["scancel", job.id], timeout=20)
        caught = re.search(r"^CAUGHT MachineLostError at step 5 completed \S+ at ([\d.]+)",
                           out, re.M)
        print(f"grown: the second allocation's node ran step 3 {t_grown:.1f} s after its sbatch; "
              f"shrunk: the first step after scancel raised MachineLostError (job states "
              f"{first.state}, {grown.state}); left: {settle(s) or 'nothing'}")
        assert "CLOSED" in out and caught, out
        # A rank per core of each node.
        both = re.search(r"^step 3 \S+ sum \S+ on 2 machines (\d+) ranks", out, re.M)
        one = re.search(r"^step 7 \S+ sum \S+ on 1 machines (\d+) ranks", out, re.M)
        assert both and one and int(both.group(1)) == 2 * int(one.group(1)), out
        want, got = serial_losses(steps), losses(out)
        assert len([k for k, (loss, _) in got.items() if loss != "lost"]) >= steps - 1, out
        for k, (loss, total) in got.items():
            if loss != "lost":
                assert float(loss) == pytest.approx(float(want[k][0]), rel=1e-5), (k, out)
                assert float(total) == float(want[k][1]), (k, out)
        assert first.state == "COMPLETED" and grown.state == "CANCELLED", (first.state,
                                                                            grown.state)
        assert not settle(s) and s.squeue() == [], (settle(s), s.squeue())
