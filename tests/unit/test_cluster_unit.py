"""Cluster pieces that need no MPI: launch detection, core shares, layouts, compact partials."""

import numpy as np
import pytest

import synkhronos as synk
from synkhronos import cluster


@pytest.mark.parametrize("env,expect", [
    ({}, None),
    ({"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"},
     (1, 3, 1, 3)),
    ({"PMI_RANK": "0", "PMI_SIZE": "1"}, None),          # one process: no cluster
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, (2, 4, 0, 2)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "SYNK_CLUSTER": "0"}, None),
])
def test_launched_reads_the_launchers_environment(monkeypatch, env, expect):
    for k in ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMIX_RANK",
              "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
              "OMPI_COMM_WORLD_LOCAL_SIZE", "SYNK_CLUSTER"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cluster.launched() == expect


def test_share_cores_splits_a_host_among_its_mpi_processes():
    cores = list(range(8))
    shares = [cluster.share_cores(cores, i, 3) for i in range(3)]
    assert sorted(c for s in shares for c in s) == cores  # each core once
    assert all(s for s in shares)
    assert cluster.share_cores(cores, 0, 1) == cores
    assert cluster.share_cores([0, 1], 3, 4) == [1]       # more processes than cores


def test_layout_numbers_ranks_machine_by_machine():
    lay = cluster.Layout([2, 3, 1], ["a", "b", "c"])
    assert lay.n_machines == 3 and lay.n_parallel == 6 and lay.offsets == [0, 2, 5]
    assert list(lay.ranks(1)) == [2, 3, 4]
    assert [lay.machine_of(r) for r in range(6)] == [0, 0, 1, 1, 1, 2]
    assert "machine 1 (b, ranks 2..4)" == lay.describe(1)
    with pytest.raises(ValueError):
        lay.machine_of(6)


def test_layout_on_one_machine(forked):
    n = forked(2)
    lay = synk.layout()
    assert lay.n_machines == 1 and lay.n_local == [n] and list(lay.ranks(0)) == [0, 1]


def test_layout_needs_fork():
    with pytest.raises(synk.SynkStateError):
        synk.layout()


def test_compact_partials_round_trip_exactly():
    arrays = [np.float32(1.5) * np.ones(3, np.float32), np.arange(6.).reshape(2, 3),
              np.array(7, dtype=np.int64), np.zeros((0, 4), np.float16)]
    packed = cluster._pack_partial((arrays, 2.5))
    got, mass = cluster._unpack_partial(packed)
    assert mass == 2.5
    for a, b in zip(arrays, got):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    # Anything else is pickled instead.
    assert cluster._pack_partial(([np.ones(1 << 15)], 1.0)) is None   # large
    assert cluster._pack_partial((None, 1.0)) is None
    assert cluster._pack_partial(([np.array([object()])], 1.0)) is None
