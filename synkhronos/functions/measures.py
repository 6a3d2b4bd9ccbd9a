"""Choices made by timing, kept on disk so that later runs make the same ones.

Some choices can only be made by timing the compiled graph: which PyTensor
mode a PyMC model's rank graph runs fastest in (extensions/pymc/modes.py),
how many chunks a call's rows are cut into (pace.py), whether ``dp.sample``
splits a model's rows (extensions/pymc/crossover.py).  A timing moves from
run to run, and each choice changes the bits a call returns, so a choice is
made once per graph, machine and library versions and kept in a JSON file in
PyTensor's compile directory, where PyTensor keeps its compiled code; every
later run reads it.  A file that cannot be read or written only costs the
next run a measurement.  Delete the file to measure again.
"""

import hashlib
import importlib.metadata
import json
import logging
import os
import platform

import pytensor

logger = logging.getLogger(__name__)

ENTRIES = 1000
"""The most entries a file keeps (the newest)."""


class MeasureFile:
    """One kind of kept measurement: the file ``name`` in PyTensor's compile directory.

    ``get(key)`` is the value kept under ``key`` (a ``digest()``), or None;
    ``put(key, value)`` keeps a JSON value, whole or not at all, whoever else writes
    the file.
    """

    def __init__(self, name, directory=None):
        self.name, self.directory = name, directory

    def path(self):
        """Where this kind is kept: ``directory``, else PyTensor's compile directory."""
        return os.path.join(self.directory or pytensor.config.compiledir, self.name)

    def _read(self):
        try:
            with open(self.path()) as f:
                entries = json.load(f)
            return entries if isinstance(entries, dict) else {}
        except (OSError, ValueError):
            return {}

    def get(self, key):
        return self._read().get(key)

    def put(self, key, value):
        entries = self._read()
        entries.pop(key, None)
        entries[key] = value
        entries = dict(list(entries.items())[-ENTRIES:])
        path = self.path()
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "w") as f:
                json.dump(entries, f)
            os.replace(tmp, path)
        except OSError as exc:
            logger.debug("a measurement was not kept in %s (%s)", path, exc)


def graph_text(graph):
    """``graph`` (variables or a FunctionGraph) as PyTensor prints it, with types: its
    operations, not its values; None where an Op cannot print."""
    try:
        return pytensor.printing.debugprint(graph, file="str", print_type=True)
    except Exception as exc:  # noqa: BLE001 - then measured every time
        logger.debug("a graph's measurement is not kept (%r)", exc)
        return None


def digest(*parts):
    """A key for what a measurement depends on: ``parts``, the libraries that compile the
    graph and the machine that runs it (architecture, CPU model, cores)."""
    everything = [*parts, pytensor.__version__, version("numba"), platform.machine(),
                  cpu_model(), os.cpu_count()]
    return hashlib.sha256(repr(everything).encode()).hexdigest()


def version(package):
    """An installed package's version, from its metadata (nothing imported), or None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model():
    """The CPU's model name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
