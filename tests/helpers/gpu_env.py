"""What the GPU tests need, and the skip marks that keep them quiet without it."""

import importlib.util

import pytest

from synkhronos.runtime import devices

N_GPUS = devices.count_gpus()  # NVML or nvidia-smi: no CUDA context in the pytest process

# Where device values must live.  test_jax_mode.py runs these cases in a GPU
# mode simulated on the CPU (a faked GPU count, CuPy stand-in) and sets "cpu".
PLATFORM = "gpu"

needs_gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(N_GPUS == 0, reason="needs an NVIDIA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                       reason="needs jax with CUDA (pip install synkhronos[gpu])"),
    pytest.mark.timeout(600),
]

needs_cupy = pytest.mark.skipif(importlib.util.find_spec("cupy") is None,
                                reason="needs cupy with NCCL (pip install synkhronos[gpu])")
