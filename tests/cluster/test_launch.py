"""cluster.launch: reading the launcher's environment without starting MPI, and refusing what
cannot be read.  The environments are those seen under each launcher (tests/cluster/test_slurm.py runs
the same routes for real)."""

import logging
import os

import pytest

from synkhronos.cluster import launch, launchers, sentinel
from synkhronos.cluster.launchers import HYDRA, PMI, PRRTE, SRUN_PMI, SRUN_PMIX
from synkhronos.cluster.slurm import slurm_step, slurm_task, tasks_per_node
from synkhronos.errors import SynkError

# What srun sets in task 3 of 4, the second of two on the second node.
SLURM_TASK = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3",
              "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
              "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NUM_NODES": "2"}
# A process Hydra started inside an allocation: its proxy was srun's task 1 of 2.
HYDRA_PROXY_STEP = {**SLURM_TASK, "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
                    "SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}


@pytest.mark.parametrize("env,expect", [
    ({}, None),
    ({"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"},
     (1, 3, 1, 3, HYDRA)),
    ({"PMI_RANK": "0", "PMI_SIZE": "1", "MPI_LOCALRANKID": "0"}, None),  # one process
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, (2, 4, 0, 2, PRRTE)),
    ({"PMIX_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, (3, 4, 1, 2, PRRTE)),
    # Hydra or PRRTE inside an allocation: their own variables win over the proxy's step.
    ({**HYDRA_PROXY_STEP, "PMI_RANK": "2", "PMI_SIZE": "4", "PMI_FD": "9",
      "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, (2, 4, 0, 2, HYDRA)),
    ({**HYDRA_PROXY_STEP, "PMIX_RANK": "3", "OMPI_COMM_WORLD_RANK": "3",
      "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, (3, 4, 1, 2, PRRTE)),
    # srun --mpi=pmi2 sets PMI's rank and size only; Slurm's variables say the rest.
    ({**SLURM_TASK, "PMI_RANK": "3", "PMI_SIZE": "4", "PMI_FD": "11", "PMI_JOBID": "7.0"},
     (3, 4, 1, 2, SRUN_PMI)),
    # srun --mpi=pmix sets PMIx's rank only.
    ({**SLURM_TASK, "PMIX_RANK": "3", "PMIX_NAMESPACE": "slurm.pmix.7.0"},
     (3, 4, 1, 2, SRUN_PMIX)),
    # Uneven tasks per node: the third task is alone on the second node.
    ({**SLURM_TASK, "PMIX_RANK": "2", "SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "3",
      "SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "2,1"}, (2, 3, 0, 1, SRUN_PMIX)),
    # A PMI launcher that names no host mates: one per host, checked once MPI runs.
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, (1, 2, 0, 1, PMI)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "SYNK_CLUSTER": "0"}, None),
    ({**SLURM_TASK, "SYNK_CLUSTER": "0"}, None),
    # The batch script itself (no step) and a one-task step: one machine.
    ({k: v for k, v in SLURM_TASK.items() if k != "SLURM_STEP_ID"}, None),
    ({**SLURM_TASK, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0",
      "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "1"}, None),
])
def test_launched_reads_the_launchers_environment(env, expect):
    got = launchers.launched(env)
    assert (got if got is None else tuple(got[:5])) == expect
    if got is not None:
        assert got.seen and all(k in env for k in
                                (part.split("=")[0] for part in got.seen.split()))


@pytest.mark.parametrize("env,words", [
    # srun without an MPI plugin: N separate programs, never silently.
    (SLURM_TASK, ["task 3 of 4", "without MPI", "srun --mpi=pmi2", "SYNK_CLUSTER=0"]),
    # A PMIx rank and nothing else: no size, no host mates.
    ({"PMIX_RANK": "1"}, ["PMIX_RANK=1", "nothing says how many", "srun --mpi=pmix"]),
])
def test_a_launch_that_cannot_be_read_is_refused(env, words):
    with pytest.raises(SynkError) as err:
        launchers.launched(env)
    for w in words:
        assert w in str(err.value), err.value


def test_launched_reads_os_environ_by_default(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("PMI", "OMPI_", "SLURM_", "MPI_LOCAL")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("MPI_LOCALRANKID", "0")
    assert launchers.launched().rank == 1


def test_batch_script_of_several_nodes_warns_that_it_runs_on_one(caplog):
    env = {k: v for k, v in SLURM_TASK.items() if k != "SLURM_STEP_ID"}
    with caplog.at_level(logging.WARNING, logger="synkhronos"):
        assert launchers.launched(env) is None
    assert "2 nodes" in caplog.text and "srun or mpiexec" in caplog.text


def test_slurm_variables():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    assert slurm_task(SLURM_TASK) == (3, 4, 1, 2)
    assert slurm_task({**SLURM_TASK, "SLURM_NODEID": "5"}) is None
    assert slurm_task({k: v for k, v in SLURM_TASK.items() if k != "SLURM_STEP_ID"}) is None
    assert slurm_step(SLURM_TASK) == "7.0"
    assert slurm_step({"SLURM_JOB_ID": "7"}) is None


MPICH = "MPICH Version:      5.0.2\nMPICH Device:       ch4:ucx ofi\n"
OMPI = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11"


def _launch(route, rank=0):
    return launchers.Launch(rank, 2, 0, 1, route, "PMI_RANK=0")


@pytest.mark.parametrize("version,route,words", [
    (MPICH, SRUN_PMIX, ["PMI-1/PMI-2, not PMIx", "srun --mpi=pmi2"]),
    (OMPI, SRUN_PMI, ["PMIx only", "srun --mpi=pmix", "Open MPI v5.0.11"]),
])
def test_an_mpi_that_cannot_join_its_launcher_is_refused_before_init(version, route, words):
    with pytest.raises(SynkError) as err:
        launch.prepare_mpi(version, _launch(route), {})
    for w in words:
        assert w in str(err.value), err.value


def test_mpich_under_srun_gets_ofi_unless_a_netmod_was_chosen(caplog):
    env = {}
    with caplog.at_level(logging.WARNING, logger="synkhronos"):
        launch.prepare_mpi(MPICH, _launch(SRUN_PMI), env)
    assert env == {"MPIR_CVAR_CH4_NETMOD": "ofi"} and "OFI" in caplog.text
    chosen = {"MPIR_CVAR_CH4_NETMOD": "ucx"}
    launch.prepare_mpi(MPICH, _launch(SRUN_PMI), chosen)
    assert chosen == {"MPIR_CVAR_CH4_NETMOD": "ucx"}
    for version, route in ((MPICH, HYDRA), (OMPI, SRUN_PMIX), (OMPI, PRRTE),
                           ("MPICH Version: 4.2\nMPICH Device: ch4:ofi\n", SRUN_PMI)):
        env = {}
        launch.prepare_mpi(version, _launch(route), env)
        assert env == {}, (version, route)


def test_placement_problem_names_processes_that_would_share_cores():
    lay = _launch(SRUN_PMI)
    assert launch.placement_problem(lay, ["a", "a", "b"], [(0, 2), (1, 2), (0, 1)]) is None
    wrong = launch.placement_problem(lay, ["a", "a", "b"], [(0, 1), (0, 1), (0, 1)])
    assert "MPI process 0" in wrong and "2 process(es)" in wrong and "0, 1" in wrong


def test_sentinel_leaves_slurms_step_daemon_alone(monkeypatch):
    names = {10: (20, "python3"), 20: (1, "prted"), 11: (21, "python3"), 21: (1, "slurmstepd")}
    monkeypatch.setattr(sentinel, "parent_and_name", lambda pid: names.get(pid, (None, None)))
    monkeypatch.setattr(sentinel, "proc_start_time", lambda pid: 123)
    assert sentinel.launcher_daemon(10) == (20, 123)
    assert sentinel.launcher_daemon(11) is None


def test_a_launcher_is_one_class_in_the_table():
    """Defining a Launcher adds it to ROUTES, asked after those before it."""
    assert [type(k).__name__ for k in launchers.ROUTES[:3]] == ["ElasticLaunch", "Hydra", "OpenMpi"]
    before = list(launchers.ROUTES)

    class Made(launchers.Launcher):
        route = "a launcher made here"

        def present(self, env):
            return "MADE_RANK" in env

        def read(self, env):
            return launchers.Launch(int(env["MADE_RANK"]), 2, 0, 1, self.route, "MADE_RANK=1")
    try:
        assert type(launchers.ROUTES[-1]) is Made
        assert launchers.launched({"MADE_RANK": "1"})[:5] == (1, 2, 0, 1, "a launcher made here")
        hydra = {"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MADE_RANK": "0"}
        assert launchers.launched(hydra).route == HYDRA  # defined before: asked first
    finally:
        launchers.ROUTES[:] = before
