"""Backend: the collective operations every communication backend provides.

Backends know arrays, not PyTensor: every method takes NumPy arrays (a list,
one entry per variable) and returns NumPy arrays.  Every rank of the command
calls the same method with the same ``op``, ``root`` and number of arrays.

Arrays returned by broadcast, gather, all_gather and scatter may be views into
communication buffers (or read-only message buffers): they are valid until
this rank's next backend call or the end of the command, and callers copy
what they keep.  reduce and all_reduce return arrays the caller owns: fresh
ones, or the ``out`` buffers given (``out`` is a list with one array or None
per input; an entry of another shape or dtype than the result is ignored).
``out`` may be the input array itself.

``keys`` (all_reduce, broadcast, gather) name one persistent buffer per array, e.g.
a shared variable's index.  With keys, every result is the caller's to keep
as its array: an ``out`` entry, a fresh array, or a buffer the backend keeps
per key and writes again only in later calls with that key (the shm
backend's homes, which the other ranks read in place, so an array passed
back in costs no copy).  A root's results are its own input arrays unless
replaced by such buffers; with keys, gather returns on a non-root rank
the arrays it should keep (its own, or such buffers).  With keys,
all_reduce needs arrays from every rank.
"""

from abc import ABC, abstractmethod


class Backend(ABC):
    """Collectives among the ranks of one run.  Created in the master before fork."""

    def __init__(self, rt, spin_s):
        self.rt = rt
        self.seq = 0
        self._check = None
        self.n_parallel = rt.n_parallel
        self.max_n_var = rt.max_n_var
        self.max_dim = rt.max_dim

    @property
    def rank(self):
        """This process's rank (the runtime's, which fork() sets in each worker)."""
        return self.rt.rank

    def _get_check(self):
        """Return (once per command) the check that raises on a dead or aborted rank."""
        if self._check is None:
            from ..process import backend_check  # process imports the backends
            self._check = backend_check(self.rt, self.seq)
        return self._check

    def begin(self, seq):
        """Start command ``seq``: reset per-command state, arm the abort check."""

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

    @abstractmethod
    def scatter(self, per_rank, root):
        """Return this rank's entry of the root's ``per_rank`` (a list of array lists)."""

    @abstractmethod
    def contribute(self, arrays, weight=1.0):
        """Worker side of ``collect``: leave ``arrays`` (or None) for the root.

        Called inside a command; the root reads them after the command's end
        barrier, so no extra synchronisation is needed.
        """

    @abstractmethod
    def collect(self):
        """Root side of ``contribute``, after the end barrier.

        Returns a list over ranks of ``(arrays, weight)`` or None (no
        contribution); the root's own entry is None.  Arrays may be views
        into communication buffers, valid until the next command.
        """

    def close(self):
        """Release what the backend holds; called once in every process."""
