"""Communication backends: one name-to-class table, imported on demand."""

import importlib
import logging
import os

from ..runtime import devices, load_extension
from ..errors import BackendUnavailableError

logger = logging.getLogger(__name__)

# The ABI of comm/_reduce.c (the small reductions) this Python expects (SYNK_REDUCE_ABI
# there): bump both together.  Checked here, before any backend imports it.
REDUCE_ABI = 1
load_extension(__name__ + "._reduce", REDUCE_ABI)

_BACKENDS = {
    "shm": ("synkhronos.comm.shm_backend", "ShmBackend", None),
    "zmq": ("synkhronos.comm.zmq_backend", "ZmqBackend", "pyzmq"),
    "nccl": ("synkhronos.comm.nccl_backend", "NcclBackend", "cupy-cuda12x"),
    "mpi": ("synkhronos.comm.mpi_backend", "MpiBackend", "mpi4py"),
}


def backend_names():
    """Return the names accepted by ``get_backend``."""
    return tuple(_BACKENDS)


def get_backend(name):
    """Return the backend class registered under ``name``.

    Raises:
        ValueError: unknown name.
        BackendUnavailableError: the backend's package is not installed.
    """
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(_BACKENDS)}; got {name!r}")
    module, cls, package = _BACKENDS[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the {name} backend needs the package {package}: pip install {package}") from exc
    return getattr(mod, cls)


def choose_backend(device, n_parallel, n_gpus, cluster=False):
    """Return the name of the backend a run uses: ``SYNK_BACKEND``, else the device's default.

    A cluster (several MPI processes) always takes the MPI backend, which
    moves bytes inside each machine through shared memory (GPU mode too, for
    now: NCCL does not yet span machines here).

    GPU mode takes NCCL when every rank has a GPU of its own and CuPy with
    NCCL is installed; otherwise (a WARNING says why) shared memory, as CPU
    mode does.
    """
    if cluster:
        return "mpi"
    name = os.environ.get("SYNK_BACKEND")
    if name == "mpi":
        raise ValueError("SYNK_BACKEND=mpi: the MPI backend serves clusters, started with "
                         "mpiexec -n N python script.py (several MPI processes)")
    if name:
        return name
    if device != "gpu":
        return "shm"
    why = devices.nccl_unavailable(n_parallel, n_gpus)
    if why:
        logger.warning("NCCL not used (%s); GPU collectives go through host memory", why)
        return "shm"
    return "nccl"
