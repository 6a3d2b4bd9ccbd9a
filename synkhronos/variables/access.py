"""Shared variables in collectives: look-up by variable or name, value checks, get and set.

Every read or write of a shared variable's value by a collective goes through
``get_array`` and ``store`` here, so a device mode that keeps values in device
memory (JAX arrays) has one place to convert.  A variable's values live on the
device when it holds a JAX array or a JAX function uses it (``distribute()``
records those in ``rt.registry.device_shareds``): collectives then write JAX arrays
back, as PyTensor's JAX backend does after an update, so the next call finds
them on the device.  ``transport`` and ``backend_values`` give the backend a
collective's values travel through and the form it takes them in.
"""

import numbers

import numpy as np
from pytensor.compile import SharedVariable
from pytensor.tensor import TensorType
from pytensor.tensor.sharedvar import TensorSharedVariable

from ..inputs import conditioning, data_object, mappings
from ..runtime import devices
from ..inputs import rank_rows


def resolve(rt, shared_vars, where, unique=True):
    """Return (indices into ``rt.registry.shareds``, whether one variable was given).

    Args:
        rt: the master's Runtime, after distribute().
        shared_vars: a shared variable, its name, or a list/tuple of either.
        where: the calling collective's name, for error messages.
        unique: refuse a variable listed twice (collectives that write it).

    Raises:
        TypeError: not a shared variable, a name, or a list/tuple of them.
        ValueError: a variable (or name) no distributed function uses, an
            ambiguous name, a repeated variable, or more than ``max_n_var``.
    """
    if type(shared_vars) is TensorSharedVariable:
        # The common case, first: one variable known to distribute().
        i = rt.registry.shared_ids.get(id(shared_vars))
        if i is not None and rt.registry.shareds[i] is shared_vars:
            return [i], True
    single = not isinstance(shared_vars, (list, tuple))
    items = [shared_vars] if single else list(shared_vars)
    if not items:
        raise ValueError(f"{where}: shared_vars is empty")
    if len(items) > rt.config.max_n_var:
        raise ValueError(f"{where}: {len(items)} shared variables exceed max_n_var="
                         f"{rt.config.max_n_var} given to fork()")
    out = []
    for item in items:
        if isinstance(item, str):
            i = by_name(rt, item, where)
        elif isinstance(item, SharedVariable):
            i = rt.registry.shared_ids.get(id(item))
            if i is None or rt.registry.shareds[i] is not item:
                raise ValueError(f"{where}: shared variable {item} is not used by any "
                                 "function given to distribute()")
        else:
            raise TypeError(f"{where}: shared_vars must be a shared variable, its name, or a "
                            f"list/tuple of them; got {type(item).__name__}")
        var = rt.registry.shareds[i]
        if not isinstance(var.type, TensorType):
            raise TypeError(f"{where}: {var} is not a tensor shared variable ({var.type})")
        out.append(i)
    if unique and len(set(out)) != len(out):
        raise ValueError(f"{where}: a shared variable appears twice in shared_vars")
    return out, single


def by_name(rt, name, where):
    """Return the index of the distributed shared variable named ``name`` (ValueError: none, several)."""
    hits = [i for i, s in enumerate(rt.registry.shareds) if s.name == name]
    if not hits:
        raise ValueError(f"{where}: no shared variable named {name!r} is used by a "
                         "function given to distribute()")
    if len(hits) > 1:
        raise ValueError(f"{where}: {len(hits)} shared variables are named {name!r}; "
                         "pass the variable itself")
    return hits[0]


def check_rank(rt, rank, where):
    """Return ``rank`` if it names a rank of this run; raise otherwise."""
    if isinstance(rank, (bool, np.bool_)) or not isinstance(rank, numbers.Integral):
        raise TypeError(f"{where}: rank must be an int; got {type(rank).__name__}")
    if not 0 <= rank < rt.place.n_parallel:
        raise ValueError(f"{where}: rank must be in range(n_parallel={rt.place.n_parallel}); got {rank}")
    return int(rank)


def value_list(values, n, single, where):
    """Return ``values`` as a list with one entry per variable."""
    if single:
        return [values]
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise ValueError(f"{where}: values must be a list/tuple with one value per shared "
                         f"variable ({n}); got {got}")
    return list(values)


def condition_value(rt, var, value, where, whole=True):
    """Check one value for ``var``; return a NumPy array or a Data object.

    Arrays and Python values follow ``conditioning.condition`` (lossless
    casts only).  A Data object, which the ranks read in place, must have the
    variable's dtype and ndim exactly.  ``whole``: the value becomes the
    variable's value as it is (else the caller checks the rows it takes
    against lengths the variable's type fixes).

    Raises:
        TypeError: the wrong dtype or ndim, or a value that does not convert.
        ValueError: a shape the variable's type forbids, or a Data object of a
            closed run or without memory.
    """
    what = f"the value for {var}"
    if isinstance(value, data_object.Data):
        data_object.check_data(value, rt, var.dtype, var.ndim, where, what)
        if whole:
            check_static_shape(var, value.data.shape, where)
        return value
    value = conditioning.condition(value, var.dtype, var.ndim, where, what,
                                   hint=f"cast it first: value.astype({str(var.dtype)!r})")
    if whole:
        check_static_shape(var, value.shape, where)
    return value


def check_static_shape(var, shape, where):
    """Raise ValueError if ``shape`` breaks a length fixed by the variable's type."""
    for d, (fixed, got) in enumerate(zip(var.type.shape, shape)):
        if fixed is not None and fixed != got:
            raise ValueError(f"{where}: {var} has a fixed length {fixed} on axis {d}; "
                             f"got shape {tuple(shape)}")


def data_view(rt, desc):
    """Return this rank's view of a Data object described by ``describe``."""
    return mappings.view(rt, desc)


def raw(var):
    """Return the variable's current value as stored: a NumPy or a device (JAX) array."""
    return var.get_value(borrow=True, return_internal_type=True)


def on_device(rt, var, value=None):
    """Return True if the variable's values live as device arrays (``value``: its raw value)."""
    if value is None:
        value = raw(var)
    return type(value) is not np.ndarray or id(var) in rt.registry.device_shareds


def get_array(var):
    """Return the variable's current value in this process as a NumPy array.

    Not copied if it is one; a device array is copied to the host (read-only
    views of JAX's buffer on CPU).
    """
    arr = var.get_value(borrow=True, return_internal_type=True)
    if type(arr) is np.ndarray:
        return arr
    return devices.to_host(arr)


def transport(rt, nccl):
    """The backend a collective uses: the run's, or its host backend for ``nccl=False``."""
    return rt.backend if nccl else rt.backend.host


def backend_values(be, shareds):
    """The variables' values as backend ``be`` takes them: device arrays stay on the device."""
    if be.device_arrays:
        return [raw(v) for v in shareds]
    return [get_array(v) for v in shareds]


def writable_out(rt, var, dtype=None):
    """Return the variable's storage if a collective may overwrite it in place, else None.

    Writing into the existing array spares an allocation and its page faults,
    which dominate large collectives; it needs a contiguous, writeable array
    of the result's dtype, in host memory, that stays the variable's kind.
    """
    arr = raw(var)
    if on_device(rt, var, arr):
        return None
    return out_of(arr, dtype)


def out_of(arr, dtype=None):
    """``writable_out`` for a value already fetched with ``get_array``."""
    if (type(arr) is np.ndarray and arr.flags.c_contiguous and arr.flags.writeable
            and (dtype is None or arr.dtype == dtype)):
        return arr
    return None


def store(rt, var, result, out=None):
    """Make ``result`` the variable's value in this process.

    ``out`` is the storage handed to the backend as output buffer: if the
    result is already there, nothing is left to do.  Anything else is copied,
    since results may be views into communication buffers or user arrays.
    """
    if out is not None and result is out:
        return
    arr = raw(var)
    if on_device(rt, var, arr):
        _put(var, devices.to_jax(result))
        return
    result = devices.to_host(result)
    if (type(arr) is np.ndarray and arr.shape == result.shape and arr.dtype == result.dtype
            and arr.flags.writeable and not np.may_share_memory(arr, result)):
        np.copyto(arr, result)
    else:
        var.set_value(np.array(result, dtype=var.dtype), borrow=True)


def adopt(rt, var, value, user=None):
    """Make ``value``, an array a backend handed over for keeping, the variable's value.

    No copy, unless ``value`` is ``user`` (an array the caller was given,
    which the variable must not alias), or the variable's values live on the
    device (then it gets a device copy).
    """
    arr = raw(var)
    if value is arr:
        return
    if on_device(rt, var, arr):
        _put(var, devices.to_jax(value))
        return
    if value is user:
        value = np.array(value)
    elif type(value) is not np.ndarray:
        value = devices.to_host(value)
    var.set_value(value, borrow=True)


def keep(rt, var, value):
    """``adopt`` after a collective that did not change the value (gather, a broadcast's root).

    A host variable takes the backend's buffer (which the other ranks may
    read in place next time); a device variable keeps its own value.
    """
    if not on_device(rt, var):
        adopt(rt, var, value)


def like(rt, var, value):
    """Return ``value`` in the variable's kind: a JAX array or a NumPy array."""
    return devices.to_jax(value) if on_device(rt, var) else devices.to_host(value)


def place(rt, var):
    """Move a device variable's host value to the device (after distribute(), every rank)."""
    arr = raw(var)
    if type(arr) is np.ndarray and id(var) in rt.registry.device_shareds:
        _put(var, devices.to_jax(arr))


def _put(var, value):
    # set_value() would filter a JAX array back into NumPy; PyTensor's JAX
    # backend writes its updates into the container's storage like this.
    var.container.storage[0] = value


def ret(results, single):
    """One result for one variable; a tuple for a list or tuple of them."""
    return results[0] if single else tuple(results)


def descs(items):
    """Data objects travel as descriptors (workers read them in place); arrays as None."""
    return [v.describe() if isinstance(v, data_object.Data) else None for v in items]


def select(sel, length, var, where):
    """Resolve ``sel`` against a value of ``length`` rows; raise if it reaches past them."""
    s = rank_rows.resolve_selection(sel, length)
    need = rank_rows.rows_needed(s, length)
    if need > length:
        raise ValueError(f"{where}: batch selects row {need - 1} but the value for {var} "
                         f"has {length} rows")
    return s
