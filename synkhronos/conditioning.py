"""One rule for turning a user's value into an array of a given dtype and ndim.

Used by ``data()`` and ``Data.set_value``, function inputs given as arrays,
and collectives that take values.  It follows PyTensor's rule for shared
values: a cast that loses nothing is applied silently (``float16`` to
``float32``, ``int8`` to ``int64``; Python numbers and lists whose values
survive the conversion; Python floats to a float dtype, as PyTensor allows
for ``floatX``); any other cast needs ``force_cast=True`` or raises
``TypeError``.  A wrong ndim is always a ``TypeError``, as in PyTensor.
"""

import numpy as np


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


def condition(value, dtype, ndim, where, what="value", force_cast=False):
    """Return ``value`` as a NumPy array of ``dtype`` and ``ndim``.

    An ndarray of the right dtype comes back as it is (no copy).

    Args:
        value: an ndarray, or anything ``numpy.asarray`` takes.
        dtype: the dtype expected.
        ndim: the number of dimensions expected (None: any).
        where: the method, for messages (``"set_value"``, ``"broadcast"``).
        what: the argument, for messages (``"input x"``, ``"the value for W"``).
        force_cast: cast whatever converts, losing what it must.

    Raises:
        TypeError: a cast that would lose information without ``force_cast``,
            a value that does not convert, or the wrong ndim.
    """
    dtype = np.dtype(dtype)
    if type(value) is np.ndarray or isinstance(value, np.ndarray):
        arr = value
        if arr.dtype != dtype:
            if not (force_cast or np.can_cast(arr.dtype, dtype, "safe")):
                raise TypeError(f"{where}: {what} needs dtype {dtype}; got {arr.dtype}, which "
                                "does not cast without loss (pass force_cast=True to cast)")
            arr = arr.astype(dtype)
    else:
        arr = _convert(value, dtype, where, what, force_cast)
    if ndim is not None and arr.ndim != ndim:
        raise TypeError(f"{where}: {what} needs ndim {ndim}; got ndim {arr.ndim} "
                        f"(shape {arr.shape})")
    return arr


def _convert(value, dtype, where, what, force_cast):
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
                        "(pass force_cast=True to cast)")
    return arr
