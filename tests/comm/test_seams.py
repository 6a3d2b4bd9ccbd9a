"""Backends know arrays, not PyTensor and not the Runtime (STYLE.md): checked on the source."""

import ast
from pathlib import Path

import pytest

import synkhronos.comm

COMM = Path(synkhronos.comm.__file__).parent
MODULES = sorted(COMM.glob("*.py"))
# What sits above the backends: they never import it.
ABOVE = ("synkhronos.runtime.state", "synkhronos.inputs", "synkhronos.functions",
         "synkhronos.variables", "synkhronos.cluster", "synkhronos.process", "pytensor")


def _imports(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "synkhronos" if node.level == 2 else "synkhronos.comm" if node.level else ""
            mod = ".".join(p for p in (base, node.module or "") if p)
            yield mod
            yield from (f"{mod}.{a.name}" for a in node.names)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_a_backend_module_imports_nothing_above_it(path):
    tree = ast.parse(path.read_text())
    bad = [m for m in _imports(tree) if m.startswith(ABOVE)]
    assert bad == [], f"{path.name} imports {bad}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_a_backend_module_reads_no_runtime_and_no_shared_variable(path):
    tree = ast.parse(path.read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
              for a in n.names}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not names & {"rt", "Runtime", "get_runtime"}, path.name
    assert not attrs & {"rt", "shareds", "registry", "container", "get_value", "set_value"}, path.name


def test_the_check_sees_a_violation(tmp_path):
    src = "from ..runtime.state import Runtime\n\ndef f(rt):\n    return rt.registry.shareds[0]\n"
    tree = ast.parse(src)
    assert any(m.startswith(ABOVE) for m in _imports(tree))
    assert "rt" in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert "shareds" in {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
