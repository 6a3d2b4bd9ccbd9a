"""How ``import synkhronos`` chooses floatX (synkhronos/floatx.py): each case in a fresh process."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _floatx(tmp_path, code, flags=None):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTENSOR_FLAGS", "THEANO_FLAGS")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if flags:
        env["PYTENSOR_FLAGS"] = flags
    code = textwrap.dedent(code) + "\nimport pytensor\nprint('FLOATX', pytensor.config.floatX)\n"
    script = tmp_path / "script.py"   # a file: its source says where floatX was set
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split("FLOATX", 1)[1].strip()


def test_default_is_float32_for_the_original_examples(tmp_path):
    assert _floatx(tmp_path, "import synkhronos") == "float32"


def test_flags_stand(tmp_path):
    assert _floatx(tmp_path, "import synkhronos", flags="floatX=float64") == "float64"


def test_float64_set_in_code_before_import_stands(tmp_path):
    assert _floatx(tmp_path, """
        import pytensor
        pytensor.config.floatX = "float64"
        import synkhronos
    """) == "float64"


def test_float16_set_in_code_stands(tmp_path):
    assert _floatx(tmp_path, """
        import pytensor
        pytensor.config.floatX = "float16"
        import synkhronos
    """) == "float16"


def _has_pymc():
    import importlib.util
    return importlib.util.find_spec("pymc") is not None


@pytest.mark.skipif(not _has_pymc(), reason="PyMC is not installed")
def test_pymc_before_or_after_keeps_float64(tmp_path):
    assert _floatx(tmp_path, "import pymc\nimport synkhronos") == "float64"
    assert _floatx(tmp_path, "import synkhronos\nimport pymc") == "float64"


@pytest.mark.skipif(not _has_pymc(), reason="PyMC is not installed")
def test_asking_whether_pymc_is_there_changes_nothing(tmp_path):
    # nutpie and test suites probe with importlib.util.find_spec; only the import counts.
    assert _floatx(tmp_path, """
        import importlib.util
        import synkhronos
        assert importlib.util.find_spec("pymc") is not None
        """) == "float32"
    assert _floatx(tmp_path, """
        import importlib.util
        import synkhronos
        importlib.util.find_spec("pymc")
        import pymc
        """) == "float64"


@pytest.mark.skipif(not _has_pymc(), reason="PyMC is not installed")
def test_explicit_float32_stands_when_pymc_comes_later(tmp_path):
    assert _floatx(tmp_path, """
        import synkhronos, pytensor
        pytensor.config.floatX = "float32"
        import pymc
    """) == "float32"


@pytest.mark.skipif(not _has_pymc(), reason="PyMC is not installed")
@pytest.mark.timeout(300)
def test_pytensor_loading_pymc_from_its_cache_changes_nothing(tmp_path):
    # A C compile reads the compile cache's keys, which import PyMC where PyMC once
    # compiled: a program without PyMC keeps float32 all the same.
    flags = f"base_compiledir={tmp_path / 'cache'}"
    _floatx(tmp_path, """
        import pymc as pm
        import pytensor
        with pm.Model() as m:
            pm.Normal("y", pm.Normal("mu"), pm.HalfNormal("s"), observed=[0.1, 0.2])
        # Compiled as plain PyTensor: PyMC's parameter checks stay, C Ops of PyMC's own.
        f = pytensor.function(m.value_vars, m.logp(), mode="CVM")
        f(*m.initial_point().values())
        """, flags)
    got = _floatx(tmp_path, """
        import sys
        import numpy as np
        import pytensor
        import pytensor.tensor as pt
        import synkhronos
        x = pt.vector("x")
        pytensor.function([x], x * 2, mode="CVM")(np.ones(2, pytensor.config.floatX))
        assert "pymc" in sys.modules, "the cache did not load PyMC: the case did not happen"
        """, flags)
    assert got == "float32"


@pytest.mark.skipif(_has_pymc(), reason="needs an environment without PyMC")
def test_probing_for_a_missing_pymc_changes_nothing(tmp_path):
    assert _floatx(tmp_path, """
        import synkhronos
        try:
            import pymc
        except ImportError:
            pass
    """) == "float32"
