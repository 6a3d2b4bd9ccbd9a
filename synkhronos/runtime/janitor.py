"""The janitor: a process that outlives the leader to clean up after it, however it ends.

Started once the workers are (a fresh interpreter running ``janitor_proc``, so it
shares nothing with the leader's heap), it waits for the leader's end of a pipe to
close: at ``close()``, at exit, or when the leader is killed.  Then it kills the
workers that are left, unlinks the run's segments, removes its directories and the
files the leader named (the segments MPI made, which a killed MPI process leaves behind).
"""

import json
import logging
import os
import subprocess
import sys
import weakref

from . import janitor_proc
from .liveness import proc_start_time

# This process's janitors that children forked later must not hold on to (os.fork() or
# multiprocessing in the user's program): the janitor would wait for such a child to end
# before cleaning up, and the run's lock it keeps would make the run look alive.
_WATCHED = weakref.WeakSet()

logger = logging.getLogger(__name__)

JANITOR_END_S = 2.0
"""How long a janitor whose end of the pipe is closed is waited for to end, before ``check``."""


def _close_in_child():
    for janitor in list(_WATCHED):
        for fd in janitor.child_closes:
            try:
                os.close(fd)
            except OSError:
                pass
    _WATCHED.clear()


os.register_at_fork(after_in_child=_close_in_child)


class Janitor:
    """The leader's handle on its janitor process.

    Args:
        prefix: the run's segment name prefix.
        dirs: directories to remove (read when the janitor starts).
        pids: the workers' pids.
        keep_fds: descriptors the janitor holds too (the run's lock: while the
            janitor lives, no other run's sweep takes this run for dead).

    Raises:
        OSError: the janitor could not start (out of processes or memory).
    """

    def __init__(self, prefix, dirs, pids, keep_fds=()):
        self._start(prefix, dirs, pids, keep_fds)
        self.child_closes = ()
        # What a janitor started again (``check``) must hold as well.
        self._prefix, self._dirs, self._keep = prefix, dirs, tuple(keep_fds)
        self._pids, self._told = list(pids), []
        self._warned = False

    def _start(self, prefix, dirs, pids, keep_fds):
        # With each start time: a pid the kernel gave to another process since is left alone.
        pids = [(pid, proc_start_time(pid)) for pid in pids]
        read_fd, write_fd = os.pipe()
        try:
            # Its own session: mpiexec (and shells) kill a failed job's process groups,
            # and the janitor must outlive them to clean up.  Every other descriptor
            # closes (close_fds): one held here could keep a launcher or a peer waiting.
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(janitor_proc.__file__),
                 str(read_fd), json.dumps([prefix, list(dirs), pids])],
                pass_fds=(read_fd, *keep_fds), close_fds=True, start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        self.pid = self.proc.pid
        self.fd = write_fd  # children must not keep it open, or the janitor never sees EOF

    def check(self):
        """Start the janitor again if it has ended (killed, say), saying so once.  Leader only.

        Without it a crash would leave the run's segments in /dev/shm: the
        janitor started again sweeps by the run's prefix, and holds the
        workers, directories and files this one held.  Where it cannot start,
        one warning says what is lost.
        """
        status = self.proc.poll()
        if status is None:
            return
        old, old_fd = self.pid, self.fd
        how = f"signal {-status}" if status < 0 else f"exit code {status}"
        try:
            self._start(self._prefix, self._dirs, self._pids, self._keep)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                logger.warning("the janitor (pid %d) ended (%s) and could not start again (%s): "
                               "if this process is killed now, its shared memory stays in "
                               "/dev/shm (the next fork() sweeps it)", old, how, exc)
            return
        os.close(old_fd)
        if self.child_closes:
            self.child_closes = (self.fd, *self.child_closes[1:])
        if self._told:
            os.write(self.fd, ("\n".join(self._told) + "\n").encode())
        logger.warning("the janitor (pid %d), which cleans up after a crash, ended (%s); "
                       "started another (pid %d)", old, how, self.pid)

    def close_in_children(self, *fds):
        """Have every child this process forks from now on close the pipe and ``fds``.

        Not for a process whose own code closes them in its children (a node
        master's sentinel): a second close could hit a descriptor reused since.
        """
        self.child_closes = (self.fd, *fds)
        _WATCHED.add(self)

    def tell(self, paths):
        """Have the janitor also remove these files (under /dev/shm) when the leader goes."""
        self._told.extend(paths)
        self._send(paths)

    def watch(self, pids):
        """Have the janitor also stop these workers (started after it) when the leader goes."""
        self._pids.extend(pids)
        self._send([f"pid {pid} {proc_start_time(pid)}" for pid in pids])

    def _send(self, lines):
        """Write ``lines`` to the janitor; where it has ended, start it again (``check``):
        the new one is handed every pid and path told so far, these included.

        A janitor found ended here (the pipe broken) failed the README's demo once, on a
        fresh clone: ``distribute()`` could not tell it the new workers and gave the run
        up (2026-12-06, bench/HISTORY.md); what ended it was not found.
        """
        try:
            os.write(self.fd, ("\n".join(lines) + "\n").encode())
        except BrokenPipeError:
            try:
                self.proc.wait(JANITOR_END_S)   # its end of the pipe closed: it is ending
            except subprocess.TimeoutExpired:
                pass
            self.check()

    def release(self, timeout_s):
        """The leader's normal end: the janitor cleans up (nothing left by now) and exits."""
        _WATCHED.discard(self)  # before the close: a child forked after it must close nothing
        os.close(self.fd)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
