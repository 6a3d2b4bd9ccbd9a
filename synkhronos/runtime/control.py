"""The control channel: the control block in shared memory, barriers, status slots, run_command.

The master announces a command by writing a pickled message into a shared
segment and bumping a sequence number (the start barrier: no worker moves
before it sees the new number); every worker posts that number in its own
slot when done (the end barrier).  Waiting spins on shared memory first,
because blocking primitives wake the other core slowly (~100 us), then falls
back to sleeping so idle workers cost no CPU.  Every wait is bounded: it keeps
checking that the other side is alive and that no rank aborted.
"""

import logging
import os
import pickle
import time
from typing import NamedTuple

from .commands import COMMANDS, Command, decode, encode, handler
from ..errors import (CommAborted, WorkerDiedError, describe_error, error_record, unpickle_exception,
                      worker_error_type)
from .liveness import spin_until, wait_until
from .shmem import SharedArray

logger = logging.getLogger(__name__)


OK, FAILED, ABORTED = 0, 1, 2

# Control block layout (int64 slots).
SEQ, MSG_LEN, ABORT = 0, 1, 2
RANK_BASE, RANK_STRIDE = 8, 8
DONE, STATUS, SLEEPING, ERR_LEN = 0, 1, 2, 3

ERR_BYTES = 256 * 1024
MSG_BYTES = 1 << 20
IDLE_TIMEOUT_S = 0.05
DECODE_CACHE_BYTES = 1024  # messages this short are kept decoded (keyed by their bytes)
DECODE_CACHE_SIZE = 256


class Control:
    """The control block, message area, error slots and wake-up semaphores.

    Created in the master before the workers fork, so every process inherits
    the mappings.  ``sems`` are multiprocessing semaphores (inherited by fork,
    nothing to unlink).
    """

    def __init__(self, rt, ctx, spin_s):
        # Slots are indexed by local index: the ranks of this machine.
        self.rt = rt
        self.spin_s = spin_s
        n_local = rt.place.n_local
        n_slots = RANK_BASE + RANK_STRIDE * n_local
        self.block = SharedArray(rt.segment_name("ctrl"), 8 * n_slots)
        self.mv = memoryview(self.block.buffer).cast("q")
        self.errors = SharedArray(rt.segment_name("err"), ERR_BYTES * n_local)
        self.msg = SharedArray(rt.segment_name("msg"), MSG_BYTES)
        self.sems = [ctx.Semaphore(0) for _ in range(n_local)]
        self.seq = 0
        self.current = 0  # the command this process runs (master: the last posted)
        self.decoded = {}  # message bytes -> decoded message (read_message)
        self.workers = rt.worker_ranks
        self.status_slots = [self.slot(r, STATUS) for r in self.workers]

    def slot(self, rank, field):
        return RANK_BASE + RANK_STRIDE * rank + field

    def post(self, rt, cmd, payload, wire=None):
        """Announce ``cmd`` to every worker; return its sequence number.

        Data objects the master dropped since the last command travel along,
        so the workers unmap them first.  ``wire``, if given, is this very
        message as an earlier post pickled it (``last_plain``): a loop that
        repeats a collective skips the pickling.
        """
        freed = rt.registry.freed
        if wire is not None and not freed:
            data = wire
        else:
            frees = [freed.popleft() for _ in range(len(freed))] if freed else None
            data = encode(cmd, payload, frees)
            if len(data) > self.msg.nbytes:
                self._grow_message(rt, len(data))
            wire = None if frees else data
        self.last = data  # what a cluster's controller forwards to the other machines
        self.last_plain = wire  # the message without frees, which can be posted again
        self.msg.buffer[: len(data)] = data
        mv = self.mv
        mv[MSG_LEN] = len(data)
        self.seq += 1
        self.current = self.seq
        mv[SEQ] = self.seq
        for r in self.workers:
            if mv[RANK_BASE + RANK_STRIDE * r + SLEEPING]:
                self.sems[r].release()
        return self.seq

    def _grow_message(self, rt, n):
        size = max(n + n // 2, 2 * self.msg.nbytes)
        new = SharedArray(rt.segment_name("msg"), size)
        run_command(rt, Command.GROW_MESSAGE, GrowMessageMsg(new.name, size))
        old, self.msg = self.msg, new
        old.unlink()
        old.close()

    def abort(self, seq):
        self.mv[ABORT] = seq

    def aborted(self, seq):
        return self.mv[ABORT] == seq

    def aborted_now(self):
        """Whether a rank aborted the command this process is running."""
        return self.mv[ABORT] == self.current

    def wait_done(self, rt, seq, check):
        """End barrier: wait until every worker has posted ``seq``."""
        mv = self.mv
        for r in self.workers:
            slot = RANK_BASE + RANK_STRIDE * r + DONE
            if mv[slot] != seq:
                wait_until(lambda: mv[slot] == seq, check, self.spin_s)

    def all_ok(self):
        """Whether every worker finished its last command without failing or aborting."""
        mv = self.mv
        return all(mv[slot] == OK for slot in self.status_slots)

    def any_failed(self):
        mv = self.mv
        for slot in self.status_slots:
            if mv[slot] == FAILED:
                return True
        return False

    def failures(self):
        """Return {global rank: (text, exception or None)} for the workers that failed."""
        out = {}
        for r in self.workers:
            if self.mv[self.slot(r, STATUS)] == FAILED:
                out[self.rt.place.rank_offset + r] = self._read_error(r)
        return out

    def _read_error(self, rank):
        n = self.mv[self.slot(rank, ERR_LEN)]
        raw = bytes(self.errors.view(offset=rank * ERR_BYTES, shape=(n,)))
        text, exc_bytes = pickle.loads(raw)
        return text, unpickle_exception(exc_bytes)

    def wait_command(self, rank, last_seq, check):
        """Block until the master posts a command after ``last_seq``; return its seq."""
        mv = self.mv
        if spin_until(lambda: mv[SEQ] != last_seq, check, self.spin_s):
            self.current = mv[SEQ]
            return self.current
        sleeping = self.slot(rank, SLEEPING)
        while True:
            mv[sleeping] = 1
            if mv[SEQ] != last_seq:
                break
            self.sems[rank].acquire(timeout=IDLE_TIMEOUT_S)
            if mv[SEQ] != last_seq:
                break
            check()
        mv[sleeping] = 0
        self.current = mv[SEQ]
        return self.current

    def read_message(self):
        """Return (command, payload, ids of dropped Data objects or None).

        A loop sends the same few messages again and again; unpickling one
        costs microseconds, a dict look-up of its bytes a tenth of that.
        Handlers never change a payload, so a decoded one can be reused.
        """
        n = self.mv[MSG_LEN]
        data = self.msg.buffer[:n]
        cache = self.decoded
        hit = cache.get(data)
        if hit is not None:
            return hit
        out = decode(data)
        if n <= DECODE_CACHE_BYTES and out[2] is None:
            if len(cache) >= DECODE_CACHE_SIZE:
                cache.clear()
            cache[data] = out
        return out

    def pending(self):
        """Return the workers that have not finished the current command."""
        mv = self.mv
        return [r for r in self.workers if mv[self.slot(r, DONE)] != self.current]

    def finish(self, rank, seq, status):
        mv = self.mv
        mv[self.slot(rank, STATUS)] = status
        mv[self.slot(rank, DONE)] = seq

    def write_error(self, rank, header, exc):
        """Store the traceback text and, if it pickles, the exception itself (both cut to fit)."""
        raw = error_record(header, exc, ERR_BYTES)
        self.errors.view(offset=rank * ERR_BYTES, shape=(len(raw),))[:] = memoryview(raw)
        self.mv[self.slot(rank, ERR_LEN)] = len(raw)

    def close(self):
        self.mv.release()
        for seg in (self.block, self.errors, self.msg):
            seg.close()

    def unlink(self):
        for seg in (self.block, self.errors, self.msg):
            seg.unlink()


class GrowMessageMsg(NamedTuple):
    """GROW_MESSAGE: map the bigger message area the master made."""

    name: str
    size: int


@handler(Command.GROW_MESSAGE, GrowMessageMsg, local=True)
def _grow_message_worker(rt, msg):
    new = SharedArray.attach(msg.name, msg.size)
    old, rt.control.msg = rt.control.msg, new
    old.close()


def rank_header(rank, n_parallel):
    """The line that opens a rank's traceback text."""
    return f"rank {rank} of {n_parallel} (pid {os.getpid()})"


def run_command(rt, cmd, payload, local=None, after=None, what=None, wire=None):
    """Run ``cmd`` on every worker and ``local(seq)`` in the master; return its result.

    ``after(result)``, if given, runs once every worker has finished without
    error and returns the final result.  If any rank raised, the master
    included, raises ``WorkerError`` after every rank has finished (end
    barrier), carrying every failing rank's traceback.  ``what`` describes
    the command in errors about ranks that stall (default: its name).
    ``wire`` is the message pickled by an earlier post (``Control.post``).
    """
    control = rt.control
    t0 = time.perf_counter()
    prof = rt.profiler
    if prof is not None:
        prof.begin(what or cmd.name.lower())
    seq = control.post(rt, cmd, payload, wire)
    cluster = rt.cluster  # the controller's link to the other machines (None elsewhere)
    result = None
    local_exc = None
    local_ok = False  # the master's own share finished (a lost machine asks)
    try:
        if cluster is not None and not COMMANDS[cmd].local:
            cluster.forward(cmd, control.last)
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
        except WorkerDiedError:
            raise
        except KeyboardInterrupt:
            rt.abandon(rt, "interrupted while running %s" % cmd.name)
            raise
        except BaseException as exc:  # noqa: BLE001 - reported after the end barrier
            local_exc = exc
            control.abort(seq)
        control.wait_done(rt, seq, rt.check)
        if cluster is not None:
            cluster.local_done = cluster.seq  # a machine lost now finds this one's share made
        remote = None if cluster is None else cluster.wait_reports(rt.check)
        if prof is not None:
            prof.lap("wait")
    except WorkerDiedError as exc:
        # A cluster that lost a machine may go on with the others (cluster/recovery.py).
        goes_on = None if rt.survive is None else rt.survive(rt, exc, seq, local_ok)
        if goes_on is None:
            rt.abandon(rt, "a worker died")
            raise
        if goes_on is exc:
            raise
        raise goes_on from exc
    except KeyboardInterrupt:
        rt.abandon(rt, "interrupted while waiting for workers")
        raise
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("master ran %s in %.6f s", cmd.name, time.perf_counter() - t0)
    if local_exc is not None or control.any_failed() or remote:
        failures = control.failures()
        if local_exc is not None:
            text, _ = describe_error(rank_header(rt.place.rank, rt.place.n_parallel), local_exc)
            failures[rt.place.rank] = (text, local_exc)
        if remote:
            failures.update(remote)
        if prof is not None:
            prof.end("reduce")  # a failed command is still one record, and the next one starts clean
        raise _worker_error(cmd, failures)
    if after is not None:
        result = after(result)
    if prof is not None:
        prof.end("reduce")
    return result


def _worker_error(cmd, failures):
    """One WorkerError for every failing rank: the same type whichever rank failed."""
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
