"""The leaders' collectives between machines: the contract every carrier keeps, and its wire helpers.

Between machines only the leaders (the controller and the node masters)
talk, through a carrier: MPI's own non-blocking collectives
(``mpi_leaders.MpiLeaders``), or gloo's, for machines that come and go
(``gloo_leaders.GlooLeaders``).  ``mpi_backend`` and ``mpi_reduce`` run on
either through ``Leaders``, stated here as an abstract class; both carriers
share the byte layouts and kept buffers below.
"""

import pickle
import struct
from abc import ABC, abstractmethod

import numpy as np

BROADCAST_HEAD = 512  # a broadcast's first message: its arrays' layout, and the arrays if they fit
PACK_BYTES = 1 << 16  # smaller arrays of one (op, dtype) travel packed in one collective
POOL_MAX = 64         # kept buffers per carrier before the pool starts afresh


class Leaders(ABC):
    """This leader's collectives with the other machines' leaders (one carrier).

    Every method is called by every leader, in the same order, with alike
    arguments; ``check()`` is the liveness check every wait calls, so no wait is
    unbounded.  Results arrive in buffers the carrier keeps (``buffer``): valid
    until the next collective.  ``rank`` and ``size`` are this leader's place
    and the leaders' count; ``gen`` the communicator's generation.
    """

    rank: int
    size: int
    gen: int

    @staticmethod
    @abstractmethod
    def reduces(op, dtype):
        """Whether the carrier's own reduction gives NumPy's result for ``op`` on ``dtype``."""

    @abstractmethod
    def renew(self, comm, gen):
        """Leave the current communicator for a fresh one (every leader, at one boundary)."""

    @abstractmethod
    def revoke(self):
        """Make every leader's pending collective fail (a machine was lost)."""

    @abstractmethod
    def buffer(self, slot, nbytes):
        """A kept byte buffer for ``slot``, reused while no collective was abandoned."""

    @abstractmethod
    def barrier(self, check):
        """Return once every leader called it."""

    @abstractmethod
    def all_reduce(self, sends, check):
        """Reduce each ``(array, op, into)`` across the leaders into ``into`` (``avg``: the sum)."""

    @abstractmethod
    def all_reduce_kept(self, sends, check):
        """``all_reduce`` on a plan made once (the latency path of small all-reduces)."""

    @abstractmethod
    def all_gather_fixed(self, mine, check):
        """Every leader's uint8 array ``mine`` (all the same size), stacked in machine order."""

    @abstractmethod
    def broadcast(self, arrays, root, check):
        """The root's ``arrays`` on every leader."""

    @abstractmethod
    def all_gather(self, obj, check):
        """Every leader's ``obj`` (arrays, lists, None...), in machine order."""

    @abstractmethod
    def gather(self, obj, root, check):
        """At the root, every leader's ``obj`` in machine order; None elsewhere."""

    @abstractmethod
    def scatter(self, objs, root, check):
        """Machine m's entry of the root's ``objs`` (one per machine), on every leader."""


def pooled(pool, slot, nbytes):
    """The byte buffer kept in ``pool`` (a dict) for ``(slot, nbytes)``; made if missing.

    A carrier keeps its buffers across collectives (fresh memory costs a page
    fault per 4 KiB at every call); at ``POOL_MAX`` the pool starts afresh
    (buffers of pending collectives are held by them).
    """
    key = (slot, nbytes)
    buf = pool.get(key)
    if buf is None:
        if len(pool) >= POOL_MAX:
            pool.clear()
        buf = pool[key] = np.empty(nbytes, np.uint8)
    return buf


def dumps(obj):
    """``obj`` as one uint8 array: the pickle's length, its buffers' lengths, the pickle, the buffers."""
    bufs = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
    raws = [b.raw() for b in bufs]
    lens = [len(head)] + [r.nbytes for r in raws]
    top = 8 * (1 + len(lens))
    out = np.empty(top + sum(lens), np.uint8)
    struct.pack_into(f"{1 + len(lens)}q", out, 0, len(raws), *lens)
    at = top
    for part in [head] + raws:
        n = len(part) if isinstance(part, bytes) else part.nbytes
        out[at:at + n] = np.frombuffer(part, np.uint8)
        at += n
    return out


def loads(buf):
    """The object ``dumps`` made; its large arrays are views of ``buf``."""
    n = struct.unpack_from("q", buf)[0]
    lens = struct.unpack_from(f"{n + 1}q", buf, 8)
    at = 8 * (2 + n)
    head = bytes(buf[at:at + lens[0]])
    at += lens[0]
    views = []
    for k in lens[1:]:
        views.append(buf[at:at + k])
        at += k
    return pickle.loads(head, buffers=views)


def c_order(a):
    """``a`` in C order (np.ascontiguousarray would make a 0-d array 1-d)."""
    a = np.asarray(a)
    return a if a.flags.c_contiguous else np.array(a, order="C")


def nbytes_of(dtype, shape):
    """The bytes of an array of ``dtype`` and ``shape``."""
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
