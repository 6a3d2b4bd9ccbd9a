"""The Batcher: chains' (logp, dlogp) requests in one call, a lone chain straight through.

No synkhronos runtime: ``evaluate`` and ``one`` are plain functions that
record how they were called.  Skipped where PyMC is not installed (the
package imports it).
"""

import os
import signal
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
        for s in range(steps):
            x = np.full(3, 10.0 * i + s)
            results[i].append((x, batcher(x)))

    threads = [threading.Thread(target=chain, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)


def _chain(batcher, i, steps, results, fail_at=None):
    """A chain body for run_together: ``steps`` requests, or an error at step ``fail_at``."""
    def body():
        for s in range(steps):
            if s == fail_at:
                raise ValueError(f"chain {i} diverged")
            x = np.full(3, 10.0 * i + s)
            results[i].append((x, batcher(x), threading.get_ident()))
    return body


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


def test_chains_run_together_meet_in_one_call_each_getting_its_row():
    rec = Recorder()
    b = Batcher(rec.evaluate, one=rec.one)
    results = {i: [] for i in range(3)}
    steps = {0: 20, 1: 20, 2: 12}
    errors, interrupted = b.run_together([_chain(b, i, steps[i], results) for i in range(3)])
    assert errors == [] and not interrupted
    me = threading.get_ident()
    for i in range(3):
        assert len(results[i]) == steps[i]
        for x, (lp, g), thread in results[i]:
            assert lp == x.sum() and np.array_equal(g, 2 * x)
            assert thread == me          # no thread of its own: one thread makes every call
    # Three at a time while all three sample, then the two left, then one alone.
    assert rec.batches == [3] * 12 + [2] * 8 and rec.ones == 0, rec.batches
    assert b.calls == 20 and b.positions == 52
    # Afterwards the batcher serves plain requests again.
    assert b(np.ones(3))[0] == 3.0


def test_a_lone_chain_run_together_goes_to_one():
    rec = Recorder()
    b = Batcher(rec.evaluate, one=rec.one)
    results = {0: []}
    assert b.run_together([_chain(b, 0, 5, results)]) == ([], False)
    assert rec.ones == 5 and rec.batches == [] and len(results[0]) == 5


def test_a_failing_chain_stops_the_others_at_their_next_request():
    rec = Recorder()
    b = Batcher(rec.evaluate, one=rec.one)
    results = {i: [] for i in range(3)}
    bodies = [_chain(b, 0, 50, results), _chain(b, 1, 50, results, fail_at=4),
              _chain(b, 2, 50, results)]
    errors, interrupted = b.run_together(bodies)
    assert not interrupted
    assert isinstance(errors[0], ValueError) and "chain 1" in str(errors[0])
    assert len(errors) == 3
    assert all(isinstance(e, BatchAborted) and e.__cause__ is errors[0] for e in errors[1:])
    assert [len(results[i]) for i in range(3)] == [4, 4, 4]


def test_a_failed_call_reaches_every_chain_of_its_batch_run_together():
    rec = Recorder(fail=ZeroDivisionError("in the graph"))
    b = Batcher(rec.evaluate, one=rec.one)
    results = {i: [] for i in range(2)}
    errors, interrupted = b.run_together([_chain(b, i, 5, results) for i in range(2)])
    assert not interrupted and rec.batches == [2]
    assert len(errors) == 2 and all(isinstance(e, ZeroDivisionError) for e in errors)
    rec.fail = None
    assert b(np.ones(3))[0] == 3.0


def test_ctrl_c_while_a_chain_runs_stops_every_chain_at_its_request():
    """SIGINT lands in a chain's own code: held (PyMC's loop would swallow it), then all stop."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default handler here")
    rec = Recorder()
    b = Batcher(rec.evaluate, one=rec.one)
    results = {i: [] for i in range(2)}
    swallowed = []

    def pymc_like(i):
        inner = _chain(b, i, 1000, results)

        def body():
            try:
                if i == 1:
                    b(np.zeros(3))
                    os.kill(os.getpid(), signal.SIGINT)   # delivered in this chain's code
                    time.sleep(0.05)
                inner()
            except KeyboardInterrupt:   # what PyMC's _sample does
                swallowed.append(i)
        return body

    errors, interrupted = b.run_together([pymc_like(0), pymc_like(1)])
    assert interrupted and swallowed == []
    assert len(errors) == 2 and all(isinstance(e, BatchAborted) for e in errors)
    assert all(isinstance(e.__cause__, KeyboardInterrupt) for e in errors)
    assert len(results[0]) < 5 and len(results[1]) < 5
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_threads_started_elsewhere_are_batched_by_what_was_seen():
    rec = Recorder(delay=0.002)
    b = Batcher(rec.evaluate, one=rec.one, max_wait_s=0.05)
    results = {i: [] for i in range(2)}
    _run_threads(b, 2, 30, results)
    for i in range(2):
        for x, (lp, g) in results[i]:
            assert lp == x.sum() and np.array_equal(g, 2 * x)
    assert b.positions == 60 and b.positions > 1.3 * b.calls, (b.positions, b.calls)
