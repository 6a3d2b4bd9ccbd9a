"""The janitor: a process that outlives the leader to clean up after it, however it ends.

Forked (bare, not a multiprocessing child) once the workers are started, it
waits for the leader's end of a pipe to close: at ``close()``, at exit, or
when the leader is killed.  Then it kills the workers that are left, unlinks
the run's segments, removes its directories and the files the leader named
(the segments MPI made, which a killed MPI process leaves behind).
"""

import os
import shutil
import signal
import time
import weakref

from . import shmem
from .liveness import proc_start_time, stop_process

# This process's janitors that children forked later must not hold on to (os.fork() or
# multiprocessing in the user's program): the janitor would wait for such a child to end
# before cleaning up, and the run's lock it keeps would make the run look alive.
_WATCHED = weakref.WeakSet()


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
        close_in_child: a callable run first in the janitor (closing what it must not hold).
    """

    def __init__(self, prefix, dirs, pids, close_in_child=lambda: None):
        # With each start time: a pid the kernel gave to another process since is left alone.
        pids = [(pid, proc_start_time(pid)) for pid in pids]
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(write_fd)
                close_in_child()
                _main(prefix, list(dirs), pids, read_fd)
            finally:
                os._exit(0)
        os.close(read_fd)
        self.pid = pid
        self.fd = write_fd  # children must not keep it open, or the janitor never sees EOF
        self.child_closes = ()

    def close_in_children(self, *fds):
        """Have every child this process forks from now on close the pipe and ``fds``.

        Not for a process whose own code closes them in its children (a node
        master's sentinel): a second close could hit a descriptor reused since.
        """
        self.child_closes = (self.fd, *fds)
        _WATCHED.add(self)

    def tell(self, paths):
        """Have the janitor also remove these files (under /dev/shm) when the leader goes."""
        os.write(self.fd, ("\n".join(paths) + "\n").encode())

    def release(self, timeout_s):
        """The leader's normal end: the janitor cleans up (nothing left by now) and exits."""
        _WATCHED.discard(self)  # before the close: a child forked after it must close nothing
        os.close(self.fd)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                done, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return
            if done or time.monotonic() > deadline:
                return
            time.sleep(0.005)


def _main(prefix, dirs, pids, read_fd):
    """Wait for the leader to go; then kill its workers, unlink its segments, remove its dirs."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A scheduler ending the job (Slurm at a time limit or scancel: SIGTERM to every
    # process of the step, SIGKILL after KillWait) must leave it to clean up after the leader.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Its own session: mpiexec (and shells) kill a failed job's process groups,
    # and the janitor must outlive them to clean up.
    os.setsid()
    told = b""
    try:
        while True:
            got = os.read(read_fd, 4096)
            if not got:
                break
            told += got
    except OSError:
        pass
    for pid, started in pids:
        if started is not None:  # else gone before the janitor started
            stop_process(pid, started)
    shmem.sweep(prefix)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    for path in told.decode(errors="replace").splitlines():
        if path.startswith(shmem.SHM_DIR + "/"):
            try:
                os.unlink(path)
            except OSError:
                pass
    os._exit(0)
