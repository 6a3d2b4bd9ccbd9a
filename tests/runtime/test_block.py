"""The compiled control path (synkhronos/runtime/_block.c): waits and wake-ups.

Waits are checked against a second process; the small reductions that wait through
them are in tests/comm/test_small_reduce.py.
"""

import mmap
import os
import signal
import time

import numpy as np
import pytest

from synkhronos.runtime._block import EQ, GE, NE, Block

pytestmark = pytest.mark.timeout(60)


def _block(n_slots=64):
    m = mmap.mmap(-1, 8 * n_slots)
    return m, Block(m), np.frombuffer(m, np.int64)


def test_wait_returns_at_once_when_the_slot_holds():
    _, b, slots = _block()
    slots[5] = 7
    assert b.wait(5, EQ, 7, 1, 0, 0)
    assert b.wait(5, NE, 6, 1, 0, 0)
    assert b.wait(5, GE, 7, 1, 0, 0) and not b.wait(5, GE, 8, 1, 0, 0)
    assert b.wait_all((5, 6), GE, 0, 1, 0, 0)
    assert b.wait_all((), EQ, 1, 1, 0, 0)  # nothing to wait for


@pytest.mark.parametrize("spin_ns, block_ns", [(2_000_000, 0), (0, 2_000_000), (1_000_000, 1_000_000)])
def test_a_wait_that_never_holds_is_bounded(spin_ns, block_ns):
    _, b, slots = _block()
    t0 = time.perf_counter()
    assert not b.wait(3, EQ, 1, 1, spin_ns, block_ns)
    assert not b.wait_all((3, 4), EQ, 1, 1, spin_ns, block_ns)
    took = time.perf_counter() - t0
    assert (spin_ns + block_ns) * 2e-9 * 0.9 <= took < 1.0


def test_bad_slots_raise():
    _, b, _ = _block(8)
    with pytest.raises(IndexError, match="out of range"):
        b.wait(8, EQ, 0, 1, 0, 0)
    with pytest.raises(IndexError):
        b.publish(0, 1, 99)
    with pytest.raises(TypeError):
        b.wait_all([1, 2], EQ, 0, 1, 0, 0)
    b.release()
    with pytest.raises(ValueError, match="released"):
        b.publish(0, 1, 1)



def test_release_refuses_while_a_wait_in_another_thread_reads_the_block():
    """A wait runs without the GIL: releasing the block under it would unmap the slots it reads."""
    import threading

    _, b, slots = _block()
    got = []
    t = threading.Thread(target=lambda: got.append(b.wait(3, EQ, 1, 1, 0, 5_000_000_000)))
    t.start()
    deadline = time.monotonic() + 5
    while slots[4] == 0 and time.monotonic() < deadline:  # its waiters count: asleep on the futex
        time.sleep(0.001)
    with pytest.raises(BufferError, match="wait"):
        b.release()
    b.publish(3, 1, 4)
    t.join(5)
    assert got == [True]
    b.release()  # no wait left: the buffer goes back
    with pytest.raises(ValueError, match="released"):
        b.publish(0, 1, 1)


def _ping_pong(n, spin_ns):
    """A forked child answers every number the parent publishes; return the seconds it took."""
    m, b, slots = _block()
    pid = os.fork()
    if pid == 0:
        try:
            for i in range(1, n + 1):
                while not b.wait(0, GE, i, 1, spin_ns, 50_000_000):
                    pass
                b.publish(8, i, 9)
        finally:
            os._exit(0)
    try:
        t0 = time.perf_counter()
        for i in range(1, n + 1):
            b.publish(0, i, 1)
            deadline = time.monotonic() + 10
            while not b.wait(8, GE, i, 1, spin_ns, 50_000_000):
                assert time.monotonic() < deadline, f"no answer to {i}"
        took = time.perf_counter() - t0
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert slots[8] == n and slots[9] == 0 and slots[1] == 0  # no waiter left registered
    return took


@pytest.mark.parametrize("spin_ns", [10_000_000, 0], ids=["spinning", "sleeping"])
def test_every_publish_reaches_a_waiting_process(spin_ns):
    # Sleeping waiters are woken through the futex: a lost wake-up would stall a round
    # for the whole 50 ms bound, so 300 rounds would take far longer than this.
    assert _ping_pong(300, spin_ns) < 10


def test_finish_writes_the_status_then_the_done_slot():
    _, b, slots = _block()
    b.finish(9, 8, 10, 1, 42)
    assert slots[9] == 1 and slots[8] == 42
    assert b.count_ne((9, 17, 25), 0) == 1
