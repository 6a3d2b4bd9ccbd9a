"""run_command: one command on every rank of every machine, from the leader that posts it.

Post the message, forward it to the other machines (``Peers``), run this
process's share, wait at the end barrier and for the other machines, then
turn every rank's failure into one ``WorkerError``.  What a dead rank means
is not decided here: the peers say whether the run goes on (a cluster that
lost a machine), else the run is abandoned (``Runtime.abandon``).
"""

import logging
import time

from . import trace
from ..errors import CommAborted, WorkerDiedError, describe_error, rank_header, worker_error_type
from .peers import ALONE

logger = logging.getLogger(__name__)
_trace = trace.ON


def run_command(rt, cmd, payload, local=None, after=None, what=None, wire=None, kept=None,
                posted=0):
    """Run ``cmd`` on every rank and ``local(seq)`` here; return its result.  Leader only.

    ``after(result)``, if given, runs once every rank has finished without
    error and returns the final result.  If any rank raised, this one
    included, raises ``WorkerError`` after every rank has finished (end
    barrier), carrying every failing rank's traceback.  ``what`` describes
    the command in profiles and in errors about ranks that stall (default:
    its name).  ``wire`` is the message as another machine sent it, ``kept``
    the message as ``Control.keep`` pickled it (``Control.post``); ``posted``
    the seq of that very message where ``repeat``'s runner posted it already.
    """
    control = rt.control
    peers = rt.peers
    alone = peers is ALONE  # one machine: no peers to forward to or wait for
    debug = logger.isEnabledFor(logging.DEBUG)
    if debug:
        t0 = time.perf_counter()
    prof = rt.profiler
    if prof is not None:
        prof.begin(what or cmd.name.lower())
    seq = posted or control.post(rt, cmd, payload, wire, kept)
    result = local_exc = remote = None
    local_ok = False  # this process's own share finished (a lost machine asks)
    try:
        if not alone:
            peers.forward(cmd, control.last)
        if not posted:  # else repeat() began it, and its share ran
            rt.processes.monitor.begin(what or cmd)  # a Command is named only if a rank stalls
            if prof is not None:
                prof.lap("control")
            rt.backend.begin(seq)
        try:
            if local is not None:
                result = local(seq)
                if prof is not None:
                    prof.lap("collective")  # what the local part did not book itself
            local_ok = True
        except CommAborted:
            pass
        except (WorkerDiedError, KeyboardInterrupt):
            raise
        except BaseException as exc:  # noqa: BLE001 - reported after the end barrier
            if interrupted(exc):
                raise KeyboardInterrupt from exc
            local_exc = exc
            control.abort(seq)
        early = control.early == seq  # chunks: closed without the ranks that took none
        if not early:
            control.wait_done(rt, seq, rt.check)
        if not alone:
            remote = peers.finish(rt.check)
        if _trace:
            trace.stamp(trace.WAITED)
        if prof is not None:
            prof.lap("wait")
    except WorkerDiedError as exc:
        goes_on = peers.survive(rt, exc, seq, local_ok)
        if goes_on is None:
            rt.abandon(rt, "a worker died")
            raise
        if goes_on is exc:
            raise
        raise goes_on from exc
    except KeyboardInterrupt:
        rt.abandon(rt, f"interrupted while running {cmd.name}")
        raise
    if debug:
        logger.debug("rank %d ran %s in %.6f s", rt.place.rank, cmd.name, time.perf_counter() - t0)
    if local_exc is not None or remote or (not early and control.any_failed()):
        if prof is not None:
            prof.end("reduce")  # a failed command is still one record, and the next one starts clean
        raise _worker_error(rt, cmd, local_exc, remote)
    if after is not None:
        result = after(result)
    if _trace:
        trace.stamp(trace.COMBINED)
    if prof is not None:
        prof.end("reduce")
    return result


def repeat(rt, cmd, payload, local, after, what, kept):
    """``run_command`` of a kept message as a callable without arguments, for its repeats.

    On one machine, without a profile, where the message area still holds
    ``kept`` (``Control.repost``) and every worker finished within the first
    wait's spin, a repeat runs only the steps that do something: post, run
    ``local``, wait, ``after``.  Anything else (a failure, a slow rank, a
    profile, debug logging) goes on in ``run_command`` itself from the step
    where it happened, so errors, stalls and dead ranks are handled in one place.
    """
    control, backend = rt.control, rt.backend
    settled, begin = control.settled, rt.processes.monitor.begin
    debug = logger.isEnabledFor

    def general(seq, local_now):
        return run_command(rt, cmd, payload, local_now, after, what, kept=kept, posted=seq)

    def run():
        if rt.profiler is not None or rt.peers is not ALONE or debug(logging.DEBUG):
            return run_command(rt, cmd, payload, local, after, what, kept=kept)
        seq = control.repost(rt, kept)
        if not seq:
            return run_command(rt, cmd, payload, local, after, what, kept=kept)
        begin(what)
        backend.begin(seq)
        try:
            result = local(seq)
        except BaseException as exc:  # noqa: BLE001 - run_command handles it, as its own
            def again(_, exc=exc):
                raise exc
            return general(seq, again)
        if not settled(seq):
            # A rank still runs (or failed, or died): wait, check and report the long way.
            return general(seq, lambda _: result)
        if _trace:
            trace.stamp(trace.WAITED)
        if after is not None:
            result = after(result)
        if _trace:
            trace.stamp(trace.COMBINED)
        return result
    return run


def interrupted(exc):
    """Whether ``exc`` is Ctrl-C in disguise.

    A SIGINT that lands while compiled code (Numba, a C extension) runs can come
    out as ``SystemError: ... returned a result with an exception set`` whose
    cause is the KeyboardInterrupt; the user pressed Ctrl-C and should see that.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _worker_error(rt, cmd, local_exc, remote):
    """One WorkerError for every failing rank: the same type whichever rank failed."""
    failures = rt.control.failures()
    if local_exc is not None:
        text, _ = describe_error(rank_header(rt.place.rank, rt.place.n_parallel), local_exc)
        failures[rt.place.rank] = (text, local_exc)
    if remote:
        failures.update(remote)
    first = min(failures)
    text, exc = failures[first]
    others = len(failures) - 1
    msg = f"{cmd.name.lower()} failed in rank {first}"
    if others:
        msg += f" (and {others} other rank{'s' if others > 1 else ''})"
    msg += ":\n" + text
    err = worker_error_type(exc)(msg, first, {r: t for r, (t, _) in failures.items()},
                                 {r: e for r, (_, e) in failures.items()})
    err.__cause__ = exc
    return err
