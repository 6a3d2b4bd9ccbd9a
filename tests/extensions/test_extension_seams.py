"""The extensions are clients of the public API: what they import of the library is pinned here.

An extension imports ``synkhronos`` (the names of its ``__all__`` and its public modules),
other extensions, and of the library's internals only the seams below, each with the
reason the public API does not serve it.  A new need either becomes public or is
declared here, with its reason.  Checked on the source (imports inside functions too).
"""

import ast
from pathlib import Path

import pytest

import synkhronos
import synkhronos.extensions

EXT = Path(synkhronos.extensions.__file__).parent
PACKAGE_ROOT = EXT.parent.parent
MODULES = sorted(EXT.rglob("*.py"))
PUBLIC = set(synkhronos.__all__) | set(synkhronos._PUBLIC_MODULES) | {"__version__"}

# Every extension may import these: what the public API has no call for, by design.
ANYWHERE = {
    "synkhronos.compat": "the one place that knows which PyTensor is installed; the extensions "
                         "build PyTensor graphs and Ops on every supported version",
    "synkhronos.import_hooks": "registrations with PyTensor's JAX backend once it loads, which "
                               "the extensions' Ops and PyMC's erfcx make without importing jax",
}

# An extension module (path under extensions/) -> {what it imports: why the public API lacks it}.
SEAMS = {
    "train.py": {
        "synkhronos.functions.overlap.OverlappedStep":
            "overlap=True's step is a command every rank runs (a runtime handler), so it lives "
            "with the commands in functions/",
        "synkhronos.inputs.rank_rows.normalize_batch":
            "the serial twin selects exactly the rows batch= selects in a data-parallel call",
        "synkhronos.inputs.rank_rows.RowRange":
            "the kind of selection normalize_batch returns (a range, else an index)",
        "synkhronos.inputs.conditioning.check_bool":
            "weighted= and overlap= refused as synk.function's flags are (no truthiness)",
        "synkhronos.comm.compressed.check_16bit":
            "all_reduce_dtype= checked as synk.all_reduce(dtype=) checks it, before any "
            "function is built",
    },
    "pymc/internals.py": {
        "synkhronos.runtime.process_setup.trim_heap":
            "dp.sample gives what PyMC's set-up freed back to the system around the chains "
            "(glibc's malloc_trim, bound once by the runtime)",
        "synkhronos.runtime.state.get_runtime":
            "pm.sample's warning asks whether this process is a forked master: a read that "
            "no public call makes without taking the call lock or admitting machines",
    },
    "pymc/master_cores.py": {
        "synkhronos.runtime.state.get_runtime":
            "where splitting would not gain, pm.sample runs on the cores the master had before "
            "fork() pinned it: the set fork() saved (Processes.unpinned), which no public call "
            "returns",
    },
    "pymc/trials.py": {
        "synkhronos.runtime.process_setup.fork_quietly":
            "a child compiles and times the rank's graph in C on the ranks' idle cores while "
            "the master compiles it in Numba: a helper process of ours, as the runtime forks its own",
        "synkhronos.runtime.liveness.stop_process":
            "that child, stuck past its bound, is killed and reaped as the runtime ends its own",
    },
    "pymc/modes.py": {
        "synkhronos.runtime.devices.jax_initialised":
            "JAX is measured only where no JAX backend started in the master (the workers and "
            "that child, forked from it, would hang at their first JAX call): the runtime's own "
            "test, which fork() applies to its workers",
        "synkhronos.functions.measures.MeasureFile":
            "the mode measured is kept on disk for the next run as the library keeps its own "
            "timed choices (how many chunks a call is cut into), in one file format",
        "synkhronos.functions.measures.digest":
            "its key: the graph, the libraries and the machine, as the library keys its own",
        "synkhronos.functions.measures.graph_text":
            "the graph in that key, printed as the library prints its own",
    },
    "pymc/decision.py": {
        "synkhronos.functions.measures.MeasureFile":
            "a measured decision is kept on disk for the next run of the model, in the file "
            "format of the library's own kept measurements",
        "synkhronos.functions.measures.digest":
            "its key: the graph, the libraries and the machine, as the library keys its own",
        "synkhronos.functions.measures.graph_text":
            "the rank's graph in that key, printed as the library prints its own",
    },
    "pymc/calls.py": {
        "synkhronos.functions.build.function_at_first_call":
            "a model's graphs are built and compiled when first called, not in data_parallel() "
            "and distribute(): dp.sample may not split at all, only several chains call the "
            "graphs at many positions, and only the mode measured fastest is built on the "
            "ranks; no public synk.function argument defers a build",
        "synkhronos.functions.aside.build_while":
            "the workers build the first mode's graph while the master measures the modes "
            "(its own compile of that graph), where their cores would idle: no public call "
            "builds a function without calling it",
        "synkhronos.functions.aside.adopt":
            "the master runs the function it compiled and timed for the mode kept, not "
            "compiling the same graph again at the first call",
        "synkhronos.functions.deferred.Lazy":
            "the graphs at many positions (vectorised, a Scan) are themselves made at their "
            "first call, in each process: 0.1-0.3 s a graph in data_parallel() otherwise",
    },
}


def _imports(tree, path):
    """Yield (line, dotted name) for each name imported by ``tree``, the source of ``path``."""
    package = ".".join(path.parent.relative_to(PACKAGE_ROOT).parts)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module
            if node.level:
                parts = package.split(".")
                mod = ".".join(p for p in (".".join(parts[:len(parts) - node.level + 1]), mod) if p)
            yield from ((node.lineno, f"{mod}.{a.name}") for a in node.names)


def _public_reads(tree):
    """Yield (line, name) for each attribute read of ``import synkhronos`` (``synk.X``)."""
    bound = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
             for a in n.names if a.name == "synkhronos"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in bound:
            yield node.lineno, node.attr


def _allowed(name, rel):
    if not name.startswith("synkhronos.") or name.startswith("synkhronos.extensions."):
        return True
    head = name.split(".")[1]
    if (name.count(".") == 1 and head in PUBLIC) or head in synkhronos._PUBLIC_MODULES:
        return True
    return name in ANYWHERE or name in SEAMS.get(rel, {})


def _violations(source, path):
    rel = path.relative_to(EXT).as_posix()
    tree = ast.parse(source)
    bad = [f"line {n}: imports {name}" for n, name in _imports(tree, path)
           if not _allowed(name, rel)]
    bad += [f"line {n}: reads synk.{attr}" for n, attr in _public_reads(tree) if attr not in PUBLIC]
    return bad


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(EXT).as_posix())
def test_an_extension_imports_only_the_public_api_and_declared_seams(path):
    bad = _violations(path.read_text(), path)
    assert bad == [], (f"{path.relative_to(EXT)} reaches into the library beyond the public API: "
                       f"{bad}; make it public or declare the seam in {Path(__file__).name}")


def test_every_declared_seam_is_used():
    # A seam that is no longer needed goes from the list, so the list stays the truth.
    used = {}
    for path in MODULES:
        rel = path.relative_to(EXT).as_posix()
        used[rel] = {name for _, name in _imports(ast.parse(path.read_text()), path)}
    everywhere = set().union(*used.values())
    assert [n for n in ANYWHERE if n not in everywhere] == []
    assert {rel: [n for n in names if n not in used.get(rel, ())]
            for rel, names in SEAMS.items()} == {rel: [] for rel in SEAMS}


def test_the_check_sees_a_violation():
    path = EXT / "pymc" / "model.py"
    src = ("import synkhronos as synk\nfrom ...runtime.state import require_forked\n"
           "from ...inputs import data_object\nfrom ... import ingraph, compat, errors\n"
           "synk.function\nsynk.runtime\n")
    assert _violations(src, path) == [
        "line 2: imports synkhronos.runtime.state.require_forked",
        "line 3: imports synkhronos.inputs.data_object",
        "line 4: imports synkhronos.errors",
        "line 6: reads synk.runtime"]
    # The same seam elsewhere is not allowed: seams are per module.
    assert _violations("from ...runtime.state import get_runtime\n", path) != []
    assert _violations("from ..inputs.rank_rows import normalize_batch\n", EXT / "train.py") == []
