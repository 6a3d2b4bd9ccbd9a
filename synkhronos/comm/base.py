"""Backend: the collective operations every communication backend provides.

Backends know arrays, not PyTensor: every method takes NumPy arrays (a list,
one entry per variable) and returns NumPy arrays.  Every rank of the command
calls the same method with the same ``op``, ``root`` and number of arrays.
"""

from abc import ABC, abstractmethod


class Backend(ABC):
    """Collectives among the ranks of one run.  Created in the master before fork."""

    def __init__(self, rt, spin_s):
        self.rt = rt
        self.n_parallel = rt.n_parallel
        self.max_n_var = rt.max_n_var
        self.max_dim = rt.max_dim

    @property
    def rank(self):
        """This process's rank (the runtime's, which fork() sets in each worker)."""
        return self.rt.rank

    def begin(self, seq):
        """Start command ``seq``: reset per-command state, arm the abort check."""

    @abstractmethod
    def barrier(self):
        """Return once every rank has called barrier() in this command."""

    @abstractmethod
    def reduce(self, arrays, op, root, weight=None):
        """Reduce ``arrays`` across ranks into ``root``.

        ``op`` is one op name or a list with one per array.  ``arrays`` may be
        None on a rank that contributes nothing (a rank given no rows);
        ``weight``, this rank's row count, weighs ``avg`` (None: equal weights).
        Returns the reduced list at the root, None elsewhere.
        """

    @abstractmethod
    def all_reduce(self, arrays, op, weight=None):
        """Reduce ``arrays`` across ranks; return the reduced list on every rank."""

    @abstractmethod
    def broadcast(self, arrays, root):
        """Return the root's ``arrays`` on every rank (others pass None)."""

    @abstractmethod
    def gather(self, arrays, root):
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
