"""Chunked calls: rows cut into fixed chunks that ranks take as they come free.

Why: with the rows split once per rank, a call lasts as long as its slowest
rank, and a rank whose core another program holds runs at half speed or not
at all until its time slice comes (bench/busy.py: 0.78-0.90x a serial call
beside one busy process).  Here a call whose outputs are small reductions
cuts its rows into chunks fixed by the row count (``chunk_rows``; the count
timed fastest, pace.py), never by the ranks; every rank, the master
too, takes the next chunk (a compare-and-swap on a claim word) until none is
left, and the master combines the chunks' results in chunk order.  So a rank
on a busy core simply does fewer chunks, and the result has the same bits
whatever the number of ranks and whoever did which chunk.

The master never waits for a rank that took no chunk: once every chunk is
done it returns, and the call is *closed early* (``Control.early``); the next
message that is not the same call again waits for every rank to pass it.
A chunk a rank took and has not finished a while after the master ran out of
chunks is run again by the master itself (the same function on the same rows
gives the same bits), so a rank preempted in the middle of a chunk delays no
call by more than that while.

The board (``Board``): a segment per function and machine holding the claim
word (tag = the call's sequence number, then the next ticket), a failure slot,
one flag per chunk (``seq << RANK_BITS | rank`` of whoever finished it) and a
region per (chunk, rank) for the results: a rank writes only its own regions,
so a late rank of an older call can overwrite no result the master reads.

Which calls (``eligible``): CPU mode, outputs all under a reduce op
("sum", "avg", "prod", "max", "min"), no updates, no in-graph collectives, no
call options, at least two chunks' worth of rows (``chunk_rows``); in a
cluster, inputs that every machine holds whole, whose chunks spread over the
ranks with no board (spread.py).  Others keep their static split.
``SYNK_CHUNK_ROWS=0`` turns chunks off; another value fixes the rows of a chunk.
"""

import time
from typing import NamedTuple

import numpy as np

from ..comm import reduce_ops
from ..inputs import mappings
from ..runtime._block import CLAIM_BITS, GE, Block
from ..runtime.control import FAILED as FAILED_STATUS, OK
from ..runtime.commands import Command
from ..runtime.liveness import CHECK_NS
from ..runtime.peers import ALONE
from ..runtime.run import run_command
from ..runtime.shmem import SharedArray
from .outputs import MACHINE_PART_BYTES
from .pace import Pace, chunk_rows
from .spread import chunk_args, in_chunk_order

RANK_BITS = 10      # a chunk flag: the call's seq, then the local rank that finished it
CLAIM, FAILED, ZERO, FLAGS = 0, 1, 2, 8
STEAL_MIN_S = 100e-6  # the master runs a late chunk itself after this, or 3 chunks' time (1
# where another program holds a worker's core: CoreTrade.contended; bench/HISTORY.md 12-05)
ALIGN = 64
BOARD_CHUNKS = 16  # a board's fewest chunks: the usual counts fit without a new segment


class ChunkPlan(NamedTuple):
    """How a call's rows are chunked and where the ranks leave each chunk's results.

    ``layout`` lists each output's (dtype str, shape, offset in a region);
    a region is ``region_bytes`` long, at ``(chunk * n_local + rank) * region_bytes``
    after the flags.
    """

    name: str
    nbytes: int
    capacity: int       # the chunks the board has room for
    n_rows: int
    rows: int
    n_chunks: int
    layout: tuple
    region_bytes: int

    def bounds(self, c):
        lo = c * self.rows
        return lo, min(self.n_rows, lo + self.rows)


def eligible(spec, rt, msg):
    """Whether the call ``msg`` of ``spec`` may run in chunks (before rows are counted)."""
    # In a cluster, where every machine holds every row (no machine plan: no NumPy inputs
    # sent in parts, no PlacedData), its chunks spread over the ranks (spread.py).
    return (msg.n_scattered > 0 and msg.sel is None and msg.then is None
            and msg.subset is None and msg.num_slices == 1 and msg.sel_s is None and msg.plan is None
            and spec.outputs and not spec.updates and not spec.sliceable and not spec.collective
            and not spec.jax and rt.config.device == "cpu" and rt.profiler is None
            and all(op in reduce_ops.COLLECTIVE_OPS for op in spec.output_ops))


class Board:
    """A function's chunk board on this machine (see the module's docstring)."""

    def __init__(self, seg, capacity, n_local):
        self.seg = seg
        self.capacity = capacity
        self.n_local = n_local
        head = 8 * (FLAGS + capacity)
        self.ctl = seg.view(np.int64, (FLAGS + capacity,))
        self.fast = Block(self.ctl)
        self.data = seg.view(np.uint8, (seg.nbytes - head,), offset=head)

    @staticmethod
    def size(capacity, region_bytes, n_local):
        return 8 * (FLAGS + capacity) + capacity * n_local * region_bytes

    def fits(self, n_chunks, region_bytes):
        return (n_chunks <= self.capacity
                and Board.size(self.capacity, region_bytes, self.n_local) <= self.seg.nbytes)

    def region(self, plan, c, rank):
        """The result arrays of chunk ``c`` as rank ``rank`` left them (views)."""
        base = (c * self.n_local + rank) * plan.region_bytes
        return [self.data[base + off:base + off + int(np.prod(shape, dtype=np.int64))
                          * np.dtype(dt).itemsize].view(dt).reshape(shape)
                for dt, shape, off in plan.layout]

    def close(self, unlink):
        self.fast.release()
        self.ctl = self.data = None
        if unlink:
            self.seg.unlink()
        self.seg.close()


def _layout(results):
    layout, off = [], 0
    for r in results:
        r = np.asarray(r)
        layout.append((r.dtype.str, tuple(r.shape), off))
        off += -(-max(r.nbytes, 1) // ALIGN) * ALIGN
    return tuple(layout), max(off, ALIGN)


class MasterChunks:
    """The master's side of one function's chunked calls: its board and the layout of its outputs."""

    def __init__(self):
        self.board = None
        self.key = None
        self.plan = None
        self.static_next = False   # the next call runs statically first (static_once)
        self.pace = Pace()          # the count timed fastest (pace.py)

    def fit(self):
        """The ``pace.Fit`` of the latest chunked call, where its chunks were timed, else None."""
        return None if self.key is None else self.pace.fit(self.key[0], self.key[2:])

    def static_once(self):
        """The next call, where chunked, first runs with its static split (result unused), so
        every rank builds a function built at that call before chunks run (else at the master's
        pace alone: a rank's Numba compile took seconds); every call returns the chunked bits."""
        self.static_next = True

    def build_first(self, spec, rt, msg):
        """Whether ``msg`` first runs once with its static split (``static_once``)."""
        if not self.static_next:
            return False
        self.static_next = False
        return eligible(spec, rt, msg) and chunk_rows(msg.n_rows) > 0

    def plan_for(self, spec, rt, msg, arrays):
        """The call ``msg`` with its ``ChunkPlan``, and the master's results of chunk 0 or None.

        Returns ``(msg, None)`` unchanged where the call keeps its static split.
        The outputs' shapes are known once the function ran on a chunk: the
        first call of a new shape runs chunk 0 here, before the others start.
        """
        if not eligible(spec, rt, msg):
            return msg, None
        rows = chunk_rows(msg.n_rows)
        if not rows:
            return msg, None
        k = msg.n_scattered
        key = (msg.n_rows, rows, tuple(a.shape[1:] for a in arrays[:k]),
               tuple(np.shape(a) for a in arrays[k:]))
        if key == self.key:
            return (msg if self.plan is None else msg._replace(chunks=self.plan)), None
        def run(lo, hi):
            return spec.fn(*[a[lo:hi] for a in arrays[:k]], *arrays[k:])
        rt.in_call = True
        try:
            rows = self.pace.rows(spec.fn, msg.n_rows, rows, key[2:], run)   # pace.py
            first = [np.array(r) for r in run(0, rows)]
        except Exception:  # noqa: BLE001 - the static split runs it again and reports it
            return msg, None
        finally:
            rt.in_call = False
        n_chunks = -(-msg.n_rows // rows)
        if rt.peers is not ALONE:
            # No board: each rank its share of the chunks, gathered to the master (spread.py).
            # Outputs too large to travel chunk by chunk keep the static split, which
            # combines them machine by machine (outputs.MACHINE_PART_BYTES).
            self.key, self.plan = key, None
            if sum(r.nbytes for r in first) >= MACHINE_PART_BYTES:
                return msg, None
            self.plan = ChunkPlan(None, 0, 0, msg.n_rows, rows, n_chunks, (), 0)
            return msg._replace(chunks=self.plan), first
        layout, region_bytes = _layout(first)
        n_local = rt.place.n_local
        if self.board is None or not self.board.fits(n_chunks, region_bytes):
            self.close()
            capacity = max(n_chunks, BOARD_CHUNKS)
            seg = SharedArray(rt.segment_name("chunks"), Board.size(capacity, region_bytes, n_local))
            self.board = Board(seg, capacity, n_local)
        board = self.board
        self.key = key
        self.plan = ChunkPlan(board.seg.name, board.seg.nbytes, board.capacity, msg.n_rows, rows,
                              n_chunks, layout, region_bytes)
        return msg._replace(chunks=self.plan), first

    def run(self, spec, rt, msg, arrays, first, what, kept=None):
        """Run the chunked call ``msg`` (not a kept one) on every rank; return its outputs."""
        arm, local = master_runner(spec, rt, msg.chunks, self.board, arrays, msg.n_scattered)
        arm(rt.control.seq + 1, first)
        return run_command(rt, Command.CALL, msg, local, None, what=what, kept=kept)

    def close(self):
        if self.board is not None:
            self.board.close(unlink=True)
        self.board = self.key = self.plan = None


def _owned(results):
    # Backends other than NumPy's (JAX) return their own array types.
    return [r if type(r) is np.ndarray else np.asarray(r) for r in results]


def master_runner(spec, rt, plan, board, arrays, n_scattered):
    """``(arm, local)``: the master's side of a chunked call, made once per kept call.

    ``arm(seq, first)`` sets the claim word just before the call is posted (no
    rank takes a chunk of a call not yet posted; ``first``, chunk 0's results
    where the master just ran it); ``local(seq)`` is ``run_command``'s local
    part: the master's chunks, the others' awaited (or run again), combined in
    chunk order.
    """
    fn = spec.fn   # built: the master's first call builds a deferred one (Function._plan_call)
    fast, ctl = board.fast, board.ctl
    n_chunks = plan.n_chunks
    control = rt.control
    ops = spec.output_ops
    weights = [float(hi - lo) for lo, hi in map(plan.bounds, range(n_chunks))]
    listed = spec.return_list
    args = chunk_args(plan, arrays, n_scattered)
    regions = [[board.region(plan, c, r) for r in range(board.n_local)] for c in range(n_chunks)]
    rank_mask = (1 << RANK_BITS) - 1
    flags = range(FLAGS, FLAGS + n_chunks)
    status_slots, claim = control.status_slots, fast.claim
    bools = [op in ("sum", "prod") and np.dtype(dt) == np.bool_
             for op, (dt, _, _) in zip(ops, plan.layout)]
    state = [None]
    trade = rt.processes.core_trade

    def arm(seq, first):
        state[0] = first
        fast.publish(CLAIM, (seq << CLAIM_BITS) | (0 if first is None else 1), ZERO)

    def local(seq):
        if trade is not None:
            trade.maybe()
        results = [None] * n_chunks
        if state[0] is not None:
            results[0], state[0] = state[0], None
        t0 = time.perf_counter()
        mine = 0
        rt.in_call = True
        try:
            while True:
                c = claim(CLAIM, seq, n_chunks)
                if c < 0:
                    break
                results[c] = _owned(fn(*args[c]))
                mine += 1
        finally:
            rt.in_call = False
        steal_ns = 0
        for c in range(n_chunks):
            if results[c] is not None:
                continue
            v = int(ctl[flags[c]])
            if v >> RANK_BITS == seq:
                results[c] = regions[c][v & rank_mask]
                continue
            if not steal_ns:
                per_chunk = (time.perf_counter() - t0) / mine if mine else 0.0
                late = 1 if trade is not None and trade.contended else 3
                steal_ns = int(max(STEAL_MIN_S, late * per_chunk) * 1e9)
            got = _await(rt, control, fast, ctl, flags[c], seq, steal_ns)
            if got is None:
                return None  # a rank failed: run_command reports it
            if got < 0:
                # Taken and not finished: its rank is off its core, most likely.
                rt.in_call = True
                try:
                    results[c] = _owned(fn(*args[c]))
                finally:
                    rt.in_call = False
            else:
                results[c] = regions[c][got]
        if control.fast.count_ne(status_slots, OK) and _failed_now(control, seq):
            control.wait_done(rt, seq, rt.check)
            return None
        control.early = seq
        return in_chunk_order(ops, results, weights, bools, listed)

    return arm, local


def _await(rt, control, fast, ctl, slot, seq, steal_ns):
    """Wait for a chunk's flag: the rank that finished it, -1 past ``steal_ns``, None: a failure."""
    target = seq << RANK_BITS
    deadline = time.perf_counter_ns() + steal_ns
    spin = control.spin_ns
    while True:
        v = int(ctl[slot])
        if v >> RANK_BITS == seq:
            return v & ((1 << RANK_BITS) - 1)
        if ctl[FAILED] == seq:
            # A rank raised: every rank finishes the call, then run_command reports it.
            control.wait_done(rt, seq, rt.check)
            return None
        left = deadline - time.perf_counter_ns()
        if left <= 0:
            return -1
        if not fast.wait(slot, GE, target, -1, min(left, spin, CHECK_NS),
                         0 if spin else min(left, CHECK_NS)):
            rt.check()


def _failed_now(control, seq):
    """Whether a worker finished this very call failing (before taking any chunk)."""
    mv = control.mv
    return any(mv[s] == FAILED_STATUS and mv[d] == seq
               for s, d in zip(control.status_slots, control.done_slots))


def worker_runner(spec, rt, msg):
    """A worker's share of a chunked call: take chunks until none is left, results to the board."""
    plan = msg.chunks
    boards = rt.chunk_boards
    board = boards.get(spec.id)
    if board is None or board.seg.name != plan.name:
        if board is not None:
            board.close(unlink=False)
        board = boards[spec.id] = Board(SharedArray.attach(plan.name, plan.nbytes),
                                        plan.capacity, rt.place.n_local)
    try:
        arrays = [mappings.view(rt, d) for d in msg.descs]
        args = chunk_args(plan, arrays, msg.n_scattered)
        regions = [board.region(plan, c, rt.place.local_index) for c in range(plan.n_chunks)]
        fn = spec.ready()
    except BaseException:
        board.fast.publish(FAILED, rt.control.current, ZERO)
        raise
    fast = board.fast
    claim, publish = fast.claim, fast.publish
    control = rt.control
    me = rt.place.local_index
    n_chunks = plan.n_chunks

    def run():
        seq = control.current
        mark = (seq << RANK_BITS) | me
        rt.in_call = True
        try:
            while not control.aborted(seq):
                c = claim(CLAIM, seq, n_chunks)
                if c < 0:
                    break
                for dst, r in zip(regions[c], fn(*args[c])):
                    dst[...] = r
                publish(FLAGS + c, mark, ZERO)
        except BaseException:
            publish(FAILED, seq, ZERO)
            raise
        finally:
            rt.in_call = False
    return run
