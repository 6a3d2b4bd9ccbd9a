"""ZeroMQ backend: collectives as messages between ranks, over ipc:// sockets.

The portable fallback (``SYNK_BACKEND=zmq``).  Every rank binds one PULL
socket (its inbox) at ``ipc://<tmpdir>/r<rank>`` and connects a PUSH socket to
every other rank's inbox.  A message is a header (command, step, sender), a
pickled description of the arrays and one frame per array, sent without
copying.  Messages are matched by (command, step, sender), so messages of an
aborted or unfinished command are dropped, never mistaken for new ones.

ZeroMQ contexts do not survive fork(): the backend is built in the master
before fork, and each process opens its own context and sockets on first
use, after the fork.
"""

import logging
import os
import pickle
import shutil
import struct
import tempfile
import time

import numpy as np
import zmq

from ..errors import CommAborted
from ..runtime.liveness import pid_alive
from . import parts
from .base import Backend

logger = logging.getLogger(__name__)

CHECK_EVERY_MS = 10
ABORT_GRACE_MS = 50
CONTRIBUTE = -1  # the step of contribute() messages, read by collect()
_HDR = struct.Struct("<3q")
DIR_PREFIX = "synk_zmq_"


class ZmqBackend(Backend):
    """Collectives through ZeroMQ messages; select with ``SYNK_BACKEND=zmq``."""

    def __init__(self, wiring):
        super().__init__(wiring)
        _sweep_stale_dirs()
        self.dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{wiring.master_pid}_")
        wiring.remove_after_crash(self.dir)
        self.master_pid = wiring.master_pid
        self._pid = None
        self._ctx = None
        self._inbox = None
        self._peers = {}
        self._poller = None
        self._held = {}
        self.k = 0

    def _address(self, rank):
        return f"ipc://{self.dir}/r{rank}"

    def _open(self):
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._ctx = zmq.Context(io_threads=1)
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.setsockopt(zmq.RCVHWM, 0)
        self._inbox.bind(self._address(self.rank))
        self._peers = {}
        for q in range(self.n_parallel):
            if q != self.rank:
                s = self._ctx.socket(zmq.PUSH)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SNDHWM, 0)
                # A peer binds when it starts its first command: retry soon.
                s.setsockopt(zmq.RECONNECT_IVL, 2)
                s.connect(self._address(q))
                self._peers[q] = s
        self._poller = zmq.Poller()
        self._poller.register(self._inbox, zmq.POLLIN)
        self._held = {}

    def begin(self, seq):
        self._open()
        self.seq = seq
        self.k = 0
        # Drop what earlier commands left (contributions nobody collected,
        # messages of an aborted collective) so the inbox stays short.
        self._held = {key: v for key, v in self._held.items() if key[0] >= seq}
        while self._inbox.poll(0):
            self._keep(self._inbox.recv_multipart(copy=False))


    def _send(self, q, arrays, step=None, weight=1.0, split=False):
        """Send ``arrays`` (or None: no contribution) to rank ``q``.

        ``split`` marks the first message of a split all_reduce (shapes and
        the receiver's parts rather than whole arrays).
        """
        step = self.k if step is None else step
        if arrays is None:
            meta = (weight, None, split)
            bufs = []
        else:
            # Not ascontiguousarray: it turns 0-d arrays into 1-d ones.
            arrays = [np.asarray(a) for a in arrays]
            arrays = [a if a.flags.c_contiguous else a.copy(order="C") for a in arrays]
            meta = (weight, [(a.dtype.str, a.shape) for a in arrays], split)
            bufs = [memoryview(a).cast("B") if a.size else b"" for a in arrays]
        frames = [_HDR.pack(self.seq, step, self.rank), pickle.dumps(meta, protocol=5)] + bufs
        self._peers[q].send_multipart(frames, copy=False)

    def _keep(self, frames):
        seq, step, src = _HDR.unpack(frames[0].bytes)
        if seq >= self.seq:
            self._held[(seq, step, src)] = frames

    def _recv(self, q, step=None):
        """Return (arrays or None, weight) sent by rank ``q`` in this step."""
        return self._recv_msg(q, step)[:2]

    def _recv_msg(self, q, step=None):
        """Return (arrays or None, weight, split flag) sent by rank ``q`` in this step."""
        key = (self.seq, self.k if step is None else step, q)
        frames = self._held.pop(key, None)
        if frames is None:
            frames = self._wait(key)
        weight, meta, split = pickle.loads(frames[1].bytes)
        if meta is None:
            return None, weight, split
        arrays = [np.frombuffer(f.buffer, dtype).reshape(shape) if np.prod(shape) else
                  np.empty(shape, dtype) for f, (dtype, shape) in zip(frames[2:], meta)]
        return arrays, weight, split

    def _wait(self, key):
        inbox = self._inbox
        spin_end = time.perf_counter() + self.spin_s
        while True:
            timeout = 0 if time.perf_counter() < spin_end else CHECK_EVERY_MS
            if inbox.poll(timeout):
                while inbox.poll(0):
                    self._keep(inbox.recv_multipart(copy=False))
                frames = self._held.pop(key, None)
                if frames is not None:
                    return frames
            if timeout:
                try:
                    self.check()
                except CommAborted:
                    # A rank that failed on what it received sent its own
                    # message first: take it if it comes, to meet the same error.
                    if inbox.poll(ABORT_GRACE_MS):
                        continue
                    raise

    def barrier(self):
        self.k += 1
        for q in self._peers:
            self._send(q, [])
        for q in self._peers:
            self._recv(q)

    def reduce(self, arrays, op, root, weight=None, out=None):
        self.k += 1
        if self.rank != root:
            self._send(root, arrays, weight=1.0 if weight is None else weight)
            return None
        got = self._from_all(arrays, 1.0 if weight is None else weight)
        return self._combine_all(got, op, weight, out)

    def all_reduce(self, arrays, op, weight=None, out=None, keys=None):
        self.k += 1
        n, me = self.n_parallel, self.rank
        if n == 1:
            return self._one_rank(arrays, op, out)
        w = 1.0 if weight is None else weight
        ops = None if arrays is None else parts.op_list(op, len(arrays))
        plan = self._split_plan(arrays, ops, weight)
        # First round: whole arrays, or (split) shapes plus the receiver's parts.
        for q in self._peers:
            if plan is None:
                self._send(q, arrays, weight=w)
            else:
                self._send(q, _shape_rows(arrays) + [a.reshape(-1)[lo:hi] for i, lo, hi
                                                     in plan[q] for a in (arrays[i],)],
                           weight=w, split=True)
        got = {q: self._recv_msg(q) for q in self._peers}
        splits = {q for q, g in got.items() if g[2]} | ({me} if plan is not None else set())
        contributors = [q for q in range(n) if (arrays if q == me else got[q][0]) is not None]
        if splits and len(contributors) < n:
            # Some rank gave nothing: split parts can't be reassembled, so every
            # contributor sends its whole arrays once more.
            self.k += 1
            if arrays is not None:
                for q in self._peers:
                    self._send(q, arrays, weight=w)
            got = {q: self._recv_msg(q) for q in contributors if q != me}
            splits = set()
        if not splits:
            table = [(arrays, w) if q == me else got[q][:2] if q in got else (None, 0.0)
                     for q in range(n)]
            return self._combine_all(table, op, weight, out)
        if len(splits) < n or any(len(got[q][0]) < len(arrays) or
                                  any(list(r) != list(m) for r, m in
                                      zip(got[q][0], _shape_rows(arrays)))
                                  for q in self._peers):
            raise ValueError("cannot reduce arrays whose shapes or dtypes differ across ranks")
        return self._split_finish(arrays, ops, out, plan, {q: got[q][0][len(arrays):]
                                                          for q in self._peers})

    def _from_all(self, arrays, weight):
        return [(arrays, weight) if q == self.rank else self._recv(q)
                for q in range(self.n_parallel)]

    def _combine_all(self, got, op, weight, out):
        ranks = [q for q, (a, _) in enumerate(got) if a is not None]
        if not ranks:
            return []
        arrays = [got[q][0] for q in range(self.n_parallel)]
        parts.check_alike(arrays, ranks, [0] * len(ranks))
        first = arrays[ranks[0]]
        ops = parts.op_list(op, len(first))
        w = None if weight is None else [got[q][1] for q in ranks]
        return [parts.combine_whole(ops[i], [arrays[q][i] for q in ranks], w, parts.out_entry(out, i))
                for i in range(len(first))]

    def _split_finish(self, arrays, ops, out, plan, received):
        """Reduce this rank's parts into the result, then exchange reduced parts.

        The parts go out without copies, from the result itself: every rank
        has received them before any command can change it again.
        """
        n, me = self.n_parallel, self.rank
        flat = [a.reshape(-1) for a in arrays]
        result = [parts.result_buffer(a, parts.out_entry(out, i)) for i, a in enumerate(arrays)]
        flats = [r.reshape(-1) for r in result]
        reduced = []
        for j, (i, lo, hi) in enumerate(plan[me]):
            srcs = [flat[i][lo:hi]] + [received[q][j] for q in sorted(received)]
            dst = flats[i][lo:hi]
            parts.reduce_into(ops[i], srcs, dst, 1.0 / n if ops[i] == "avg" else None)
            reduced.append(dst)
        self.k += 1
        for q in self._peers:
            self._send(q, reduced)
        for q in self._peers:
            got = self._recv(q)[0]
            for j, (i, lo, hi) in enumerate(plan[q]):
                np.copyto(flats[i][lo:hi], got[j])
        return result

    def contribute(self, arrays, weight=1.0):
        self._send(self.master_rank, arrays, step=CONTRIBUTE, weight=weight)

    def _contribution(self, q):
        return self._recv(q, CONTRIBUTE)

    def broadcast(self, arrays, root, out=None, keys=None):
        self.k += 1
        if self.rank == root:
            for q in self._peers:
                self._send(q, arrays)
            return list(arrays)
        got = self._recv(root)[0]
        result = []
        for i, v in enumerate(got):
            o = parts.out_entry(out, i)
            if o is not None and o.shape == v.shape and o.dtype == v.dtype:
                np.copyto(o, v)
                v = o
            elif keys is not None:
                v = np.array(v)  # message buffers are read-only
            result.append(v)
        return result

    def gather(self, arrays, root, keys=None):
        self.k += 1
        if self.rank != root:
            self._send(root, arrays)
            return None if keys is None else list(arrays)
        return [g for g, _ in self._from_all(arrays, 1.0)]

    def all_gather(self, arrays):
        self.k += 1
        for q in self._peers:
            self._send(q, arrays)
        return [g for g, _ in self._from_all(arrays, 1.0)]

    def all_to_all(self, per_rank):
        """Send each rank only its list (one message per peer)."""
        self.k += 1
        if len(per_rank) != self.n_parallel:
            raise ValueError("all_to_all: give one list per rank")
        for q in self._peers:
            self._send(q, per_rank[q])
        return [list(per_rank[q]) if q == self.rank else self._recv(q)[0]
                for q in range(self.n_parallel)]

    def scatter(self, per_rank, root):
        self.k += 1
        if self.rank == root:
            self._check_scatter(per_rank)
            for q in self._peers:
                self._send(q, per_rank[q])
            return list(per_rank[root])
        return self._recv(root)[0]

    def close(self):
        if self._pid == os.getpid():
            for s in list(self._peers.values()) + [self._inbox]:
                s.close(linger=0)
            self._ctx.term()
            self._pid = None
        if os.getpid() == self.master_pid:
            shutil.rmtree(self.dir, ignore_errors=True)


def _shape_rows(arrays):
    """Each array's shape and dtype number as an int64 row, to compare across ranks."""
    return [np.array(a.shape + (a.dtype.num,), np.int64) for a in arrays]


def _sweep_stale_dirs():
    """Remove socket directories of runs whose master is gone (a crash skips close())."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if not name.startswith(DIR_PREFIX):
            continue
        pid = name[len(DIR_PREFIX):].split("_")[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
