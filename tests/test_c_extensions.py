"""The C extensions, each checked at import against the ABI its Python expects.

A build from older sources (``git pull`` without rebuilding) must not import silently:
the error names the rebuild, ``pip install -e .``.
"""

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import synkhronos
from synkhronos import comm, runtime
from synkhronos.comm import _reduce
from synkhronos.runtime import _block

PACKAGE = Path(synkhronos.__file__).parent
EXTENSIONS = [("synkhronos.runtime._block", runtime.BLOCK_ABI),
              ("synkhronos.comm._reduce", comm.REDUCE_ABI)]


def test_each_extension_is_the_abi_its_python_expects():
    assert _block.ABI == runtime.BLOCK_ABI and _reduce.ABI == comm.REDUCE_ABI
    header = (PACKAGE / "runtime" / "_block.h").read_text()
    assert f"#define SYNK_BLOCK_ABI {runtime.BLOCK_ABI}\n" in header
    source = (PACKAGE / "comm" / "_reduce.c").read_text()
    assert f"#define SYNK_REDUCE_ABI {comm.REDUCE_ABI}\n" in source


# In a fresh interpreter, for each case: ``name`` replaced in sys.modules by a module
# running ``fake`` (or None: not built), then ``import synkhronos``; what it raised.
CASES_SCRIPT = """
import json, sys, types
said = []
for name, fake in json.loads(sys.argv[1]):
    for mod in [m for m in sys.modules if m.startswith("synkhronos")]:
        del sys.modules[mod]
    if fake is not None:
        module = types.ModuleType(name)
        exec(fake, module.__dict__)
        fake = module
    sys.modules[name] = fake
    try:
        import synkhronos  # noqa: F401
    except ImportError as exc:
        said.append("ImportError: " + str(exc))
    else:
        said.append("imported")
print(json.dumps(said))
"""


def _import_synkhronos_with(cases):
    """What ``import synkhronos`` raised in each case of ``cases`` ((name, fake source or None))."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PACKAGE.parent)] + sys.path))
    out = subprocess.run([sys.executable, "-c", CASES_SCRIPT, json.dumps(cases)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_a_stale_or_missing_build_refuses_to_import_and_names_the_rebuild():
    cases = [("synkhronos.unrelated", None)]  # the control: the fakes are what fail
    for name, abi in EXTENSIONS:
        cases += [(name, f"ABI = {abi - 1}"), (name, ""), (name, None)]  # "": older, no ABI
    said = _import_synkhronos_with(cases)
    assert said[0] == "imported"
    for (name, abi), (older, no_abi, missing) in zip(EXTENSIONS, zip(*[iter(said[1:])] * 3)):
        for text in (older, no_abi, missing):
            assert text.startswith("ImportError:") and "pip install -e ." in text, text
        assert f"{name} is a stale build (ABI {abi - 1}, these sources expect {abi})" in older
        assert f"{name} is a stale build (ABI None" in no_abi
        assert f"{name} does not import" in missing


def _compiler():
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    return cc if shutil.which(cc[0]) else None


@pytest.mark.skipif(_compiler() is None, reason="no C compiler (every install needs one)")
def test_a_reduce_built_against_another_block_refuses_to_import(tmp_path):
    # A real stale build: _reduce.c compiled against a _block.h of another ABI, then
    # loaded beside the installed _block (its capsule says which ABI it is).
    for rel in ("comm/_reduce.c", "runtime/_block.h", "_c/atomics.h"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(PACKAGE / rel, tmp_path / rel)
    header = tmp_path / "runtime" / "_block.h"
    text, n = re.subn(r"#define SYNK_BLOCK_ABI \d+", "#define SYNK_BLOCK_ABI 999", header.read_text())
    assert n == 1
    header.write_text(text)
    so = tmp_path / ("_reduce" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run(_compiler() + ["-shared", "-fPIC", "-O0", "-std=gnu11",
                                  "-I" + sysconfig.get_paths()["include"],
                                  str(tmp_path / "comm" / "_reduce.c"), "-o", str(so)],
                   check=True, timeout=120)
    spec = importlib.util.spec_from_file_location("synkhronos.comm._reduce", so)
    with pytest.raises(ImportError, match=r"ABI 999, but the installed _block is ABI \d+: "
                                          r"rebuild both with `pip install -e \.`"):
        importlib.util.module_from_spec(spec)


def test_every_c_source_rebuilds_what_includes_it():
    # setup.py's depends and the Makefile's stamps name every C file and header, so a
    # change to any of them rebuilds the extensions (pip install -e . and make).
    root = PACKAGE.parent
    sources = sorted(str(p.relative_to(root)) for p in PACKAGE.rglob("*.[ch]"))
    assert len(sources) == 4, sources
    setup = (root / "setup.py").read_text()
    makefile = (root / "Makefile").read_text()
    listed = re.search(r"^C_SOURCES := ((?:.*\\\n)*.*)$", makefile, re.M).group(1).split()
    for path in sources:
        assert f'"{path}"' in setup, path
        assert path in listed, path
