"""GPU discovery and selection, without creating a CUDA context in the master."""

import logging
import os
import shutil
import subprocess
import sys

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
    except Exception:  # no driver here: nvidia-smi will not find one either
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
    if "jax" in sys.modules:
        try:
            from jax._src import xla_bridge
            if getattr(xla_bridge, "_backends", None):
                return "JAX"
        except Exception:  # a JAX without this internal: fall back to the checks below
            pass
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                return "torch.cuda"
        except Exception:
            pass
    if _pid_has_gpu_context(os.getpid()):
        return "a CUDA library (this process holds a GPU context)"
    return None


def _pid_has_gpu_context(pid):
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        return False
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid:
                    return True
        return False
    except Exception:
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
