"""KeptCall: a call repeated with the very same Data and no options, prepared once (master side).

The worker side is ``rank_call``'s ``_call_prepare``: each worker keeps its
share of a kept message ready, as the master keeps its own here.  Also the
master's share of a call and of a function's first call, which the master
builds before or after posting it (``builds_together``).
"""

import os

from ..inputs.data_object import Data
from ..runtime import trace
from ..runtime.commands import Command
from ..runtime.peers import ALONE
from ..runtime.run import repeat, run_command
from ..runtime.state import PID
from . import spread
from .chunks import master_runner
from .outputs import collect
from .rank_call import Share

_trace = trace.ON


def own_share(share_result):
    """The master's share as ``collect`` takes it: ``(results, weight)``, or None without results."""
    results, weight = share_result
    return None if results is None else (results, weight)


class KeptCall:
    """A call repeated with the very same Data and no options, prepared once.  Master only.

    Its message is pickled once and posted under an id (``Control.keep``), so
    each worker keeps its share prepared too; the master's share (its rows'
    views) is kept here.  Valid while every Data still has the memory and
    shape it had (``matches``).
    """

    __slots__ = ("rt", "msg", "kept", "descs", "arrays", "local", "after", "what", "epoch",
                 "arm", "again", "pid")

    def __init__(self, function, rt, msg, arrays, kept, board=None):
        self.rt = rt
        self.msg = msg
        self.kept = kept
        # Valid while the run's ranks and Data mappings stay (a cluster that lost or gained
        # a machine numbers its ranks anew: every rank's rows change).
        self.epoch = rt.registry.epoch
        # Not the Data themselves, whose finalizers free their memory: their descriptors,
        # which no other Data has (describe() makes one per Data).
        self.descs = tuple(msg.descs)
        self.arrays = tuple(arrays)
        spec = function.spec
        self.what = function.what
        self.pid = PID[0]   # the master's: a child forked with this call may not run it
        self.arm = self.again = None
        if msg.chunks is not None and msg.chunks.name is None:
            # A cluster's chunks, spread over its ranks (spread.py).
            self.arm, self.local, self.after = spread.master_runner(spec, rt, msg.chunks, arrays,
                                                                    msg.n_scattered)
            return
        if msg.chunks is not None:
            # Chunks: the master's runner combines every chunk itself (chunks.py).
            self.arm, self.local = master_runner(spec, rt, msg.chunks, board, arrays,
                                                 msg.n_scattered)
            self.after = None
            return
        share = Share(spec, rt, msg, arrays)
        run = share.bound()
        if share.plain and share.runs:
            self.local = lambda seq: run()  # results, never None
        else:
            self.local = lambda seq: own_share(run())
        name = function.name or "function"
        self.after = _combiner(spec, rt, name)

    def ready(self, args, serialized=False):
        """Whether this call runs again now, with ``args``: what ``runtime()`` would check.

        ``args`` are the kept call's Data, unchanged in memory and shape; the
        run is open, not inside a call and not profiled.  Unless ``serialized``
        (a public entry point's wrapper checked it), also what that wrapper
        would: this process is the run's master, on one machine (no peers'
        turn to give between calls); the caller holds ``state.CALL_LOCK``.
        Anything else: ``Function.__call__``'s general path says why.
        """
        rt = self.rt
        if (rt.closed or rt.in_call or rt.profiler is not None or len(args) != len(self.descs)
                or rt.registry.epoch != self.epoch):
            return False
        if not serialized and (PID[0] != self.pid or rt.peers is not ALONE):
            return False
        for a, desc, arr in zip(args, self.descs, self.arrays):
            if type(a) is not Data or not a.unchanged(desc, arr):
                return False
        return True

    def run(self, first=None):
        """Run the call again on every rank; return its reduced outputs.

        ``first``: a chunked call's chunk 0, where the master just ran it (chunks.py).
        """
        if _trace:
            trace.stamp(trace.CHECKED)
        if self.arm is not None:
            self.arm(self.rt.control.seq + 1, first)
        again = self.again
        if again is None:
            again = self.again = repeat(self.rt, Command.CALL, self.msg, self.local, self.after,
                                        self.what, self.kept)
        return again()


def _combiner(spec, rt, name):
    """``collect`` for a kept call: one small output (a loss, a gradient) goes straight to the backend."""
    if not spec.simple:
        return lambda mine: collect(spec, rt, mine, None, name)
    combine = rt.backend.output_combiner(spec.output_ops[0])
    listed = spec.return_list

    def after(mine):
        if mine is not None:
            out = combine(mine[0][0], mine[1])
            if out is not None:
                return [out] if listed else out
        return collect(spec, rt, mine, None, name)
    return after


def builds_together(rt):
    """Whether the master builds a function built at its first call after posting that call,
    as the ranks build theirs, rather than before: on one machine where each rank has a core.

    Built first in the master, the ranks load its code from PyTensor's cache instead of
    compiling it each (where ranks outnumber cores, a compile each took seconds); warm,
    that order only made the ranks wait for the master's build (0.3-0.4 s, PyMC's
    logistic regression on 2 ranks, bench/pymc_gallery.py --parts startup).
    """
    if rt.peers is not ALONE:
        return False
    cores = rt.processes.unpinned or os.sched_getaffinity(0)
    return rt.place.n_local <= len(cores)


def share_runner(spec, rt, msg, arrays, together=False):
    """``run_command``'s local part: run the master's share of ``msg``; ``together``: the
    master builds a function built at its first call once the call is posted (``builds_together``)."""
    if together:
        return lambda seq: own_share(Share(spec, rt, msg, arrays).run())
    share = Share(spec, rt, msg, arrays)
    return lambda seq: own_share(share.run())


def static_call(spec, rt, msg, arrays, what, together=False):
    """Run the call ``msg`` with its static split on every rank, its result unused: each rank
    builds a function built at its first call (``chunks.MasterChunks.static_once``)."""
    run_command(rt, Command.CALL, msg, share_runner(spec, rt, msg, arrays, together), what=what)
