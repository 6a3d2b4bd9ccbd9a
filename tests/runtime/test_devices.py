"""gpu: counting GPUs without CUDA, one GPU per rank, the environment a rank gets, and the
checks that need no device (what started CUDA, where an array lives, whether NCCL can serve).

No GPU is needed: NVML and nvidia-smi are stand-ins (a fake ``pynvml`` module, an
``nvidia-smi`` script on PATH).  Nothing here starts JAX: the pytest process forks
ranks in other tests, and a process forked after JAX started hangs.
"""

import os
import sys
import types

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

from synkhronos.runtime import devices
from synkhronos.errors import BackendUnavailableError

SMI_4_GPUS = """\
GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0a)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1b)
  MIG 3g.40gb     Device  0: (UUID: MIG-GPU-1b/1/0)
GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-3d)
GPU 3: NVIDIA H100 80GB HBM3 (UUID: GPU-4e)
"""


@pytest.fixture
def no_nvml(monkeypatch):
    """No pynvml: importing it fails, as where it is not installed."""
    monkeypatch.setitem(sys.modules, "pynvml", None)


@pytest.fixture
def smi(tmp_path, monkeypatch, no_nvml):
    """Put a fake nvidia-smi alone on PATH; call with what ``-L`` prints and its exit status."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def install(listing=SMI_4_GPUS, status=0):
        (tmp_path / "listing").write_text(listing)
        script = tmp_path / "nvidia-smi"
        # Shell builtins only: PATH holds nothing else.
        script.write_text(f'#!/bin/sh\n[ "$1" = "-L" ] || exit 9\n'
                          f'while IFS= read -r line; do echo "$line"; done < "{tmp_path}/listing"\n'
                          f"exit {status}\n")
        script.chmod(0o755)
    return install


def _fake_nvml(count=None, init_error=None):
    """A pynvml stand-in that reports ``count`` devices, or fails to start."""
    calls = []
    nvml = types.ModuleType("pynvml")

    def init():
        calls.append("init")
        if init_error is not None:
            raise init_error
    nvml.nvmlInit = init
    nvml.nvmlDeviceGetCount = lambda: count
    nvml.nvmlShutdown = lambda: calls.append("shutdown")
    nvml.calls = calls
    return nvml


# ---- counting ----------------------------------------------------------------------------

def test_count_reads_nvidia_smi_gpu_lines(smi):
    smi()
    assert devices.count_gpus() == 4                    # the MIG line is not a GPU
    smi("GPU 0: Tesla T4 (UUID: GPU-9)\n")
    assert devices.count_gpus() == 1


def test_count_is_zero_without_a_gpu(smi, monkeypatch):
    smi("", status=0)
    assert devices.count_gpus() == 0
    smi("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
        status=9)
    assert devices.count_gpus() == 0                    # no driver: exit status != 0
    monkeypatch.setenv("PATH", "/nonexistent")
    assert devices.count_gpus() == 0                    # neither NVML nor nvidia-smi


@pytest.mark.parametrize("visible", ["", "-1", "  "])
def test_count_is_zero_when_cuda_visible_devices_hides_every_gpu(smi, monkeypatch, visible):
    smi()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert devices.count_gpus() == 0


@pytest.mark.parametrize("visible, want", [("2", 1), ("1,3", 2), ("0, 1, 2,", 3),
                                           ("0,1,2,3,4,5", 4)])
def test_count_is_capped_by_cuda_visible_devices(smi, monkeypatch, visible, want):
    smi()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert devices.count_gpus() == want


def test_count_asks_nvml_first_and_shuts_it_down(smi, monkeypatch):
    smi()                                           # 4 GPUs, were nvidia-smi asked
    nvml = _fake_nvml(count=2)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert devices.count_gpus() == 2
    assert nvml.calls == ["init", "shutdown"]


def test_count_falls_back_to_nvidia_smi_when_nvml_cannot_start(smi, monkeypatch):
    smi()
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(init_error=RuntimeError("no driver")))
    assert devices.count_gpus() == 4


# ---- one GPU per rank ------------------------------------------------------------------------

def test_device_for_rank_is_round_robin():
    assert [devices.device_for_rank(r, 3) for r in range(8)] == [0, 1, 2, 0, 1, 2, 0, 1]
    assert [devices.device_for_rank(r, 1) for r in range(3)] == [0, 0, 0]
    assert [devices.device_for_rank(r, 4) for r in range(4)] == [0, 1, 2, 3]


def test_visible_ids_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.visible_ids(3) == ["0", "1", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5,7")
    assert devices.visible_ids(2) == ["3", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0a,GPU-1b")
    assert devices.visible_ids(2) == ["GPU-0a", "GPU-1b"]


def test_select_device_narrows_the_environment(monkeypatch):
    # Recorded, so the test's end puts back what was there.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    devices.select_device("2", 1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ    # one rank: JAX's default
    devices.select_device("1", 2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.35"  # 70 % shared by 2 ranks
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    devices.select_device("0", 4)
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"   # the user's own stays


# ---- what started CUDA, and JAX on the CPU -----------------------------------------------------

def _fake_jax(started):
    """Modules ``jax`` and ``jax._src.xla_bridge``; ``started``: a backend exists."""
    jax = types.ModuleType("jax")
    jax.__path__ = []
    src = types.ModuleType("jax._src")
    src.__path__ = []
    bridge = types.ModuleType("jax._src.xla_bridge")
    bridge._backends = {"cpu": object()} if started else {}
    src.xla_bridge = bridge
    jax._src = src
    updates = []

    class Config:
        jax_platforms = "before"

        def update(self, name, value):
            updates.append((name, value))
            setattr(self, name, value)
    jax.config = Config()
    jax.updates = updates
    return {"jax": jax, "jax._src": src, "jax._src.xla_bridge": bridge}


@pytest.fixture
def no_jax(monkeypatch):
    for name in [m for m in sys.modules if m == "jax" or m.startswith("jax.")]:
        monkeypatch.delitem(sys.modules, name)


def test_cuda_in_use_names_what_started_it(monkeypatch, no_jax, no_nvml):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert devices.cuda_in_use() is None
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert devices.cuda_in_use() is None
    torch.cuda.is_initialized = lambda: True
    assert devices.cuda_in_use() == "torch.cuda"
    for name, module in _fake_jax(started=True).items():
        monkeypatch.setitem(sys.modules, name, module)
    assert devices.jax_initialised()
    assert devices.cuda_in_use() == "JAX"


def test_jax_imported_is_not_jax_started(monkeypatch, no_jax):
    assert not devices.jax_initialised()
    for name, module in _fake_jax(started=False).items():
        monkeypatch.setitem(sys.modules, name, module)
    assert not devices.jax_initialised()


def test_keep_jax_on_cpu_sets_and_undoes(monkeypatch, no_jax):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    undo = devices.keep_jax_on_cpu()
    assert os.environ["JAX_PLATFORMS"] == "cpu"
    undo()
    assert "JAX_PLATFORMS" not in os.environ
    # JAX imported already: its config read the environment, so it is updated too.
    mods = _fake_jax(started=False)
    for name, module in mods.items():
        monkeypatch.setitem(sys.modules, name, module)
    undo = devices.keep_jax_on_cpu()
    assert os.environ["JAX_PLATFORMS"] == "cpu" and mods["jax"].config.jax_platforms == "cpu"
    undo()
    assert "JAX_PLATFORMS" not in os.environ and mods["jax"].config.jax_platforms == "before"


def test_keep_jax_on_cpu_leaves_the_users_choice_and_a_started_jax(monkeypatch, no_jax):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    devices.keep_jax_on_cpu()()
    assert os.environ["JAX_PLATFORMS"] == "cuda"
    monkeypatch.delenv("JAX_PLATFORMS")
    mods = _fake_jax(started=True)
    for name, module in mods.items():
        monkeypatch.setitem(sys.modules, name, module)
    devices.keep_jax_on_cpu()()
    assert "JAX_PLATFORMS" not in os.environ and mods["jax"].updates == []


# ---- arrays and NCCL -----------------------------------------------------------------------

class _CupyArray:
    """A device array as far as devices.py can tell: ``.get()`` copies it to the host."""

    def __init__(self, host):
        self.host = host

    def get(self):
        return self.host.copy()


def _fake_cupy(nccl_available=True):
    cupy = types.ModuleType("cupy")
    cupy.__path__ = []
    cupy.ndarray = _CupyArray
    cuda = types.ModuleType("cupy.cuda")
    cuda.__path__ = []
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = nccl_available
    cupy.cuda, cuda.nccl = cuda, nccl
    return {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.nccl": nccl}


def test_to_host_returns_numpy_arrays_as_they_are_and_copies_device_arrays(monkeypatch, no_jax):
    a = np.arange(6.0).reshape(2, 3)
    assert devices.to_host(a) is a
    np.testing.assert_array_equal(devices.to_host([[1, 2], [3, 4]]), [[1, 2], [3, 4]])
    assert not devices.is_jax_array(a) and not devices.is_cupy_array(a)
    for name, module in _fake_cupy().items():
        monkeypatch.setitem(sys.modules, name, module)
    dev = _CupyArray(a)
    assert devices.is_cupy_array(dev) and not devices.is_cupy_array(a)
    host = devices.to_host(dev)
    assert type(host) is np.ndarray and host is not a
    np.testing.assert_array_equal(host, a)
    assert "jax" not in sys.modules                 # asking never imports JAX


def test_nccl_needs_one_gpu_per_rank():
    assert devices.nccl_unavailable(3, 2) == "3 ranks share 2 GPUs; NCCL needs one GPU per rank"
    assert devices.nccl_unavailable(2, 1).startswith("2 ranks share 1 GPU;")


def test_nccl_needs_cupy_and_its_nccl(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(BackendUnavailableError, match="pip install cupy") as info:
        devices.import_cupy()
    assert isinstance(info.value, ImportError)
    assert "pip install cupy" in devices.nccl_unavailable(2, 2)
    mods = _fake_cupy(nccl_available=False)
    for name, module in mods.items():
        monkeypatch.setitem(sys.modules, name, module)
    assert "cupy did not find" in devices.nccl_unavailable(2, 2)
    mods["cupy.cuda.nccl"].available = True
    assert devices.nccl_unavailable(2, 2) == ""
    assert devices.import_cupy() == (mods["cupy"], mods["cupy.cuda.nccl"])


def test_uses_jax_reads_the_linker():
    x = pt.dvector("x")
    fn = pytensor.function([x], 2 * x, mode="FAST_COMPILE")
    assert not devices.uses_jax(fn)
    jax_linker = type("JAXLinker", (), {})()
    assert devices.uses_jax(types.SimpleNamespace(maker=types.SimpleNamespace(linker=jax_linker)))
