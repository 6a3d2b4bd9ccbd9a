"""A stand-in for CuPy and cupy.cuda.nccl on the CPU, to test the NCCL path without a GPU.

"Device" arrays are NumPy arrays (a subclass with CuPy's ``.data.ptr``).  The
communicator does what NCCL would, through the run's host backend, reading and
writing the raw pointers it is given, so the NcclBackend code runs unchanged:
headers, grouping, DLPack hand-over from JAX (CPU JAX arrays export DLPack too),
scaling for avg, fallbacks, reconnection.  What it cannot show is NCCL's own
behaviour on GPUs (streams, kernels, the real library).

``install()`` puts it in ``sys.modules`` as ``cupy`` / ``cupy.cuda`` /
``cupy.cuda.nccl``; call it before fork() so the workers have it too.  Each
process logs its NCCL calls in ``LOG``.
"""

import ctypes
import importlib.machinery
import sys
import types

import numpy as np

from synkhronos.runtime.state import get_runtime

LOG = []          # ("comm", uid), ("group",), ("allReduce", count), ..., in call order
FAIL = {}         # {"rank": r, "call": k}: the k-th NCCL data call (from 1) of rank r raises
_CALLS = [0]


class ndarray(np.ndarray):  # noqa: N801 - CuPy's name
    """A NumPy array that answers ``.data.ptr`` as CuPy arrays do."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def get(self):
        """Device to host, as CuPy's ``get()``."""
        return np.array(self, copy=True).view(np.ndarray)


def asarray(value):
    return np.array(value, copy=True).view(ndarray)


def empty(shape, dtype):
    return np.empty(shape, dtype).view(ndarray)


def from_dlpack(value):
    return np.from_dlpack(value).view(ndarray)


class Stream:
    """Every call runs synchronously, so a stream is always done."""

    def __init__(self, non_blocking=False):
        self.ptr = 0
        self.done = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


class NcclError(RuntimeError):
    pass


OPS = {"NCCL_SUM": 0, "NCCL_PROD": 1, "NCCL_MAX": 2, "NCCL_MIN": 3}
DTYPES = {"NCCL_INT8": "int8", "NCCL_UINT8": "uint8", "NCCL_INT32": "int32",
          "NCCL_UINT32": "uint32", "NCCL_INT64": "int64", "NCCL_UINT64": "uint64",
          "NCCL_FLOAT16": "float16", "NCCL_FLOAT32": "float32", "NCCL_FLOAT64": "float64"}
_OP_NAMES = {0: "sum", 1: "prod", 2: "max", 3: "min"}
_DTYPE_OF = {}


def _view(ptr, count, dtype):
    """The ``count`` elements of ``dtype`` at address ``ptr``, as a writeable NumPy array."""
    dtype = np.dtype(dtype)
    buf = (ctypes.c_char * (count * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype=dtype, count=count)


def _data_call(name, count):
    _CALLS[0] += 1
    LOG.append((name, count))
    rt = get_runtime()
    if FAIL and FAIL.get("rank") == rt.place.rank and FAIL.get("call") == _CALLS[0]:
        raise NcclError(f"fake NCCL failure in rank {rt.place.rank}, call {_CALLS[0]}")
    return rt


def get_unique_id():
    # CuPy 14's form (128 bytes); CuPy 13 gave a tuple of 128 ints.
    return np.random.default_rng().integers(0, 256, 128, dtype=np.uint8).tobytes()


def groupStart():  # noqa: N802 - NCCL's names
    LOG.append(("groupStart",))


def groupEnd():  # noqa: N802
    LOG.append(("groupEnd",))


class NcclCommunicator:
    def __init__(self, ndev, uid, rank):
        rt = get_runtime()
        assert rank == rt.place.rank and ndev == rt.place.n_parallel, (rank, ndev)
        # NCCL joins ranks holding the same id; check that every rank got the master's.
        assert isinstance(uid, bytes) and len(uid) == 128, type(uid)
        ids = rt.backend.host.all_gather([np.frombuffer(uid, dtype=np.uint8).copy()])
        assert all(np.array_equal(ids[q][0], ids[0][0]) for q in range(ndev)), "uids differ"
        LOG.append(("comm", uid))
        self.alive = True

    def allReduce(self, send, recv, count, dtype, op, stream):  # noqa: N802
        rt = _data_call("allReduce", count)
        got = rt.backend.host.all_reduce([_view(send, count, _DTYPE_OF[dtype]).copy()],
                                    _OP_NAMES[op])
        _view(recv, count, _DTYPE_OF[dtype])[:] = got[0]

    def reduce(self, send, recv, count, dtype, op, root, stream):
        rt = _data_call("reduce", count)
        got = rt.backend.host.reduce([_view(send, count, _DTYPE_OF[dtype]).copy()],
                                _OP_NAMES[op], root)
        if rt.place.rank == root:
            _view(recv, count, _DTYPE_OF[dtype])[:] = got[0]

    def broadcast(self, send, recv, count, dtype, root, stream):
        rt = _data_call("broadcast", count)
        mine = rt.place.rank == root
        data = [_view(send, count, _DTYPE_OF[dtype]).copy()] if mine else None
        got = rt.backend.host.broadcast(data, root)
        if not mine:
            _view(recv, count, _DTYPE_OF[dtype])[:] = got[0]

    def allGather(self, send, recv, count, dtype, stream):  # noqa: N802
        rt = _data_call("allGather", count)
        got = rt.backend.host.all_gather([_view(send, count, _DTYPE_OF[dtype]).copy()])
        _view(recv, count * rt.place.n_parallel, _DTYPE_OF[dtype])[:] = np.concatenate(
            [got[q][0] for q in range(rt.place.n_parallel)])

    def destroy(self):
        LOG.append(("destroy",))
        self.alive = False

    def abort(self):
        LOG.append(("abort",))
        self.alive = False


def install():
    """Register the fake as ``cupy`` in sys.modules, with an empty log; return the nccl module."""
    LOG.clear()
    _CALLS[0] = 0
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    nccl = types.ModuleType("cupy.cuda.nccl")
    for mod in (cupy, cuda, nccl):
        mod.__spec__ = importlib.machinery.ModuleSpec(mod.__name__, None)
    for name in ("ndarray", "asarray", "empty", "from_dlpack"):
        setattr(cupy, name, globals()[name])
    cuda.Stream = Stream
    for i, (name, dtype) in enumerate(DTYPES.items()):
        setattr(nccl, name, 100 + i)
        _DTYPE_OF[100 + i] = dtype
    for name, value in OPS.items():
        setattr(nccl, name, value)
    for name in ("get_unique_id", "groupStart", "groupEnd", "NcclCommunicator", "NcclError"):
        setattr(nccl, name, globals()[name])
    nccl.available = True
    cuda.nccl = nccl
    cupy.cuda = cuda
    sys.modules.update({"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.nccl": nccl})
    return nccl


def calls(name):
    """How many NCCL calls of ``name`` this process made."""
    return sum(1 for entry in LOG if entry[0] == name)
