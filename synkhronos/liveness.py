"""Liveness: whether the other ranks are alive, and waits that stay bounded because they keep asking.

Low in the package: the control channel and the backends take the checks
made here as callbacks and never import the modules that start processes.
"""

import os
import time

from .errors import CommAborted, WorkerDiedError

CHECK_EVERY_S = 0.01


def pid_alive(pid):
    """Return whether a process with this pid exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def master_check(procs):
    """Return a check that raises WorkerDiedError if any worker in ``procs`` has exited.

    Args:
        procs: rank to ``multiprocessing.Process``, the master's workers.
    """
    def check():
        for rank, p in procs.items():
            if not p.is_alive():
                raise WorkerDiedError(
                    f"rank {rank} (pid {p.pid}) died with exit code {p.exitcode}; "
                    "synkhronos is closed, call fork() to start again",
                    rank, p.exitcode)
    return check


def worker_check(master_pid):
    """Return a check that ends this worker at once if its master has gone."""
    def check():
        if os.getppid() != master_pid:
            os._exit(1)
    return check


def command_check(alive, aborted):
    """Return the check used inside one command: ``alive()``, then CommAborted if ``aborted()``."""
    def check():
        alive()
        if aborted():
            raise CommAborted("command aborted by another rank")
    return check


def spin_until(pred, check, spin_s):
    """Spin up to ``spin_s`` seconds for ``pred()``; return whether it came true."""
    if pred():
        return True
    now = time.perf_counter()
    spin_end = now + spin_s
    next_check = now + CHECK_EVERY_S
    n = 0
    while not pred():
        n += 1
        if n & 127 == 0:
            now = time.perf_counter()
            if now > next_check:
                _check(pred, check)
                next_check = now + CHECK_EVERY_S
            if now > spin_end:
                return pred()
    return True


def _check(pred, check):
    """Run ``check``; an abort seen after the awaited rank arrived does not count."""
    try:
        check()
    except CommAborted:
        if not pred():
            raise


def wait_until(pred, check, spin_s, poll_max_s=1e-3):
    """Return once ``pred()`` is true; call ``check()`` (which may raise) every 10 ms."""
    if spin_until(pred, check, spin_s):
        return
    delay = 2e-5
    next_check = time.perf_counter() + CHECK_EVERY_S
    while not pred():
        time.sleep(delay)
        delay = min(2 * delay, poll_max_s)
        now = time.perf_counter()
        if now > next_check:
            _check(pred, check)
            next_check = now + CHECK_EVERY_S
