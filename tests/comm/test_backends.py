"""The backend suite: every Backend method on plain arrays, written once, run per backend.

Backends are driven inside commands: a test-only handler (installed before
fork, so the workers inherit it) runs a module-level function on every rank,
the master included.  Each function computes what its rank expects from the
rank numbers alone and asserts; a failed assertion in a worker comes back as
WorkerError.
"""

import sys

import numpy as np
import pytest

import synkhronos as synk
from helpers import fake_cupy
from synkhronos.comm import backend_names
from synkhronos.runtime.commands import COMMANDS, Command
from synkhronos.runtime.run import run_command
from synkhronos.errors import WorkerError
from synkhronos.runtime.state import get_runtime

pytestmark = pytest.mark.timeout(60)

OPS = ["avg", "sum", "prod", "max", "min"]
BIG = 100_003  # float32 elements: over the backends' split threshold, odd on purpose
TEST_CMD = Command.GET_VALUE


def _run_test_fn(rt, payload):
    fn, args = payload
    fn(rt, *args)


def _value(rank, shape, dtype, salt=0):
    """A deterministic, rank-dependent array with small integer values."""
    n = int(np.prod(shape))
    base = (np.arange(n) * 7 + salt) % 5 + rank + 1
    return base.astype(dtype).reshape(shape)


def _reduced(op, parts):
    stack = np.stack(parts)
    if op == "avg":
        return stack.mean(axis=0)
    return {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}[op](stack, axis=0)


def _expect(op, n, shape, dtype, salt=0):
    return _reduced(op, [_value(q, shape, dtype, salt) for q in range(n)])


# ---- functions run on every rank --------------------------------------------
def _barriers(rt, count):
    for _ in range(count):
        rt.backend.barrier()


def _all_reduce(rt, op, shapes, dtype, in_place):
    arrays = [_value(rt.place.rank, s, dtype, salt=i) for i, s in enumerate(shapes)]
    out = list(arrays) if in_place else None
    got = rt.backend.all_reduce(arrays, op, out=out)
    assert len(got) == len(shapes)
    for i, (g, s) in enumerate(zip(got, shapes)):
        want = _expect(op, rt.place.n_parallel, s, dtype, salt=i)
        assert g.shape == tuple(s)
        np.testing.assert_allclose(g, want, rtol=1e-6)
        if in_place and g.dtype == arrays[i].dtype:
            assert g is arrays[i]


def _mixed_ops(rt, ops):
    arrays = [_value(rt.place.rank, (BIG // 4,), np.float32, salt=i) for i in range(len(ops))]
    got = rt.backend.all_reduce(arrays, ops)
    for i, (g, op) in enumerate(zip(got, ops)):
        np.testing.assert_allclose(g, _expect(op, rt.place.n_parallel, (BIG // 4,), np.float32, i),
                                   rtol=1e-6)


def _reduce(rt, op, root, shape):
    a = _value(rt.place.rank, shape, np.float64)
    before = a.copy()
    got = rt.backend.reduce([a], op, root)
    np.testing.assert_array_equal(a, before)
    if rt.place.rank == root:
        np.testing.assert_allclose(got[0], _expect(op, rt.place.n_parallel, shape, np.float64))
    else:
        assert got is None


def _weighted_avg(rt):
    a = np.full(4, float(rt.place.rank + 1))
    got = rt.backend.all_reduce([a], "avg", weight=float(rt.place.rank + 1))
    w = np.arange(1, rt.place.n_parallel + 1, dtype=float)
    np.testing.assert_allclose(got[0], np.full(4, (w * w).sum() / w.sum()))


def _none_contribution(rt):
    a = None if rt.place.rank == rt.place.n_parallel - 1 and rt.place.n_parallel > 1 else [np.full(3, 2.0)]
    got = rt.backend.all_reduce(a, "sum")
    contributors = rt.place.n_parallel - 1 if rt.place.n_parallel > 1 else 1
    np.testing.assert_array_equal(got[0], np.full(3, 2.0 * contributors))


def _mismatch(rt, big):
    n = BIG if big else 3
    a = np.ones(n + rt.place.rank, np.float32)
    rt.backend.all_reduce([a], "sum")


def _broadcast(rt, root, with_out):
    shapes = [(3, 2), (), (BIG,)]
    if rt.place.rank == root:
        arrays = [_value(root, s, np.float32, i) for i, s in enumerate(shapes)]
        got = rt.backend.broadcast(arrays, root)
    else:
        out = [np.zeros(s, np.float32) for s in shapes] if with_out else None
        got = rt.backend.broadcast(None, root, out=out)
        if with_out:
            assert all(g is o for g, o in zip(got, out))
    for i, (g, s) in enumerate(zip(got, shapes)):
        np.testing.assert_array_equal(g, _value(root, s, np.float32, i))


def _gather(rt, root, everyone):
    # Shapes differ across ranks on purpose: a gather must not crop or pad.
    me = rt.place.rank
    arrays = [_value(me, (me + 1, 2), np.int64), _value(me, (), np.float32, 1)]
    got = rt.backend.all_gather(arrays) if everyone else rt.backend.gather(arrays, root)
    if not everyone and rt.place.rank != root:
        assert got is None
        return
    assert len(got) == rt.place.n_parallel
    for q, entry in enumerate(got):
        np.testing.assert_array_equal(entry[0], _value(q, (q + 1, 2), np.int64))
        np.testing.assert_array_equal(entry[1], _value(q, (), np.float32, 1))


def _scatter(rt, root):
    n = rt.place.n_parallel
    per_rank = None
    if rt.place.rank == root:
        per_rank = [[_value(q, (q + 2,), np.float32), _value(q, (2, 2), np.int32, 3)]
                    for q in range(n)]
    got = rt.backend.scatter(per_rank, root)
    me = rt.place.rank
    np.testing.assert_array_equal(got[0], _value(me, (me + 2,), np.float32))
    np.testing.assert_array_equal(got[1], _value(me, (2, 2), np.int32, 3))


def _sequence(rt):
    """Several collectives in one command reuse buffers; none may see another's data."""
    n, me = rt.place.n_parallel, rt.place.rank
    for step in range(3):
        big = _value(me, (BIG,), np.float32, step)
        got = rt.backend.all_reduce([big], "sum")
        np.testing.assert_allclose(got[0], _expect("sum", n, (BIG,), np.float32, step))
        small = rt.backend.all_gather([np.full(2, me + 10 * step)])
        assert [int(g[0][0]) for g in small] == [q + 10 * step for q in range(n)]
        root = step % n
        b = rt.backend.broadcast([np.full(BIG, float(root + step))] if me == root else None, root)
        np.testing.assert_array_equal(b[0], np.full(BIG, float(root + step)))
        g = rt.backend.all_reduce([np.full(5, float(me))], "max")
        np.testing.assert_array_equal(g[0], np.full(5, float(n - 1)))


_KEPT = {}  # per process: arrays a keyed collective handed over, kept across commands


def _keyed_reset(rt):
    _KEPT.clear()


def _keyed(rt, op, root, keeps_buffers):
    """Keep keyed results as one's arrays, change them in place, reduce again.

    After every round all ranks hold the same values x; each adds its rank in
    place (as a function updating a variable's storage would), so the next
    all_reduce must give op over ranks q of (x + q).
    """
    n, me = rt.place.n_parallel, rt.place.rank
    shapes = [(BIG,), (BIG // 2, 2), (3,), (0,), ()]
    keys = [10, 11, 12, 13, 14]
    kept = _KEPT.get(op)
    if kept is None:
        bases = [[_value(q, s, np.float32, i) for i, s in enumerate(shapes)] for q in range(n)]
        kept = [x.copy() for x in bases[me]]
    else:
        bases = [[x.copy() for x in kept] for _ in range(n)]
        if keeps_buffers and n > 1:
            assert rt.backend.is_kept(keys[0], kept[0])  # no copy-in this time
    for x in kept:
        x += me
    want = [_reduced(op, [bases[q][i] + q for q in range(n)]) for i in range(len(shapes))]
    got = rt.backend.all_reduce(kept, op, keys=keys)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5)
    b = rt.backend.broadcast(got if me == root else None, root, keys=keys)
    for x, y in zip(b, got):
        np.testing.assert_array_equal(x, y)
    g = rt.backend.gather(b, root, keys=keys)
    if me == root:
        for entry in g:
            for x, y in zip(entry, b):
                np.testing.assert_array_equal(x, y)
    else:
        for x, y in zip(g, b):
            np.testing.assert_array_equal(x, y)
        b = g
    _KEPT[op] = b


def _contribute(rt):
    if not rt.is_master:
        me = rt.place.rank
        rt.backend.contribute([np.full(3, float(me)), np.arange(me)], weight=me)


def _fail_in_worker(rt):
    if rt.place.rank == rt.place.n_parallel - 1 and not rt.is_master:
        raise RuntimeError("boom in the middle of a collective")
    rt.backend.all_reduce([np.ones(BIG, np.float32)], "sum")


# ---- the suite ------------------------------------------------------------------
class BackendSuite:
    backend = None
    keeps_buffers = False  # large keyed results stay in buffers the backend keeps

    @pytest.fixture
    def backend_env(self):
        """What the backend needs in place before fork (nothing, for the host backends)."""
        yield

    @pytest.fixture
    def start(self, forked, monkeypatch, backend_env):
        monkeypatch.setenv("SYNK_BACKEND", self.backend)
        monkeypatch.setitem(COMMANDS, TEST_CMD, COMMANDS[TEST_CMD]._replace(run=_run_test_fn))

        def _start(n):
            forked(n)
            rt = get_runtime()
            assert type(rt.backend).__name__.lower().startswith(self.backend)

            def run(fn, *args, after=None):
                return run_command(rt, TEST_CMD, (fn, args), local=lambda seq: fn(rt, *args),
                                   after=after)
            return run
        return _start

    @pytest.mark.parametrize("n", [1, 2, 3])
    def test_all_reduce_every_op_and_size(self, start, n):
        run = start(n)
        run(_barriers, 5)
        shapes = [(), (0,), (5,), (3, 4), (BIG,)]
        for op in OPS:
            for dtype in (np.float32, np.float64):
                run(_all_reduce, op, shapes, dtype, False)
                run(_all_reduce, op, [(BIG,), (7,), (BIG // 3, 3)], dtype, True)
            run(_all_reduce, op, [(4,), (BIG,)], np.int32, True)
        run(_mixed_ops, ["sum", "max", "avg", "min"])

    @pytest.mark.parametrize("n", [2, 3])
    def test_reduce_to_any_root(self, start, n):
        run = start(n)
        for op in OPS:
            for root in range(n):
                run(_reduce, op, root, (3, 2))
                run(_reduce, op, root, (BIG,))

    @pytest.mark.parametrize("n", [2, 3])
    def test_avg_weights_and_missing_contributions(self, start, n):
        run = start(n)
        run(_weighted_avg)
        run(_none_contribution)

    @pytest.mark.parametrize("n", [2, 3])
    def test_different_shapes_cannot_be_reduced(self, start, n):
        run = start(n)
        for big in (False, True):
            with pytest.raises(ValueError, match="differ across ranks"):
                run(_mismatch, big)
            run(_all_reduce, "sum", [(5,)], np.float32, False)

    @pytest.mark.parametrize("n", [1, 2, 3])
    def test_broadcast_gather_scatter(self, start, n):
        run = start(n)
        for root in range(n):
            run(_broadcast, root, False)
            run(_broadcast, root, True)
            run(_gather, root, False)
            run(_scatter, root)
        run(_gather, 0, True)

    @pytest.mark.parametrize("n", [2, 3])
    def test_collectives_in_one_command_do_not_mix(self, start, n):
        run = start(n)
        run(_sequence)
        run(_sequence)

    @pytest.mark.parametrize("n", [1, 2, 3])
    def test_keyed_results_are_kept_and_reused(self, start, n):
        run = start(n)
        run(_keyed_reset)
        for op in OPS:
            for step in range(3):
                run(_keyed, op, step % n, self.keeps_buffers)

    @pytest.mark.parametrize("n", [2, 3])
    def test_contribute_collect(self, start, n):
        run = start(n)
        rt = get_runtime()

        def after(_):
            got = rt.backend.collect()
            assert got[rt.place.rank] is None
            return [(list(map(np.array, g[0])), g[1]) for g in got if g is not None]
        for _ in range(3):
            got = run(_contribute, after=after)
            assert [w for _, w in got] == list(range(1, n))
            for r, (arrays, _) in enumerate(got, start=1):
                np.testing.assert_array_equal(arrays[0], np.full(3, float(r)))
                np.testing.assert_array_equal(arrays[1], np.arange(r))
        # Contributions nobody collects must not confuse the next collect.
        run(_contribute)
        run(_contribute)
        assert len(run(_contribute, after=after)) == n - 1

    def test_worker_failure_mid_collective(self, start):
        run = start(3)
        with pytest.raises(WorkerError) as info:
            run(_fail_in_worker)
        assert info.value.rank == 2
        run(_sequence)


class TestShmBackend(BackendSuite):
    backend = "shm"
    keeps_buffers = True


class TestZmqBackend(BackendSuite):
    backend = "zmq"


class TestNcclBackend(BackendSuite):
    """NCCL on its CPU stand-in for CuPy: the NCCL code paths and their host fallbacks."""

    backend = "nccl"

    @pytest.fixture
    def backend_env(self):
        names = ("cupy", "cupy.cuda", "cupy.cuda.nccl")
        saved = {k: sys.modules.get(k) for k in names}
        fake_cupy.install()  # before fork: the workers inherit it
        yield
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def test_every_backend_has_a_suite():
    suites = {cls.backend for cls in BackendSuite.__subclasses__()}
    # The MPI backend exists only under mpiexec: tests/cluster/test_cluster.py runs every
    # collective through it in real jobs.
    assert set(backend_names()) - {"mpi"} <= suites


def test_mpi_backend_needs_mpiexec(monkeypatch):
    monkeypatch.setenv("SYNK_BACKEND", "mpi")
    with pytest.raises(ValueError, match="mpiexec"):
        synk.fork(2, use_gpu=False)
    assert get_runtime() is None
