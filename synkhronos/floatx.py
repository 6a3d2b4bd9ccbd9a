"""How ``import synkhronos`` chooses PyTensor's floatX: float32 by default, any explicit choice stands.

The original Synkhronos ran on GPUs with ``floatX=float32`` and its examples
mix float32 data with ``T.matrix()``, so synkhronos makes float32 the default.
A choice the user made always stands (DESIGN decision 13):

1. floatX given in ``PYTENSOR_FLAGS``, ``THEANO_FLAGS`` or a ``.pytensorrc``;
2. floatX set in code before ``import synkhronos`` (``pytensor.config.floatX = ...``
   or ``change_flags(floatX=...)`` above the import in the importing file, a
   notebook cell or ``python -c``, or any value other than PyTensor's default
   float64); typed at an interactive prompt or piped to ``python -`` it cannot be
   read back, so say it in ``PYTENSOR_FLAGS`` there;
3. PyMC in the program: ``import pymc`` before synkhronos keeps float64; ``import
   pymc`` after it puts float64 back (PyMC users keep PyMC's precision),
   unless the user set floatX in code since ``import synkhronos``.  PyTensor's own
   import of PyMC (its compile cache's keys name PyMC's Ops) does not count; a program
   that imports PyMC only after such a compile finds it imported already and keeps
   float32 (set floatX to choose).

In every other case floatX becomes float32 and ``DEFAULTED`` says so.
"""

import importlib.machinery
import linecache
import logging
import os
import re
import sys

import pytensor

logger = logging.getLogger(__name__)

_SET_IN_CODE = re.compile(r"floatX\s*=\s*['\"]\w+['\"]")
_IMPORT = re.compile(r"(?:import|from)\s+synkhronos")
_OWN = os.path.dirname(os.path.abspath(__file__))

DEFAULTED = False
"""True while floatX is float32 because synkhronos chose it (nobody else did)."""


def _param():
    return pytensor.config._config_var_dict["floatX"]


def _chosen_by_flags():
    flags = os.environ.get("PYTENSOR_FLAGS", "") + os.environ.get("THEANO_FLAGS", "")
    return "floatX" in flags or not getattr(_param(), "is_default", True)


def _set_in_importing_code():
    """Return the ``file:line`` where the code importing synkhronos set floatX, or None.

    Reads the source above the import statement in every frame of the import
    chain outside synkhronos and importlib (what ``pytensor.config`` itself
    cannot tell: a value set in code equals the default).
    """
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path == "<string>" and "-c" in getattr(sys, "orig_argv", ()):
            # python -c "...": the program is in the command line, not in a file.
            argv = sys.orig_argv
            code = argv[argv.index("-c") + 1] if argv.index("-c") + 1 < len(argv) else ""
            above = _IMPORT.split(code, maxsplit=1)[0]
            if _SET_IN_CODE.search(above):
                return "python -c"
        elif not os.path.abspath(path).startswith(_OWN):
            # Files, and "<...>" sources that linecache knows (IPython's cells).
            for lineno in range(1, frame.f_lineno):
                if _SET_IN_CODE.search(linecache.getline(path, lineno)):
                    return f"{path}:{lineno}"
        frame = frame.f_back
    return None


class _WatchPyMC:
    """A finder that never finds: it notices ``import pymc`` and restores float64 first."""

    def find_spec(self, name, path=None, target=None):
        # Only a PyMC that is there and imported: a probe (try: import pymc, or
        # importlib.util.find_spec("pymc"), as nutpie and test suites ask) changes nothing.
        if (name == "pymc" and not _imported_by_pytensor() and not _probed()
                and importlib.machinery.PathFinder.find_spec(name, path) is not None):
            _restore_for_pymc()
        return None


_PYTENSOR = os.path.dirname(os.path.abspath(pytensor.__file__))


def _imported_by_pytensor():
    """Whether PyTensor itself is importing (its compile cache unpickles keys naming PyMC's ops).

    That import is no sign of a PyMC program: any C compile in an environment
    where PyMC once compiled loads those keys, so floatX must not change then.
    """
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith("<frozen") and path != __file__:
            return os.path.abspath(path).startswith(_PYTENSOR)
        frame = frame.f_back
    return False


_UTIL = os.path.join("importlib", "util.py")


def _probed():
    """Whether ``importlib.util.find_spec`` asks (whether PyMC is there), not an import."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "find_spec" and (code.co_filename.endswith(_UTIL)
                                             or code.co_filename == "<frozen importlib.util>"):
            return True
        if code.co_name == "_find_and_load":   # the import system: a real import
            return False
        frame = frame.f_back
    return False


_WATCHER = _WatchPyMC()


def _restore_for_pymc():
    global DEFAULTED
    if _WATCHER in sys.meta_path:
        sys.meta_path.remove(_WATCHER)
    if DEFAULTED and pytensor.config.floatX == "float32" and not _set_since():
        pytensor.config.floatX = "float64"
        DEFAULTED = False
        logger.info("import pymc: floatX back to float64 (PyMC's default; set floatX to choose)")


_SETS = {"n": 0}


def _set_since():
    return _SETS["n"] > 0


def _watch_sets():
    """Count floatX assignments made after ``import synkhronos`` (explicit choices)."""
    param = _param()
    base = type(param)
    if getattr(base, "_synk_watched", False):
        return

    class Watched(base):
        _synk_watched = True

        def __set__(self, cls, val):
            _SETS["n"] += 1
            super().__set__(cls, val)

    try:
        param.__class__ = Watched
    except TypeError:   # a PyTensor whose config params cannot be subclassed: no watch
        logger.debug("floatX: cannot watch assignments in this PyTensor")


def apply_default():
    """Make float32 the default floatX unless the user chose one; run once at import."""
    global DEFAULTED
    why = None
    if _chosen_by_flags():
        why = "chosen in PYTENSOR_FLAGS or .pytensorrc"
    elif pytensor.config.floatX != "float64":
        why = "set before import synkhronos"
    elif "pymc" in sys.modules:
        why = "PyMC is imported"
    else:
        where = _set_in_importing_code()
        if where:
            why = f"set in code at {where}"
    if why:
        logger.debug("floatX stays %s (%s)", pytensor.config.floatX, why)
        return
    pytensor.config.floatX = "float32"
    DEFAULTED = True
    _watch_sets()
    sys.meta_path.insert(0, _WATCHER)
