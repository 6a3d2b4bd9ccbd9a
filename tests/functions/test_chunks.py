"""Chunked calls (functions/chunks.py): the same bits on any number of ranks, work that
follows the free cores, failures reported, and the calls that keep their static split.

The expectation is independent of the library: the same graph compiled serially by
PyTensor, run on each chunk's rows, the results combined in chunk order by NumPy.
"""

import os
import signal
import time

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from synkhronos.functions import chunks, pace
from synkhronos.functions.measures import MeasureFile
from synkhronos.runtime.state import get_runtime

pytestmark = pytest.mark.timeout(180)

N_ROWS = 10_000  # 8 chunks of 1250 rows by the default rule


@pytest.fixture(autouse=True)
def _rows_rule(request, monkeypatch, tmp_path):
    """Chunks as the rows' rule cuts them, whatever a chunk costs on this machine (pace.py
    keeps fewer where a call's fixed cost shows, more where a pass ran faster in them),
    except in the tests of that; what pace measures goes to a file of the test's own."""
    monkeypatch.setattr(pace, "KEPT", MeasureFile("chunks.json", str(tmp_path)))
    if "pace" not in request.node.name:
        monkeypatch.setattr(pace, "SHARE", 1.0)
        monkeypatch.setattr(pace, "passes", lambda *args: {})


def _graph():
    x = pt.dmatrix("x")
    v = pt.dvector("v")
    outs = [(pt.sum(pt.exp(pt.sin(x * v)), axis=0), "sum"), (pt.sum(x ** 2), "sum"),
            (pt.mean(x * v), "avg"), (pt.max(x), "max")]
    return x, v, outs


def _chunked_expectation(X, vs):
    """What a chunked call must return, bit for bit: serial PyTensor per chunk, combined in order."""
    x, v, outs = _graph()
    serial = pytensor.function([x, v], [o for o, _ in outs])
    rows = chunks.chunk_rows(len(X))
    bounds = [(lo, min(len(X), lo + rows)) for lo in range(0, len(X), rows)]
    got = []
    for vv in vs:
        per = [serial(X[lo:hi], vv) for lo, hi in bounds]
        total = []
        for j, (_, op) in enumerate(outs):
            parts = [p[j] for p in per]
            if op == "sum":
                acc = parts[0].copy()
                for p in parts[1:]:
                    acc = acc + p
            elif op == "avg":
                w = [hi - lo for lo, hi in bounds]
                acc = parts[0] * (w[0] / float(sum(w)))
                for p, wi in zip(parts[1:], w[1:]):
                    acc = acc + p * (wi / float(sum(w)))
            else:
                acc = np.max(parts, axis=0)
            total.append(acc)
        got.append(total)
    return got


@pytest.fixture(scope="module")
def rows():
    rng = np.random.default_rng(5)
    X = rng.standard_normal((N_ROWS, 3))
    vs = [np.array([1.0, -0.5, 0.25]) * (1 + i) for i in range(4)]
    return X, vs, _chunked_expectation(X, vs)


def test_the_same_bits_on_any_number_of_ranks(rows):
    X, vs, want = rows
    seen = {}
    for n in (1, 2, 3, 4):
        synk.fork(n, use_gpu=False)
        try:
            x, v, outs = _graph()
            f = synk.function([x], outs, bcast_inputs=[v])
            synk.distribute()
            d = synk.data(X)
            vd = synk.data(np.zeros(3))
            got = []
            for vv in vs:
                vd.data[...] = vv
                # The first call of a shape runs chunk 0 in the master; the next are kept.
                for _ in range(3):
                    got.append([np.asarray(g).tobytes() for g in f(d, vd)])
            # A NumPy input (copied into shared memory each call) takes the same path.
            got.append([np.asarray(g).tobytes() for g in f(X, vs[-1])])
            assert f._chunks.plan is not None and f._chunks.plan.n_chunks == 8
        finally:
            synk.close()
        seen[n] = got
        assert all(g == got[0] for g in got[:3])
    assert seen[2] == seen[1] and seen[3] == seen[1] and seen[4] == seen[1]
    # The serial graph on each chunk, combined in chunk order.
    for i, w in enumerate(want):
        for g, e in zip(seen[1][3 * i], w):
            np.testing.assert_allclose(np.frombuffer(g), np.ravel(e), rtol=1e-13)
    np.testing.assert_allclose(np.frombuffer(seen[1][-1][1]), (X ** 2).sum(), rtol=1e-12)
    np.testing.assert_array_equal(np.frombuffer(seen[1][-1][3]), X.max())


def test_a_stopped_worker_costs_no_call(forked, rows):
    X, vs, want = rows
    forked(2)
    x, v, outs = _graph()
    f = synk.function([x], outs, bcast_inputs=[v])
    g = synk.function([x], (x.sum(), "sum"))
    synk.distribute()
    d = synk.data(X)
    vd = synk.data(vs[0])
    f(d, vd)
    worker = get_runtime().processes.procs[1]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        for _ in range(5):
            got = f(d, vd)
            for a, e in zip(got, want[0]):
                np.testing.assert_allclose(a, e, rtol=1e-13)
        assert time.monotonic() - t0 < 5.0
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    # Another command waits for the worker to pass the calls it skipped, then runs.
    np.testing.assert_allclose(g(d), X.sum(), rtol=1e-12)
    np.testing.assert_allclose(f(d, vd)[0], want[0][0], rtol=1e-13)


class FailInWorker(pytensor.graph.op.Op):
    """Return x; raise in the workers when the flag input is 1, in the master when it is 2.

    With flag 1 the master sleeps in each chunk it takes, so that the workers, however
    late the schedule wakes them, take chunks before the master has run them all.
    """

    __props__ = ()

    def make_node(self, x, flag):
        x, flag = pt.as_tensor_variable(x), pt.as_tensor_variable(flag)
        return pytensor.graph.basic.Apply(self, [x, flag], [x.type()])

    def perform(self, node, inputs, outputs):
        x, flag = inputs
        master = get_runtime().is_master
        if (flag == 1 and not master) or (flag == 2 and master):
            raise ValueError(f"chunk failed in rank {get_runtime().place.rank}")
        if flag == 1:
            time.sleep(0.05)
        outputs[0][0] = x.copy()


def test_a_failing_chunk_is_reported_and_the_run_goes_on(forked):
    forked(3)
    x = pt.dmatrix("x")
    flag = pt.lscalar("flag")
    f = synk.function([x], (FailInWorker()(x, flag).sum(), "sum"), bcast_inputs=[flag],
                      mode="FAST_COMPILE")
    synk.distribute()
    X = np.arange(2.0 * N_ROWS).reshape(N_ROWS, 2)
    d = synk.data(X)
    ok, bad = synk.data(np.array(0)), synk.data(np.array(1))
    assert f(d, ok) == X.sum()
    for _ in range(3):
        # The master's chunks take 50 ms each (8 chunks): a worker takes one meanwhile.
        with pytest.raises(synk.WorkerError, match="chunk failed in rank [12]"):
            f(d, bad)
    assert f(d, ok) == X.sum()
    # The master's own chunk 0 of a new shape, run before the call is posted, fails as
    # any rank's share does.
    with pytest.raises(synk.WorkerError, match="chunk failed in rank 0"):
        f(synk.data(X[:-1]), synk.data(np.array(2)))
    assert f(d, ok) == X.sum()


def test_calls_that_keep_the_static_split(forked):
    forked(2)
    x = pt.dmatrix("x")
    s = pytensor.shared(np.zeros(2), name="s")
    gathered = synk.function([x], (x * 2, "gather"))
    updating = synk.function([x], (x.sum(), "sum"), updates=[(s, s + x.sum(axis=0))])
    reduced = synk.function([x], (x.sum(axis=0), "sum"))
    synk.distribute()
    X = np.ones((N_ROWS, 2))
    d = synk.data(X)
    np.testing.assert_array_equal(gathered(d), X * 2)
    assert updating(d) == 2 * N_ROWS
    small = synk.data(X[:100])
    np.testing.assert_array_equal(reduced(small), [100, 100])
    np.testing.assert_array_equal(reduced(d, batch=slice(0, N_ROWS // 2)), [N_ROWS // 2] * 2)
    assert gathered._chunks.plan is None and updating._chunks.plan is None
    assert reduced._chunks.plan is None
    np.testing.assert_array_equal(reduced(d), [N_ROWS, N_ROWS])
    assert reduced._chunks.plan is not None


def test_a_function_built_at_its_first_call_is_built_on_every_rank_before_chunks(forked, rows):
    """Its first call runs once with the static split, so that every rank has built the
    function before chunks start (and the master does not run every chunk alone meanwhile);
    what it returns is the chunked call's: the same bits at the first call as at the next."""
    from synkhronos.functions.build import function_at_first_call

    X, vs, want = rows
    forked(2)
    x, v, outs = _graph()
    f = function_at_first_call([x], outputs=outs, bcast_inputs=[v])
    g = function_at_first_call([x], outputs=outs, bcast_inputs=[v])
    synk.distribute()
    d = synk.data(X)
    g(d, vs[1])                                   # g built and chunked
    assert g._chunks.plan is not None
    first = f(d, vs[0])
    assert f._chunks.plan is not None
    for got, again, ref in zip(first, g(d, vs[0]), want[0]):
        np.testing.assert_allclose(got, ref, rtol=1e-12)
        np.testing.assert_array_equal(got, again)  # the first call has the chunked bits
    for vv, ref in zip(vs[1:], want[1:]):
        got = f(d, vv)
        for g_, again, r in zip(got, f(d, vv), ref):
            np.testing.assert_allclose(g_, r, rtol=1e-13)
            np.testing.assert_array_equal(g_, again)


def test_chunk_rows_rule_and_setting():
    assert chunks.chunk_rows(1000, {}) == 0                   # too few rows: static split
    assert chunks.chunk_rows(2048, {}) == 1024                # 2 chunks
    assert chunks.chunk_rows(10_000, {}) == 1250              # 8 chunks (a power of two)
    assert chunks.chunk_rows(10 ** 6, {}) == 3907             # at most 256 (timed: pace.py)
    assert chunks.chunk_rows(10_000, {"SYNK_CHUNK_ROWS": "0"}) == 0
    assert chunks.chunk_rows(10_000, {"SYNK_CHUNK_ROWS": "3000"}) == 3000
    assert chunks.chunk_rows(5_000, {"SYNK_CHUNK_ROWS": "3000"}) == 0
    with pytest.raises(ValueError, match="SYNK_CHUNK_ROWS"):
        chunks.chunk_rows(10_000, {"SYNK_CHUNK_ROWS": "many"})
    with pytest.raises(ValueError, match="SYNK_CHUNK_ROWS"):
        chunks.chunk_rows(10_000, {"SYNK_CHUNK_ROWS": "-1"})


def test_a_bad_chunk_setting_is_refused_at_fork(monkeypatch):
    monkeypatch.setenv("SYNK_CHUNK_ROWS", "lots")
    with pytest.raises(ValueError, match="SYNK_CHUNK_ROWS must be a number of rows"):
        synk.fork(2, use_gpu=False)
    assert get_runtime() is None


class _Clock:
    """A clock that only ``run`` moves: a call costs ``fixed`` seconds and ``per_row(rows)``
    a row, so a test knows what each pass over the rows takes."""

    def __init__(self, fixed, per_row):
        self.now, self.fixed, self.per_row, self.calls = 0.0, fixed, per_row, []

    def perf_counter(self):
        return self.now

    def run(self, lo, hi):
        self.calls.append((lo, hi))
        self.now += self.fixed + (hi - lo) * self.per_row(hi - lo)
        return [np.zeros(3)]


def test_pace_rule():
    """Fewer chunks where a call's fixed cost would be more than pace.SHARE of a chunk's
    time, never fewer than the machine's cores (a power of two) or two."""
    us = 1e-6
    # A radon-style graph at 10^5 rows: 4 us a call beside 180 us of rows.
    assert pace.fewest(4 * us, 180 * us, 16, 2) == 2
    assert pace.fewest(4 * us, 180 * us, 16, 3) == 4          # 3 cores: 4 chunks
    assert pace.fewest(4 * us, 180 * us, 16, 16) == 16        # every core a chunk
    assert pace.fewest(4 * us, 180 * us, 8, 16) == 8          # at most the rows' rule
    assert pace.fewest(4 * us, 180 * us, 16, 1) == 2          # never the static split
    # A logistic regression: 5 us a call; 4.5 ms of rows at 10^5, 450 us at 10^4.
    assert pace.fewest(5 * us, 4500 * us, 16, 2) == 16
    assert pace.fewest(5 * us, 450 * us, 8, 2) == 2           # 225 us each: 2.6% fixed
    # A large whole term (1.2 ms a call) beside cheap rows: one chunk a core.
    assert pace.fewest(1200 * us, 500 * us, 16, 2) == 2


def test_pace_rule_over_the_rows_passes(monkeypatch):
    """Where a pass over all the rows ran over pace.SHARE faster in another count than in
    the one a chunk's fixed cost gives, the fastest is kept; the passes cover every row,
    from one chunk a core to the rows' rule's count, and stop once they only grow."""
    assert [pace.fewest_chunks(c) for c in (1, 2, 3, 16, 17)] == [2, 2, 4, 16, 32]
    assert pace.chosen(4, {2: 1.0, 4: 1.04, 8: 1.2}) == 4       # 4% slower: kept
    assert pace.chosen(4, {2: 1.0, 4: 1.06, 8: 1.2}) == 2
    assert pace.chosen(16, {16: 1.0, 32: 0.9}) == 32
    assert pace.chosen(16, {2: 1.0, 4: 1.6}) == 2               # 16 not timed: past it
    assert pace.chosen(8, {}) == 8
    n_rows, us, ns = 100_000, 1e-6, 1e-9
    # A radon-style graph: 4 us a call beside 120 us of rows.
    clock = _Clock(4 * us, lambda rows: 1.2 * ns)
    monkeypatch.setattr(pace, "time", clock)
    seconds = pace.passes(clock.run, n_rows, 2, 64)
    assert pace.chosen(2, seconds) == 2
    # Each pass covers every row once, in order, in chunks of equal rows (the last less).
    assert clock.calls[:2] == [(0, 50_000), (50_000, 100_000)]
    # Timing stopped at a pass over pace.PAST times the fastest: 32 chunks (248 us
    # against 128), so 64 were not timed.
    assert sorted(seconds) == [2, 4, 8, 16, 32]
    # Rows that stay in a core's cache between the graph's passes (up to 6,000 rows a
    # chunk) cost a third: 32 chunks, though a chunk's fixed cost would keep 4.
    clock = _Clock(3 * us, lambda rows: (2 if rows <= 6000 else 6) * ns)
    monkeypatch.setattr(pace, "time", clock)
    seconds = pace.passes(clock.run, n_rows, 2, 64)
    assert pace.chosen(4, seconds) == 32 and sorted(seconds) == [2, 4, 8, 16, 32, 64]
    # Costly rows: the passes differ by under 5%, the count stays.
    clock = _Clock(5 * us, lambda rows: 100 * ns)
    monkeypatch.setattr(pace, "time", clock)
    assert pace.chosen(16, pace.passes(clock.run, n_rows, 2, 64)) == 16
    # A large whole term (1.2 ms a call) beside cheap rows: one chunk a core.
    clock = _Clock(1200 * us, lambda rows: 5 * ns)
    monkeypatch.setattr(pace, "time", clock)
    seconds = pace.passes(clock.run, n_rows, 4, 64)
    assert pace.chosen(4, seconds) == 4 and sorted(seconds) == [4, 8]


def test_pace_reads_only_a_fit_it_could_have_kept():
    """A count kept on disk is used only where it is a whole fit that the rows' rule's
    chunks allow; else (an older file's bare count, a damaged entry) the call is timed."""
    fit = pace.Fit(4, 8e-6, 3e-9)
    assert pace._kept(fit._asdict(), 16) == fit
    assert pace._kept(fit._asdict(), 2) is None                 # more than the rows' rule
    assert pace._kept(4, 16) is None and pace._kept(None, 16) is None
    for bad in ({"chunks": 3, "fixed_s": 0.0, "row_s": 0.0},      # not a power of two
                {"chunks": 4, "fixed_s": -1.0, "row_s": 0.0},
                {"chunks": 4, "fixed_s": float("nan"), "row_s": 0.0},
                {"chunks": 4.5, "fixed_s": 0.0, "row_s": 0.0},
                {"chunks": 4, "fixed_s": "x", "row_s": 0.0},
                {"chunks": 4, "fixed_s": 0.0}, [4, 0.0, 0.0]):
        assert pace._kept(bad, 16) is None, bad
    assert fit.fixed_per_rank(2) == pytest.approx(2 * (8e-6 + pace.MACHINERY_S))
    assert fit.fixed_per_rank(3) == fit.fixed_per_rank(2)


def _one_chunk_a_core():
    """What pace keeps at 10^5 rows where a chunk's fixed cost shows: the machine's cores, a
    power of two, at most 16."""
    return min(pace.BALANCED, pace.fewest_chunks(os.cpu_count() or 1))


def _cut_expectation(X, rows):
    """The sum by a serial PyTensor function on each chunk of ``rows`` rows, combined in
    chunk order."""
    x = pt.dvector("x")
    serial = pytensor.function([x], x.sum())
    acc = None
    for lo in range(0, len(X), rows):
        part = serial(X[lo:lo + rows])
        acc = part if acc is None else acc + part
    return acc


def test_pace_cheap_chunks_are_fewer_the_same_at_any_rank_count_and_kept(monkeypatch):
    """A cheap call at 10^5 rows is cut into as few chunks as the machine's cores (a
    chunk's fixed cost would be most of its time; the passes over the rows, which could
    choose another count, not timed here); the count is measured once, kept on disk, and
    every later run cuts the rows the same way, at any number of ranks: the same bits."""
    monkeypatch.setattr(pace, "passes", lambda *args: {})
    X = np.sin(np.arange(100_000.0) * 0.37) * 1e3 + 1e-3
    seen, counts, fits = {}, {}, {}
    for n in (1, 2, 3):
        synk.fork(n, use_gpu=False)
        try:
            x = pt.dvector("x")
            f = synk.function([x], (x.sum(), "sum"))
            synk.distribute()
            d = synk.data(X)
            got = [np.asarray(f(d)).tobytes() for _ in range(3)]
            counts[n] = f._chunks.plan.n_chunks
            fits[n] = f.chunk_fit
        finally:
            synk.close()
        assert got[1:] == got[:2]
        seen[n] = got[0]
        if n == 1:
            # Kept: the next runs read it and time nothing.
            def no_timing(*args):
                raise AssertionError("measured again")
            monkeypatch.setattr(pace, "_measured", no_timing)
            monkeypatch.setattr(pace, "passes", no_timing)
    assert counts[1] == counts[2] == counts[3] == _one_chunk_a_core(), counts
    # What the count was cut by is kept with it: a fixed cost and a row's time.
    assert fits[1].chunks == counts[1] and fits[1].row_s > 0.0 and fits[1].fixed_s >= 0.0
    assert fits[2] == fits[1] and fits[3] == fits[1], fits
    assert seen[2] == seen[1] and seen[3] == seen[1]
    rows = -(-len(X) // counts[1])
    np.testing.assert_array_equal(np.frombuffer(seen[1]), [_cut_expectation(X, rows)])
    assert abs(np.frombuffer(seen[1])[0] - X.sum()) < 1e-9 * np.abs(X).sum()


def test_pace_costly_chunks_keep_the_rows_rule(forked, monkeypatch):
    """A call whose rows' work hides its fixed cost keeps the rows' 16 chunks (where no
    other count's pass over the rows ran faster: not timed here)."""
    monkeypatch.setattr(pace, "passes", lambda *args: {})
    forked(2)
    x = pt.dmatrix("x")
    f = synk.function([x], (pt.sum(pt.exp(pt.sin(x)) * pt.cos(x), axis=0), "sum"))
    synk.distribute()
    X = np.sin(np.arange(100_000.0 * 16).reshape(100_000, 16))
    got = f(X)
    assert f._chunks.plan.n_chunks == 16
    np.testing.assert_allclose(got, (np.exp(np.sin(X)) * np.cos(X)).sum(axis=0), rtol=1e-11)


def test_pace_a_large_fixed_cost_keeps_one_chunk_a_core(forked):
    """A call that does much work beside its rows (as a PyMC model's large whole term
    does; here a product of a broadcast matrix) is cut into one chunk a core, not the
    rows' 16, though each chunk takes well over a millisecond."""
    forked(2)
    x, M, w = pt.dvector("x"), pt.dmatrix("M"), pt.dscalar("w")
    f = synk.function([x], (x.sum() + pt.sum(pt.dot(M, M)) * w, "sum"), bcast_inputs=[M, w])
    cheap = synk.function([x], (x.sum(), "sum"))
    synk.distribute()
    X = np.sin(np.arange(100_000.0) * 0.37)
    got = f(X, np.full((200, 200), 0.5), np.float64(0.0))
    assert f._chunks.plan.n_chunks == _one_chunk_a_core()
    cheap(X)
    fit, sum_fit = f.chunk_fit, cheap.chunk_fit
    # The product (8 MFLOP a call) is fitted as fixed cost: many times the sum's alone.
    assert fit.chunks == _one_chunk_a_core() and fit.fixed_s > 10 * sum_fit.fixed_s + 20e-6, (
        fit, sum_fit)
    np.testing.assert_allclose(got, X.sum(), rtol=1e-12)
