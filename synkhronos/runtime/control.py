"""The control channel: the control block in shared memory, barriers, status slots.

The leader announces a command by writing a pickled message into a shared
segment and publishing a new sequence number (the start barrier: no worker
moves before it sees the new number); every worker publishes that number in
its own slot when done (the end barrier).  The waits and wake-ups run in
compiled code (``_block.Block``): they spin a bounded time without the GIL,
because blocking primitives wake the other core slowly, then sleep on a futex
so idle workers cost no CPU.  Every wait is bounded: between two waits it
checks that the other side is alive and that no rank aborted.

A message the leader sends again and again (a loop's call, its all-reduce)
is ``keep``-ed: pickled once, given an id that travels with it, so each
worker decodes it once and may keep what it prepared for it (``prepared``),
ready to run the next time the same id comes.
"""

import functools
import itertools
import logging
import pickle
import time
from typing import NamedTuple

from ..errors import error_record, unpickle_exception
from . import trace
from ._block import EQ, GE, NE, Block
from .commands import Command, decode, encode, handler
from .liveness import CHECK_NS, wait_slots
from .peers import ALONE
from .process_setup import trim_heap
from .run import run_command
from .shmem import SharedArray

logger = logging.getLogger(__name__)


OK, FAILED, ABORTED = 0, 1, 2

# Control block layout (int64 slots): a header line, then one line per local rank,
# which only that rank writes (but for the waiters count of a slot someone sleeps on).
SEQ, MSG_LEN, ABORT, SEQ_WAITERS, MSG_ID = 0, 1, 2, 3, 4
RANK_BASE, RANK_STRIDE = 8, 8
DONE, STATUS, DONE_WAITERS, ERR_LEN = 0, 1, 2, 3

ERR_BYTES = 256 * 1024
MSG_BYTES = 1 << 20
IDLE_TIMEOUT_NS = 50_000_000  # an idle worker looks at its master this often
DECODE_CACHE_BYTES = 1024  # messages this short are kept decoded (keyed by their bytes)
DECODE_CACHE_SIZE = 256
CONTENDED_NS = 500_000_000  # a worker seen off its core sleeps at once this long (wait_command)
KEPT_SIZE = 256  # decoded kept messages (and what was prepared for them) per worker

_trace = trace.ON


class Kept(NamedTuple):
    """A message the leader posts repeatedly: pickled once, named by ``id`` (> 0)."""

    id: int
    data: bytes


class Control:
    """The control block, message area and error slots of one machine's ranks.

    Created in the leader before the workers fork, so every process inherits
    the mappings.
    """

    def __init__(self, rt, spin_s):
        # Slots are indexed by local index: the ranks of this machine.
        self.rt = rt
        self.spin_s = spin_s
        self.spin_ns = int(spin_s * 1e9)
        n_local = rt.place.n_local
        n_slots = RANK_BASE + RANK_STRIDE * n_local
        self.block = SharedArray(rt.segment_name("ctrl"), 8 * n_slots)
        self.mv = memoryview(self.block.buffer).cast("q")
        self.fast = Block(self.block.buffer)
        self.errors = SharedArray(rt.segment_name("err"), ERR_BYTES * n_local)
        self.msg = SharedArray(rt.segment_name("msg"), MSG_BYTES)
        self.seq = 0
        self.current = 0  # the command this process runs (master: the last posted)
        self.decoded = {}  # message bytes -> decoded message (read_message)
        self.kept = {}     # kept message id -> [decoded message, prepared runner or None]
        self.epoch = 0     # the Registry.epoch the prepared runners were made in
        self.msg_id = 0    # the kept message the area holds (leader), or 0
        # The last command closed before every worker finished it (functions/chunks.py), or 0:
        # no other message is written before they all have.
        self.early = 0
        self.preempts = 0  # Block.preempted() when last looked at (wait_command)
        self.calm_at = 0   # until then (monotonic ns) a worker's waits do not spin
        self.ids = itertools.count(1)
        self.workers = rt.worker_ranks
        self.status_slots = tuple(self.slot(r, STATUS) for r in self.workers)
        self.done_slots = tuple(self.slot(r, DONE) for r in self.workers)

    def slot(self, rank, field):
        return RANK_BASE + RANK_STRIDE * rank + field

    def keep(self, cmd, payload):
        """Pickle ``cmd`` with ``payload`` once, for posting many times (``post(kept=)``)."""
        return Kept(next(self.ids), encode(cmd, payload))

    def post(self, rt, cmd, payload, wire=None, kept=None):
        """Announce ``cmd`` to every worker; return its sequence number.

        Data objects the master dropped since the last command travel along,
        so the workers unmap them first (the message then goes fresh, not as
        ``kept``).  ``wire``, if given, is this very message as the
        controller sent it (a node master posts those bytes as they came);
        ``kept`` (``keep``) is a message posted before under its id.
        """
        freed = rt.registry.freed
        mv = self.mv
        if self.early and (kept is None or freed or kept.id != self.msg_id):
            # A worker may still read the message area for that command (a repeat of the
            # same kept message leaves the area as it is).
            wait_slots(self.fast, self.done_slots, GE, self.early, DONE_WAITERS - DONE, rt.check,
                       self.spin_ns)
            self.early = 0
        if not self.workers and rt.peers is ALONE:
            # One rank, one machine: nobody reads the message (nothing to unmap either).
            freed.clear()
            data = None
        elif kept is not None and not freed:
            data = kept.data
            if self.msg_id != kept.id:
                # No id claims the area while it is rewritten (an exception midway, Ctrl-C,
                # must not leave another message's bytes under a kept id).
                self.msg_id = 0
                self._write(rt, data)
                mv[MSG_ID] = self.msg_id = kept.id
        else:
            if wire is not None and not freed:
                data = wire
            else:
                frees = [freed.popleft() for _ in range(len(freed))] if freed else None
                data = encode(cmd, payload, frees)
            self.msg_id = 0
            self._write(rt, data)
            mv[MSG_ID] = 0
        self.last = data  # what a cluster's controller forwards to the other machines
        self.seq += 1
        self.current = self.seq
        # After the message: a worker that sees the number reads the whole message.
        self.fast.publish(SEQ, self.seq, SEQ_WAITERS)
        if _trace:
            trace.stamp(trace.POSTED)
        return self.seq

    def repost(self, rt, kept):
        """Post the kept message ``kept`` again where nothing else is to do; return its seq, or 0.

        ``post``'s common case alone: the area holds ``kept`` (so a worker still
        in an early-closed repeat of it reads the same bytes), no Data to unmap,
        workers to tell.  0: call ``post``.
        """
        if self.msg_id != kept.id or rt.registry.freed or not self.workers:
            return 0
        self.last = kept.data
        self.seq = self.current = seq = self.seq + 1
        self.fast.publish(SEQ, seq, SEQ_WAITERS)
        if _trace:
            trace.stamp(trace.POSTED)
        return seq

    def settled(self, seq):
        """Whether every worker finished ``seq`` with OK within one spin (no check, no sleep).

        False says nothing: ``wait_done`` and ``any_failed`` then settle it.
        """
        if self.early == seq:
            return True   # chunks: every chunk is done; ranks that took none are not awaited
        return (self.fast.wait_all(self.done_slots, EQ, seq, DONE_WAITERS - DONE,
                                   min(self.spin_ns, CHECK_NS), 0)
                and not self.fast.count_ne(self.status_slots, OK))

    def _write(self, rt, data):
        n = len(data)
        if n > self.msg.nbytes:
            # (bytes another machine sent, too: each machine grows its own area)
            self._grow_message(rt, n)
        self.msg.buffer[:n] = data
        self.mv[MSG_LEN] = n

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
        """End barrier: wait until every worker has published ``seq``."""
        wait_slots(self.fast, self.done_slots, EQ, seq, DONE_WAITERS - DONE, check, self.spin_ns)

    def all_ok(self):
        """Whether every worker finished its last command without failing or aborting."""
        return not self.fast.count_ne(self.status_slots, OK)

    def any_failed(self):
        status_slots = self.status_slots
        if not self.fast.count_ne(status_slots, OK):
            return False
        mv = self.mv
        return any(mv[slot] == FAILED for slot in status_slots)

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
        """Block until the master posts a command after ``last_seq``; return its seq.

        A worker whose spinning wait saw it taken off its core (another program
        holds the core) sleeps at once for the next ``CONTENDED_NS``: spinning
        there only spends the time slice it needs for its chunks, and a rank
        that sleeps gets its core back as soon as it is woken.
        """
        spin = self.spin_ns
        if spin:
            seen = self.fast.preempted()
            if seen != self.preempts:
                self.preempts = seen
                self.calm_at = time.monotonic_ns() + CONTENDED_NS
            if self.calm_at and time.monotonic_ns() < self.calm_at:
                spin = 0
        if not self.fast.wait(SEQ, NE, last_seq, SEQ_WAITERS - SEQ, min(spin, CHECK_NS),
                              IDLE_TIMEOUT_NS):
            # Idle a while: give back what the calls before freed (glibc keeps a call's
            # intermediates for the next; a rank at 10^6 rows held 30 MiB of them).
            trim_heap()
            wait_slots(self.fast, SEQ, NE, last_seq, SEQ_WAITERS - SEQ, check,
                       max(spin - CHECK_NS, 0), IDLE_TIMEOUT_NS)
        self.current = self.mv[SEQ]
        return self.current

    def posted_kept(self):
        """The id of the kept message just posted, or 0 (a message posted once)."""
        return self.mv[MSG_ID]

    def prepared(self, epoch):
        """The runner prepared for the kept message just posted, if still valid for ``epoch``."""
        if epoch != self.epoch:
            self.forget_prepared(epoch)
            return None
        msg_id = self.mv[MSG_ID]
        if msg_id:
            entry = self.kept.get(msg_id)
            if entry is not None:
                return entry[1]
        return None

    def forget_prepared(self, epoch):
        """Drop every prepared runner (they hold views of Data unmapped since); now ``epoch``."""
        for entry in self.kept.values():
            entry[1] = None
        self.epoch = epoch

    def prepare(self, runner, epoch):
        """Keep ``runner`` for the kept message just posted (read by ``read_message``)."""
        if epoch != self.epoch:
            self.forget_prepared(epoch)
        entry = self.kept.get(self.mv[MSG_ID])
        if entry is not None:
            entry[1] = runner

    def read_message(self):
        """Return (command, payload, ids of dropped Data objects or None).

        A loop sends the same few messages again and again; unpickling one
        costs microseconds, a dict look-up a tenth of that.  Handlers never
        change a payload, so a decoded one can be reused: kept messages by
        their id, other short ones by their bytes.
        """
        mv = self.mv
        msg_id = mv[MSG_ID]
        if msg_id:
            entry = self.kept.get(msg_id)
            if entry is not None:
                return entry[0]
        n = mv[MSG_LEN]
        data = self.msg.buffer[:n]
        if msg_id:
            out = decode(data)
            if len(self.kept) >= KEPT_SIZE:
                self.kept.clear()
            self.kept[msg_id] = [out, None]
            return out
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
        self.finisher(rank)(status, seq)

    def finisher(self, rank):
        """``finish`` of local rank ``rank`` as ``f(status, seq)``: its slots bound once."""
        base = RANK_BASE + RANK_STRIDE * rank
        return functools.partial(self.fast.finish, base + STATUS, base + DONE, base + DONE_WAITERS)

    def write_error(self, rank, header, exc):
        """Store the traceback text and, if it pickles, the exception itself (both cut to fit)."""
        raw = error_record(header, exc, ERR_BYTES)
        self.errors.view(offset=rank * ERR_BYTES, shape=(len(raw),))[:] = memoryview(raw)
        self.mv[self.slot(rank, ERR_LEN)] = len(raw)

    def close(self):
        self.fast.release()
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
