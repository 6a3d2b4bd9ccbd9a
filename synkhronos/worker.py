"""The worker loop: wait for a command, run its handler, post a status."""

import logging
import os
import time

# Importing the command modules registers their handlers in HANDLERS.
from . import (checkpoint, cluster, collectives, data_module, distribute,  # noqa: F401
               function_module, overlap, profiling)
from .control import ABORTED, FAILED, HANDLERS, OK, Command, rank_header
from .errors import CommAborted

logger = logging.getLogger(__name__)


def loop(rt):
    """Serve commands until QUIT; never returns to the caller's code."""
    control = rt.control
    me = rt.local_index  # in a cluster, the global rank is known only after LAYOUT
    check = rt.check
    profiler = None
    if rt.profile_workers:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    debug = logger.isEnabledFor(logging.DEBUG)
    last = 0
    while True:
        seq = control.wait_command(me, last, check)
        last = seq
        prof = rt.profiler
        if prof is not None:
            t_seen = time.perf_counter_ns()
        cmd, payload, frees = control.read_message()
        if prof is not None:
            prof.begin(_what(rt, cmd, payload), t_seen)
            prof.lap("control")
        if frees:
            unmap(rt, frees)
        rt.backend.begin(seq)
        if debug:
            t0 = time.perf_counter()
        status = OK
        try:
            HANDLERS[cmd](rt, payload)
        except CommAborted:
            status = ABORTED
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the master
            control.write_error(me, rank_header(rt.rank, rt.n_parallel), exc)
            control.abort(seq)
            status = FAILED
        if prof is not None:
            prof.lap("collective")  # what the handler did not book itself
            prof.end("control")
        if debug:
            logger.debug("rank %d ran %s in %.6f s", rt.rank, cmd.name, time.perf_counter() - t0)
        if cmd is Command.QUIT:
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(f"synk_worker_{rt.rank}.prof")
            control.finish(me, seq, status)
            os._exit(0)
        control.finish(me, seq, status)


def _what(rt, cmd, payload):
    """The command as the master's profile names it."""
    if cmd == Command.CALL:
        return f"call of {rt.functions[payload.function_id].name or 'function'}"
    return cmd.name.lower()


def unmap(rt, ids):
    """Close this rank's mappings of Data objects the master dropped."""
    for data_id in ids:
        seg = rt.datas.pop(data_id, None)
        if seg is not None:
            seg.close()


HANDLERS.setdefault(Command.QUIT, lambda rt, payload: None)
