"""The Batcher: concurrent chains' (logp, dlogp) requests in one call, a lone chain straight through.

No synkhronos runtime: ``evaluate`` and ``one`` are plain functions that
record how they were called.  Skipped where PyMC is not installed (the
package imports it).
"""

import threading
import time

import numpy as np
import pytest

pytest.importorskip("pymc", reason="PyMC is not installed (pip install -e '.[pymc]')")

from synkhronos.extensions.pymc.batching import BatchAborted, Batcher  # noqa: E402

pytestmark = pytest.mark.timeout(60)


class Recorder:
    """logp(x) = sum(x), grad(x) = 2x; records the batch sizes it was called with."""

    def __init__(self, fail=None, delay=0.0):
        self.delay = delay       # seconds a call takes (the GIL released, as a synk call does)
        self.batches = []
        self.ones = 0
        self.fail = fail
        self.lock = threading.Lock()

    def evaluate(self, positions):
        with self.lock:
            self.batches.append(len(positions))
        time.sleep(self.delay)
        if self.fail:
            raise self.fail
        P = np.stack(positions)
        return P.sum(axis=1), 2 * P

    def one(self, x):
        with self.lock:
            self.ones += 1
        time.sleep(self.delay)
        if self.fail:
            raise self.fail
        return float(np.sum(x)), 2 * np.asarray(x)


def _run_threads(batcher, n, steps, results):
    start = threading.Barrier(n)

    def chain(i):
        start.wait()
        try:
            for s in range(steps):
                x = np.full(3, 10.0 * i + s)
                results[i].append((x, batcher(x)))
        finally:
            batcher.leave()

    threads = [threading.Thread(target=chain, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)


def test_a_lone_chain_goes_straight_to_one():
    rec = Recorder()
    b = Batcher(rec.evaluate, one=rec.one)
    for s in range(5):
        lp, g = b(np.full(3, float(s)))
        assert lp == 3.0 * s and np.array_equal(g, np.full(3, 2.0 * s))
    assert rec.ones == 5 and rec.batches == []
    assert b.calls == 5 and b.positions == 5


def test_without_one_a_lone_chain_is_a_batch_of_one():
    rec = Recorder()
    b = Batcher(rec.evaluate)
    lp, g = b(np.ones(3))
    assert lp == 3.0 and np.array_equal(g, np.full(3, 2.0))
    assert rec.batches == [1]


def test_expected_chains_meet_in_one_call_each_getting_its_row():
    rec = Recorder(delay=0.001)
    b = Batcher(rec.evaluate, one=rec.one)
    b.expect(3)
    results = {i: [] for i in range(3)}
    _run_threads(b, 3, 20, results)
    for i in range(3):
        for x, (lp, g) in results[i]:
            assert lp == x.sum() and np.array_equal(g, 2 * x)
    # Every step of the three chains in one call, until chains finish.
    assert rec.batches.count(3) >= 15, rec.batches
    assert b.positions == 60 and b.calls < 30


def test_threads_started_elsewhere_are_batched_by_what_was_seen():
    rec = Recorder(delay=0.002)
    b = Batcher(rec.evaluate, one=rec.one, max_wait_s=0.05)
    results = {i: [] for i in range(2)}
    _run_threads(b, 2, 30, results)
    for i in range(2):
        for x, (lp, g) in results[i]:
            assert lp == x.sum() and np.array_equal(g, 2 * x)
    assert b.positions == 60 and b.positions > 1.3 * b.calls, (b.positions, b.calls)


def test_a_failed_call_reaches_every_chain_of_its_batch():
    rec = Recorder(fail=ZeroDivisionError("in the graph"))
    b = Batcher(rec.evaluate, one=rec.one)
    with pytest.raises(ZeroDivisionError):
        b(np.ones(3))
    b.expect(2)
    errors = []

    def chain():
        try:
            b(np.ones(3))
        except ZeroDivisionError as exc:
            errors.append(exc)
        finally:
            b.leave()

    threads = [threading.Thread(target=chain) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(errors) == 2 and rec.batches == [2]
    # The batcher is usable afterwards.
    rec.fail = None
    b.reset()
    assert b(np.ones(3))[0] == 3.0


def test_abort_stops_waiting_and_later_requests():
    rec = Recorder()
    b = Batcher(rec.evaluate, one=rec.one)
    b.expect(2)
    out = []

    def waiting():
        try:
            b(np.ones(3))
        except BatchAborted as exc:
            out.append(exc)

    t = threading.Thread(target=waiting)
    t.start()
    b.abort(RuntimeError("chain 1 failed"))
    t.join(10)
    assert len(out) == 1 and isinstance(out[0].__cause__, RuntimeError)
    with pytest.raises(BatchAborted):
        b(np.ones(3))
