"""What a node master tells the controller after each command: ``NodeReport``, and its packed form.

Most commands end in success, with nothing or a few small arrays from the
machine's ranks (a call's loss): those travel packed, a fixed binary layout
read with ``struct`` and ``np.frombuffer`` (``pack_outputs``/``unpack_outputs``),
since pickling a report and its arrays costs several microseconds on each
side, as much as the message itself.  Failures, a machine whose ranks died,
large or unusual contributions (a machine's combined part, object arrays)
travel pickled, as a whole ``NodeReport``.
"""

import struct
from typing import NamedTuple, Optional

import numpy as np

REPORT_HEAD = struct.Struct("qq")         # the command's number, the entries
ENTRY = struct.Struct("qdq")       # global rank, weight, arrays
ARRAY = struct.Struct("8sqq")      # dtype.str, ndim, bytes (each array's data padded to 8)
PACKED_MAX_BYTES = 1 << 16         # contributions larger than this travel pickled
_SHAPES = [struct.Struct(f"{n}q") for n in range(33)]  # a shape of each ndim NumPy allows
_DTYPES = {}                       # dtype.str as packed -> dtype (made once per kind)


class NodeReport(NamedTuple):
    """A node master's outcome of one command.

    Attributes:
        seq: the command's number.
        failures: ``[(global rank, traceback text, pickled exception or None)]``.
        contributions: ``[(global rank, arrays, weight)]`` for collected commands.
        died: why the machine's ranks died, or None.
    """

    seq: Optional[int]
    failures: list
    contributions: list
    died: Optional[str]


DONE_REPORT = NodeReport(None, [], [], None)


def pack_outputs(seq, contributions):
    """``contributions`` (``[(rank, arrays, weight)]``) as bytes, or None where they must be pickled.

    Packs plain arrays of fixed-size dtypes whose data add up to at most
    ``PACKED_MAX_BYTES``; weights travel as float64.
    """
    parts = [REPORT_HEAD.pack(seq, len(contributions))]
    total = 0
    for entry in contributions:
        rank, arrays, weight = entry
        if type(arrays) is not list or not isinstance(weight, (float, int, np.number)):
            return None
        parts.append(ENTRY.pack(rank, weight, len(arrays)))
        for a in arrays:
            if type(a) is not np.ndarray or a.dtype.hasobject or not a.flags.c_contiguous:
                return None
            code = a.dtype.str.encode()
            n = a.nbytes
            total += n
            if len(code) > 8 or total > PACKED_MAX_BYTES:
                return None
            parts.append(ARRAY.pack(code, a.ndim, n))
            if a.ndim:
                parts.append(_SHAPES[a.ndim].pack(*a.shape))
            parts.append(a.tobytes())
            if n & 7:
                parts.append(bytes(8 - (n & 7)))
    return b"".join(parts)


def unpack_outputs(buf):
    """The ``NodeReport`` of success that ``pack_outputs`` made; arrays are views of ``buf``."""
    seq, n_entries = REPORT_HEAD.unpack_from(buf, 0)
    at = REPORT_HEAD.size
    contributions = []
    for _ in range(n_entries):
        rank, weight, n_arrays = ENTRY.unpack_from(buf, at)
        at += ENTRY.size
        arrays = []
        for _ in range(n_arrays):
            code, ndim, n = ARRAY.unpack_from(buf, at)
            at += ARRAY.size
            shape = _SHAPES[ndim].unpack_from(buf, at) if ndim else ()
            at += 8 * ndim
            dtype = _DTYPES.get(code)
            if dtype is None:
                dtype = _DTYPES[code] = np.dtype(code.rstrip(b"\0").decode())
            if n:
                a = np.frombuffer(buf, dtype, n // dtype.itemsize, at).reshape(shape)
            else:
                a = np.empty(shape, dtype)
            arrays.append(a)
            at += n + (-n & 7)
        contributions.append((rank, arrays, weight))
    return NodeReport(seq, [], contributions, None)
