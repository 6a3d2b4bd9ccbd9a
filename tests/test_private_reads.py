"""Contracts as code: no module of the package reads another module's private names.

A private name (``_x``) is its module's own business; a module that needs it
asks the owner for a method.  What this test counts, statically:

- ``obj._name`` where ``obj`` is not ``self``, ``cls`` or ``super()``, not a module
  from outside the package, and ``_name`` is defined only in other modules;
- ``from .module import _name``.

A read that must stay says why on its line (``# private read: ...``); at most
five may.
"""

import ast
import collections
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "synkhronos"
ALLOWED = 5


def _defined(trees):
    """Private name -> the modules that define it (functions, classes, self.attributes, globals)."""
    out = collections.defaultdict(set)
    for path, tree in trees.items():
        for node in ast.walk(tree):
            name = None
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = node.name
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                name = node.attr
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                name = node.id
            elif isinstance(node, ast.arg):
                name = node.arg
            if name and name.startswith("_") and not name.startswith("__"):
                out[name].add(path)
            if isinstance(node, ast.ClassDef):
                for item in node.body:  # slots and class attributes
                    if isinstance(item, ast.Assign):
                        for t in item.targets:
                            if isinstance(t, ast.Name) and t.id.startswith("_"):
                                out[t.id].add(path)
    return out


def _external_modules(tree):
    """Names bound to modules imported from outside the package (os, logging, ...)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if not a.name.startswith("synkhronos"):
                    out.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not (
                node.module or "").startswith("synkhronos"):
            for a in node.names:
                out.add(a.asname or a.name)
    return out


def private_reads():
    """Every cross-module private read in the package: (module, line, text, commented)."""
    trees = {p: ast.parse(p.read_text()) for p in PACKAGE.rglob("*.py")}
    defined = _defined(trees)
    reads = []
    for path, tree in trees.items():
        lines = path.read_text().splitlines()
        external = _external_modules(tree)
        for node in ast.walk(tree):
            hit = None
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                base = node.value
                if isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in external):
                    continue
                if isinstance(base, ast.Call) and getattr(base.func, "id", None) == "super":
                    continue
                owners = defined.get(node.attr, set())
                if owners and path not in owners:
                    hit = ast.unparse(node)
            elif isinstance(node, ast.ImportFrom) and node.level:
                names = [a.name for a in node.names if a.name.startswith("_")
                         and not a.name.startswith("__")]
                if names:
                    hit = f"from {'.' * node.level}{node.module or ''} import {', '.join(names)}"
            if hit is not None:
                line = lines[node.lineno - 1]
                reads.append((str(path.relative_to(PACKAGE)), node.lineno, hit,
                              "# private read:" in line))
    return sorted(reads)


def test_no_module_reads_another_modules_private_names():
    reads = private_reads()
    unexplained = [r[:3] for r in reads if not r[3]]
    assert unexplained == []
    assert len(reads) <= ALLOWED, reads
