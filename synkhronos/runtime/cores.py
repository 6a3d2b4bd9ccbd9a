"""Cores that follow the work: the master trades cores with a worker when another program holds its own.

Why: ranks are pinned one to a core (``process_setup.pin``), and a program that
is not pinned (a build, another notebook, a test suite) settles on one of those
cores.  Where that core is the master's, everything waits for the master's turns
on it: the workers run chunks only while a call is posted, and the user's own
code between calls (a sampler's tree) runs at half speed.  Where it is a worker's,
chunked calls (``functions/chunks.py``) let that worker simply take fewer chunks.
Measured beside one busy process on 2 cores (AMD EPYC VM, PyMC's logistic
regression at 10^5 rows, ``dp.logp_dlogp`` on 2 ranks): 4.0 ms a call with the
busy process on the master's core, 3.2 ms once the two ranks traded cores, in one
run.  Nothing keeps that program off the master's core (the kernel's balancer moves
it between the cores, to whichever holds one task), so the master follows it.

How: at most every ``PERIOD_S``, on a chunked call, the master reads how long it
and each worker on this machine waited, runnable, for their cores since the last
look (``/proc/<pid>/schedstat``, its second field); where the master waited at
least ``WAIT_MIN`` of that time and a worker at most half as much, the two trade
cores, every thread of each that was on them.  The next period only re-reads the
figures, so that a move is judged on waits measured after it.  ``SYNK_CORE_TRADE``
sets the seconds between looks; 0 turns trades off.
"""

import logging
import os
import time

logger = logging.getLogger("synkhronos")

TRADE_ENV = "SYNK_CORE_TRADE"
PERIOD_S = 0.02
"""Seconds between looks.  A process that is not pinned moves between the cores (the
kernel's balancer takes it off whichever core holds two tasks: after a trade, the
worker's), so the master follows it: beside one busy process, PyMC's (logp, dlogp) at
10^4 rows took 401 us a call without trades, 387 with a look every 0.25 s, 364 every
0.05 s, 334-349 every 0.02 s and 334 every 0.01 s (PyMC's serial call 432 us; at 10^5
rows 3698 us without, 3465 every 0.02 s), one process each, 2026-12-05.  A look reads
one small /proc file per rank, 1.6 us each through a descriptor kept open."""
WAIT_MIN = 0.2      # the share of a period the master waited for its core before it moves


def run_wait_ns(pid):
    """Nanoseconds process ``pid``'s main thread has waited, runnable, for a core; None if unknown."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


def cores_of(pid):
    """The cores process ``pid`` (0: this thread) may run on."""
    return os.sched_getaffinity(pid)


def _set_cores(pid, old, new):
    """Move every thread of process ``pid`` pinned to ``old`` onto ``new``; False where it is gone.

    Only those: threads the process had before ``fork()`` pinned it (a notebook's
    own) keep the cores they had.
    """
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            if os.sched_getaffinity(int(tid)) == old:
                os.sched_setaffinity(int(tid), new)
        except (OSError, ValueError):
            pass  # a thread that ended since
    return True


class CoreTrade:
    """The master's watch over its ranks' waits for their cores (see the module's docstring).

    ``procs`` is the live ``{local index: process}`` of this machine's workers.
    Trades start at the first call, after ``distribute()`` started the workers
    for the last time: no worker pins itself after one.
    """

    def __init__(self, procs, period_s=PERIOD_S, wait_min=WAIT_MIN, clock=time.perf_counter_ns):
        self.clock = clock
        self.procs = procs
        self.period_ns = int(period_s * 1e9)
        self.wait_min = wait_min
        self.next_ns = 0
        self.last = None      # (time ns, {pid: wait ns}) at the last look
        self.trades = 0
        self.contended = False  # a worker waited WAIT_MIN of the last period for its core
        self.fds = {}         # pid -> its schedstat, kept open: a read is then one pread

    def wait_ns(self, pid):
        """``run_wait_ns(pid)`` through a descriptor kept open."""
        fd = self.fds.get(pid)
        try:
            if fd is None:
                fd = self.fds[pid] = os.open(f"/proc/{pid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
            return int(os.pread(fd, 64, 0).split()[1])
        except (OSError, ValueError, IndexError):
            self._drop(pid)
            return None

    def _drop(self, pid):
        fd = self.fds.pop(pid, None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self):
        """Close the descriptors kept open."""
        for pid in list(self.fds):
            self._drop(pid)

    def maybe(self):
        """Look at the waits if a period has passed since the last look; trade cores if it pays."""
        now = self.clock()
        if now < self.next_ns:
            return
        self.next_ns = now + self.period_ns
        me = os.getpid()
        index = {p.pid: i for i, p in list(self.procs.items()) if p.pid is not None}
        for gone in set(self.fds) - set(index) - {me}:
            self._drop(gone)
        waits = {p: self.wait_ns(p) for p in (me, *index)}
        last, self.last = self.last, (now, waits)
        if last is None or waits[me] is None or last[1].get(me) is None:
            return
        span = now - last[0]
        share = {p: (w - last[1][p]) / span for p, w in waits.items()
                 if w is not None and last[1].get(p) is not None}
        mine = share.pop(me)
        self.contended = any(v >= self.wait_min for v in share.values())
        if mine < self.wait_min or not share:
            return
        pid, theirs = min(share.items(), key=lambda kv: kv[1])
        if theirs > mine / 2:
            return  # every core is as contended: nothing to gain
        try:
            here, there = cores_of(0), cores_of(pid)
        except OSError:
            return
        if len(here) != 1 or len(there) != 1 or here == there:
            return  # released to every core (pm.sample in its place) or not pinned: leave it
        if _set_cores(pid, there, here):
            _set_cores(me, here, there)
            self.trades += 1
            self.last = None  # judge the next move on waits measured after this one
            logger.debug("master moved from core %d to core %d (waited %.0f%% of the last "
                         "%.2f s for its core; worker pid %d %.0f%%)", min(here), min(there),
                         100 * mine, span / 1e9, pid, 100 * theirs)


def core_trade(rt, env=os.environ):
    """A ``CoreTrade`` for this master where its ranks are pinned one to a core, else None.

    ``SYNK_CORE_TRADE``: seconds between looks (``PERIOD_S`` where unset), 0: never.
    """
    setting = env.get(TRADE_ENV, "").strip()
    period_s = float(setting) if setting else PERIOD_S
    if period_s <= 0 or rt.place.n_local < 2:
        return None
    if rt.place.n_local > len(rt.config.cores) or run_wait_ns(os.getpid()) is None:
        return None  # not pinned (more ranks than cores), or no schedstat in this kernel
    return CoreTrade(rt.processes.procs, period_s)
