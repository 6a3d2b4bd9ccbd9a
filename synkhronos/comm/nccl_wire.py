"""What NCCL ranks agree on before a collective: op and dtype names, headers, the unique id.

Pure NumPy, no CuPy: the NCCL backend (nccl_backend.py) exchanges these
through its host backend so that every rank decides alike, before any enters
NCCL, whether a collective can run there.
"""

import numpy as np

# Reduce ops, by the names of cupy.cuda.nccl's constants.  NCCL has no "avg"
# that every version knows: sum, then scale by 1/n (as the original did).
NCCL_OPS = {
    "avg": "NCCL_SUM",
    "sum": "NCCL_SUM",
    "prod": "NCCL_PROD",
    "max": "NCCL_MAX",
    "min": "NCCL_MIN",
}

# Dtypes NCCL reduces.  Others (bool, int16, complex, ...) are reduced on the
# host path; data that is only moved (broadcast, gather) travels as bytes.
NCCL_DTYPES = {
    "int8": "NCCL_INT8",
    "uint8": "NCCL_UINT8",
    "int32": "NCCL_INT32",
    "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64",
    "uint64": "NCCL_UINT64",
    "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
}

# Dtypes a header can name (its index is the code); -1: not movable here.
HEADER_DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                 "uint64", "float16", "float32", "float64", "complex64", "complex128")
_CODES = {name: code for code, name in enumerate(HEADER_DTYPES)}


def dtype_code(dtype):
    """Return the header code of ``dtype``, or -1 if the NCCL path cannot carry it."""
    return _CODES.get(np.dtype(dtype).name, -1)


def nccl_op_name(op, dtype):
    """Return (NCCL op constant name, NCCL dtype constant name), or None if NCCL can't.

    ``avg`` needs a float dtype (its result is scaled in place); every op
    needs a dtype NCCL reduces.
    """
    name = np.dtype(dtype).name
    if op not in NCCL_OPS or name not in NCCL_DTYPES:
        return None
    if op == "avg" and np.dtype(dtype).kind != "f":
        return None
    return NCCL_OPS[op], NCCL_DTYPES[name]


def header(values):
    """Describe ``values`` (or None) as one int64 array: count, then (code, ndim, *shape) each."""
    out = [0 if values is None else len(values)]
    for v in values or ():
        out += [dtype_code(v.dtype), v.ndim, *v.shape]
    return np.array(out, dtype=np.int64)


def parse_header(hdr):
    """Return [(dtype name or None, shape)] from a ``header`` array."""
    n, pos, out = int(hdr[0]), 1, []
    for _ in range(n):
        code, ndim = int(hdr[pos]), int(hdr[pos + 1])
        shape = tuple(int(x) for x in hdr[pos + 2:pos + 2 + ndim])
        out.append((HEADER_DTYPES[code] if code >= 0 else None, shape))
        pos += 2 + ndim
    return out


def encode_unique_id(uid):
    """NCCL's unique id as int64s for the host broadcast: a kind flag, then the 128 values.

    CuPy 13 gives a tuple of ints (signed chars), CuPy 14 the 128 bytes; the
    communicator takes back the form it gave.
    """
    if isinstance(uid, (bytes, bytearray)):
        return np.concatenate([[1], np.frombuffer(bytes(uid), dtype=np.uint8)]).astype(np.int64)
    return np.concatenate([[0], np.asarray(uid, dtype=np.int64)])


def decode_unique_id(arr):
    """The inverse of :func:`encode_unique_id`."""
    arr = np.asarray(arr, dtype=np.int64)
    if arr[0] == 1:
        return arr[1:].astype(np.uint8).tobytes()
    return tuple(int(x) for x in arr[1:])
