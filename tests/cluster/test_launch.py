"""cluster.launch: reading mpiexec's environment without starting MPI."""

import pytest

from synkhronos.cluster import launch


@pytest.mark.parametrize("env,expect", [
    ({}, None),
    ({"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"},
     (1, 3, 1, 3)),
    ({"PMI_RANK": "0", "PMI_SIZE": "1"}, None),          # one process: no cluster
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, (2, 4, 0, 2)),
    ({"PMIX_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}, (3, 4, 0, 1)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "SYNK_CLUSTER": "0"}, None),
])
def test_launched_reads_the_launchers_environment(env, expect):
    got = launch.launched(env)
    assert got == expect
    if expect is not None:
        assert (got.rank, got.size, got.local_index, got.local_count) == expect


def test_launched_reads_os_environ_by_default(monkeypatch):
    for k in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "2")
    assert launch.launched().rank == 1
