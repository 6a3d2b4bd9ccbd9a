"""The package's import graph: imports point down, so it has no cycle."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import synkhronos

PACKAGE = Path(synkhronos.__file__).parent


def _module_name(path):
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path, name):
    """(module, names) of every synkhronos import in ``path``, at module level or in functions."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update((a.name, ()) for a in node.names if a.name.startswith("synkhronos"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module
                                                                        else []))
            else:
                target = node.module or ""
            if not target.startswith("synkhronos"):
                continue
            found.add((target, tuple(a.name for a in node.names)))
    return found


def _graph():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for target, names in _imports(path, name):
            # "from . import x" imports submodule x; the package itself only for other names.
            subs = {f"{target}.{n}" for n in names} & set(modules)
            edges |= subs
            if len(subs) < len(names):
                edges.add(target)
        graph[name] = sorted(m for m in edges if m in modules and m != name)
    return graph


def _cycle(graph):
    """Return one import cycle as a list of modules, or None."""
    state = {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, stack)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in graph:
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    graph = _graph()
    assert len(graph) > 20 and "synkhronos.runtime.control" in graph["synkhronos.process"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert _cycle({"a": ["b"], "b": [], "c": ["a"]}) is None


@pytest.mark.timeout(150)
def test_extensions_are_imported_when_first_named():
    """``synkhronos.extensions`` imports none of its groups itself: the Ops register Numba
    implementations (0.35 s), which a PyMC user of ``extensions.pymc`` never needs; each
    group, and the old ``bn_ops`` path, still imports when named."""
    code = """if True:
        import sys
        import synkhronos.extensions as ext
        heavy = ("synkhronos.extensions.ops", "synkhronos.extensions.layers",
                 "synkhronos.extensions.train", "synkhronos.extensions.updates")
        assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]
        from synkhronos.extensions import make_train_function, updates
        assert updates is sys.modules["synkhronos.extensions.updates"]
        assert make_train_function is ext.train.make_train_function
        import synkhronos.extensions.bn_ops as old
        assert old is ext.ops.batch_norm and "layers" in dir(ext)
        try:
            ext.nothing
        except AttributeError as exc:
            assert "nothing" in str(exc)
        else:
            raise AssertionError("ext.nothing")
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
