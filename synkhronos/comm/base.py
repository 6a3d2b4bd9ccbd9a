"""Backend: the collective operations every communication backend provides.

Backends know arrays and ranks, not PyTensor: every method takes a list of
arrays (one entry per variable) and returns a list.  Every rank of a command
calls the same method with the same ``op``, ``root`` and number of arrays.

Arrays returned by broadcast, gather, all_gather and scatter may be views into
communication buffers (or read-only message buffers): they are valid until
this rank's next backend call or the end of the command, and callers copy
what they keep.  reduce and all_reduce return arrays the caller owns: fresh
ones, or the ``out`` buffers given (``out`` is a list with one array or None
per input; an entry of another shape or dtype than the result is ignored).
``out`` may be the input array itself.

``keys`` (all_reduce, broadcast, gather) name one persistent buffer per
array, e.g. a shared variable's index.  With keys, every result is the
caller's to keep as its array: an ``out`` entry, a fresh array, or a buffer
the backend keeps per key and writes again only in later calls with that key
(``is_kept`` tells which), so an array passed back in may cost no copy.  A
root's results are its own input arrays unless replaced by such buffers; with
keys, gather returns on a non-root rank the arrays it should keep (its own,
or such buffers).  With keys, all_reduce needs arrays from every rank.

A device backend (``device_arrays``) also takes device arrays and returns
its results as device arrays; ``host`` is the backend that moves host memory
(the backend itself, or the one a device backend wraps).
"""

from abc import ABC, abstractmethod
from typing import Callable, NamedTuple

import numpy as np

from . import reduce_ops
from . import parts

# Below this many bytes in all, splitting a reduction across ranks costs more
# (an extra round of synchronisation) than it saves.
SPLIT_BYTES = 1 << 18


def _never_aborted():
    pass


class Wiring(NamedTuple):
    """What a backend is built from: where this process stands among the ranks, and names.

    Attributes:
        ranks: the ranks the backend serves, read live: ``rank`` (this process's, which
            fork() sets in each worker), ``n_parallel`` and ``master_rank`` (the root of
            call results).  The run's placement, or one machine's view of it.
        machine: this machine's ranks alone, the same way (local indices, the leader as
            ``master_rank``): what a backend spanning machines moves inside one.
        spin_s: how long waits spin before sleeping.
        prefix: every shared-memory segment name of the run starts so.
        master_pid: the pid of this machine's leader.
        max_dim: most dimensions of an array in a collective.
        new_name: ``new_name(tag)``, a fresh shared-memory segment name of the run.
        remove_after_crash: ``remove_after_crash(path)``: a directory the janitor removes
            if the leader dies without closing.
    """

    ranks: object
    machine: object
    spin_s: float
    prefix: str
    master_pid: int
    max_dim: int
    new_name: Callable
    remove_after_crash: Callable


class Backend(ABC):
    """Collectives among the ranks of one run.  Created in the master before fork."""

    device_arrays = False
    small_all_reduce = None  # a backend with a latency path for small all_reduce sets a method
    # Whether a rank's process may be replaced by one forked from the leader after commands
    # ran (``distribute()`` does so on one machine): the new process takes up the rank's
    # state from shared memory in ``bind_check``.  A backend with per-process links
    # (sockets, communicators) keeps its first workers.
    restartable = False

    def small_plan(self, keys, op, arrays):
        """The latency path's plan of a small all-reduce (with ``small_all_reduce``), or None."""
        return None

    def output_combiner(self, op):
        """A call's one output combined over the ranks by ``op``, as ``f(value, weight)``.

        ``value`` and ``weight`` are the root's own; ``f`` returns the result,
        or None to send the caller to ``collect`` (here always, but for float
        scalars where ``scalar_result`` takes them).
        """
        scalar = self.scalar_combiner(op)

        def combine(value, weight):
            if type(value) is np.ndarray and value.ndim == 0:
                return scalar(value, weight)
            return None
        return combine

    def scalar_combiner(self, op):
        """``scalar_result`` for one ``op`` as ``f(value, weight)``, bound once (a kept call's)."""
        return lambda value, weight: self.scalar_result(op, value, weight)

    def scalar_result(self, op, value, weight):
        """Root, after a command: every rank's float scalar ``value`` combined by ``op``, or None.

        A backend that passes float scalars outside its buffers combines them
        here; None (always, here) sends the caller to ``collect``.
        """
        return None

    def __init__(self, wiring):
        self.wiring = wiring
        self.ranks = wiring.ranks
        self.spin_s = wiring.spin_s
        self.max_dim = wiring.max_dim
        self.seq = 0
        self.check = _never_aborted

    @property
    def rank(self):
        """This process's rank among ``ranks`` (fork() sets it in each worker)."""
        return self.ranks.rank

    @property
    def n_parallel(self):
        """The ranks this backend serves."""
        return self.ranks.n_parallel

    @property
    def master_rank(self):
        """The rank that collects call results (``collect``)."""
        return self.ranks.master_rank

    @property
    def host(self):
        """The backend that moves host memory: this one."""
        return self

    def bind_check(self, check):
        """Set the check every wait calls: it raises if a rank died or aborted the command.

        Called once in every process, after fork (also in a worker forked from
        the leader after commands ran, see ``restartable``); a backend never
        builds it itself, so it needs nothing from the modules that start processes.
        """
        self.check = check

    def begin(self, seq):
        """Start command ``seq``: reset per-command state."""
        self.seq = seq

    def is_kept(self, key, array):
        """Whether ``array`` is the buffer this backend keeps for ``key`` (then it costs no copy)."""
        return False

    @abstractmethod
    def barrier(self):
        """Return once every rank has called barrier() in this command."""

    @abstractmethod
    def reduce(self, arrays, op, root, weight=None, out=None):
        """Reduce ``arrays`` across ranks into ``root``.

        ``op`` is one op name or a list with one per array.  ``arrays`` may be
        None on a rank that contributes nothing (a rank given no rows);
        ``weight``, this rank's row count, weighs ``avg`` (None: equal weights).
        Returns the reduced list at the root, None elsewhere.
        """

    @abstractmethod
    def all_reduce(self, arrays, op, weight=None, out=None, keys=None):
        """Reduce ``arrays`` across ranks; return the reduced list on every rank."""

    @abstractmethod
    def broadcast(self, arrays, root, out=None, keys=None):
        """Return the root's ``arrays`` on every rank (others pass None).

        A non-root rank's ``out`` entries that match the root's arrays in
        shape and dtype receive the data and are returned.
        """

    @abstractmethod
    def gather(self, arrays, root, keys=None):
        """Return, at the root, a list over ranks of each rank's ``arrays`` (or None)."""

    @abstractmethod
    def all_gather(self, arrays):
        """Return on every rank the list over ranks of each rank's ``arrays``."""

    def all_to_all(self, per_rank):
        """Send ``per_rank[q]`` (a list of arrays) to rank q; return what each rank sent here.

        Every rank gives one list per rank, and the list for a given rank has
        the same length on every rank.  Returns the list over ranks q of the
        arrays q gave for this rank (this rank's own entry as given); they
        may be views into communication buffers, as all_gather's are.  This
        version sends the lists through all_gather, each rank's own left out:
        right where a rank reads only what it needs of the others' buffers
        (shared memory).  A backend that sends messages overrides it.
        """
        n, me = self.n_parallel, self.rank
        if len(per_rank) != n:
            raise ValueError("all_to_all: give one list per rank")
        counts = [len(e) for e in per_rank]
        got = self.all_gather([a for q, e in enumerate(per_rank) if q != me for a in e])
        out = []
        for q in range(n):
            if q == me:
                out.append(list(per_rank[me]))
                continue
            start = sum(counts[r] for r in range(me) if r != q)
            out.append(got[q][start:start + counts[me]])
        return out

    @abstractmethod
    def scatter(self, per_rank, root):
        """Return this rank's entry of the root's ``per_rank`` (a list of array lists)."""

    @abstractmethod
    def contribute(self, arrays, weight=1.0):
        """Worker side of ``collect``: leave ``arrays`` (or None) for the root.

        Called inside a command; the root reads them after the command's end
        barrier, so no extra synchronisation is needed.  After other
        collectives in the same command, every rank calls ``settle()`` first.
        """

    def settle(self):
        """Every rank, after a command's last collective: wait until no rank reads its buffers."""

    def collect(self):
        """Root side of ``contribute``, after the end barrier.

        Returns a list over ranks of ``(arrays, weight)`` or None (no
        contribution); the root's own entry is None.  Arrays may be views
        into communication buffers, valid until the next command.
        """
        out = []
        for q in range(self.n_parallel):
            if q == self.rank:
                out.append(None)
                continue
            arrays, weight = self._contribution(q)
            out.append(None if arrays is None else (arrays, weight))
        return out

    @abstractmethod
    def _contribution(self, q):
        """Return ``(arrays or None, weight)`` that rank ``q`` contributed in this command."""

    def close(self):
        """Release what the backend holds; called once in every process."""

    # Shared by the host backends.
    def _one_rank(self, arrays, op, out):
        """A reduction over one rank: this rank's arrays, converted as the op would."""
        if arrays is None:
            return []
        ops = parts.op_list(op, len(arrays))
        return [parts.local_result(o, a, parts.out_entry(out, i))
                for i, (o, a) in enumerate(zip(ops, arrays))]

    def _split_plan(self, arrays, ops, weight):
        """Per-rank parts for a reduction worth splitting across ranks, else None.

        Worth it for unweighted reductions of many bytes whose result keeps
        the inputs' dtype (the parts are reduced in place).
        """
        if (arrays is None or weight is not None
                or sum(a.nbytes for a in arrays) < SPLIT_BYTES
                or any(reduce_ops.result_dtype(o, a.dtype) != a.dtype
                       for o, a in zip(ops, arrays))):
            return None
        return parts.byte_parts(arrays, self.n_parallel)

    def _check_scatter(self, per_rank):
        """Raise ValueError unless ``per_rank`` has one equally long list per rank."""
        n = len(per_rank[0]) if per_rank else 0
        if len(per_rank) != self.n_parallel or any(len(e) != n for e in per_rank):
            raise ValueError("scatter: give one list per rank, all of the same length")
        return n


def as_arrays(arrays):
    """NumPy views of ``arrays`` (None stays None): device and other array types are read here."""
    if arrays is None:
        return None
    return [a if type(a) is np.ndarray else np.asarray(a) for a in arrays]
