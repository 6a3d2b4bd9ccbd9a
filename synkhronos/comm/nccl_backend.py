"""NCCL backend: collectives on device arrays through cupy.cuda.nccl, buffers passed by DLPack.

It works beside the host backend (``rt.backend``, shared memory), not instead
of it: every collective first exchanges a small header (dtypes and shapes,
and whether the rank has a communicator) through the host backend, so that
all ranks decide alike, before any rank enters NCCL, whether the call can run
there.  Calls NCCL cannot run exactly (shapes that differ between ranks, a
dtype or op NCCL lacks) return None and the caller takes the host path; NCCL
itself would hang on counts that differ, or crop and pad gathered data
silently (the original's caveat).

The communicator is created in every rank inside one command: the first
collective that finds a rank without one has the master rank make a unique
id and broadcast it through the host backend.  A communicator aborted after a
failure is replaced the same way by the next collective.

Inputs are read in place (JAX arrays via DLPack); results go into fresh
buffers, never into JAX's, which JAX assumes immutable.  Waits for the GPU
poll the stream and check that every rank is alive, so no wait is unbounded.
"""

import contextlib
import logging
import time

import numpy as np

from .. import gpu

logger = logging.getLogger(__name__)

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


class NcclBackend:
    """Collectives on device arrays among the ranks of one run, one GPU per rank.

    Has the methods of ``comm.base.Backend`` that move device data
    (all_reduce, reduce, broadcast, gather, all_gather) and returns CuPy
    arrays; each returns None when the call must take the host path instead.
    Created lazily in every rank (``rt.nccl``); every rank of a command calls
    the same method with the same arguments, as with any backend.

    Raises:
        BackendUnavailableError: CuPy or NCCL is not installed.
    """

    def __init__(self, rt):
        self.cupy, self.nccl = gpu.import_cupy()
        self.rt = rt
        self.n_parallel = rt.n_parallel
        self.comm = None
        # Its own stream: NCCL kernels queue behind nothing else, and waiting
        # for them waits for nothing else.
        self.stream = self.cupy.cuda.Stream(non_blocking=True)

    @property
    def rank(self):
        return self.rt.rank

    @property
    def host(self):
        """The host backend: headers and the unique id travel there."""
        return self.rt.backend

    # ---- agreement and the communicator ----------------------------------
    def _agree(self, values):
        """Exchange headers through the host backend; return every rank's (parsed) header.

        Connects first if any rank has no communicator, so that every rank
        connects, or none.
        """
        mine = np.concatenate([[0 if self.comm is None else 1], header(values)])
        parts = self.host.all_gather([mine])
        # Copies: the host backend's results are valid until its next call.
        hdrs = [np.array(parts[q][0]) for q in range(self.n_parallel)]
        if any(h[0] == 0 for h in hdrs):
            self._connect()
        return [parse_header(h[1:]) for h in hdrs]

    def _connect(self):
        root = self.rt.master_rank
        uid = None
        if self.rank == root:
            uid = [np.array(self.nccl.get_unique_id(), dtype=np.int64)]
        got = self.host.broadcast(uid, root)
        uid = tuple(int(x) for x in got[0])
        self._drop()
        t0 = time.perf_counter()
        self.comm = self.nccl.NcclCommunicator(self.n_parallel, uid, self.rank)
        logger.info("rank %d joined an NCCL communicator of %d ranks in %.3f s",
                    self.rank, self.n_parallel, time.perf_counter() - t0)

    def _drop(self):
        comm, self.comm = self.comm, None
        if comm is not None:
            try:
                comm.destroy()
            except Exception:  # a broken communicator: nothing left to release
                pass

    def _abort(self):
        comm, self.comm = self.comm, None
        if comm is not None:
            try:
                comm.abort()
            except Exception:  # aborting is best effort; the next call reconnects
                pass

    @contextlib.contextmanager
    def _group(self):
        # One NCCL group per collective: a list of variables goes in one launch.
        self.nccl.groupStart()
        try:
            yield
        finally:
            self.nccl.groupEnd()

    def _wait(self):
        """Wait for this collective's NCCL work; raise if a rank died or aborted meanwhile."""
        check = self.host._get_check()
        stream = self.stream
        spins = 0
        while not stream.done:
            try:
                check()
            except BaseException:
                # The other ranks may never join: free the GPU from the waiting kernels.
                self._abort()
                raise
            spins += 1
            if spins > 1000:
                time.sleep(50e-6)

    def _run(self, launch, then=None):
        """Launch NCCL calls in one group on this backend's stream (then ``then()``); wait."""
        try:
            with self.stream, self._group():
                launch()
            if then is not None:
                with self.stream:
                    then()
        except BaseException:
            self._abort()
            raise
        self._wait()

    def _prepare(self, values):
        """Device views of ``values`` for NCCL, made on this backend's stream.

        On its stream, host-to-device copies (NumPy values) and the DLPack
        hand-over are ordered before the NCCL kernels that read them.
        """
        with self.stream:
            return [gpu.to_cupy(v) for v in values]

    def _empty(self, shape, dtype):
        with self.stream:
            return self.cupy.empty(shape, dtype)

    def _const(self, name):
        return getattr(self.nccl, name)

    @staticmethod
    def _same(hdrs):
        return all(h == hdrs[0] for h in hdrs[1:])

    # ---- collectives ---------------------------------------------------
    def all_reduce(self, values, op):
        """Reduce device arrays over all ranks; return the results on every rank (or None)."""
        hdrs = self._agree(values)
        names = self._reduce_names(hdrs, op)
        if names is None:
            return None
        src = self._prepare(values)
        dst = [self._empty(s.shape, s.dtype) for s in src]

        def launch():
            for s, d, (nop, ndt) in zip(src, dst, names):
                if s.size:
                    self.comm.allReduce(s.data.ptr, d.data.ptr, s.size, self._const(ndt),
                                        self._const(nop), self.stream.ptr)
        self._run(launch, lambda: self._scale(dst, op))
        return dst

    def reduce(self, values, op, root):
        """Reduce device arrays into ``root``; return the results there, Nones elsewhere (or None)."""
        hdrs = self._agree(values)
        names = self._reduce_names(hdrs, op)
        if names is None:
            return None
        src = self._prepare(values)
        mine = self.rank == root
        # Only the root receives; elsewhere NCCL ignores the receive buffer.
        dst = [self._empty(s.shape, s.dtype) if mine else s for s in src]

        def launch():
            for s, d, (nop, ndt) in zip(src, dst, names):
                if s.size:
                    self.comm.reduce(s.data.ptr, d.data.ptr, s.size, self._const(ndt),
                                     self._const(nop), root, self.stream.ptr)
        self._run(launch, (lambda: self._scale(dst, op)) if mine else None)
        return dst if mine else [None] * len(src)

    def broadcast(self, values, root):
        """Return the root's device arrays on every rank (others pass None), or None.

        The root gets its own ``values`` back.
        """
        hdrs = self._agree(values if self.rank == root else None)
        meta = hdrs[root]
        if any(name is None for name, _ in meta):
            return None
        if self.rank == root:
            bufs = self._prepare(values)
        else:
            bufs = [self._empty(shape, name) for name, shape in meta]

        def launch():
            for b in bufs:
                if b.nbytes:
                    # In place at the root (send == receive buffer): its data is only read.
                    self.comm.broadcast(b.data.ptr, b.data.ptr, b.nbytes,
                                        self._const("NCCL_UINT8"), root, self.stream.ptr)
        self._run(launch)
        return list(values) if self.rank == root else bufs

    def all_gather(self, values):
        """Return on every rank each array stacked over ranks, shape ``(n, *shape)``, or None.

        None (the host path) unless every rank's arrays have the same shapes.
        """
        hdrs = self._agree(values)
        if not self._same(hdrs) or any(name is None for name, _ in hdrs[0]):
            return None
        src = self._prepare(values)
        dst = [self._empty((self.n_parallel,) + s.shape, s.dtype) for s in src]

        def launch():
            for s, d in zip(src, dst):
                if s.nbytes:
                    self.comm.allGather(s.data.ptr, d.data.ptr, s.nbytes,
                                        self._const("NCCL_UINT8"), self.stream.ptr)
        self._run(launch)
        return dst

    def gather(self, values, root):
        """Return at the root each array stacked over ranks, Nones elsewhere (or None).

        NCCL has no gather: this is an all_gather whose result only the root keeps.
        """
        got = self.all_gather(values)
        if got is None or self.rank == root:
            return got
        return [None] * len(got)

    def close(self):
        """Release the communicator (workers exit without it; the OS reclaims theirs)."""
        self._drop()

    # ---- helpers ---------------------------------------------------------
    def _reduce_names(self, hdrs, op):
        """Return each array's NCCL (op, dtype) names, or None for the host path."""
        if not self._same(hdrs):
            return None
        names = []
        for dtype, _ in hdrs[0]:
            pair = None if dtype is None else nccl_op_name(op, dtype)
            if pair is None:
                return None
            names.append(pair)
        return names

    def _scale(self, arrays, op):
        """``avg``: the sum, scaled in place by 1/n on the current (this backend's) stream."""
        if op != "avg" or self.n_parallel == 1:
            return
        for a in arrays:
            a *= 1.0 / self.n_parallel
