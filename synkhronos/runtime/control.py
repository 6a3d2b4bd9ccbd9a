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
import pickle
from typing import NamedTuple

from ..errors import error_record, unpickle_exception
from .commands import Command, decode, encode, handler
from .liveness import spin_until, wait_until
from .run import run_command
from .shmem import SharedArray
from . import trace

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
        message as an earlier post pickled it (``last_plain``: a loop that
        repeats a collective skips the pickling), or as the controller sent
        it (a node master posts those bytes as they came).
        """
        freed = rt.registry.freed
        if wire is not None and not freed:
            data = wire
        else:
            frees = [freed.popleft() for _ in range(len(freed))] if freed else None
            data = encode(cmd, payload, frees)
            wire = None if frees else data
        if len(data) > self.msg.nbytes:
            # (bytes another machine sent, too: each machine grows its own area)
            self._grow_message(rt, len(data))
        self.last = data  # what a cluster's controller forwards to the other machines
        self.last_plain = wire  # the message without frees, which can be posted again
        self.msg.buffer[: len(data)] = data
        mv = self.mv
        mv[MSG_LEN] = len(data)
        self.seq += 1
        self.current = self.seq
        mv[SEQ] = self.seq
        if trace.ON:
            trace.stamp(trace.POSTED)
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
