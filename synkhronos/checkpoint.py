"""Checkpoints: save and restore every shared variable of a run, per rank where ranks differ.

One ``save()`` writes what resuming training bit for bit needs: every shared
variable the distributed functions use (parameters, the update rule's state
such as Adam's moments and step counter ``t``, batch-norm statistics, random
generators), once where every rank holds the same value and per rank where
they differ, plus the caller's own counters (``metadata``).  The file is
written atomically (a temporary file in the same folder, then ``os.replace``),
so a kill leaves the previous checkpoint or the new one, never half of one.

Format: a NumPy ``.npz`` archive, readable without synkhronos::

    with np.load("ckpt.npz") as f:
        manifest = json.loads(str(f["manifest"]))
        W = f["v0"]              # variable 0, equal on every rank
        b1 = f["v3_r1"]          # variable 3 as rank 1 holds it

``manifest`` (JSON, a 0-d string array) holds ``format``
("synkhronos-checkpoint"), ``version`` (1), ``n_parallel``, ``metadata`` and
``variables``: one entry per variable in ``distribute()`` order with
``name``, ``kind`` ("array" or "rng"), ``per_rank`` and, for arrays,
``dtype`` and ``shape``, for random generators ``state`` (the bit
generator's state; per rank a list of them).  Array entries are ``v<i>``, or
``v<i>_r<rank>`` for a variable whose ranks differ.
"""

import json
import logging
import os
import pickle
import tempfile
from typing import NamedTuple

import numpy as np

from . import gpu
from . import sharedvars as sv
from .control import Command, handler, run_command
from .runtime import get_runtime

logger = logging.getLogger(__name__)

__all__ = ["save", "load", "read"]

FORMAT = "synkhronos-checkpoint"
VERSION = 1


def save(path, shared_vars=None, metadata=None):
    """Write every shared variable (per rank where ranks differ) to ``path``, atomically.

    Master only.  After ``distribute()`` it saves every variable the
    distributed functions use, from every rank; without a forked run (a serial
    twin) it saves ``shared_vars`` from this process.

    Args:
        path: the file to write (``.npz``; replaced atomically if it exists).
        shared_vars: the variables to save; default: every distributed one.
            Required without a distributed run.
        metadata: a JSON-serialisable dict stored with the values, e.g.
            ``{"step": 120, "epoch": 3}``.

    Raises:
        ValueError: no variables to save, or metadata that JSON cannot hold.
        WorkerError: a rank failed while reading its values.
    """
    rt = _run()
    shareds = _variables(rt, shared_vars, "save")
    if rt is None:
        per_rank = [_local_values(shareds)]
    else:
        idx = [rt.shared_ids[id(v)] for v in shareds]
        msg = SaveMsg(idx)
        per_rank = run_command(rt, Command.SAVE_STATE, msg, lambda seq: _save_local(rt, msg))
    entries, arrays = [], {}
    for i, var in enumerate(shareds):
        values = [ranks[i] for ranks in per_rank]
        entries.append(_entry(i, var, values, arrays))
    manifest = {"format": FORMAT, "version": VERSION, "n_parallel": len(per_rank),
                "metadata": metadata or {}, "variables": entries}
    try:
        text = json.dumps(manifest)
    except TypeError as exc:
        raise ValueError(f"save: metadata must be JSON-serialisable ({exc})") from None
    _write_atomically(path, text, arrays)
    logger.info("checkpoint of %d variables from %d ranks written to %s",
                len(shareds), len(per_rank), path)


def read(path):
    """Return ``(manifest, arrays)`` of a checkpoint file, without touching any variable.

    Runs anywhere.  ``arrays`` maps the archive's entry names to arrays.
    """
    with np.load(path, allow_pickle=False) as f:
        manifest = json.loads(str(f["manifest"]))
        arrays = {k: f[k] for k in f.files if k != "manifest"}
    if manifest.get("format") != FORMAT:
        raise ValueError(f"load: {path} is not a synkhronos checkpoint")
    return manifest, arrays


def load(path, shared_vars=None):
    """Restore the shared variables saved by ``save()``; return its metadata.  Master only.

    Build the same functions (so ``distribute()`` lists the same variables in
    the same order), fork and distribute, then load.  Values saved once go to
    every rank, so they load into any number of ranks; values saved per rank
    need the same number of ranks.  Without a forked run the variables of this
    process are set (per-rank values need one rank).

    Args:
        path: a file written by ``save()``.
        shared_vars: the variables to restore, in the order they were saved;
            default: every distributed one.

    Returns:
        The ``metadata`` dict given to ``save()``.

    Raises:
        ValueError: the file does not match the variables (count, names,
            shapes, dtypes), or holds per-rank values for another number of ranks.
        WorkerError: a rank failed while storing.
    """
    rt = _run()
    shareds = _variables(rt, shared_vars, "load")
    manifest, arrays = read(path)
    entries = manifest["variables"]
    if len(entries) != len(shareds):
        raise ValueError(f"load: {path} holds {len(entries)} variables; this run has "
                         f"{len(shareds)}")
    n = 1 if rt is None else rt.n_parallel
    per_rank = [[] for _ in range(n)]
    for i, (entry, var) in enumerate(zip(entries, shareds)):
        values = _values_of(entry, arrays, var, n, path)
        for r in range(n):
            per_rank[r].append(values[r])
    if rt is None:
        _restore_local(None, shareds, per_rank[0])
    else:
        idx = [rt.shared_ids[id(v)] for v in shareds]
        blobs = [np.frombuffer(pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
                 for v in per_rank]
        msg = LoadMsg(idx)
        run_command(rt, Command.LOAD_STATE, msg, lambda seq: _load_local(rt, msg, blobs))
    logger.info("checkpoint %s restored into %d ranks", path, n)
    return manifest["metadata"]


# ---- commands ---------------------------------------------------------------

class SaveMsg(NamedTuple):
    """SAVE_STATE: every rank sends its values of variables ``idx`` to the master."""

    idx: list


class LoadMsg(NamedTuple):
    """LOAD_STATE: every rank receives its values of variables ``idx`` from the master."""

    idx: list


def _save_local(rt, msg):
    values = _local_values([rt.shareds[i] for i in msg.idx])
    blob = np.frombuffer(pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    got = rt.backend.host.gather([blob], rt.master_rank)
    if rt.rank != rt.master_rank:
        return None
    # Unpickled at once: the arrays are views into communication buffers.
    return [values if q == rt.rank else pickle.loads(got[q][0].tobytes())
            for q in range(rt.n_parallel)]


@handler(Command.SAVE_STATE, SaveMsg)
def _save_worker(rt, msg):
    _save_local(rt, msg)


def _load_local(rt, msg, blobs=None):
    per_rank = None if blobs is None else [[b] for b in blobs]
    mine = rt.backend.host.scatter(per_rank, rt.master_rank)[0]
    _restore_local(rt, [rt.shareds[i] for i in msg.idx], pickle.loads(np.asarray(mine).tobytes()))


@handler(Command.LOAD_STATE, LoadMsg)
def _load_worker(rt, msg):
    _load_local(rt, msg)


# ---- values in one process ------------------------------------------------------

def _run():
    rt = get_runtime()
    if rt is None or rt.closed:
        return None
    if not rt.distributed:
        return None
    return rt


def _variables(rt, shared_vars, where):
    if shared_vars is None:
        if rt is None:
            raise ValueError(f"{where}: without a distributed run, name the shared_vars")
        return list(rt.shareds)
    shareds = list(shared_vars) if isinstance(shared_vars, (list, tuple)) else [shared_vars]
    if rt is not None:
        for v in shareds:
            if id(v) not in rt.shared_ids:
                raise ValueError(f"{where}: {v} is used by no distributed function")
    if not shareds:
        raise ValueError(f"{where}: no shared variables")
    return shareds


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
            out.append(np.array(gpu.to_host(value)))
    return out


def _restore_local(rt, shareds, values):
    for var, value in zip(shareds, values):
        if isinstance(value, tuple):
            var.set_value(_generator_like(var, value[1]), borrow=True)
        elif rt is None:
            var.set_value(np.array(value, dtype=var.dtype), borrow=True)
        else:
            sv.store(rt, var, value)


def _generator_like(var, state):
    bit_generator = getattr(np.random, state["bit_generator"])()
    bit_generator.state = state
    current = var.get_value(borrow=True)
    if isinstance(current, np.random.RandomState):
        return np.random.RandomState(bit_generator)
    return np.random.Generator(bit_generator)


# ---- the file -------------------------------------------------------------------

def _same(values):
    first = values[0]
    for v in values[1:]:
        if isinstance(first, tuple) or isinstance(v, tuple):
            if not (isinstance(first, tuple) and isinstance(v, tuple)
                    and _json_state(first[1]) == _json_state(v[1])):
                return False
        elif first.shape != v.shape or first.dtype != v.dtype or not np.array_equal(
                first, v, equal_nan=first.dtype.kind in "fc"):
            return False
    return True


def _entry(i, var, values, arrays):
    per_rank = not _same(values)
    entry = {"index": i, "name": var.name, "per_rank": per_rank}
    if isinstance(values[0], tuple):
        entry["kind"] = "rng"
        states = [_json_state(v[1]) for v in values]
        entry["state"] = states if per_rank else states[0]
        return entry
    entry.update(kind="array", dtype=str(values[0].dtype), shape=list(values[0].shape))
    if per_rank:
        for r, v in enumerate(values):
            arrays[f"v{i}_r{r}"] = v
    else:
        arrays[f"v{i}"] = values[0]
    return entry


def _values_of(entry, arrays, var, n, path):
    """One value per rank for variable ``var`` from its manifest ``entry``."""
    where = f"load: {path}, variable {entry['index']} ({entry['name']})"
    if entry["name"] != var.name:
        raise ValueError(f"{where} does not match this run's variable {var.name}")
    if entry["per_rank"]:
        n_saved = len(entry["state"]) if entry["kind"] == "rng" else sum(
            1 for k in arrays if k.startswith(f"v{entry['index']}_r"))
        if n_saved != n:
            raise ValueError(f"{where}: saved per rank from {n_saved} ranks, which differ; "
                             f"this run has {n}")
    if entry["kind"] == "rng":
        states = entry["state"] if entry["per_rank"] else [entry["state"]] * n
        return [("rng", _from_json_state(s)) for s in states]
    values = ([arrays[f"v{entry['index']}_r{r}"] for r in range(n)] if entry["per_rank"]
              else [arrays[f"v{entry['index']}"]] * n)
    current = sv.get_array(var) if not isinstance(var.get_value(borrow=True), np.random.Generator) \
        else None
    for v in values:
        if current is not None and (v.dtype != current.dtype or v.ndim != current.ndim):
            raise ValueError(f"{where}: saved {v.dtype} with {v.ndim} dims; the variable is "
                             f"{current.dtype} with {current.ndim}")
    return values


def _json_state(state):
    """A bit generator's state with arrays turned into lists (JSON holds big ints)."""
    if isinstance(state, dict):
        return {k: _json_state(v) for k, v in state.items()}
    if isinstance(state, np.ndarray):
        return {"__ndarray__": state.tolist(), "dtype": str(state.dtype)}
    if isinstance(state, np.integer):
        return int(state)
    return state


def _from_json_state(state):
    if isinstance(state, dict):
        if "__ndarray__" in state:
            return np.array(state["__ndarray__"], dtype=state["dtype"])
        return {k: _from_json_state(v) for k, v in state.items()}
    return state


def _write_atomically(path, text, arrays):
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".synk-ckpt-", suffix=".npz", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, manifest=np.array(text), **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)
