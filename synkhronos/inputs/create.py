"""synk.data(): the one public constructor of Data, ordinary or produced where it is used;
its arguments checked here (data_object.py makes the object)."""

import numpy as np
from pytensor.graph.basic import Variable

from ..runtime.state import require_forked, serialized
from . import conditioning, machine_rows, produced
from .data_object import Data, replicated
from .machine_rows import Part


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
    rt = require_forked("data()")
    if produce is None:
        if length is not None:
            raise ValueError("data: length goes with produce; give shape for an ordinary Data")
        value, dtype, ndim, shape, minibatch, force_cast = _checked(
            value, var, dtype, ndim, shape, minibatch, force_cast, oversize, name)
        return replicated(rt, value, dtype, ndim, shape, minibatch, force_cast, oversize, name)
    if value is not None or shape is not None:
        raise ValueError("data: give produce, or value or shape, not both")
    if not callable(produce):
        raise TypeError(f"data: produce must be callable; got {type(produce).__name__}")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int)
                               or length < 0):
        raise ValueError(f"data: length must be an int >= 0 or None; got {length!r}")
    force_cast = conditioning.check_bool(force_cast, "data: force_cast")
    if rt.peers.layout is None:
        rows = produce(Part(0, 1, 0 if length is not None else None, length))
        rows = machine_rows.check_produced_rows(rows, var, dtype, ndim, force_cast, length, 0)
        rows, dtype, ndim, _, minibatch, _ = _checked(rows, var, rows.dtype, rows.ndim, None,
                                                      minibatch, False, oversize, name)
        return replicated(rt, rows, dtype, ndim, None, minibatch, False, oversize, name)
    return produced.produce(rt, produce, var, dtype, ndim, minibatch, force_cast, name, length)


def _checked(value, var, dtype, ndim, shape, minibatch, force_cast, oversize, name):
    """``data()``'s arguments checked: ``(value, dtype, ndim, shape, minibatch, force_cast)``."""
    force_cast = conditioning.check_bool(force_cast, "data: force_cast")
    minibatch = conditioning.check_bool(minibatch, "data: minibatch")
    conditioning.check_name(name, "data")
    if dtype is not None:
        dtype = conditioning.check_dtype(dtype, "data: dtype")
    if ndim is not None:
        conditioning.check_ndim(ndim, "data")
    if var is not None:
        if not isinstance(var, Variable):
            raise TypeError(f"data: var must be a PyTensor variable; got {type(var).__name__}")
        if dtype is not None and dtype != np.dtype(var.dtype):
            raise TypeError(f"data: dtype {dtype} disagrees with var's dtype {var.dtype}")
        if ndim is not None and ndim != var.ndim:
            raise TypeError(f"data: ndim {ndim} disagrees with var's ndim {var.ndim}")
        dtype, ndim = var.dtype, var.ndim
    conditioning.check_oversize(oversize, "data")
    if shape is not None:
        shape = conditioning.check_shape(shape, "data: shape", ndim)
    if value is not None:
        value = value.data if isinstance(value, Data) else value
        if dtype is None or ndim is None:
            arr = value if isinstance(value, np.ndarray) else conditioning.as_array(value, "data")
            dtype, ndim = (arr.dtype if dtype is None else dtype), (arr.ndim if ndim is None else ndim)
    elif shape is not None and ndim is None:
        ndim = len(shape)
    if dtype is None or ndim is None:
        raise TypeError("data: cannot tell dtype and ndim; give value, var, or dtype and ndim")
    return value, conditioning.check_dtype(dtype, "data"), ndim, shape, minibatch, force_cast
