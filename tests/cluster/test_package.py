"""cluster/'s two worlds as the folders show them: what only machines that come and go use
is in cluster/elastic/, each package's docstring names every module's job, and the MPI world
never imports the elastic one (nor ZeroMQ, nor torch)."""

import pathlib
import subprocess
import sys

import synkhronos.cluster
import synkhronos.cluster.elastic

CLUSTER = pathlib.Path(synkhronos.cluster.__file__).parent


def _modules(folder):
    return sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")


def test_the_elastic_world_has_a_folder_of_its_own():
    root = _modules(CLUSTER)
    assert not [m for m in root if m.startswith(("elastic", "zlink", "zmq"))], root
    assert _modules(CLUSTER / "elastic") == ["door", "env", "join", "knocks", "zmq_link"]


def test_each_package_docstring_names_every_module():
    for package, folder in ((synkhronos.cluster, CLUSTER),
                            (synkhronos.cluster.elastic, CLUSTER / "elastic")):
        missing = [m for m in _modules(folder) if f"``{m}``" not in package.__doc__]
        assert not missing, (package.__name__, missing)
    assert "``elastic/``" in synkhronos.cluster.__doc__


def test_the_mpi_world_imports_nothing_of_the_elastic_one():
    code = ("import sys, synkhronos, synkhronos.cluster.rendezvous; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('zmq', 'torch') "
            "or m.startswith('synkhronos.cluster.elastic.') and m != 'synkhronos.cluster.elastic.env'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=CLUSTER.parent.parent).stdout
    assert out.strip() == "[]", out
