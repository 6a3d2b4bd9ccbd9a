"""The control channel: commands, the control block in shared memory, barriers, status slots.

The master announces a command by writing a pickled message into a shared
segment and bumping a sequence number (the start barrier: no worker moves
before it sees the new number); every worker posts that number in its own
slot when done (the end barrier).  Waiting spins on shared memory first,
because blocking primitives wake the other core slowly (~100 us), then falls
back to sleeping so idle workers cost no CPU.  Every wait is bounded: it keeps
checking that the other side is alive and that no rank aborted.
"""

import enum
import logging
import os
import pickle
import time
import traceback
from typing import NamedTuple

from .errors import CommAborted, WorkerDiedError, worker_error_type
from .liveness import spin_until, wait_until
from .shmem import SharedArray

logger = logging.getLogger(__name__)


class Command(enum.IntEnum):
    """Every command a worker can run; handlers register under these."""

    QUIT = 0
    GROW_MESSAGE = 1
    DATA_ALLOC = 2
    DATA_FREE = 3
    DISTRIBUTE = 4
    CALL = 5
    BROADCAST = 10
    SCATTER = 11
    GATHER = 12
    ALL_GATHER = 13
    REDUCE = 14
    ALL_REDUCE = 15
    SET_VALUE = 16
    GET_VALUE = 17
    GET_SHAPES = 18
    PROFILE = 19
    SAVE_STATE = 30
    LOAD_STATE = 31
    OVERLAP_STEP = 32
    LAYOUT = 40         # cluster: every rank learns its global rank
    DATA_SYNC = 41      # cluster: node masters copy written Data contents


HANDLERS = {}


MESSAGES = {}


def handler(cmd, message=None):
    """Register the decorated function as the worker handler of ``cmd``.

    ``message``, the command's NamedTuple, travels as a plain tuple (pickling
    a named tuple costs microseconds per call) and is rebuilt in the worker:
    by its ``from_wire`` (made with ``to_wire``) where it has one, else ``_make``.
    """
    def deco(fn):
        HANDLERS[cmd] = fn
        if message is not None:
            # Looked up once here, not at every call.
            MESSAGES[cmd] = (message, getattr(message, "to_wire", None),
                             getattr(message, "from_wire", None))
        return fn
    return deco


def _to_wire(cmd, payload):
    entry = MESSAGES.get(cmd)
    if entry is None or type(payload) is not entry[0]:
        return payload
    return tuple(payload) if entry[1] is None else entry[1](payload)


def _from_wire(cmd, raw):
    entry = MESSAGES.get(cmd)
    if entry is None or type(raw) is not tuple:
        return raw
    return tuple.__new__(entry[0], raw) if entry[2] is None else entry[2](raw)


# Command(n) runs Python code in the enum machinery; a dict lookup does not.
_COMMANDS = {int(c): c for c in Command}


def decode(data):
    """Return (command, payload, ids of dropped Data objects or None) from a posted message."""
    cmd, raw, frees = pickle.loads(data)
    cmd = _COMMANDS[cmd]
    return cmd, _from_wire(cmd, raw), frees


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


def default_spin_s(n_parallel, n_cpus):
    """How long a waiter spins before sleeping; 0 when ranks outnumber cores."""
    env = os.environ.get("SYNK_SPIN_S")
    if env is not None:
        return float(env)
    return 0.0 if n_parallel > n_cpus else 0.01


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
        n_local = rt.n_local
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
        freed = rt.freed
        if wire is not None and not freed:
            data = wire
        else:
            frees = [freed.popleft() for _ in range(len(freed))] if freed else None
            data = pickle.dumps((int(cmd), _to_wire(cmd, payload), frees),
                                protocol=pickle.HIGHEST_PROTOCOL)
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
                out[self.rt.rank_offset + r] = self._read_error(r)
        return out

    def _read_error(self, rank):
        n = self.mv[self.slot(rank, ERR_LEN)]
        raw = bytes(self.errors.view(offset=rank * ERR_BYTES, shape=(n,)))
        text, exc_bytes = pickle.loads(raw)
        exc = None
        if exc_bytes is not None:
            try:
                exc = pickle.loads(exc_bytes)
            except Exception:  # noqa: BLE001 - the type may not unpickle here; the text remains
                exc = None
        return text, exc

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
        """Store the traceback text and, if it pickles, the exception itself."""
        text, exc_bytes = describe_error(header, exc)
        raw = pickle.dumps((text, exc_bytes))
        if len(raw) > ERR_BYTES:
            raw = pickle.dumps((text[-(ERR_BYTES // 2):], None))
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


@handler(Command.GROW_MESSAGE, GrowMessageMsg)
def _grow_message_worker(rt, msg):
    new = SharedArray.attach(msg.name, msg.size)
    old, rt.control.msg = rt.control.msg, new
    old.close()


def describe_error(header, exc):
    """Return (traceback text under ``header``, the pickled exception or None)."""
    text = header + "\n" + "".join(traceback.format_exception(exc))
    try:
        exc_bytes = pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - the text alone still tells what happened
        exc_bytes = None
    return text, exc_bytes


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
    cluster = rt.cluster
    if cluster is not None:
        cluster.forward(cmd, control.last)  # controller: the other machines; node master: nothing
    rt.monitor.begin(what or cmd)  # a Command is named only if a rank stalls
    if prof is not None:
        prof.lap("control")
    rt.backend.begin(seq)
    result = None
    local_exc = None
    try:
        try:
            if local is not None:
                result = local(seq)
                if prof is not None:
                    prof.lap("collective")  # what the local part did not book itself
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
        remote = None if cluster is None else cluster.wait_reports(rt.check)
        if prof is not None:
            prof.lap("wait")
    except WorkerDiedError:
        rt.abandon(rt, "a worker died")
        raise
    except KeyboardInterrupt:
        rt.abandon(rt, "interrupted while waiting for workers")
        raise
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("master ran %s in %.6f s", cmd.name, time.perf_counter() - t0)
    if local_exc is not None or control.any_failed() or remote:
        failures = control.failures()
        if local_exc is not None:
            text, _ = describe_error(rank_header(rt.rank, rt.n_parallel), local_exc)
            failures[rt.rank] = (text, local_exc)
        if remote:
            failures.update(remote)
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
    err = worker_error_type(exc)(msg, first, {r: t for r, (t, _) in failures.items()})
    err.__cause__ = exc
    err.raw_failures = failures  # a node master sends them on to the controller
    return err
