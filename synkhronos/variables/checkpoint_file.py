"""The checkpoint file: its format, its checks on reading, and the atomic write.

Written by ``checkpoint.save()`` and read by ``checkpoint.load()``, atomically:
a temporary file in the same folder, then ``os.replace``, so a kill leaves
the previous checkpoint or the new one, never half of one.  Reading checks
that every entry the manifest lists is there, so an empty, truncated or
foreign file is refused by name rather than half-loaded.

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
import os
import socket
import tempfile
import zipfile
import zlib

import numpy as np

FORMAT = "synkhronos-checkpoint"
VERSION = 1


def _same(values):
    """Whether every rank's value (an array or ("rng", state)) is the same."""
    first = values[0]
    for v in values[1:]:
        if isinstance(first, tuple) or isinstance(v, tuple):
            if not (isinstance(first, tuple) and isinstance(v, tuple)
                    and json_state(first[1]) == json_state(v[1])):
                return False
        elif first.shape != v.shape or first.dtype != v.dtype or not np.array_equal(
                first, v, equal_nan=first.dtype.kind in "fc"):
            return False
    return True


def make_entry(i, var, values, arrays):
    """Return variable ``i``'s manifest entry; put its arrays into ``arrays``."""
    per_rank = not _same(values)
    entry = {"index": i, "name": var.name, "per_rank": per_rank}
    if isinstance(values[0], tuple):
        entry["kind"] = "rng"
        states = [json_state(v[1]) for v in values]
        entry["state"] = states if per_rank else states[0]
        return entry
    entry.update(kind="array", dtype=str(values[0].dtype), shape=list(values[0].shape))
    if per_rank:
        for r, v in enumerate(values):
            arrays[f"v{i}_r{r}"] = v
    else:
        arrays[f"v{i}"] = values[0]
    return entry


def json_state(state):
    """A bit generator's state with arrays turned into lists (JSON holds big ints)."""
    if isinstance(state, dict):
        return {k: json_state(v) for k, v in state.items()}
    if isinstance(state, np.ndarray):
        return {"__ndarray__": state.tolist(), "dtype": str(state.dtype)}
    if isinstance(state, np.integer):
        return int(state)
    return state


def from_json_state(state):
    if isinstance(state, dict):
        if "__ndarray__" in state:
            return np.array(state["__ndarray__"], dtype=state["dtype"])
        return {k: from_json_state(v) for k, v in state.items()}
    return state


def read_checkpoint(path, where):
    """Return ``(manifest, arrays)`` of a complete checkpoint at ``path``.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not a complete synkhronos checkpoint, naming ``path``
            (``where`` is the caller, for the message).
    """
    try:
        f = np.load(path, allow_pickle=False)
        if not isinstance(f, np.lib.npyio.NpzFile):
            raise ValueError("a single .npy array, not an .npz archive")
        with f:
            if "manifest" not in f.files:
                raise ValueError("no manifest")
            manifest = json.loads(str(f["manifest"]))
            arrays = {k: f[k] for k in f.files if k != "manifest"}
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except (OSError, EOFError, ValueError, KeyError, AttributeError, TypeError,
            zipfile.BadZipFile, zlib.error) as exc:
        # Empty, truncated or corrupt files fail in zipfile, the .npy reader or JSON.
        raise ValueError(f"{where}: {path} is not a synkhronos checkpoint "
                         f"({type(exc).__name__}: {exc})") from None
    _check_file(manifest, arrays, f"{where}: {path}")
    return manifest, arrays


def _check_file(manifest, arrays, where):
    """Raise ValueError unless the manifest is ours and every entry it lists is there.

    Adds ``n_saved`` to each variable's entry: how many ranks' values it holds.
    """
    def bad(what):
        return ValueError(f"{where} is not a synkhronos checkpoint ({what})")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise bad(f"its manifest does not say format {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise bad(f"format version {manifest.get('version')!r}; this synkhronos reads {VERSION}")
    n, entries = manifest.get("n_parallel"), manifest.get("variables")
    for key, kind in (("n_parallel", int), ("metadata", dict), ("variables", list)):
        if not isinstance(manifest.get(key), kind):
            raise bad(f"its manifest has no {key}")
    for i, e in enumerate(entries):
        if not (isinstance(e, dict) and e.get("index") == i and isinstance(e.get("name"), str)
                and e.get("kind") in ("array", "rng") and isinstance(e.get("per_rank"), bool)):
            raise bad(f"manifest entry {i} is incomplete")
        e["n_saved"] = n if e["per_rank"] else 1
        if e["kind"] == "rng":
            if not isinstance(e.get("state"), list if e["per_rank"] else dict) or (
                    e["per_rank"] and len(e["state"]) != n):
                raise bad(f"variable {i} ({e['name']}) has no generator state")
            continue
        keys = [f"v{i}_r{r}" for r in range(n)] if e["per_rank"] else [f"v{i}"]
        for r, key in enumerate(keys):
            if key not in arrays:
                raise bad(f"array {key} of variable {i} ({e['name']}) is missing")
            a = arrays[key]
            if str(a.dtype) != e.get("dtype") or (r == 0 and list(a.shape) != e.get("shape")):
                raise bad(f"array {key} does not match its manifest entry")


# Temporary files carry the host and pid of the process writing them, so a
# later save() can tell one a killed process left behind from one in progress.
_TMP_PREFIX = ".synk-ckpt-"


def write_atomically(path, text, arrays):
    """Write the manifest ``text`` and ``arrays`` to ``path``: all of it or nothing."""
    folder = os.path.dirname(os.path.abspath(path))
    _sweep_stale(folder)
    fd, tmp = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{socket.gethostname()}-{os.getpid()}-",
                               suffix=".npz", dir=folder)
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


def _sweep_stale(folder):
    """Remove temporary files that processes of this host, killed while saving, left."""
    mine = f"{_TMP_PREFIX}{socket.gethostname()}-"
    for name in os.listdir(folder):
        pid = name[len(mine):].split("-", 1)[0]
        if not name.startswith(mine) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(folder, name))
            except FileNotFoundError:
                pass  # another save() swept it first
        except PermissionError:
            pass  # alive, another user's
