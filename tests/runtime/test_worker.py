"""The worker loop: any exception in a handler goes back to the master and the worker keeps
serving; dropped Data are unmapped; QUIT ends the process; debug lines and profiles per rank.

Through the public API: a test op raises in the ranks it is told to, inside an
ordinary call.  The failure reports themselves (types, lowest rank, counts) are
in test_failures.py.
"""

import gc
import logging
import os
import pstats

import numpy as np
import pytensor.tensor as pt
import pytest
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

import synkhronos as synk
from synkhronos.runtime.state import get_runtime

pytestmark = pytest.mark.timeout(90)


class RaiseIn(Op):
    """Return x; in every rank listed in the second input, raise ``kind`` instead."""

    __props__ = ("kind",)

    def __init__(self, kind):
        self.kind = kind

    def make_node(self, x, ranks):
        x, ranks = pt.as_tensor_variable(x), pt.as_tensor_variable(ranks)
        return Apply(self, [x, ranks], [x.type()])

    def perform(self, node, inputs, outputs):
        x, ranks = inputs
        rank = get_runtime().place.rank
        if rank in ranks:
            if self.kind == "exit":
                raise SystemExit(f"exit in rank {rank}")
            if self.kind == "interrupt":
                raise KeyboardInterrupt(f"interrupt in rank {rank}")
            if self.kind == "huge":
                raise LookupError("x" * (1 << 20) + " END OF MESSAGE")
            if self.kind == "huge value":
                raise ValueError("v" * (1 << 20) + " END OF MESSAGE")
            raise KeyError(f"key in rank {rank}")
        outputs[0][0] = x.copy()


def _build(kind):
    x = pt.dmatrix("x")
    ranks = pt.lvector("ranks")
    return synk.function([x], bcast_inputs=[ranks], outputs=(RaiseIn(kind)(x, ranks).sum(axis=0),
                                                             "sum"), mode="FAST_COMPILE")


def _ranks(*rs):
    return synk.data(np.array(rs or (-1,), dtype=np.int64))


def _pids():
    return {rank: p.pid for rank, p in get_runtime().processes.procs.items()}


def test_a_worker_error_carries_the_rank_header_and_the_worker_serves_on(forked, rng):
    forked(3)
    f = _build("key")
    synk.distribute()
    x = rng.standard_normal((7, 2))
    d = synk.data(x)
    pids = _pids()
    for rank in (1, 2):
        with pytest.raises(synk.WorkerError) as info:
            f(d, _ranks(rank))
        err = info.value
        text = err.failures[rank]
        assert text.splitlines()[0] == f"rank {rank} of 3 (pid {pids[rank]})"
        assert "KeyError" in text and f"key in rank {rank}" in text
        assert type(err.__cause__) is KeyError and isinstance(err, KeyError)
        np.testing.assert_allclose(f(d, _ranks()), x.sum(axis=0), rtol=1e-12)
    assert _pids() == pids                          # the same processes served on


@pytest.mark.parametrize("kind, base", [("exit", SystemExit), ("interrupt", KeyboardInterrupt)])
def test_a_base_exception_in_a_worker_is_reported_not_fatal(forked, rng, kind, base):
    forked(2)
    f = _build(kind)
    synk.distribute()
    x = rng.standard_normal((5, 3))
    d = synk.data(x)
    pids = _pids()
    with pytest.raises(synk.WorkerError) as info:
        f(d, _ranks(1))
    err = info.value
    assert err.rank == 1 and set(err.failures) == {1}
    assert base.__name__ in err.failures[1] and "in rank 1" in err.failures[1]
    assert isinstance(err.__cause__, base)
    assert all(p.is_alive() for p in get_runtime().processes.procs.values())
    np.testing.assert_allclose(f(d, _ranks()), x.sum(axis=0), rtol=1e-12)
    assert _pids() == pids


@pytest.mark.parametrize("kind, base", [("huge", LookupError), ("huge value", ValueError)])
def test_an_error_too_big_for_its_slot_keeps_its_type_and_header(forked, rng, kind, base):
    forked(2)
    f = _build(kind)
    synk.distribute()
    pids = _pids()
    x = rng.standard_normal((4, 2))
    d = synk.data(x)
    with pytest.raises(base) as info:
        f(d, _ranks(1))
    err = info.value
    assert isinstance(err, synk.WorkerError) and err.rank == 1
    assert type(err.__cause__) is base                  # cut to fit, not dropped
    assert str(err.__cause__).endswith(" END OF MESSAGE")
    text = err.failures[1]
    # The header stays on top, the tail (PyTensor's notes follow the message) is kept,
    # the slot bounds the size.
    assert text.splitlines()[0] == f"rank 1 of 2 (pid {pids[1]})"
    assert "END OF MESSAGE" in text and len(text) < (1 << 20)
    np.testing.assert_allclose(f(d, _ranks()), x.sum(axis=0), rtol=1e-12)


def test_quit_ends_every_worker_by_itself(forked):
    forked(3)
    procs = list(get_runtime().processes.procs.values())
    assert len(procs) == 2 and all(p.is_alive() for p in procs)
    synk.close()
    # Exit code 0: each worker left its loop on QUIT (a worker killed by close() shows -9).
    assert [p.exitcode for p in procs] == [0, 0]


def _mapped_segments(pid):
    """The shared-memory segments of this test's run that process ``pid`` has mapped."""
    prefix = f"/dev/shm/synk_{os.getpid()}_"
    with open(f"/proc/{pid}/maps") as f:
        return {line.split(None, 5)[5].strip().removesuffix(" (deleted)")
                for line in f if prefix in line}


def test_dropped_data_are_unmapped_in_every_worker(forked):
    forked(3)
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(), "sum"))
    synk.distribute()
    keep = synk.data(np.ones((4, 2)))
    assert f(keep) == 8.0
    workers = list(_pids().values())
    base = [_mapped_segments(p) for p in workers]
    drop = synk.data(np.full((1000, 3), 2.0))
    assert f(drop) == 6000.0                        # every worker maps it to read its rows
    grown = [_mapped_segments(p) for p in workers]
    assert all(len(g) > len(b) for g, b in zip(grown, base)), (base, grown)
    del drop
    gc.collect()
    assert f(keep) == 8.0                           # the next command carries the frees
    assert [_mapped_segments(p) for p in workers] == base


def test_every_worker_logs_one_debug_line_per_command(forked, tmp_path):
    log = tmp_path / "synk.log"
    handler = logging.FileHandler(log)               # inherited by the forked workers
    handler.setFormatter(logging.Formatter("%(process)d %(message)s"))
    root = logging.getLogger("synkhronos")
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        forked(3)
        forked_pids = _pids()
        x = pt.dmatrix("x")
        f = synk.function([x], (x.sum(), "sum"))
        synk.distribute()  # on one machine: the workers start again from the master
        pids = _pids()
        assert f(np.ones((6, 2))) == 12.0
        synk.close()
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        handler.close()
    lines = log.read_text().splitlines()

    def ran(rank, pid):
        mine = [line.split(" ", 1)[1] for line in lines if line.startswith(f"{pid} rank {rank} ran ")]
        return [m.split()[3] for m in mine]

    for rank, pid in forked_pids.items():
        assert pid != pids[rank]
        assert ran(rank, pid) == ["QUIT"]
    for rank, pid in pids.items():
        got = ran(rank, pid)  # nothing pickled: no DISTRIBUTE
        assert got[-1] == "QUIT" and got.count("CALL") == 1 and "DISTRIBUTE" not in got, got


def test_profile_workers_writes_one_profile_per_worker_rank(forked, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                     # the workers inherit it
    forked(3, master_rank=1, profile_workers=True)
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(), "sum"))
    synk.distribute()
    assert f(np.ones((6, 2))) == 12.0
    synk.close()
    assert sorted(os.listdir(tmp_path)) == ["synk_worker_0.prof", "synk_worker_2.prof"]
    for name in os.listdir(tmp_path):
        assert pstats.Stats(str(tmp_path / name)).total_calls > 0
