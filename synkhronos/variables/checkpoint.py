"""Checkpoints: save and restore every shared variable of a run, per rank where ranks differ.

One ``save()`` writes what resuming training bit for bit needs: every shared
variable the distributed functions use (parameters, the update rule's state
such as Adam's moments and step counter ``t``, batch-norm statistics, random
generators), once where every rank holds the same value and per rank where
they differ, plus the caller's own counters (``metadata``).  The file is
written atomically (a temporary file in the same folder, then ``os.replace``),
so a kill leaves the previous checkpoint or the new one, never half of one.

The file format, its checks and the atomic write live in ``checkpoint_file``.
"""

import json
import logging
import pickle
from typing import NamedTuple

import numpy as np
from pytensor.compile import SharedVariable
from pytensor.tensor import TensorType

from . import checkpoint_file as cf
from ..runtime import devices
from . import rank_values
from . import access
from ..runtime.commands import Command, handler
from ..runtime.run import run_command
from ..runtime.state import get_runtime

logger = logging.getLogger(__name__)

__all__ = ["save", "load", "read"]

def save(path, shared_vars=None, metadata=None):
    """Write every shared variable (per rank where ranks differ) to ``path``, atomically.

    Master only.  After ``distribute()`` it saves every variable the
    distributed functions use, from every rank; without a forked run (a serial
    twin) it saves ``shared_vars`` from this process.

    Args:
        path: the file to write (``.npz``; replaced atomically if it exists).
        shared_vars: the variables to save (shared variables, or their names
            after ``distribute()``); default: every distributed one.
            Required without a distributed run.
        metadata: a JSON-serialisable dict stored with the values, e.g.
            ``{"step": 120, "epoch": 3}``.

    Raises:
        TypeError: ``shared_vars`` holds something other than shared variables
            (or, after ``distribute()``, their names).
        ValueError: no variables to save, a variable no distributed function
            uses, or metadata that JSON cannot hold.
        WorkerError: a rank failed while reading its values.
    """
    rt = _run()
    shareds = _variables(rt, shared_vars, "save")
    if rt is None:
        per_rank = [_local_values(shareds)]
    else:
        idx = [rt.registry.shared_ids[id(v)] for v in shareds]
        msg = SaveMsg(idx)
        per_rank = run_command(rt, Command.SAVE_STATE, msg, lambda seq: _save_local(rt, msg))
    entries, arrays = [], {}
    for i, var in enumerate(shareds):
        values = [ranks[i] for ranks in per_rank]
        entries.append(cf.make_entry(i, var, values, arrays))
    manifest = {"format": cf.FORMAT, "version": cf.VERSION, "n_parallel": len(per_rank),
                "metadata": metadata or {}, "variables": entries}
    try:
        text = json.dumps(manifest)
    except TypeError as exc:
        raise ValueError(f"save: metadata must be JSON-serialisable ({exc})") from None
    cf.write_atomically(path, text, arrays)
    logger.info("checkpoint of %d variables from %d ranks written to %s",
                len(shareds), len(per_rank), path)


def read(path):
    """Return ``(manifest, arrays)`` of a checkpoint file, without touching any variable.

    Runs anywhere.  ``arrays`` maps the archive's entry names to arrays.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not a complete synkhronos checkpoint (empty,
            truncated, corrupt, another format, or an entry missing).
    """
    return cf.read_checkpoint(path, "read")


def load(path, shared_vars=None):
    """Restore the shared variables saved by ``save()``; return its metadata.  Master only.

    Build the same functions (so ``distribute()`` lists the same variables in
    the same order), fork and distribute, then load.  Values saved once go to
    every rank, so they load into any number of ranks; values saved per rank
    need the same number of ranks.  Without a forked run the variables of this
    process are set (per-rank values need one rank).

    Args:
        path: a file written by ``save()``.
        shared_vars: the variables to restore (shared variables, or their
            names after ``distribute()``); default: every distributed one, in
            the order they were saved.  Given, each is found in the file by
            its name (any subset, any order) where every name is saved once,
            else by order.

    Returns:
        The ``metadata`` dict given to ``save()``.

    Raises:
        TypeError: ``shared_vars`` holds something other than shared variables
            (or, after ``distribute()``, their names).
        ValueError: the file is not a complete synkhronos checkpoint, or does
            not match the variables (count, names, kinds, dtypes, shapes in
            every rank), or holds per-rank values (ranks that differed) for
            another number of ranks.
        WorkerError: a rank failed while storing.
    """
    rt = _run()
    shareds = _variables(rt, shared_vars, "load")
    manifest, arrays = cf.read_checkpoint(path, "load")
    entries = _entries_for(manifest["variables"], shareds, shared_vars is not None, path)
    n = 1 if rt is None else rt.place.n_parallel
    shapes = _current_shapes(rt, shareds)
    per_rank = [[] for _ in range(n)]
    for entry, var, have in zip(entries, shareds, shapes):
        values = _values_of(entry, arrays, var, n, have, f"load: {path}")
        for r in range(n):
            per_rank[r].append(values[r])
    if rt is None:
        _restore_local(None, shareds, per_rank[0])
    else:
        idx = [rt.registry.shared_ids[id(v)] for v in shareds]
        blobs = [np.frombuffer(pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
                 for v in per_rank]
        msg = LoadMsg(idx)
        run_command(rt, Command.LOAD_STATE, msg, lambda seq: _load_local(rt, msg, blobs))
    if manifest["n_parallel"] != n:
        # Allowed (every value was saved once, _values_of checked), but the run differs.
        logger.info("checkpoint %s, saved from %d ranks, restored into %d ranks (each "
                    "variable held one value for every rank)", path, manifest["n_parallel"], n)
    else:
        logger.info("checkpoint %s restored into %d ranks", path, n)
    return manifest["metadata"]


def _entries_for(entries, shareds, named, path):
    """The manifest entry of each variable: by name when the caller named the variables
    and each name is in the file once, else by order (then the counts must agree)."""
    if named:
        by_name = {}
        for e in entries:
            by_name.setdefault(e["name"], []).append(e)
        if all(v.name is not None and len(by_name.get(v.name, ())) == 1 for v in shareds):
            return [by_name[v.name][0] for v in shareds]
        if len(entries) != len(shareds):
            bad = next(v for v in shareds if v.name is None or len(by_name.get(v.name, ())) != 1)
            found = len(by_name.get(bad.name, ())) if bad.name is not None else 0
            raise ValueError(f"load: {path} holds {found} variables named {bad.name!r}; a "
                             "subset of a checkpoint loads by name, each name saved once "
                             f"(the file holds {len(entries)} variables)")
    elif len(entries) != len(shareds):
        raise ValueError(f"load: {path} holds {len(entries)} variables; this run has "
                         f"{len(shareds)} (pass shared_vars to load some of them by name)")
    return entries


# ---- commands ---------------------------------------------------------------

class SaveMsg(NamedTuple):
    """SAVE_STATE: every rank sends its values of variables ``idx`` to the master."""

    idx: list


class LoadMsg(NamedTuple):
    """LOAD_STATE: every rank receives its values of variables ``idx`` from the master."""

    idx: list


def _save_local(rt, msg):
    values = _local_values([rt.registry.shareds[i] for i in msg.idx])
    blob = np.frombuffer(pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    got = rt.backend.host.gather([blob], rt.place.master_rank)
    if rt.place.rank != rt.place.master_rank:
        return None
    # Unpickled at once: the arrays are views into communication buffers.
    return [values if q == rt.place.rank else pickle.loads(got[q][0].tobytes())
            for q in range(rt.place.n_parallel)]


@handler(Command.SAVE_STATE, SaveMsg)
def _save_worker(rt, msg):
    _save_local(rt, msg)


def _load_local(rt, msg, blobs=None):
    per_rank = None if blobs is None else [[b] for b in blobs]
    mine = rt.backend.host.scatter(per_rank, rt.place.master_rank)[0]
    _restore_local(rt, [rt.registry.shareds[i] for i in msg.idx], pickle.loads(np.asarray(mine).tobytes()))


@handler(Command.LOAD_STATE, LoadMsg)
def _load_worker(rt, msg):
    _load_local(rt, msg)


# ---- values in one process ------------------------------------------------------

def _run():
    rt = get_runtime()
    if rt is None or rt.closed:
        return None
    if not rt.registry.distributed:
        return None
    return rt


def _variables(rt, shared_vars, where):
    """The shared variables ``shared_vars`` names (variables, or names after distribute())."""
    if shared_vars is None:
        if rt is None:
            raise ValueError(f"{where}: without a distributed run, name the shared_vars")
        return list(rt.registry.shareds)
    items = list(shared_vars) if isinstance(shared_vars, (list, tuple)) else [shared_vars]
    if not items:
        raise ValueError(f"{where}: shared_vars is empty")
    out = []
    for item in items:
        if isinstance(item, str):
            if rt is None:
                raise TypeError(f"{where}: shared_vars names {item!r}; without a distributed "
                                "run, pass the shared variables themselves")
            item = rt.registry.shareds[access.by_name(rt, item, where)]
        elif not isinstance(item, SharedVariable):
            raise TypeError(f"{where}: shared_vars must be a shared variable, its name, or a "
                            f"list/tuple of them; got {type(item).__name__}")
        elif rt is not None and (id(item) not in rt.registry.shared_ids
                                 or rt.registry.shareds[rt.registry.shared_ids[id(item)]] is not item):
            raise ValueError(f"{where}: shared variable {item} is not used by any function "
                             "given to distribute()")
        out.append(item)
    if len({id(v) for v in out}) != len(out):
        raise ValueError(f"{where}: a shared variable appears twice in shared_vars")
    return out


def _current_shapes(rt, shareds):
    """Per variable, its shape in every rank (one rank without a run); None for a generator."""
    tensors = [k for k, v in enumerate(shareds) if isinstance(v.type, TensorType)]
    out = [None] * len(shareds)
    if rt is None:
        found = [[tuple(access.raw(shareds[k]).shape)] for k in tensors]
    elif tensors:
        # A query only: every rank reports, none changes anything.
        found = rank_values.shapes_in_ranks(rt, [rt.registry.shared_ids[id(shareds[k])] for k in tensors])
    else:
        found = []
    for k, shapes in zip(tensors, found):
        out[k] = [tuple(s) for s in shapes]
    return out


def _local_values(shareds):
    """This process's values: arrays (copied to the host) or ("rng", state)."""
    out = []
    for var in shareds:
        value = var.get_value(borrow=True, return_internal_type=True)
        if isinstance(value, np.random.Generator):
            out.append(("rng", value.bit_generator.state))
        elif isinstance(value, np.random.RandomState):
            out.append(("rng", value.get_state(legacy=False)))
        else:
            out.append(np.array(devices.to_host(value)))
    return out


def _restore_local(rt, shareds, values):
    for var, value in zip(shareds, values):
        if isinstance(value, tuple):
            var.set_value(_generator_like(var, value[1]), borrow=True)
        elif rt is None:
            var.set_value(np.array(value, dtype=var.dtype), borrow=True)
        else:
            access.store(rt, var, value)


def _generator_like(var, state):
    bit_generator = getattr(np.random, state["bit_generator"])()
    bit_generator.state = state
    current = var.get_value(borrow=True)
    if isinstance(current, np.random.RandomState):
        return np.random.RandomState(bit_generator)
    return np.random.Generator(bit_generator)


def _values_of(entry, arrays, var, n, shapes, where):
    """One value per rank for variable ``var`` from its (checked) manifest ``entry``.

    ``shapes``: the variable's shape in each rank now (None for a generator).
    """
    i = entry["index"]
    where = f"{where}, variable {i} ({entry['name']})"
    if entry["name"] != var.name:
        raise ValueError(f"{where} does not match this run's variable {var.name}")
    if (entry["kind"] == "rng") != (shapes is None):
        saved = "a random generator" if entry["kind"] == "rng" else "an array"
        raise ValueError(f"{where}: saved {saved}; the variable's type is {var.type}")
    if entry["per_rank"] and entry["n_saved"] != n:
        raise ValueError(f"{where}: saved per rank from {entry['n_saved']} ranks, which "
                         f"differ; this run has {n}")
    if entry["kind"] == "rng":
        states = entry["state"] if entry["per_rank"] else [entry["state"]] * n
        return [("rng", cf.from_json_state(s)) for s in states]
    values = ([arrays[f"v{i}_r{r}"] for r in range(n)] if entry["per_rank"]
              else [arrays[f"v{i}"]] * n)
    for r, (v, shape) in enumerate(zip(values, shapes)):
        if v.dtype != var.dtype or v.ndim != var.ndim:
            raise ValueError(f"{where}: saved {v.dtype} with {v.ndim} dims; the variable is "
                             f"{var.dtype} with {var.ndim}")
        if v.shape != shape:
            rank = f" in rank {r}" if n > 1 else ""
            raise ValueError(f"{where}: saved shape {v.shape}; the variable has shape "
                             f"{shape}{rank}")
    return values
