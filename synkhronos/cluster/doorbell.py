"""Waking an idle node master: the controller rings through the sentinel, the node master wakes.

MPI has no wait that sleeps (MPICH's blocking calls poll), so a node master
waiting for the next command spins for a while and then, to leave its core
to others, has to sleep between polls, and each sleep delays the next
command by as much (up to ``liveness.wait_until``'s 1 ms).  Instead, after
spinning it blocks on the read end of a pipe whose write end its sentinel
holds (``Doorbell``).  The controller already holds a TCP connection to every
sentinel (the heartbeats: sentinel.py, heartbeats.py): before a command that
follows ``QUIET_S`` or more without one, it sends ``RING`` there, the sentinel writes
into the pipe, and the node master wakes while the command's message is on
its way.  Commands in a loop ring nothing: their node masters still spin.
"""

import os
import select
import time

RING = b"w"      # on the heartbeat connection, beside the beats (b".")
QUIET_S = 1e-3   # the controller rings after this long without a command: less than any spin
UNRUNG_POLL_S = 1e-3  # without a sentinel to ring it, a doorbell waits as liveness.wait_until


def make_pipe():
    """A pipe for a doorbell, both ends non-blocking: (read end, write end)."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    return r, w


def ring(fd):
    """Write to a doorbell's pipe (the sentinel, when the controller rang)."""
    try:
        os.write(fd, RING)
    except BlockingIOError:
        pass  # full: the node master has rings to read already


class Doorbell:
    """The node master's end: block until rung, or until ``timeout_s``.

    Args:
        fd: the read end of the pipe the sentinel writes into.
    """

    def __init__(self, fd):
        self.fd = fd

    def wait(self, timeout_s):
        """Block until the doorbell rang or ``timeout_s`` passed; return whether it rang."""
        if self.fd is None:
            time.sleep(min(timeout_s, UNRUNG_POLL_S))
            return False
        ready, _, _ = select.select([self.fd], [], [], timeout_s)
        if not ready:
            return False
        try:
            while True:  # forget every ring read: one wake-up serves them all
                if not os.read(self.fd, 4096):
                    # The sentinel is gone (it ends this process soon): nothing will ring.
                    os.close(self.fd)
                    self.fd = None
                    return False
        except BlockingIOError:
            pass
        return True
