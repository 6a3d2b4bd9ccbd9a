"""The master trades cores with a worker when another program holds its own (runtime/cores.py).

The rule's cases run on scripted waits; the whole path runs on this machine with a
spinning process pinned to the master's core, and the results of the calls around the
trade are checked against PyTensor's serial function.
"""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from synkhronos.runtime import cores
from synkhronos.runtime.state import get_runtime

pytestmark = pytest.mark.timeout(120)


class _Proc:
    def __init__(self, pid):
        self.pid = pid


def _scripted(monkeypatch, waits, affinity):
    """A CoreTrade over fake workers whose waits (ns, per look) and cores are scripted."""
    looks = iter(waits)
    state = {"affinity": dict(affinity), "set": []}
    me = os.getpid()
    monkeypatch.setattr(cores, "cores_of", lambda pid: set(state["affinity"][me if pid == 0 else pid]))

    def set_cores(pid, old, new):
        assert state["affinity"][pid] == old
        state["affinity"][pid] = set(new)
        state["set"].append((pid, min(new)))
        return True
    monkeypatch.setattr(cores, "_set_cores", set_cores)
    clock = iter(range(0, 10 ** 12, 10 ** 9))   # a second between looks
    trade = cores.CoreTrade({1: _Proc(101), 2: _Proc(102)}, period_s=0.0,
                            clock=lambda: next(clock))

    def look():
        current = next(looks)
        trade.wait_ns = lambda pid: current.get(pid)
        trade.maybe()
    return trade, state, look


def test_the_master_trades_with_the_least_contended_worker(monkeypatch):
    me = os.getpid()
    s = 10 ** 9
    trade, state, look = _scripted(
        monkeypatch,
        [{me: 0, 101: 0, 102: 0}, {me: s // 2, 101: s // 3, 102: 0}],
        {me: {0}, 101: {1}, 102: {2}})
    look()
    assert trade.trades == 0  # a first look only reads the figures
    look()
    assert trade.trades == 1
    assert trade.contended  # worker 101 waited a third of the period: chunks are stolen sooner
    assert state["affinity"][me] == {2} and state["affinity"][102] == {0}
    assert state["affinity"][101] == {1}


@pytest.mark.parametrize("waits, affinity, why", [
    ({os.getpid(): 10 ** 8, 101: 0, 102: 0}, None, "the master waited 10%: under WAIT_MIN"),
    ({os.getpid(): 6 * 10 ** 8, 101: 4 * 10 ** 8, 102: 5 * 10 ** 8}, None,
     "every core as contended"),
    ({os.getpid(): 6 * 10 ** 8, 101: 0, 102: 0}, {0, 1}, "the master released to every core"),
])
def test_no_trade_where_it_cannot_pay(monkeypatch, waits, affinity, why):
    me = os.getpid()
    trade, state, look = _scripted(
        monkeypatch, [{me: 0, 101: 0, 102: 0}, waits],
        {me: affinity or {0}, 101: {1}, 102: {2}})
    look()
    look()
    assert trade.trades == 0, why
    assert state["set"] == []
    assert trade.contended == (why == "every core as contended")


def test_a_trade_is_judged_on_waits_measured_after_it(monkeypatch):
    me = os.getpid()
    s = 10 ** 9
    trade, state, look = _scripted(
        monkeypatch,
        [{me: 0, 101: 0, 102: 0}, {me: s, 101: 0, 102: 0},
         {me: 2 * s, 101: s, 102: 0},       # right after the trade: only read
         {me: 2 * s, 101: 2 * s, 102: 0}],  # the master no longer waits
        {me: {0}, 101: {1}, 102: {2}})
    for _ in range(4):
        look()
    assert trade.trades == 1


def _busy_on(core):
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.sched_setaffinity(p.pid, {core})
    return p


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or cores.run_wait_ns(os.getpid()) is None,
                    reason="needs 2 cores and /proc/<pid>/schedstat")
@pytest.mark.parametrize("setting, trades", [("0.02", True), ("0", False)])
def test_a_busy_process_on_the_masters_core_moves_the_master(forked, monkeypatch, setting, trades):
    monkeypatch.setenv(cores.TRADE_ENV, setting)
    x = pt.dmatrix("x")
    v = pt.dvector("v")
    out = pt.sum(pt.exp(pt.sin(x * v)), axis=0)
    forked(2)
    f = synk.function([x], (out, "sum"), bcast_inputs=[v])
    synk.distribute()
    rt = get_runtime()
    assert (rt.processes.core_trade is not None) == trades
    rng = np.random.default_rng(3)
    X = rng.standard_normal((20_000, 8))
    vv = rng.standard_normal(8)
    serial = pytensor.function([x, v], out)
    np.testing.assert_allclose(f(X, vv), serial(X, vv), rtol=1e-12)  # the worker pinned itself
    master_core = next(iter(os.sched_getaffinity(0)))
    worker = rt.processes.procs[1].pid
    worker_core = next(iter(os.sched_getaffinity(worker)))
    assert master_core != worker_core
    # A thread of the master's that is not pinned (a notebook's own) keeps its cores.
    free = set(os.sched_getaffinity(worker)) | {master_core}
    release = threading.Event()
    other = threading.Thread(target=release.wait, daemon=True)
    other.start()
    os.sched_setaffinity(other.native_id, free)
    busy = _busy_on(master_core)
    try:
        deadline = time.monotonic() + 20
        n = 0
        while time.monotonic() < deadline and n < 400:
            got = f(X, vv)
            n += 1
            if trades and rt.processes.core_trade.trades:
                break
        # Chunked: the rows' sums in chunk order, as PyTensor's serial call's up to rounding.
        np.testing.assert_allclose(got, serial(X, vv), rtol=1e-12)
        kept = os.sched_getaffinity(other.native_id)
    finally:
        busy.kill()
        busy.wait()
        release.set()
        other.join()
    if trades:
        assert rt.processes.core_trade.trades >= 1
        assert os.sched_getaffinity(0) == {worker_core}
        assert os.sched_getaffinity(worker) == {master_core}
        assert kept == free
    else:
        assert os.sched_getaffinity(0) == {master_core}
        assert os.sched_getaffinity(worker) == {worker_core}
    np.testing.assert_allclose(f(X, vv), serial(X, vv), rtol=1e-12)
