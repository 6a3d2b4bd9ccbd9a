"""cluster.doorbell: the pipe an idle node master blocks on, which its sentinel writes when rung."""

import os
import threading
import time

from synkhronos.cluster import doorbell
from synkhronos.cluster.link import wait_for


def test_a_ring_wakes_the_doorbell_and_is_read_once():
    r, w = doorbell.make_pipe()
    bell = doorbell.Doorbell(r)
    try:
        assert not bell.wait(0.01)  # nobody rang: the timeout
        for _ in range(3):
            doorbell.ring(w)
        assert bell.wait(5.0)
        assert not bell.wait(0.01)  # the rings read are forgotten together
    finally:
        os.close(w)
        os.close(r)


def test_a_full_pipe_takes_more_rings_without_blocking():
    r, w = doorbell.make_pipe()
    try:
        for _ in range(100000):  # more than a pipe holds
            doorbell.ring(w)
        assert doorbell.Doorbell(r).wait(1.0)
    finally:
        os.close(w)
        os.close(r)


def test_a_gone_sentinel_leaves_a_doorbell_that_only_times_out():
    r, w = doorbell.make_pipe()
    os.close(w)
    bell = doorbell.Doorbell(r)
    assert not bell.wait(1.0)  # end of file: the pipe is closed and dropped
    assert bell.fd is None
    assert not bell.wait(0.001)


def test_a_wait_with_a_doorbell_returns_once_the_awaited_message_comes():
    r, w = doorbell.make_pipe()
    came, checks = threading.Event(), []

    def send():
        # The message comes once the waiter has checked liveness at least once: on a loaded
        # machine (two busy processes beside the suite) the waiter's first 0.1 s can pass
        # before its first check, and the doorbell then answers without one.
        deadline = time.monotonic() + 30
        while not checks and time.monotonic() < deadline:
            time.sleep(0.001)
        came.set()
        doorbell.ring(w)
    timer = threading.Timer(0.1, send)
    timer.start()
    try:
        wait_for(came.is_set, lambda: checks.append(1), 0.0, doorbell.Doorbell(r))
        assert came.is_set() and checks  # the liveness check ran while it waited
    finally:
        timer.join()
        os.close(w)
        os.close(r)
