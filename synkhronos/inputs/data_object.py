"""Data (synk.data): NumPy arrays in POSIX shared memory, seen by every rank.

``synk.data()``'s arguments are checked in create.py; here, the object.
"""

import logging
import math
import numbers
import weakref

import numpy as np

from . import conditioning
from ..runtime.commands import Command
from ..runtime.run import run_command
from .mappings import DataAllocMsg, DataDesc, DataFreeMsg, DataSyncMsg
from ..runtime.state import require_forked, serialized
from ..runtime.shmem import SharedArray

logger = logging.getLogger(__name__)


def replicated(rt, value, dtype, ndim, shape, minibatch, force_cast, oversize, name):
    """Return a new ordinary Data object of run ``rt`` from ``synk.data()``'s checked arguments."""
    obj = Data(new_id(rt), dtype, ndim, minibatch=minibatch, name=name)
    try:
        if value is not None:
            obj._store(obj._condition(value, force_cast, "data"), oversize)
        elif shape is not None:
            obj.set_shape(shape, oversize=oversize)
    except BaseException:
        # A rejected value leaves no half-made Data registered in the run.
        rt.registry.datas.pop(obj._ID, None)
        raise
    return obj


def new_id(rt):
    """A Data id no Data of run ``rt`` holds (one made directly with ``Data(ID)`` may)."""
    ID = next(rt.counter)
    while ID in rt.registry.datas:
        ID = next(rt.counter)
    return ID


class Data:
    """A NumPy array in OS shared memory, for input to synkhronos functions.

    Made by ``synkhronos.data()``.  Reads and writes go to the underlying array
    (``.data``) with full NumPy indexing; its shape may change, its ``dtype``
    and ``ndim`` may not.  Changing the shape beyond the allocation reallocates
    (the workers follow at once); the allocation never shrinks except through
    ``free_memory()``.  A Data object that is garbage collected frees its
    memory in the master at once and in the workers with the next command.
    """

    placed = False  # whether machines hold different rows of it (Data produced where it is used)

    def __init__(self, ID, dtype, ndim, minibatch=False, name=None):
        rt = require_forked("Data")
        if isinstance(ID, (bool, np.bool_)) or not isinstance(ID, (numbers.Integral, np.integer)):
            raise TypeError(f"Data: ID must be an int; got {ID!r}")
        ID = int(ID)
        if ID in rt.registry.datas:
            # Two objects on one id would share, and then free, one memory in the ranks.
            raise ValueError(f"Data: ID {ID} is in use by another Data of this run; "
                             "make Data objects with synk.data()")
        conditioning.check_ndim(ndim, "Data")
        if ndim > rt.config.max_dim:
            raise ValueError(f"Data: ndim {ndim} exceeds max_dim={rt.config.max_dim} given to fork()")
        minibatch = conditioning.check_bool(minibatch, "Data: minibatch")
        conditioning.check_name(name, "Data")
        self._ID = ID
        self._dtype = conditioning.check_dtype(dtype, "Data")
        self._ndim = int(ndim)
        self._minibatch = minibatch
        self._name = name
        self._rt = rt
        self._seg = None
        self._data = None
        self._desc = None
        self._alloc_size = 0
        # The finalizer sees the current segment through this box, not through self.
        self._box = [None]
        weakref.finalize(self, _dropped, rt, ID, self._box)
        rt.registry.datas[ID] = self

    @property
    def data(self):
        """The underlying NumPy array (a view of the shared memory), or None.

        In a cluster the array is read-only: the other machines hold copies,
        which only writes through the Data API (``set_value``, ``data[k] = v``,
        ``set_shape``...) keep up to date.
        """
        if self._rt.peers.copies and self._data is not None:
            ro = self._data.view()
            ro.flags.writeable = False
            return ro
        return self._data

    @property
    def dtype(self):
        """The NumPy dtype, fixed at creation."""
        return self._dtype

    @property
    def ndim(self):
        """The number of dimensions, fixed at creation."""
        return self._ndim

    @property
    def shape(self):
        """The shape of the contents, or None before any memory."""
        return None if self._data is None else self._data.shape

    @property
    def size(self):
        """The number of items in the contents (0 before any memory)."""
        return 0 if self._data is None else self._data.size

    alloc_size = property(lambda self: self._alloc_size, doc="Items the allocation holds (>= size).")

    @property
    def minibatch(self):
        """Whether rows pair with positions of a call's ``batch`` (see ``Function.__call__``)."""
        return self._minibatch

    name = property(lambda self: self._name, doc="The name given to ``synk.data(name=...)``, or None.")

    def __len__(self):
        if self._data is None or self._ndim == 0:
            raise TypeError("len() of a Data object without rows")
        return len(self._data)

    def __getitem__(self, k):
        if self._rt.peers.copies:
            self._require_data()
            return self.data[k]  # read-only: a write through a view would not be mirrored
        return self._require_data()[k]

    @serialized
    def __setitem__(self, k, v):
        arr = self._require_data()
        arr[k] = v
        if self._rt.peers.copies:
            self._mirror(*conditioning.rows_written(arr, k))

    def __reduce_ex__(self, protocol):
        # A Data is a handle on this run's shared memory (its id, its segment): a copy
        # in another process or run would name memory that is not there.
        raise TypeError(f"cannot pickle or copy {type(self).__name__} {self._ID}: it is a handle "
                        "on this run's shared memory; pickle its contents instead "
                        "(numpy.asarray(d.data)) and make a Data of them again with "
                        "synk.data(array); synk.data(d) copies it within the run")

    def __repr__(self):
        return (f"Data(name={self._name!r}, dtype={self._dtype}, shape={self.shape}, "
                f"alloc_size={self._alloc_size}, minibatch={self._minibatch})")

    def _require_data(self):
        if self._data is None:
            raise ValueError(f"Data {self._name or self._ID} holds no memory; set_value() first")
        return self._data

    def describe(self):
        """Return what a rank needs to find this Data's memory (a ``DataDesc``), or None.

        The same object while the shape stays the same, so a call can tell
        that it got the very Data of its last call (``is``).  None without memory.
        """
        data = self._data
        if data is None:
            return None
        desc = self._desc
        if desc is None or desc.shape != data.shape:
            # Made again only when the shape changes: calls repeat the same ones.
            desc = self._desc = DataDesc(self._ID, self._dtype.str, data.shape, self._minibatch)
        return desc

    def belongs_to(self, rt):
        """Whether this Data belongs to run ``rt`` (and not to a run closed since)."""
        return self._rt is rt

    def ready_for(self, rt, dtype, ndim):
        """Whether a command of run ``rt`` can read this Data in place as ``dtype`` and ``ndim``.

        The common case of a call's input, checked fast; ``check_data`` says
        what is wrong otherwise.  ``dtype`` is a NumPy dtype.
        """
        return (self._rt is rt and self._data is not None and self._dtype == dtype
                and self._ndim == ndim)

    def unchanged(self, desc, array):
        """Whether this Data still has the descriptor and array (``memory()``) it had.

        A kept call's check that its prepared views still show this Data.
        """
        return self._data is array and self._desc is desc

    def memory(self):
        """This process's array of this Data (a view of its shared memory), or None.

        For Data produced where it is used, this machine's rows.  Writable:
        only the library writes through it (writes must reach every machine).
        """
        return self._data

    def condition_data(self, input_data, force_cast=False):
        """Return ``input_data`` as the array ``set_value`` would store; store nothing.

        Lossless casts happen silently; others need ``force_cast``.

        Args:
            input_data: an array, anything ``numpy.asarray`` takes, or a Data.
            force_cast: cast whatever converts, losing what it must.

        Returns:
            A NumPy array of this Data's dtype and ndim.

        Raises:
            TypeError: a cast that loses information without ``force_cast``,
                or the wrong number of dimensions.
        """
        return self._condition(input_data, force_cast, "condition_data")

    def _condition(self, input_data, force_cast, where):
        if isinstance(input_data, Data):
            input_data = input_data.data
        return conditioning.condition(input_data, self._dtype, self._ndim, where,
                                      "input_data", force_cast)

    @serialized
    def set_value(self, input_data, force_cast=False, oversize=1):
        """(Over)write the contents, reshaping and reallocating if needed.

        Args:
            input_data: the new contents (e.g. a NumPy array).
            force_cast: cast to this Data's dtype instead of raising.
            oversize: headroom factor (1 to 2), used only if reallocating.
        """
        conditioning.check_oversize(oversize, "set_value")
        force_cast = conditioning.check_bool(force_cast, "set_value: force_cast")
        self._store(self._condition(input_data, force_cast, "set_value"), oversize)

    def _store(self, arr, oversize):
        self._reshape(arr.shape, oversize, keep=False)
        np.copyto(self._data, arr)
        self._mirror(0, self._data.size)

    def replica(self):
        """(id, segment) of the memory other machines hold a copy of, or None if none yet."""
        return None if self._seg is None else (self._ID, self._seg)

    def _mirror(self, lo, hi):
        """Copy items ``lo:hi`` to the other machines' copies (none on one machine)."""
        peers = self._rt.peers
        if peers.copies and hi > lo:
            size = self._dtype.itemsize
            raw = memoryview(self._seg.buffer)[lo * size:hi * size]
            peers.mirror(Command.DATA_SYNC, DataSyncMsg(self._ID, lo * size, len(raw)), raw)

    @serialized
    def set_length(self, length, oversize=1):
        """Change the length (rows); reallocates only if the allocation is too small.

        The rows that fit are kept, also across a reallocation (an improvement
        on the original, which lost them).
        """
        if self._ndim == 0:
            raise ValueError("set_length: a 0-d Data has no length")
        if isinstance(length, bool) or not isinstance(length, numbers.Integral) or length < 0:
            raise ValueError(f"set_length: length must be an int >= 0; got {length!r}")
        rest = self._data.shape[1:] if self._data is not None else (0,) * (self._ndim - 1)
        self.set_shape((int(length),) + tuple(rest), oversize)

    @serialized
    def set_shape(self, shape, oversize=1):
        """Change the shape; reallocates only if the allocation is too small.

        The leading items that fit are kept, also across a reallocation.
        """
        conditioning.check_oversize(oversize, "set_shape")
        shape = conditioning.check_shape(shape, "set_shape: shape", self._ndim)
        self._reshape(shape, oversize, keep=True)

    @serialized
    def free_memory(self):
        """Release the shared memory in the master and in every worker.

        The only way to shrink the allocation; ``set_value`` allocates anew.
        """
        if self._seg is None:
            return
        self._check_live("free_memory")
        run_command(self._rt, Command.DATA_FREE, DataFreeMsg(self._ID))
        self._seg.unlink()
        self._seg.close()
        self._seg = self._box[0] = None
        self._data = None
        self._alloc_size = 0

    def _check_live(self, what):
        rt = self._rt
        if rt.closed:
            raise RuntimeError(f"{what}: this Data belongs to a closed synkhronos run")

    def _reshape(self, shape, oversize, keep):
        n = math.prod(shape)
        if self._data is not None and self._data.shape == tuple(shape) and self._seg is not None:
            # The same memory, the same view: a call kept for this Data stays valid.
            return
        if n > self._alloc_size or self._seg is None:
            self._check_live("Data")
            old = self._data
            self._allocate(int(math.ceil(n * oversize)))
            if keep and old is not None:
                m = min(old.size, n)
                self._seg.view(self._dtype, (m,))[:] = old.reshape(-1)[:m]
                self._data = self._seg.view(self._dtype, shape)
                self._mirror(0, m)
        self._data = self._seg.view(self._dtype, shape)

    def _allocate(self, n_items):
        rt = self._rt
        nbytes = n_items * self._dtype.itemsize
        seg = SharedArray(rt.segment_name(f"d{self._ID}"), nbytes)
        try:
            run_command(rt, Command.DATA_ALLOC, DataAllocMsg(self._ID, seg.name, nbytes))
        except BaseException:
            seg.unlink()
            seg.close()
            raise
        self._swap_segment(seg)
        logger.debug("data %s: allocated %d bytes", self._name or self._ID, nbytes)

    def _swap_segment(self, seg):
        """Make ``seg`` this Data's memory here: the old segment unlinked and closed.

        The one place a Data's memory changes hands (``Data`` and ``PlacedData``).
        """
        if self._seg is not None:
            self._seg.unlink()
            self._seg.close()
        self._seg = self._box[0] = seg
        self._alloc_size = seg.nbytes // self._dtype.itemsize

    def detach(self):
        """Forget the shared memory at close(); views the user holds stay valid."""
        if self._seg is not None:
            self._seg.unlink()
        self._seg = self._box[0] = None


def _dropped(rt, data_id, box):
    """Finalizer of a Data object: free its memory here, and in the workers at the next command.

    Runs whenever the garbage collector does, so it sends no command itself.
    """
    seg = box[0]
    if seg is None:
        return
    box[0] = None
    seg.unlink()
    seg.close()
    if not rt.closed:
        rt.registry.freed.append(data_id)


def check_data(value, rt, dtype, ndim, where, what, placed_ok=False):
    """Raise unless Data ``value`` can stand for an array of ``dtype`` and ``ndim`` in run ``rt``.

    The ranks read a Data in place, so its dtype must match exactly.  A Data
    produced where it is used (``placed_ok``) only as a call's scattered input.

    Raises:
        TypeError: another dtype or ndim, or a placed Data where it cannot be.
        ValueError: a Data object of a closed run, or one holding no memory.
    """
    if value._rt is not rt:
        raise ValueError(f"{where}: {what} is a Data object of a closed run")
    if value.dtype != np.dtype(dtype):
        raise TypeError(f"{where}: {what} needs dtype {dtype}; got Data of {value.dtype}")
    if value.ndim != ndim:
        raise TypeError(f"{where}: {what} needs ndim {ndim}; got Data of ndim {value.ndim}")
    if value.placed and not placed_ok:
        raise TypeError(f"{where}: {what} is a Data produced where it is used; only a "
                        "function's scattered inputs take one")
    if value._data is None:
        raise ValueError(f"{where}: {what} is a Data object holding no memory")
