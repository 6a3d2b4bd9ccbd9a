"""GPU discovery without creating a CUDA context in the calling process."""

import logging
import shutil
import subprocess

logger = logging.getLogger(__name__)


def count_gpus():
    """Return the number of NVIDIA GPUs visible, asking NVML or nvidia-smi.

    Neither creates a CUDA context, so forking afterwards stays safe.
    """
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            try:
                return int(pynvml.nvmlDeviceGetCount())
            finally:
                pynvml.nvmlShutdown()
        except Exception:  # no driver: fall through to nvidia-smi, then to zero
            pass
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
