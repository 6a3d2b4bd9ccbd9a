"""GPU discovery and selection (without a CUDA context in the master), and device arrays:
where they live, and handing them between JAX, CuPy and NumPy (DLPack, zero-copy on the device)."""

import logging
import os
import shutil
import subprocess
import sys

import numpy as np

from ..errors import BackendUnavailableError

logger = logging.getLogger(__name__)


def count_gpus():
    """Return the number of NVIDIA GPUs visible, asking NVML or nvidia-smi.

    Neither creates a CUDA context, so forking afterwards stays safe.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    n = _count_nvml()
    if n is None:
        n = _count_smi()
    if visible is not None:
        n = min(n, len([v for v in visible.split(",") if v.strip()]))
    return n


def _count_nvml():
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver here: nvidia-smi will not find one either
        return None
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


def _count_smi():
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if out.returncode != 0:
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def cuda_in_use():
    """Return what already initialised CUDA in this process, or None.

    A child forked after CUDA (or JAX's GPU backend) initialised cannot use
    the GPU, so ``fork()`` refuses to go on in GPU mode.
    """
    if jax_initialised():
        return "JAX"
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return "torch.cuda"
        except Exception:  # noqa: BLE001
            pass
    if _pid_has_gpu_context(os.getpid()):
        return "a CUDA library (this process holds a GPU context)"
    return None


def jax_initialised():
    """Return True if JAX has started a backend in this process.

    A started backend owns thread pools; a forked child inherits the backend
    but not its threads, and its first JAX computation hangs.  Importing JAX
    alone starts nothing.
    """
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except Exception:  # noqa: BLE001 - a JAX without this internal: assume nothing started
        return False
    return bool(getattr(xla_bridge, "_backends", None))


def keep_jax_on_cpu():
    """Make JAX use the CPU in this process and the ones it forks; return the undo.

    Leaves a user's own JAX_PLATFORMS alone, and a JAX already started.
    """
    if os.environ.get("JAX_PLATFORMS") is not None or jax_initialised():
        return lambda: None
    os.environ["JAX_PLATFORMS"] = "cpu"  # read when JAX is imported
    jax = sys.modules.get("jax")
    before = None
    if jax is not None:  # imported already: its config has read the environment
        before = jax.config.jax_platforms
        jax.config.update("jax_platforms", "cpu")

    def undo():
        os.environ.pop("JAX_PLATFORMS", None)
        if jax is not None and not jax_initialised():
            jax.config.update("jax_platforms", before)
    return undo


def _pid_has_gpu_context(pid):
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001
        return False
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid:
                    return True
        return False
    except Exception:  # noqa: BLE001
        return False
    finally:
        pynvml.nvmlShutdown()


def device_for_rank(rank, n_gpus):
    """Return the GPU index rank ``rank`` uses (round robin when ranks outnumber GPUs)."""
    return rank % n_gpus


def visible_ids(n_gpus):
    """Return the device ids this process may use, as CUDA_VISIBLE_DEVICES names them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [v.strip() for v in visible.split(",") if v.strip()][:n_gpus]
    return [str(i) for i in range(n_gpus)]


def select_device(device_id, ranks_per_gpu):
    """Make this process see only GPU ``device_id``; call before any CUDA library starts.

    Also keeps JAX from preallocating most of the GPU when several ranks share it.
    """
    os.environ["CUDA_VISIBLE_DEVICES"] = device_id
    if ranks_per_gpu > 1:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION",
                              f"{0.7 / ranks_per_gpu:.2f}")


def is_jax_array(value):
    """Return True if ``value`` is a JAX array (without importing JAX)."""
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(value, jax.Array)


def is_cupy_array(value):
    """Return True if ``value`` is a CuPy array (without importing CuPy)."""
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(value, cupy.ndarray)


def uses_jax(fn):
    """Return True if the compiled PyTensor function ``fn`` runs on PyTensor's JAX backend."""
    known = getattr(fn, "uses_jax", None)   # a function not built yet knows (functions/deferred.py)
    if known is not None:
        return known
    return type(fn.maker.linker).__name__ == "JAXLinker"


def wait(values, fetch=()):
    """Return once JAX finished computing ``values`` and ``fetch`` (lists; other arrays pass).

    The JAX arrays in ``fetch`` start their copies to the host first: the
    caller reads them next, and a copy queued behind the computation is
    waited for in the same round trip (on an H200 each wait cost 0.2-0.5 ms,
    bench/gpu.py --profile).
    """
    jax = sys.modules.get("jax")
    if jax is None:
        return
    for r in fetch:
        if isinstance(r, jax.Array):
            r.copy_to_host_async()
    jax.block_until_ready(list(fetch) + values if fetch else values)


def to_jax(value):
    """Return ``value`` as a JAX array on this process's default device.

    JAX arrays come back as they are; other device arrays (CuPy) are wrapped
    without a copy through DLPack; NumPy arrays are copied, since they may be
    views into communication buffers that the next collective overwrites.
    A NumPy array of up to 1 MiB is first copied on the host, and JAX reads
    that private copy when it likes (no wait); a larger one is copied by JAX
    and waited for, as is a DLPack hand-over, after which JAX does not keep
    the source alive for a copy.
    """
    import jax
    import jax.numpy as jnp

    if is_jax_array(value):
        return value
    if type(value) is np.ndarray:
        if value.nbytes <= _OWN_COPY_BYTES:
            # A copy of our own, which nothing else writes: JAX may read it after
            # returning, so no wait for the transfer (0.1-0.2 ms on a GPU).
            return jax.device_put(np.array(value, copy=True))
        out = jnp.array(value, copy=True)
    else:
        out = jnp.from_dlpack(value)
    out.block_until_ready()
    return out


_OWN_COPY_BYTES = 1 << 20   # below this an extra host copy costs less than a wait


def to_host(value):
    """Return ``value`` as a NumPy array: itself, or one device-to-host copy."""
    if isinstance(value, np.ndarray) and not is_cupy_array(value):
        return value
    if is_cupy_array(value):
        return value.get()  # CuPy refuses implicit conversion by np.asarray
    return np.asarray(value)


def to_cupy(value):
    """Return ``value`` as a CuPy array on this rank's GPU, for NCCL.

    JAX arrays are wrapped without a copy through DLPack, after their
    computation finished: NCCL runs on its own stream, which knows nothing of
    JAX's.  The result aliases JAX's buffer, which JAX assumes immutable, so
    it must only be read.  NumPy arrays are copied to the device.
    """
    cupy = import_cupy()[0]
    if isinstance(value, cupy.ndarray):
        return value
    if type(value) is np.ndarray:
        return cupy.asarray(value)
    if is_jax_array(value):
        value.block_until_ready()
    return cupy.from_dlpack(value)


def nccl_unavailable(n_parallel, n_gpus):
    """Return why NCCL cannot serve a run of ``n_parallel`` ranks on ``n_gpus`` GPUs, or ""."""
    if n_parallel > n_gpus:
        return (f"{n_parallel} ranks share {n_gpus} GPU{'s' if n_gpus > 1 else ''}; "
                "NCCL needs one GPU per rank")
    try:
        import_cupy()
    except BackendUnavailableError as exc:
        return str(exc)
    return ""


def import_cupy():
    """Return ``(cupy, cupy.cuda.nccl)``.

    Importing CuPy and its NCCL bindings creates no CUDA context.

    Raises:
        BackendUnavailableError: CuPy, or its NCCL support, is not installed.
    """
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as exc:
        raise BackendUnavailableError(
            "the nccl backend needs the package cupy with NCCL: pip install cupy-cuda12x "
            f"nvidia-nccl-cu12 (or synkhronos[gpu]); importing it failed: {exc}") from exc
    if not getattr(nccl, "available", True):
        # CuPy imports its NCCL module even when it found no NCCL library.
        raise BackendUnavailableError(
            "the nccl backend needs NCCL, which cupy did not find: pip install nvidia-nccl-cu12")
    return cupy, nccl
