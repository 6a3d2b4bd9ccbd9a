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

import pytest

from helpers.machines import mpi_flavor
from helpers.slurm import Slurm, why_no_pmix, why_no_slurm
from helpers.slurm_jobs import (FAULTS_KINDS, RECOMMENDED, REFUSED, ROUTES, SRUN, fault_run,
                                fork_once, refused, run_route, settle, start)

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
