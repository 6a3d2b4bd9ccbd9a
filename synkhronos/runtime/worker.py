"""The worker loop: wait for a command, run its handler, post a status."""

import logging
import os
import time

from . import trace
from .commands import COMMANDS, label
from .control import ABORTED, FAILED, OK
from ..errors import rank_header
from ..errors import CommAborted

logger = logging.getLogger(__name__)


def loop(rt):
    """Serve commands until the final one; never returns to the caller's code.

    The handlers are whatever modules registered them (runtime/commands.py) before the
    fork that started this worker.
    """
    control = rt.control
    me = rt.place.local_index  # in a cluster, the global rank is known only after LAYOUT
    check = rt.check
    profiler = None
    if rt.config.profile_workers:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    debug = logger.isEnabledFor(logging.DEBUG)
    last = 0
    while True:
        seq = control.wait_command(me, last, check)
        if trace.ON:
            trace.stamp(trace.WOKE)
        last = seq
        prof = rt.profiler
        if prof is not None:
            t_seen = time.perf_counter_ns()
        cmd, payload, frees = control.read_message()
        if prof is not None:
            prof.begin(label(cmd, rt, payload), t_seen)
            prof.lap("control")
        if frees:
            rt.registry.unmap(frees)
        rt.backend.begin(seq)
        if debug:
            t0 = time.perf_counter()
        spec = COMMANDS[cmd]
        status = OK
        try:
            spec.run(rt, payload)
        except CommAborted:
            status = ABORTED
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the master
            control.write_error(me, rank_header(rt.place.rank, rt.place.n_parallel), exc)
            control.abort(seq)
            status = FAILED
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
        if trace.ON:
            trace.stamp(trace.FINISHED)
        control.finish(me, seq, status)
