"""The worker loop: wait for a command, run its handler, post a status."""

import logging
import os
import time

# Importing the command modules registers their handlers in HANDLERS.
from . import (checkpoint, collectives, data_module, distribute,  # noqa: F401
               function_module, overlap)
from .control import ABORTED, FAILED, HANDLERS, OK, Command, rank_header
from .errors import CommAborted

logger = logging.getLogger(__name__)


def loop(rt):
    """Serve commands until QUIT; never returns to the caller's code."""
    control = rt.control
    rank = rt.rank
    log = logging.LoggerAdapter(logger, {"rank": rank})
    check = rt.check
    header = rank_header(rank, rt.n_parallel)
    profiler = None
    if rt.profile_workers:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    debug = logger.isEnabledFor(logging.DEBUG)
    last = 0
    while True:
        seq = control.wait_command(rank, last, check)
        last = seq
        cmd, payload = control.read_message()
        rt.backend.begin(seq)
        t0 = time.perf_counter()
        status = OK
        try:
            HANDLERS[cmd](rt, payload)
        except CommAborted:
            status = ABORTED
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the master
            control.write_error(rank, header, exc)
            control.abort(seq)
            status = FAILED
        if debug:
            log.debug("rank %d ran %s in %.6f s", rank, cmd.name, time.perf_counter() - t0)
        if cmd == Command.QUIT:
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(f"synk_worker_{rank}.prof")
            control.finish(rank, seq, status)
            os._exit(0)
        control.finish(rank, seq, status)


HANDLERS.setdefault(Command.QUIT, lambda rt, payload: None)
