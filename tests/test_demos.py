"""The demos run as scripts and pass their own asserts; MNIST in a short configuration."""

import gzip
import importlib.util
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMOS = os.path.join(ROOT, "demos")
SCRIPT_TIMEOUT_S = 110    # below pytest-timeout's 120 s, so a hang reports its output


def run(script, *args, timeout=SCRIPT_TIMEOUT_S):
    """Run a demo script; return its stdout, failing with its output if it fails."""
    cmd = [sys.executable, os.path.join(DEMOS, script), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize("script,n_parallel", [
    ("demo_1.py", 3), ("demo_2.py", 2), ("demo_3.py", 3), ("demo_4.py", 3), ("demo_5.py", 2),
])
def test_walkthrough(script, n_parallel):
    out = run(script, "--n-parallel", n_parallel)
    assert "All assertions passed." in out


def accuracies(out):
    return [float(a) for a in re.findall(r"test accuracy (\d+\.\d+)%", out)]


def test_mnist_cpu_data_default_digits():
    # Small batches: enough steps in two epochs to learn (the default is 512 for speed).
    out = run("mnist/train_mnist_cpu_data.py", "--epochs", "2", "--batch-size", "128",
              "--no-progress", "--serial-epochs", "1")
    acc = accuracies(out)
    assert len(acc) >= 4                       # 2 data-parallel epochs, 1 + 1 serial
    assert acc[1] > 85.0, out                  # learns: the digits are easy
    assert re.search(r"speedup \d+\.\d+x", out), out
    # The speedup comes with the idle cores measured before each timed phase, or a warning.
    assert "cores idle before each timed phase" in out or "WARNING: the machine was busy" in out


def test_speedup_warns_when_the_machine_was_busy(capsys):
    sys.path.insert(0, os.path.join(DEMOS, "mnist"))
    import common

    class Log:
        def __init__(self, label, idle):
            self.label, self.idle = label, idle

    common.warn_if_busy([(Log("2 ranks", 0.6), 2), (Log("serial, 1 thread", 1.9), 1)], 2)
    out = capsys.readouterr().out
    assert "WARNING: the machine was busy: 0.6 of 2 cores were idle before the '2 ranks'" in out
    assert "serial, 1 thread'" not in out       # that phase had its core
    common.warn_if_busy([(Log("2 ranks", 1.95), 2)], 2)
    assert "WARNING" not in capsys.readouterr().out
    idle = common.idle_cores(0.2)
    assert idle is None or 0 <= idle <= len(os.sched_getaffinity(0)) + 0.01


def write_idx(path, array):
    """Write an array as a gzipped IDX file (the MNIST format)."""
    codes = {np.dtype(np.uint8): 0x08}
    header = struct.pack(">HBB", 0, codes[array.dtype], array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.tobytes())


@pytest.fixture(scope="module")
def fake_mnist(tmp_path_factory):
    """Tiny IDX files: 28x28 images whose class is the bright row band."""
    d = tmp_path_factory.mktemp("mnist")
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 300), ("t10k", 100)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
        for i, k in enumerate(labels):
            images[i, 2 * k + 4:2 * k + 6] = 255
        write_idx(d / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(d / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return d


def test_mnist_gpu_data_idx_files(fake_mnist):
    out = run("mnist/train_mnist_gpu_data.py", "--data", fake_mnist, "--epochs", "2",
              "--hidden", "64", "--batch-size", "30", "--n-parallel", "3", "--no-progress",
              "--serial-epochs", "1")
    assert "300 train / 100 test images" in out
    assert "training rows per rank: [100, 100, 100]" in out
    assert accuracies(out)[1] > 80.0, out


def test_mnist_serial_npz(fake_mnist, tmp_path):
    sys.path.insert(0, os.path.join(DEMOS, "mnist"))
    try:
        import common
        x_tr, y_tr, x_te, y_te, _ = common.load_data(str(fake_mnist))
    finally:
        sys.path.remove(os.path.join(DEMOS, "mnist"))
    assert x_tr.shape == (300, 784) and x_tr.dtype == np.float32 and x_tr.max() == 1.0
    path = tmp_path / "mnist.npz"
    np.savez(path, x_train=(x_tr * 255).astype(np.uint8).reshape(-1, 28, 28), y_train=y_tr,
             x_test=(x_te * 255).astype(np.uint8).reshape(-1, 28, 28), y_test=y_te)
    out = run("mnist/train_mnist_serial.py", "--data", path, "--epochs", "2", "--hidden", "64",
              "--batch-size", "30", "--no-progress")
    assert "mnist.npz: 300 train / 100 test images" in out
    assert accuracies(out)[-1] > 80.0, out


def test_resnet50_layout():
    """The default-free build is ResNet-50: 25,557,032 parameters for 1000 classes."""
    spec = importlib.util.spec_from_file_location("train_resnet",
                                                  os.path.join(DEMOS, "resnet", "train_resnet.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.ResNet(50, 64, 1000)
    assert sum(p.get_value().size for p in model.params) == 25_557_032
    assert len(model.blocks) == 16 and len(model.bns) == 53

    import pytensor.tensor as pt
    small = mod.ResNet(14, 4, 10)
    x = pt.tensor4("x", shape=(None, 32, 32, 3))
    assert small.forward(x).type.shape[1] == 10
    assert len(small.bn_updates()) == 2 * len(small.bns)


TINY_RESNET = ("--depth", "14", "--width", "4", "--image-size", "16", "--batch-size", "16",
               "--n-images", "64", "--steps", "2", "--warmup", "1", "--n-parallel", "2")


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax")
@pytest.mark.timeout(400)
@pytest.mark.slow
def test_resnet_jax_mode_matches_serial_twin():
    """GPU mode's code path on the CPU: data-parallel JAX follows the serial JAX twin."""
    out = run("resnet/train_resnet.py", *TINY_RESNET, "--mode", "JAX", timeout=380)
    assert "mode JAX" in out and "speedup" in out, out
    diff = float(re.search(r"largest difference (\S+);", out).group(1))
    assert diff < 1e-3, out                    # float32 throughout
    bn = float(re.search(r"statistics differ by (\S+)", out).group(1))
    assert bn < 1e-4, out


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_resnet_default_mode():
    """CPU mode (Numba kernels); on a cold compile cache this compiles for minutes."""
    out = run("resnet/train_resnet.py", *TINY_RESNET, "--no-serial", timeout=580)
    assert re.search(r"data-parallel \(2 ranks\): \d+\.\d images/s", out), out
