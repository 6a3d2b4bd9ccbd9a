"""The worker loop: wait for a command, run its handler (or what it prepared), post a status."""

import logging
import os
import time

from . import trace
from .commands import COMMANDS, label
from .control import ABORTED, FAILED, OK
from ..errors import rank_header
from ..errors import CommAborted

logger = logging.getLogger(__name__)


def loop(rt, last=0):
    """Serve commands posted after ``last`` until the final one; never returns to the caller's code.

    The handlers are whatever modules registered them (runtime/commands.py) before the
    fork that started this worker.  A kept message (``Control.keep``) whose command
    can ``prepare`` runs, from its second time on, the runner prepared for it: no
    decoding, no look-ups, nothing re-derived from the message.
    """
    control = rt.control
    registry = rt.registry
    backend = rt.backend
    me = rt.place.local_index  # in a cluster, the global rank is known only after LAYOUT
    check = rt.check
    profiler = None
    if rt.config.profile_workers:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    debug = logger.isEnabledFor(logging.DEBUG)
    traced = trace.ON
    finish = control.finisher(me)
    while True:
        seq = control.wait_command(me, last, check)
        if traced:
            trace.stamp(trace.WOKE)
        last = seq
        prof = rt.profiler
        runner = None
        if prof is None and not debug:
            runner = control.prepared(registry.epoch)
        kept = runner is not None
        if not kept:
            if prof is not None:
                t_seen = time.perf_counter_ns()
            cmd, payload, frees = control.read_message()
            if prof is not None:
                prof.begin(label(cmd, rt, payload), t_seen)
                prof.lap("control")
            if frees:
                registry.unmap(frees)
                control.forget_prepared(registry.epoch)  # their views would keep the memory mapped
            spec = COMMANDS[cmd]
        backend.begin(seq)
        if debug:
            t0 = time.perf_counter()
        # One guard for both paths: any failure goes back to the master as the status.
        status = OK
        try:
            if kept:
                runner()
            elif spec.prepare is not None and prof is None and control.posted_kept():
                runner = spec.prepare(rt, payload)
                if runner is None:
                    spec.run(rt, payload)
                else:
                    control.prepare(runner, registry.epoch)
                    runner()
            else:
                spec.run(rt, payload)
        except CommAborted:
            status = ABORTED
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the master
            control.write_error(me, rank_header(rt.place.rank, rt.place.n_parallel), exc)
            control.abort(seq)
            status = FAILED
        if kept:
            if traced:
                trace.stamp(trace.FINISHED)
            finish(status, seq)
            continue
        if prof is not None:
            prof.lap("collective")  # what the handler did not book itself
            prof.end("control")
        if debug:
            logger.debug("rank %d ran %s in %.6f s", rt.place.rank, cmd.name, time.perf_counter() - t0)
        if spec.final:
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(f"synk_worker_{rt.place.rank}.prof")
            control.finish(me, seq, status)
            os._exit(0)
        if traced:
            trace.stamp(trace.FINISHED)
        control.finish(me, seq, status)
