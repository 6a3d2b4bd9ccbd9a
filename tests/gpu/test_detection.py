"""GPU detection and device selection (GPU machines only).

Every body runs in a forked child (tests/helpers/child.py): GPU mode must fork from a
process in which neither CUDA nor JAX ever ran, and the pytest process stays so.
"""

import os
import shutil
import subprocess

import pytest

import synkhronos as synk
from helpers import child
from helpers.gpu_env import N_GPUS, needs_gpu
from synkhronos.runtime.state import get_runtime

pytestmark = needs_gpu


def test_count_matches_nvidia_smi():
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("nvidia-smi not on PATH")
    out = subprocess.run([smi, "-L"], capture_output=True, text=True, check=True).stdout
    listed = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        listed = min(listed, len([v for v in visible.split(",") if v.strip()]))
    assert N_GPUS == listed


def _own_device(rt):
    """Every rank: it sees exactly its GPU, and JAX computes there."""
    import jax
    import jax.numpy as jnp

    assert os.environ["CUDA_VISIBLE_DEVICES"] == rt.config.gpu_ids[rt.place.rank % rt.config.n_gpus]
    devices = jax.devices()
    assert len(devices) == 1 and devices[0].platform == "gpu", devices
    assert float(jnp.arange(4.0).sum()) == 6.0


def _case_gpu_mode_by_default():
    run_all = child.on_every_rank()
    n = synk.fork()
    rt = get_runtime()
    assert rt.config.device == "gpu" and n == N_GPUS and rt.config.n_gpus == N_GPUS
    run_all(_own_device)


def test_fork_picks_gpu_mode_and_one_gpu_per_rank():
    child.run(_case_gpu_mode_by_default)


def _case_master_rank_picks_its_gpu():
    run_all = child.on_every_rank()
    synk.fork(N_GPUS, use_gpu=True, master_rank=N_GPUS - 1)
    run_all(_own_device)


def test_master_rank_picks_the_masters_gpu():
    child.run(_case_master_rank_picks_its_gpu)


def _case_refuses_after_jax():
    import jax.numpy as jnp

    jnp.ones(2).block_until_ready()                # JAX starts CUDA in this process
    with pytest.raises(synk.SynkStateError, match="JAX"):
        synk.fork()
    assert get_runtime() is None
    synk.fork(1, use_gpu=False)                    # CPU mode still works
    assert get_runtime().config.device == "cpu"


def test_fork_refuses_after_jax_started_cuda():
    child.run(_case_refuses_after_jax)


def _case_cpu_mode_on_request():
    synk.fork(2, use_gpu=False)
    assert get_runtime().config.device == "cpu"


def test_use_gpu_false_gives_cpu_mode():
    child.run(_case_cpu_mode_on_request)
