"""One rule for turning a user's value into an array of a given dtype and ndim, and the
checks of the arguments that describe one (flags, shape, ndim, name, oversize).

Used by ``data()`` and ``Data.set_value``, function inputs given as arrays,
and collectives that take values.  It follows PyTensor's rule for shared
values: a cast that loses nothing is applied silently (``float16`` to
``float32``, ``int8`` to ``int64``; Python numbers and lists whose values
survive the conversion; Python floats to a float dtype, as PyTensor allows
for ``floatX``); any other cast needs ``force_cast=True`` or raises
``TypeError``.  A wrong ndim is always a ``TypeError``, as in PyTensor.
"""

import numbers

import numpy as np


def check_bool(value, where):
    """Return ``value`` if it is a bool (Python or NumPy); raise TypeError naming ``where``.

    Flags are not taken by truthiness: ``"no"`` would otherwise mean True.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{where} must be True or False; got {value!r}")


def check_shape(shape, where, ndim=None):
    """Return ``shape`` as a tuple of ints >= 0; raise naming ``where`` otherwise.

    Entries must be integers (Python or NumPy), not bools or floats (``2.5``
    would be truncated, ``nan`` cannot be a length).

    Raises:
        TypeError: not a list, tuple or 1-d array of ints.
        ValueError: a negative entry, or not ``ndim`` entries.
    """
    if isinstance(shape, np.ndarray) and shape.ndim == 1:
        shape = shape.tolist()
    if not isinstance(shape, (list, tuple)):
        raise TypeError(f"{where} must be a list or tuple of ints; got {shape!r}")
    for s in shape:
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, (numbers.Integral, np.integer)):
            raise TypeError(f"{where} must be a list or tuple of ints; got {shape!r}")
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"{where} entries must be >= 0; got {shape}")
    if ndim is not None and len(shape) != ndim:
        raise ValueError(f"{where} must have {ndim} entries (ndim); got {shape}")
    return shape


def check_ndim(ndim, where):
    """Raise TypeError naming ``where`` unless ``ndim`` is an int >= 0 (not a bool)."""
    if isinstance(ndim, (bool, np.bool_)) or not isinstance(ndim, (numbers.Integral, np.integer)) \
            or ndim < 0:
        raise TypeError(f"{where}: ndim must be an int >= 0; got {ndim!r}")


def check_name(name, where):
    """Raise TypeError naming ``where`` unless ``name`` is a str or None."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{where}: name must be a str or None; got {type(name).__name__}")


def check_oversize(oversize, where):
    """Raise ValueError naming ``where`` unless ``oversize`` is a number in [1, 2]."""
    if isinstance(oversize, (bool, np.bool_)) or not isinstance(oversize, numbers.Real) \
            or not 1 <= oversize <= 2:
        raise ValueError(f"{where}: oversize must be a number in [1, 2]; got {oversize!r}")


def check_dtype(dtype, where):
    """Return ``dtype`` as a NumPy dtype if it is a plain numeric one; raise TypeError otherwise."""
    try:
        dtype = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"{where}: {dtype!r} is not a dtype") from exc
    if dtype.kind not in "biufc":
        raise TypeError(f"{where}: dtype must be a numeric (bool, int, float or complex) "
                        f"dtype; got {dtype}")
    return dtype


def condition(value, dtype, ndim, where, what="value", force_cast=False, hint=None):
    """Return ``value`` as a NumPy array of ``dtype`` and ``ndim``.

    An ndarray of the right dtype comes back as it is (no copy).

    Args:
        value: an ndarray, or anything ``numpy.asarray`` takes.
        dtype: the dtype expected.
        ndim: the number of dimensions expected (None: any).
        where: the method, for messages (``"set_value"``, ``"broadcast"``).
        what: the argument, for messages (``"input x"``, ``"the value for W"``).
        force_cast: cast whatever converts, losing what it must.
        hint: how to cast, for messages; the default names ``force_cast=True``,
            so callers without that argument pass what works for them.

    Raises:
        TypeError: a cast that would lose information without ``force_cast``,
            a value that does not convert, or the wrong ndim.
    """
    dtype = np.dtype(dtype)
    hint = hint or "pass force_cast=True to cast"
    if force_cast is not False:
        force_cast = check_bool(force_cast, f"{where}: force_cast")
    if type(value) is np.ndarray or isinstance(value, np.ndarray):
        arr = value
        if arr.dtype != dtype:
            if not (force_cast or np.can_cast(arr.dtype, dtype, "safe")):
                raise TypeError(f"{where}: {what} needs dtype {dtype}; got {arr.dtype}, which "
                                f"does not cast without loss ({hint})")
            arr = arr.astype(dtype)
    else:
        arr = _convert(value, dtype, where, what, force_cast, hint)
    if ndim is not None and arr.ndim != ndim:
        raise TypeError(f"{where}: {what} needs ndim {ndim}; got ndim {arr.ndim} "
                        f"(shape {arr.shape})")
    return arr


def as_array(value, where):
    """``numpy.asarray(value)``, or a TypeError naming ``where`` when it does not convert."""
    try:
        return np.asarray(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"{where}: value does not convert to an array: {exc}") from exc


def _convert(value, dtype, where, what, force_cast, hint):
    """Python values (numbers, lists): convert when no value changes, as PyTensor does."""
    try:
        raw = np.asarray(value)
        arr = np.asarray(value, dtype=dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"{where}: cannot convert {what} to {dtype}: {exc}") from exc
    if raw.dtype.kind not in "biufc":
        raise TypeError(f"{where}: {what} needs dtype {dtype}; got {raw.dtype} "
                        f"({type(value).__name__})")
    if force_cast or raw.dtype == dtype or np.can_cast(raw.dtype, dtype, "safe"):
        return arr
    if raw.dtype.kind == "f" and dtype.kind == "f":
        return arr  # Python floats to float32: what PyTensor allows for floatX
    with np.errstate(invalid="ignore"):
        lossless = raw.shape == arr.shape and bool(np.all(arr == raw))
    if not lossless:
        raise TypeError(f"{where}: {what} needs dtype {dtype}; its values change when cast "
                        f"({hint})")
    return arr


def rows_written(arr, k):
    """The item range ``arr[k] = v`` can have written: its rows for an int or slice, else all."""
    if arr.ndim == 0:
        return 0, arr.size
    row = arr.size // len(arr) if len(arr) else 0
    if isinstance(k, tuple) and k:
        k = k[0] if len(k) == 1 or isinstance(k[0], (numbers.Integral, slice)) else None
    if isinstance(k, numbers.Integral) and not isinstance(k, bool):
        i = int(k) + (len(arr) if k < 0 else 0)
        return i * row, (i + 1) * row
    if isinstance(k, slice):
        lo, hi, step = k.indices(len(arr))
        if step > 0:
            return lo * row, max(lo, hi) * row
    return 0, arr.size
