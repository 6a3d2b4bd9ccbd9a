"""Data that lives where it is used: each machine of a cluster holds only its own rows.

``synk.data(produce=fn)`` runs ``fn`` on every machine for that machine's
rows (``placement.Part``), and the machine keeps them in its own shared
memory: the controller never holds or sends the others.  Calls then split
each machine's rows among its ranks (``placement.owner_plan``).  NumPy
inputs of a call in a cluster travel the same way: each machine is sent
only the rows its ranks use (``send_rows``).  On one machine a produced Data
is an ordinary Data.
"""

import logging
import math

import cloudpickle
import numpy as np

from . import conditioning, machine_rows as placement
from ..cluster.link import DATA
from ..runtime.commands import Command
from ..runtime.control import run_command
from .data_object import Data, data as _plain_data, new_id
from .mappings import GROW, PLACED_POSITIONS, PLACED_ROWS, DataDesc, MapMsg, ProduceMsg, SendMsg
from ..errors import MachineLostError, SynkError
from .machine_rows import Part
from ..runtime.state import require_forked, serialized
from ..runtime.shmem import SharedArray

logger = logging.getLogger(__name__)




class PlacedData(Data):
    """A Data whose rows live on the machines that use them; made by ``synk.data(produce=...)``.

    Machine ``m`` holds rows ``parts[m]`` of the whole; only function calls
    (as a scattered input, with or without ``batch``) read it.  Its contents
    are written where they are made: there is no ``set_value``.
    """

    _placed = True

    def __init__(self, ID, dtype, ndim, minibatch, name, kind, layout):
        super().__init__(ID, dtype, ndim, minibatch=minibatch, name=name)
        self._kind = kind          # datamaps.PLACED_ROWS, or PLACED_POSITIONS (a call's input)
        self._layout = layout      # the machines it was placed on
        self._parts = None         # machine -> (lo, hi) rows of the whole
        self._whole = None         # the whole's shape

    @property
    def data(self):
        raise TypeError(f"Data {self._name or self._ID}: its rows live on the machines that use "
                        "them; .local is this machine's part (rows .parts[0])")

    @property
    def local(self):
        """This machine's rows (read-only): rows ``parts[0]`` of the whole."""
        if self._data is None:
            return None
        ro = self._data.view()
        ro.flags.writeable = False
        return ro

    @property
    def parts(self):
        """Each machine's rows of the whole: a list of ``(lo, hi)``, machine by machine."""
        return list(self._parts or ())

    @property
    def shape(self):
        return self._whole

    @property
    def size(self):
        return 0 if self._whole is None else math.prod(self._whole)

    def __len__(self):
        return self._whole[0]

    def __getitem__(self, k):
        raise TypeError(f"Data {self._name or self._ID}: its rows live on the machines that use "
                        "them; index .local for this machine's part")

    def __setitem__(self, k, v):
        raise TypeError(f"Data {self._name or self._ID} was produced where it is used; "
                        "its rows are written there (make a new one with synk.data(produce=...))")

    def set_value(self, input_data, force_cast=False, oversize=1):
        self.__setitem__(None, None)

    def set_shape(self, shape, oversize=1):
        self.__setitem__(None, None)

    def set_length(self, length, oversize=1):
        self.__setitem__(None, None)

    def describe(self):
        desc = self._desc
        if desc is None or desc.shape != self._whole:
            desc = self._desc = self._make_desc()
        return desc

    def _make_desc(self):
        return DataDesc(self._ID, self._dtype.str, self._whole, self._minibatch, self._kind)

    def check_layout(self, rt, where):
        """Raise unless the machines this Data was placed on are the run's machines still."""
        if rt.cluster is not None and rt.cluster.layout is not self._layout:
            raise SynkError(f"{where}: Data {self._name or self._ID} was placed on machines "
                            "of which one was lost since; make it again")

    def _own_segment(self, nbytes, headroom=1.0):
        """Make this machine's memory hold ``nbytes`` (``headroom`` times more if made anew).

        Returns whether it was made anew (the machine's ranks must map it).
        """
        if self._seg is not None and self._seg.nbytes >= nbytes:
            return False
        seg = SharedArray(self._rt.segment_name(f"d{self._ID}"), max(int(nbytes * headroom), 1))
        if self._seg is not None:
            self._seg.unlink()
            self._seg.close()
        self._seg = self._box[0] = seg
        self._alloc_size = seg.nbytes // self._dtype.itemsize
        return True


@serialized
def data(value=None, var=None, dtype=None, ndim=None, shape=None, minibatch=False,
         force_cast=False, oversize=1, name=None, produce=None, length=None):
    """Return a new Data object, for input to functions and collectives.  Master only.

    Like a PyTensor variable, a Data object has a fixed ``dtype`` and ``ndim``;
    they come from ``var``, else from ``dtype``/``ndim``, else from ``value``.
    Giving ``value`` or ``shape`` allocates shared memory at once.

    With ``produce``, the rows are made where they are used: ``produce(part)``
    runs on every machine (``part``: a ``synk.Part``) and returns that
    machine's rows, which only that machine holds (docs/data.md).  On one
    machine it runs once, for every row, and the result is an ordinary Data.

    Args:
        value: initial contents (anything ``numpy.asarray`` takes).
        var: a PyTensor variable to take ``dtype`` and ``ndim`` from.
        dtype: the dtype, if not implied by ``var``.
        ndim: the number of dimensions, if not implied by ``var``.
        shape: allocate this shape (contents undefined) if no ``value``.
        minibatch: treat as minibatch data in calls with ``batch`` (see
            ``Function.__call__``).
        force_cast: cast a ``value`` (or what ``produce`` returns) of another
            dtype instead of raising.
        oversize: allocate this factor (1 to 2) more memory than needed, so
            that growing later does not reallocate.
        name: a name, as for PyTensor variables.
        produce: a function of a ``synk.Part`` returning that machine's rows
            (anything ``numpy.asarray`` takes).  It is pickled by value
            (cloudpickle), so a lambda or closure works; it runs in each
            machine's leader process.
        length: with ``produce``: the rows of the whole.  Machine ``m`` is
            asked for rows ``part.lo:part.hi``, in proportion to its ranks.
            None: each machine returns the rows it has (``part.lo`` and
            ``part.hi`` are None), stacked in machine order.

    Returns:
        Data

    Raises:
        SynkStateError: called before ``fork()``.
        TypeError: ``dtype`` or ``ndim`` cannot be determined, ``value``
            does not cast to ``dtype`` without loss and ``force_cast`` is
            False, ``value`` has the wrong ndim, a flag is not a bool,
            ``shape`` is not a list or tuple of ints, ``produce`` is not
            callable or does not pickle, or it returned the wrong rows.
        ValueError: ``shape`` has negative entries or disagrees with
            ``ndim``, ``oversize`` is outside [1, 2], ``produce`` is given
            with ``value`` or ``shape``, or ``length`` is not an int >= 0.
        WorkerError: ``produce`` raised on some machine (nothing is kept).
    """
    if produce is None:
        if length is not None:
            raise ValueError("data: length goes with produce; give shape for an ordinary Data")
        return _plain_data(value, var, dtype, ndim, shape, minibatch, force_cast, oversize, name)
    rt = require_forked("data()")
    if value is not None or shape is not None:
        raise ValueError("data: give produce, or value or shape, not both")
    if not callable(produce):
        raise TypeError(f"data: produce must be callable; got {type(produce).__name__}")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int)
                               or length < 0):
        raise ValueError(f"data: length must be an int >= 0 or None; got {length!r}")
    force_cast = conditioning.check_bool(force_cast, "data: force_cast")
    if rt.cluster is None:
        rows = produce(Part(0, 1, 0 if length is not None else None, length))
        rows = placement.check_rows(rows, var, dtype, ndim, force_cast, length, 0)
        return _plain_data(rows, var, rows.dtype, rows.ndim, None, minibatch, False, oversize,
                           name)
    return _produce(rt, produce, var, dtype, ndim, minibatch, force_cast, name, length)


def _produce(rt, produce, var, dtype, ndim, minibatch, force_cast, name, length):
    layout = rt.cluster.layout
    try:
        fn = cloudpickle.dumps(produce)
    except Exception as exc:  # noqa: BLE001 - any pickling failure means the same to the user
        raise TypeError(f"data: produce does not pickle ({exc}); it runs on every machine") \
            from None
    parts = None if length is None else placement.machine_rows(length, layout.n_local)
    mine = (None, None) if parts is None else parts[0]
    own = None
    if var is not None:
        dtype, ndim = var.dtype, var.ndim
    elif dtype is None or ndim is None:
        # The dtype and ndim the machines cast to come from machine 0's rows.
        own = placement.check_rows(produce(Part(0, layout.n_machines, *mine)), var, dtype, ndim,
                                   force_cast, placement.count(mine), 0)
        dtype, ndim = own.dtype, own.ndim
    ID = new_id(rt)
    obj = PlacedData(ID, dtype, ndim, minibatch, name, PLACED_ROWS, layout)
    msg = ProduceMsg(ID, obj._dtype.str, ndim, fn, parts, force_cast)

    def local(seq):
        arr = own if own is not None else placement.check_rows(
            produce(Part(0, layout.n_machines, *mine)), None, obj._dtype, ndim, force_cast,
            placement.count(mine), 0)
        obj._own_segment(arr.nbytes)
        obj._data = obj._seg.view(obj._dtype, arr.shape)
        obj._data[...] = arr
        return arr.shape

    def after(shape0):
        shapes = {0: shape0}
        for entry in rt.backend.collect():
            if entry is not None and entry[0]:
                m, shape = int(entry[0][0][0]), tuple(int(s) for s in entry[0][0][1:])
                shapes[m] = shape
        return shapes
    try:
        shapes = run_command(rt, Command.DATA_PRODUCE, msg, local, after,
                             what=f"data({name or ID}): produce")
        rests = {m: s[1:] for m, s in shapes.items()}
        if len(set(rests.values())) > 1:
            raise TypeError("data: produce returned rows of different shapes: " + ", ".join(
                f"machine {m}: {rests[m]}" for m in sorted(rests)))
        if rt.worker_ranks:
            run_command(rt, Command.DATA_MAP, MapMsg(ID, obj._seg.name, obj._seg.nbytes))
    except BaseException as exc:
        _forget(rt, obj, exc)
        raise
    counts = [shapes[m][0] for m in range(layout.n_machines)]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()
    obj._parts = [(starts[m], starts[m + 1]) for m in range(layout.n_machines)]
    obj._whole = (starts[-1],) + rests[0]
    logger.debug("data %s: produced %s on %d machines, parts %s", name or ID, obj._whole,
                 layout.n_machines, obj._parts)
    return obj


def _forget(rt, obj, exc):
    """A Data that failed to be made: free what some machines made of it."""
    if not isinstance(exc, MachineLostError) and not rt.closed:
        try:
            obj.free_memory()
        except Exception:  # noqa: BLE001 - the first error is the one to raise
            logger.debug("freeing a Data that failed to be made failed too", exc_info=True)
    if obj._seg is not None:
        obj._release()
    rt.registry.datas.pop(obj._ID, None)


def scratch(rt, var):
    """A call input's per-machine memory in a cluster (its rows are sent by ``send_rows``)."""
    return PlacedData(new_id(rt), var.dtype, var.ndim, False, None, PLACED_POSITIONS, rt.cluster.layout)


def send_rows(rt, obj, arr, plans):
    """Send each machine the rows of ``arr`` its ranks use in a call (``plans``, by machine).

    Machine ``m`` is sent ``arr[plans[m].sel]`` only; ``obj`` (``scratch``)
    then stands for ``arr`` in the call.
    """
    link = rt.cluster.link
    rows = [placement.gather_rows(arr, p.sel) for p in plans]
    rows = [r if r.flags.c_contiguous else np.ascontiguousarray(r) for r in rows]
    new = obj._own_segment(rows[0].nbytes, GROW)
    msg = SendMsg(obj._ID, obj._seg.name if new else None, obj._seg.nbytes,
                  tuple(r.nbytes for r in rows))

    def local(seq):
        for m in link.others:
            link.send_bytes(m, DATA, rows[m].reshape(-1).view(np.uint8))
        obj._data = obj._seg.view(obj._dtype, rows[0].shape)
        obj._data[...] = rows[0]
    obj._whole = (sum(p.n for p in plans),) + arr.shape[1:]
    obj._parts = None
    try:
        run_command(rt, Command.DATA_SEND, msg, local, what="call inputs: rows to each machine")
    except MachineLostError as exc:
        if exc.survived:
            exc.settled(False, "the call did not start: call it again")
        raise
