"""The node master: a cluster machine's leader, serving the controller's commands (cluster.py)."""

import logging
import os
import pickle
import signal

from .cluster import Exit, exit_finalized, finalize
from .control import HANDLERS, Command, decode, describe_error, rank_header, run_command
from .data_module import node_alloc, node_free, node_sync
from .errors import CommAborted, WorkerDiedError, WorkerError
from .worker import unmap

logger = logging.getLogger(__name__)

FINALIZE_S = 10

# Commands whose ranks leave results for the controller (Backend.contribute).
COLLECTED = frozenset({Command.CALL, Command.OVERLAP_STEP, Command.PROFILE,
                       Command.GET_VALUE, Command.GET_SHAPES})


def _no_check():
    pass


def serve(rt, join_workers):
    """A node master's life after ``fork()``: run the controller's commands until QUIT.

    ``join_workers(rt)`` ends the machine's workers after QUIT (process.py).
    """
    cluster = rt.cluster
    check = rt.check
    alone = not rt.worker_ranks  # no local workers: nothing to post
    status = 0

    def idle_check():
        # Between commands nothing runs here, so no command timeout applies: only
        # the controller's orders (and the sentinel, for its death) end the wait.
        cluster.node_check()

    def ended(signum, frame):
        # The sentinel's way to end this machine when the controller has gone:
        # at once, wherever Python is (an exception could land in a callback
        # that swallows it), and with MPI finalised so mpiexec ends the job quietly.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not rt.closed:
            rt.abandon(rt, "the controller ended the job")
        finalize(cluster.MPI)
        exit_finalized(0)
    signal.signal(signal.SIGTERM, ended)
    try:
        while True:
            data = cluster.receive_command(idle_check)
            cmd, payload, frees = decode(data)
            if cmd == Command.QUIT:
                # A normal end: the sentinel must not take the controller's exit,
                # which may come before this process's, for a failure.
                _stop(cluster.sentinel)
            if frees:
                node_free(rt, frees)
                unmap(rt, frees)
                rt.freed.extend(frees)
            failures, died = [], None
            contributions = []
            try:
                if cmd == Command.DATA_SYNC:
                    node_sync(rt, cluster, payload, check)
                else:
                    if cmd == Command.DATA_ALLOC:
                        payload = node_alloc(rt, payload)
                    if alone and cmd != Command.QUIT:
                        failures = _run_alone(rt, cmd, payload)
                    else:
                        run_command(rt, cmd, payload,
                                    local=lambda seq, c=cmd, p=payload: HANDLERS[c](rt, p))
                    if cmd == Command.DATA_FREE:
                        node_free(rt, [payload.data_id])
                    if cmd in COLLECTED:
                        contributions = rt.backend.node_contributions()
            except WorkerDiedError as exc:
                died = str(exc)
            except WorkerError as exc:
                failures = [(r, t, _pickled(e)) for r, (t, e) in exc.raw_failures.items()]
            except CommAborted:
                pass
            except Exit:
                raise
            except Exception as exc:  # noqa: BLE001 - reported to the controller
                text, raw = describe_error(rank_header(rt.rank, rt.n_parallel), exc)
                failures = [(rt.rank, text, raw)]
            cluster.retire_sends()  # an aborted collective's sends nobody will receive
            cluster.report(failures, contributions, died)
            # After a death the machine is torn down; the sentinel still ends this
            # process if the controller goes.
            cluster.complete_sends(check if died is None else _no_check)
            if died is not None:
                raise Exit()
            if cmd == Command.QUIT:
                break
    except Exit:
        status = 1
    except BaseException as exc:  # noqa: BLE001 - the controller sees the heartbeat stop
        logger.error("node master %d failed: %r", cluster.node, exc)
        status = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if status != 0:
            # The controller must learn at once that this machine is gone, not by
            # heartbeats that would go on while MPI_Finalize below waits.
            _stop(cluster.sentinel)
        if not rt.closed:
            if status == 0:
                join_workers(rt)
            else:
                rt.abandon(rt, "the controller ended the job")
        # Always finalise: mpiexec ends the whole job, the controller too, when a
        # process exits without it.  MPI_Finalize waits for messages still in
        # flight, so it gets a deadline: SIGALRM ends this process past it.
        signal.alarm(FINALIZE_S)
        finalize(cluster.MPI)
        exit_finalized(0)


def _stop(pid):
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except OSError:
        pass


def _run_alone(rt, cmd, payload):
    """Run a command on a machine whose only rank is its node master; return its failures."""
    control = rt.control
    control.seq += 1
    control.current = control.seq  # what the abort flag is compared with
    rt.backend.begin(control.seq)
    rt.monitor.begin(cmd)
    prof = rt.profiler
    if prof is not None:
        prof.begin(cmd.name.lower())
    try:
        HANDLERS[cmd](rt, payload)
    except (CommAborted, WorkerDiedError, Exit):
        raise
    except Exception as exc:  # noqa: BLE001 - reported to the controller
        text, raw = describe_error(rank_header(rt.rank, rt.n_parallel), exc)
        return [(rt.rank, text, raw)]
    finally:
        if prof is not None and rt.profiler is prof:
            prof.end("collective")  # what the handler did not book itself
    return []


def _pickled(exc):
    if exc is None:
        return None
    try:
        return pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - the text remains
        return None
