"""Liveness: whether the other ranks are alive, and waits that stay bounded because they keep asking.

Low in the package: the control channel and the backends take the checks
made here as callbacks and never import the modules that start processes.
"""

import os
import signal
import time

from ..errors import CommAborted, SynkError, WorkerDiedError, WorkerStalledError

CHECK_EVERY_S = 0.01
SLOW_CHECK_S = 0.25  # how often /proc states and the timeout are looked at
DEFAULT_TIMEOUT_S = 1800.0


def pid_alive(pid):
    """Return whether a process with this pid exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_process(pid, started=None, grace_s=0.0, reap=False, sig=signal.SIGTERM):
    """End process ``pid``: SIGKILL, or ``sig`` first when ``grace_s`` > 0 (SIGKILL past it).

    ``started`` (its ``proc_start_time``) guards against a reused pid: a
    process that started at another time is left alone.  ``reap`` waits for
    it (only for this process's own child).
    """
    if started is not None and proc_start_time(pid) != started:
        return  # gone already, and the pid maybe given to another process since
    try:
        if grace_s > 0:
            os.kill(pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            os.kill(pid, sig)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and proc_state(pid) not in ("Z", "X", None):
                time.sleep(0.02)
            if proc_state(pid) in ("Z", "X", None):
                return _reap(pid, reap)
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return None
    return _reap(pid, reap)


def _reap(pid, reap):
    if reap:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def no_check():
    """A check with nothing to check: the wait is bounded by something else."""


def deadline_check(seconds, message):
    """Return a check that raises ``SynkError(message)`` once ``seconds`` have passed."""
    deadline = time.monotonic() + seconds

    def check():
        if time.monotonic() > deadline:
            raise SynkError(message)
    return check


def proc_stat(pid):
    """(command name, fields after it) of /proc/<pid>/stat, state first; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields follow the last ")".
    head, tail = stat.rsplit(b")", 1)
    return head.split(b"(", 1)[1].decode(errors="replace"), tail.split()


def proc_state(pid):
    """Return the one-letter state of process ``pid`` from /proc (``"T"``: stopped), or None."""
    stat = proc_stat(pid)
    return None if stat is None else stat[1][0].decode()


def proc_start_time(pid):
    """Return when process ``pid`` started (clock ticks since boot), or None if it is gone.

    With the pid, it names one process: pids are reused, start times are not.
    """
    stat = proc_stat(pid)
    return None if stat is None else int(stat[1][19])


class Monitor:
    """The master's check on its workers: dead, stopped, or busy past the timeout.

    Called often while the master waits for a command's ranks; a dead worker
    is seen at once, a stopped one (state ``T``: SIGSTOP, a debugger) or a
    command running past ``timeout_s`` within ``SLOW_CHECK_S``.

    Args:
        procs: local index to ``multiprocessing.Process``, the leader's workers.
        timeout_s: the longest a command may run (``math.inf``: no limit).
        pending: returns the local indices that have not finished the current command.
        place: where this machine's ranks stand (its ``rank_offset`` turns local
            indices into the global ranks that messages name), read live.
        remote: returns the global ranks of other machines still busy (a cluster).
        also: called at each slower check too (the janitor's: ``Janitor.check``).
    """

    def __init__(self, procs, timeout_s, pending, place, remote, also=None):
        self.place = place
        self.remote = remote
        self.also = also
        self.procs = procs
        self.timeout_s = timeout_s
        self.pending = pending
        self.what = "nothing"
        self.started = time.monotonic()
        self.next_slow = 0.0

    def begin(self, what):
        """Note that the master just posted the command ``what`` (a description or a Command)."""
        self.what = what
        self.started = time.monotonic()

    def _doing(self):
        what = self.what
        return what if isinstance(what, str) else what.name.lower()

    @property
    def offset(self):
        return self.place.rank_offset

    def __call__(self):
        for rank, p in self.procs.items():
            # A worker that finished the command and then exited (QUIT) did its part.
            if not p.is_alive() and rank in self.pending():
                raise WorkerDiedError(
                    f"rank {rank + self.offset} (pid {p.pid}) died with exit code {p.exitcode}; "
                    "synkhronos is closed, call fork() to start again",
                    rank + self.offset, p.exitcode)
        now = time.monotonic()
        if now < self.next_slow:
            return
        self.next_slow = now + SLOW_CHECK_S
        if self.also is not None:
            self.also()
        ran = now - self.started
        for rank, p in self.procs.items():
            if proc_state(p.pid) in ("T", "t"):
                raise WorkerStalledError(
                    f"rank {rank + self.offset} (pid {p.pid}) is stopped (SIGSTOP or a debugger) "
                    f"and made no progress on {self._doing()} for {ran:.1f} s; synkhronos stopped "
                    "every worker and is closed, call fork() to start again",
                    rank + self.offset, None)
        if ran > self.timeout_s:
            late = [r + self.offset for r in self.pending()] + self.remote()
            late = late or [r + self.offset for r in sorted(self.procs)] or [self.offset]
            ranks = ", ".join(str(r) for r in late)
            raise WorkerStalledError(
                f"rank{'s' if len(late) > 1 else ''} {ranks} ran {self._doing()} for {ran:.1f} s, "
                f"past the timeout of {self.timeout_s:g} s (fork(timeout=...) or SYNK_TIMEOUT_S);"
                " synkhronos stopped every worker and is closed, call fork() to start again",
                late[0], None)


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


CHECK_NS = int(CHECK_EVERY_S * 1e9)


def wait_slots(block, slots, mode, target, waiters, check, spin_ns, block_ns=CHECK_NS):
    """Return once the slots of ``block`` (a ``_block.Block``) hold what ``mode`` asks of ``target``.

    ``slots`` is one slot index or a tuple of them (all must hold); ``mode``
    ``_block.EQ``, ``NE`` or ``GE``; ``waiters`` the offset of each slot's
    waiters count (the writer wakes sleepers only if it is set).  Spins for
    up to ``spin_ns`` nanoseconds without the GIL, then sleeps on the slot's
    futex; ``check()`` (which may raise) runs every ``CHECK_EVERY_S`` of
    spinning and every ``block_ns`` of sleeping.  A ``CommAborted`` raised by
    the check after the slots came true does not count.
    """
    wait = block.wait_all if type(slots) is tuple else block.wait
    if spin_ns <= CHECK_NS:
        if wait(slots, mode, target, waiters, spin_ns, block_ns):
            return
        spin_ns = 0
    while True:
        if spin_ns > 0:
            spin = spin_ns if spin_ns < CHECK_NS else CHECK_NS
            spin_ns -= spin
            if wait(slots, mode, target, waiters, spin, block_ns if spin_ns <= 0 else 0):
                return
        try:
            check()
        except CommAborted:
            if not wait(slots, mode, target, waiters, 0, 0):
                raise
            return
        if spin_ns <= 0 and wait(slots, mode, target, waiters, 0, block_ns):
            return


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
