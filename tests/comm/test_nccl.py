"""The NCCL path without processes or GPUs: tables, headers, when NCCL is chosen, missing CuPy.

The end-to-end runs on a CPU stand-in for CuPy are in test_jax_mode.py; real
GPUs in tests/gpu/.
"""

import logging
import subprocess
import sys
import types

import numpy as np
import pytest

from helpers import fake_cupy
from synkhronos.runtime import devices
from synkhronos.comm import choose_backend, get_backend
from synkhronos.comm import nccl_backend, nccl_wire
from synkhronos.comm.base import Wiring
from synkhronos.errors import BackendUnavailableError


@pytest.fixture
def cupy_stub():
    """The CPU stand-in as ``cupy`` for this test only."""
    saved = {k: sys.modules.get(k) for k in ("cupy", "cupy.cuda", "cupy.cuda.nccl")}
    nccl = fake_cupy.install()
    yield nccl
    for k, v in saved.items():
        if v is None:
            sys.modules.pop(k, None)
        else:
            sys.modules[k] = v


@pytest.fixture
def no_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError


def _wiring(n_parallel=2):
    ranks = types.SimpleNamespace(rank=0, n_parallel=n_parallel, master_rank=0)
    return Wiring(ranks=ranks, machine=ranks, spin_s=0.0, prefix="/synk_test_", master_pid=0,
                  max_dim=16, new_name=None, remove_after_crash=None)


# ---- tables -------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["avg", "sum", "prod", "max", "min"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_every_op_on_floats(op, dtype):
    nop, ndt = nccl_wire.nccl_op_name(op, dtype)
    assert nop == ("NCCL_SUM" if op == "avg" else f"NCCL_{op.upper()}")
    assert ndt == f"NCCL_{dtype.upper()}"


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int32", "uint32", "int64", "uint64"])
def test_integers_reduce_but_do_not_average(dtype):
    assert nccl_wire.nccl_op_name("sum", dtype) == ("NCCL_SUM", f"NCCL_{dtype.upper()}")
    assert nccl_wire.nccl_op_name("max", dtype)[0] == "NCCL_MAX"
    assert nccl_wire.nccl_op_name("avg", dtype) is None      # avg scales in place: floats only


@pytest.mark.parametrize("dtype", ["bool", "int16", "uint16", "complex64"])
def test_dtypes_nccl_cannot_reduce(dtype):
    for op in ("sum", "max"):
        assert nccl_wire.nccl_op_name(op, dtype) is None


def test_unknown_op():
    assert nccl_wire.nccl_op_name("mean", "float32") is None
    assert nccl_wire.nccl_op_name(None, "float32") is None


def test_constant_names_exist_in_the_stand_in(cupy_stub):
    # The stand-in copies cupy.cuda.nccl's names; every name the tables use must be there.
    names = list(nccl_wire.NCCL_OPS.values()) + list(nccl_wire.NCCL_DTYPES.values())
    for name in names + ["NCCL_UINT8"]:
        assert isinstance(getattr(cupy_stub, name), int), name


def test_header_round_trip():
    values = [np.zeros((2, 3), "float32"), np.array(1.5), np.zeros(0, "int16"),
              np.zeros((4,), "datetime64[s]")]
    hdr = nccl_wire.header(values)
    assert hdr.dtype == np.int64
    assert nccl_wire.parse_header(hdr) == [("float32", (2, 3)), ("float64", ()), ("int16", (0,)),
                                    (None, (4,))]
    assert nccl_wire.parse_header(nccl_wire.header(None)) == []
    assert nccl_wire.dtype_code("complex128") >= 0 and nccl_wire.dtype_code("U3") == -1


@pytest.mark.parametrize("uid", [
    bytes(range(128)),                                      # CuPy 14
    tuple(int(x) for x in np.arange(-64, 64)),              # CuPy 13: signed chars
], ids=["bytes", "ints"])
def test_unique_id_round_trip(uid):
    # Each CuPy's communicator takes the unique id in the form its get_unique_id gave.
    got = nccl_wire.decode_unique_id(nccl_wire.encode_unique_id(uid))
    assert type(got) is type(uid) and got == uid


def test_gpu_mode_with_a_gpu_per_rank_chooses_nccl(cupy_stub, caplog, monkeypatch):
    monkeypatch.delenv("SYNK_BACKEND", raising=False)
    with caplog.at_level(logging.WARNING, "synkhronos"):
        assert choose_backend("gpu", 2, 2) == "nccl"
    assert not caplog.records
    assert get_backend("nccl") is nccl_backend.NcclBackend


def test_cpu_mode_never_uses_nccl_and_says_nothing(cupy_stub, caplog, monkeypatch):
    monkeypatch.delenv("SYNK_BACKEND", raising=False)
    with caplog.at_level(logging.WARNING, "synkhronos"):
        assert choose_backend("cpu", 2, 0) == "shm"
    assert not caplog.records


def test_synk_backend_overrides_the_choice(cupy_stub, monkeypatch):
    monkeypatch.setenv("SYNK_BACKEND", "zmq")
    assert choose_backend("gpu", 2, 2) == "zmq"


def test_ranks_sharing_a_gpu_fall_back_with_a_warning(cupy_stub, caplog, monkeypatch):
    monkeypatch.delenv("SYNK_BACKEND", raising=False)
    with caplog.at_level(logging.WARNING, "synkhronos"):
        assert choose_backend("gpu", 2, 1) == "shm"
    assert len(caplog.records) == 1
    assert "2 ranks share 1 GPU" in caplog.records[0].getMessage()
    assert "NCCL" in caplog.records[0].getMessage()


def test_missing_cupy_falls_back_with_a_warning_naming_it(no_cupy, caplog, monkeypatch):
    monkeypatch.delenv("SYNK_BACKEND", raising=False)
    with caplog.at_level(logging.WARNING, "synkhronos"):
        assert choose_backend("gpu", 2, 2) == "shm"
    assert len(caplog.records) == 1 and "cupy" in caplog.records[0].getMessage()


class _HostStub:
    """A host backend that records what it was given, for construction tests."""

    def __init__(self, wiring):
        self.made = wiring


def test_backend_without_cupy_raises_naming_it(no_cupy):
    with pytest.raises(BackendUnavailableError, match="cupy"):
        nccl_backend.NcclBackend(_wiring(), host_backend=_HostStub)
    with pytest.raises(BackendUnavailableError, match="pip install cupy-cuda12x"):
        devices.import_cupy()


def test_cupy_without_nccl_raises_naming_nccl(cupy_stub, monkeypatch):
    monkeypatch.setattr(cupy_stub, "available", False)
    with pytest.raises(BackendUnavailableError, match="NCCL"):
        devices.import_cupy()
    assert "NCCL" in devices.nccl_unavailable(2, 2)


def test_backend_wraps_a_host_backend_and_touches_no_device_until_used(cupy_stub):
    wiring = _wiring()
    b = nccl_backend.NcclBackend(wiring, host_backend=_HostStub)
    assert isinstance(b.host, _HostStub) and b.host.made is wiring
    assert b.device_arrays and b.comm is None    # the first collective connects
    assert b._stream is None                     # no CUDA stream before fork's children use it


# ---- device arrays, host side ------------------------------------------------------------

def test_host_arrays_stay_and_device_arrays_come_back(cupy_stub):
    a = np.arange(6.0)
    assert devices.to_host(a) is a
    dev = fake_cupy.asarray(a)
    assert devices.is_cupy_array(dev) and not devices.is_cupy_array(a)
    back = devices.to_host(dev)
    assert type(back) is np.ndarray and np.array_equal(back, a)
    assert devices.to_cupy(dev) is dev
    assert devices.is_cupy_array(devices.to_cupy(a))
    assert not devices.is_jax_array(a)


def test_import_synkhronos_stays_light():
    code = ("import sys, synkhronos, synkhronos.variables.collectives; "
            "bad = [m for m in ('cupy', 'jax', 'mpi4py') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
