"""Communication backends: one name-to-class table, imported on demand."""

import importlib

from ..errors import BackendUnavailableError

_BACKENDS = {
    "shm": ("synkhronos.comm.shm_backend", "ShmBackend", None),
    "zmq": ("synkhronos.comm.zmq_backend", "ZmqBackend", "pyzmq"),
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
