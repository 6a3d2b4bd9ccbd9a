"""Collectives between machines' leaders (comm/mpi_leaders.py, comm/mpi_reduce.py).

The reductions' arithmetic is checked here against a stand-in for MPI with one
leader; the communicator's reset after an aborted collective, in a real
``mpiexec`` job on simulated machines (leaders_reset_job.py).
"""

import os
import sys

import numpy as np
import pytest

from synkhronos.comm import reduce_ops
from synkhronos.comm import leaders, mpi_leaders, mpi_reduce, mpi_small

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "leaders_reset_job.py")
SMALL_JOB = os.path.join(HERE, "small_reduce_job.py")


class OneLeader:
    """``Leaders`` of a run with one machine: every collective returns this leader's own bytes."""

    size = 1

    def __init__(self):
        self.pool = {}
        self.calls = []

    buffer = mpi_leaders.MpiLeaders.buffer
    reduces = staticmethod(mpi_leaders.mpi_reduces)

    def all_reduce(self, sends, check):
        self.calls.append(("all_reduce", [(a.dtype, a.size, op) for a, op, _ in sends]))
        out = []
        for i, (a, _, into) in enumerate(sends):
            buf = into.reshape(-1) if into is not None else self.buffer(("r", i), a.nbytes)
            if not mpi_leaders._owned(a, buf):
                buf.view(a.dtype)[:] = a.reshape(-1)
            out.append(buf)
        return out

    def all_gather_fixed(self, mine, check):
        self.calls.append(("all_gather", mine.nbytes))
        return mine.reshape(1, -1)


def _contributions(dtype, n_contrib=3):
    rng = np.random.default_rng(0)
    return [[(rng.normal(size=(4, 5)) * 10).astype(dtype),
             (rng.normal(size=70000) * 10).astype(dtype),
             np.array(rng.normal() * 10).astype(dtype)] for _ in range(n_contrib)]


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "float16", "bool"])
@pytest.mark.parametrize("op", ["avg", "sum", "prod", "max", "min"])
@pytest.mark.parametrize("weighted", [False, True])
def test_reduce_across_one_machine_is_numpys(dtype, op, weighted):
    vals = _contributions(dtype)
    weights = [1.0, 3.0, 2.0] if weighted else None
    leaders = OneLeader()
    # The machine's partial (its shared-memory stage's result) and its mass.
    partials = [reduce_ops.combine(op, [v[i] for v in vals], weights) for i in range(3)]
    mass = float(sum(weights)) if weighted else 3.0
    got = mpi_reduce.reduce_across(leaders, partials, [op] * 3, mass, None, lambda: None)
    for i in range(3):
        exp = reduce_ops.combine(op, [v[i] for v in vals], weights)
        assert got[i].dtype == exp.dtype and got[i].shape == exp.shape
        if op == "avg":
            # Sums of terms of size ~10 in the partial's precision (float32: ~1e-6 * 10).
            tol = {"float16": 0.1, "float32": 1e-4}.get(dtype, 1e-9)
            np.testing.assert_allclose(got[i], exp, rtol=1e-6, atol=tol)
        else:
            assert np.array_equal(got[i], exp)
    kinds = {c[0] for c in leaders.calls}
    assert ("all_reduce" in kinds) == mpi_leaders.mpi_reduces(op, reduce_ops.result_dtype(op, dtype))


def test_small_arrays_of_one_op_and_dtype_travel_in_one_message():
    leaders = OneLeader()
    partials = [np.ones(3, np.float32), np.ones((2, 2), np.float32), np.ones(5, np.int64)]
    out = [np.empty(3, np.float32), None, None]
    got = mpi_reduce.reduce_across(leaders, partials, ["avg", "avg", "sum"], 1.0, out,
                                   lambda: None)
    assert got[0] is out[0]
    # float32 avg (with the mass beside it) and int64 sum: two messages.
    (_, sends), = leaders.calls
    assert sorted((str(d), n) for d, n, _ in sends) == [("float32", 3 + 4 + 1), ("int64", 5)]


def test_large_results_land_in_the_buffers_given():
    leaders = OneLeader()
    a = np.arange(70000, dtype=np.float32)
    into = [np.empty_like(a), None]
    got = mpi_reduce.reduce_across(leaders, [a, a[:3].copy()], ["avg", "sum"], 1.0, None,
                                   lambda: None, into)
    assert got[0] is into[0] and np.array_equal(got[0], a)
    assert np.array_equal(got[1], a[:3])


def test_mpi_reduces_only_what_gives_numpys_bytes():
    assert mpi_leaders.mpi_reduces("sum", "float32")
    assert mpi_leaders.mpi_reduces("max", "int16")
    # NaN and -0.0 make C's comparison differ from np.maximum, and by operand order.
    assert not mpi_leaders.mpi_reduces("max", "float32")
    assert not mpi_leaders.mpi_reduces("sum", "float16")
    assert not mpi_leaders.mpi_reduces("sum", "bool")
    assert not mpi_leaders.mpi_reduces("sum", ">f4")


def test_messages_round_trip():
    obj = [[np.arange(100000.0), np.array(3, np.int8)], None, [np.zeros((0, 4), np.float16)],
           [np.arange(12.0).reshape(3, 4)[:, 1]]]
    got = leaders.loads(leaders.dumps(obj))
    assert got[1] is None
    for a, b in zip([obj[0][0], obj[0][1], obj[2][0], obj[3][0]],
                    [got[0][0], got[0][1], got[2][0], got[3][0]]):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


class TwinLeaders:
    """``Leaders`` of two machines holding the same partials: each reduction is ``op(x, x)``.

    Records what each collective sends (dtype, elements, op), so the small
    all-reduce's plan can be held against ``reduce_across``.
    """

    size = 2
    epoch = 0
    reduces = staticmethod(mpi_leaders.mpi_reduces)
    buffer = mpi_leaders.MpiLeaders.buffer

    def __init__(self):
        self.pool = {}
        self.calls = []

    @staticmethod
    def _twice(buf, op):
        reduce_ops.UFUNCS[op](buf, buf, out=buf)

    def all_reduce(self, sends, check):
        out = []
        for i, (a, op, into) in enumerate(sends):
            buf = into.reshape(-1) if into is not None else self.buffer(("r", i), a.nbytes)
            if not mpi_leaders._owned(a, buf):
                buf.view(a.dtype)[:] = a.reshape(-1)
            self.calls.append((a.dtype.str, a.size, op))
            self._twice(buf.view(a.dtype), op)
            out.append(buf)
        return out

    def all_reduce_kept(self, sends, check):
        for buf, op in sends:
            self.calls.append((buf.dtype.str, buf.size, op))
            self._twice(buf, op)


SMALL_CASES = [
    ("avg", [np.float32, np.float32]), ("sum", [np.float64, np.int32, np.float64]),
    ("prod", [np.float32]), ("max", [np.int64, np.int8]), ("min", [np.int16]),
    ("avg", [np.float64]),
]


@pytest.mark.parametrize("voters", [0, 2])
@pytest.mark.parametrize("op,dtypes", SMALL_CASES)
def test_small_all_reduce_makes_the_general_paths_calls_and_bytes(op, dtypes, voters):
    rng = np.random.default_rng(1)
    shapes = [(), (3,), (2, 5), (0,), (7,)]
    arrays = [np.asarray(rng.normal(size=shapes[i % len(shapes)]) * 10).astype(d)
              for i, d in enumerate(dtypes)]
    general, small = TwinLeaders(), TwinLeaders()
    # Where a ballot rides, the general path votes no (its share may go on after the collective).
    ballot = mpi_small.Ballot(op, voters, yes=False) if voters else None
    assert mpi_small.eligible(general, arrays, op)
    expected = mpi_reduce.reduce_across(general, [a.copy() for a in arrays], [op] * len(arrays),
                                        1.0, None, lambda: None, ballot=ballot)
    mine = [a.copy() for a in arrays]
    plan = mpi_small.SmallPlan(small, mine, op, voters)
    assert plan.ok and plan.fits(small, mine, voters)
    passed = plan.run(small, lambda: None)
    assert small.calls == general.calls
    # Both twins voted alike: yes on the small path, no on the general one.
    assert passed == bool(voters) and (ballot is None or not ballot.passed)
    for got, exp in zip(mine, expected):
        assert got.dtype == exp.dtype and got.shape == exp.shape
        assert got.tobytes() == np.ascontiguousarray(exp).tobytes()
    # Run again on new values in the same arrays: the plan copies them in each time.
    for a in mine:
        a[...] = 1
    plan.run(small, lambda: None)
    assert all(np.all(a == (1 if op in ("avg", "max", "min", "prod") else 2)) for a in mine)


@pytest.mark.parametrize("op", ["avg", "sum", "prod", "max", "min"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.uint8, np.int64])
def test_a_ballot_passes_only_when_every_leader_votes_yes(op, dtype):
    if not mpi_leaders.mpi_reduces(op, dtype) or reduce_ops.result_dtype(op, dtype) != dtype:
        pytest.skip("no small path for this op and dtype")
    n = mpi_small.MAX_VOTERS if np.dtype(dtype).itemsize == 1 else 5
    for yes in ([True] * n, [True] * (n - 1) + [False], [False] * n):
        ballots = [mpi_small.Ballot(op, n, y) for y in yes]
        reduced = np.array(ballots[0].vote, dtype)
        for b in ballots[1:]:
            reduce_ops.UFUNCS[op](reduced, np.array(b.vote, dtype), out=reduced)
        ballots[0].count(reduced)
        assert ballots[0].passed == all(yes), (op, dtype, yes)


@pytest.mark.parametrize("why,arrays,op", [
    ("float max: MPI's NaN differs", [np.ones(2, np.float32)], "max"),
    ("int avg gives float64", [np.ones(2, np.int32)], "avg"),
    ("large: its own message", [np.ones(leaders.PACK_BYTES // 4, np.float32)], "sum"),
    ("float16", [np.ones(2, np.float16)], "sum"),
])
def test_small_all_reduce_declines_what_the_general_path_does_differently(why, arrays, op):
    assert not mpi_small.eligible(TwinLeaders(), arrays, op), why
    assert not mpi_small.SmallPlan(TwinLeaders(), arrays, op, 2).ok, why


def test_an_array_not_writable_in_place_declines_but_stays_eligible():
    """Its machine goes the general path, whose message carries the same ballot slot."""
    a = np.ones((4, 4), np.float32)[:, 1]
    b = np.ones(3, np.float32)
    b.flags.writeable = False
    for arrays in ([a], [b]):
        assert mpi_small.eligible(TwinLeaders(), arrays, "sum")
        assert not mpi_small.SmallPlan(TwinLeaders(), arrays, "sum", 2).ok


def test_small_plan_is_dropped_when_the_arrays_communicator_or_layout_change():
    leaders = TwinLeaders()
    a = np.ones(3, np.float32)
    plan = mpi_small.SmallPlan(leaders, [a], "sum", 2)
    assert plan.fits(leaders, [a], 2)
    assert not plan.fits(leaders, [a.copy()], 2)  # set_value gave the variable a new array
    assert not plan.fits(leaders, [a], 3)  # a machine joined
    leaders.epoch += 1  # an aborted command renewed the leaders' communicator
    assert not plan.fits(leaders, [a], 2)


def _no_mpi():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed"
    if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "mpiexec")):
        return "no mpiexec next to this Python"
    return None


@pytest.mark.skipif(_no_mpi() is not None, reason=_no_mpi() or "")
@pytest.mark.timeout(240)
def test_collectives_are_right_after_aborted_ones():
    """A rank fails while the other leaders are inside MPI's all-reduce; the next ones are exact."""
    from helpers.cluster_jobs import assert_nothing_left, machines, mpirun

    with machines(3) as m:
        rc, out, _ = mpirun(m, 3, [JOB, "2"])
        assert rc == 0 and "ALL OK" in out, out
        assert out.count("OK after a failure") == 4, out
        assert_nothing_left(m, out, "leaders_reset_job.py")


def test_ballots_only_where_every_machine_has_one_rank_and_votes_count_exactly():
    assert mpi_small.voters([1, 1]) == 2
    assert mpi_small.voters([1, 1, 1]) == 3
    assert mpi_small.voters([1]) == 0  # one machine: no report to spare
    assert mpi_small.voters([1, 2]) == 0
    assert mpi_small.voters([1] * mpi_small.MAX_VOTERS) == mpi_small.MAX_VOTERS
    assert mpi_small.voters([1] * (mpi_small.MAX_VOTERS + 1)) == 0


@pytest.mark.skipif(_no_mpi() is not None, reason=_no_mpi() or "")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("n_machines", [2, 3])
def test_small_all_reduces_on_machines_of_one_rank(n_machines):
    """The latency path and its ballot, beside failures and the general path (small_reduce_job.py)."""
    from helpers.cluster_jobs import assert_nothing_left, machines, mpirun

    with machines(n_machines) as m:
        rc, out, _ = mpirun(m, n_machines, [SMALL_JOB])
        assert rc == 0 and "ALL OK" in out, out
        assert sum(line.startswith("OK ") for line in out.splitlines()) == 5, out
        assert_nothing_left(m, out, "small_reduce_job.py")

