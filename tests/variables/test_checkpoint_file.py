"""The checkpoint file (synkhronos.variables.checkpoint_file): broken files named, kills inside save().

A saving process is SIGKILLed at every write, fsync and rename inside
``save()`` (instrumented, in a forked child), and at random moments while it
saves in a loop; the file at the path must load whole every time.
"""

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytensor
import pytest

from synkhronos.variables import checkpoint

pytestmark = pytest.mark.timeout(60)


# ---- broken files --------------------------------------------------------------------------

def _manifest_of(path):
    with np.load(path) as z:
        return json.loads(str(z["manifest"])), {k: z[k] for k in z.files if k != "manifest"}


def _bad_files(good):
    """(name, the bytes or a function writing them to a file object, what the error says)."""
    data = good.read_bytes()
    manifest, arrays = _manifest_of(good)

    def npz(manifest, arrays):
        return lambda f: np.savez(f, manifest=np.array(json.dumps(manifest)), **arrays)

    def without(key):
        return {k: v for k, v in manifest.items() if k != key}
    return [
        ("empty", b"", "not a synkhronos checkpoint"),
        ("truncated", data[:len(data) // 2], "not a synkhronos checkpoint"),
        ("cut short", data[:-1], "not a synkhronos checkpoint"),
        ("garbage", bytes(range(256)) * 8, "not a synkhronos checkpoint"),
        ("flipped", data[:200] + bytes(b ^ 0xFF for b in data[200:300]) + data[300:],
         "not a synkhronos checkpoint"),
        ("npy", lambda f: np.save(f, np.zeros(3)), "not an .npz archive"),
        ("no manifest", lambda f: np.savez(f, v0=np.zeros(3)), "no manifest"),
        ("bad json", lambda f: np.savez(f, manifest=np.array("{not json")),
         "not a synkhronos checkpoint"),
        ("other format", npz(dict(manifest, format="other"), arrays), "does not say format"),
        ("newer version", npz(dict(manifest, version=2), arrays), "format version 2"),
        ("no variables", npz(without("variables"), arrays), "manifest has no variables"),
        ("no metadata", npz(without("metadata"), arrays), "manifest has no metadata"),
        ("incomplete entry", npz(dict(manifest, variables=[{"index": 0}]), arrays),
         "manifest entry 0 is incomplete"),
        ("array missing", npz(manifest, {}), r"array v0 of variable 0 \(W\) is missing"),
        ("wrong array", npz(manifest, {"v0": np.zeros(4, "int8")}),
         "array v0 does not match its manifest entry"),
    ]


def test_broken_files_are_named(tmp_path):
    good = tmp_path / "good.npz"
    w = pytensor.shared(np.arange(6.0).reshape(2, 3), name="W")
    checkpoint.save(good, [w], metadata={"ok": True})
    for name, content, says in _bad_files(good):
        path = tmp_path / f"{name}.npz"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            with open(path, "wb") as f:
                content(f)
        w.set_value(np.full((2, 3), 7.0))
        for call in (lambda: checkpoint.load(path, [w]), lambda: checkpoint.read(path)):
            with pytest.raises(ValueError, match=says) as info:
                call()
            assert str(path) in str(info.value), name
            assert info.type is ValueError, name
        np.testing.assert_array_equal(w.get_value(), np.full((2, 3), 7.0), err_msg=name)
    with pytest.raises(FileNotFoundError):
        checkpoint.load(tmp_path / "absent.npz", [w])
    assert checkpoint.load(good, [w]) == {"ok": True}



# ---- a kill inside save() ---------------------------------------------------------------

N_BIG = 1 << 19  # 4 MiB of float64: a save takes long enough to be killed in the middle


def _generation(g):
    rng = np.random.default_rng(g)
    return [rng.standard_normal(N_BIG), rng.integers(0, 100, size=(64, 3)).astype("int32")]


def _shareds(values):
    return [pytensor.shared(v, name=f"s{k}") for k, v in enumerate(values)]


class _WatchedFile:
    """A file whose every write reaches the disk at once and then counts as an event."""

    def __init__(self, f, event):
        self._f, self._event = f, event

    def write(self, data):
        n = self._f.write(data)
        self._f.flush()
        self._event()
        return n

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


def _save_in_child(path, generation, kill_at, count_file=None):
    """Fork a child that saves ``generation`` and SIGKILLs itself at I/O event ``kill_at``.

    Events: each write into the temporary file (flushed), each fsync, and
    os.replace, before and after.  Return the child's wait status.
    """
    pid = os.fork()
    if pid:
        return os.waitpid(pid, 0)[1]
    try:
        seen = [0]
        real_fdopen, real_fsync, real_replace = os.fdopen, os.fsync, os.replace

        def event():
            if seen[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            seen[0] += 1

        def fsync(fd):
            event()
            real_fsync(fd)

        def replace(src, dst):
            event()
            real_replace(src, dst)
            event()
        os.fdopen = lambda *a, **k: _WatchedFile(real_fdopen(*a, **k), event)
        os.fsync, os.replace = fsync, replace
        checkpoint.save(path, _shareds(_generation(generation)), metadata={"gen": generation})
        if count_file is not None:
            Path(count_file).write_text(str(seen[0]))
    finally:
        os._exit(0)


def _loads_as(path):
    """Load ``path`` into fresh variables; check its values are all of one generation."""
    shareds = _shareds([np.zeros(N_BIG), np.zeros((64, 3), "int32")])
    gen = checkpoint.load(path, shareds)["gen"]
    for var, want in zip(shareds, _generation(gen)):
        np.testing.assert_array_equal(var.get_value(), want)
    return gen


def _temporaries(folder):
    return [p.name for p in folder.iterdir() if p.name.startswith(".synk-ckpt-")]


def test_a_kill_at_any_point_of_save_leaves_a_whole_checkpoint(tmp_path):
    path = tmp_path / "c.npz"
    checkpoint.save(path, _shareds(_generation(0)), metadata={"gen": 0})
    count = tmp_path / "count"
    assert _save_in_child(tmp_path / "dry.npz", 1, -1, count) == 0
    n_events = int(count.read_text())
    assert n_events >= 8  # writes, two fsyncs, the rename: the points below are real
    previous = 0
    for kill_at in range(n_events):
        gen = kill_at + 1
        status = _save_in_child(path, gen, kill_at)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, kill_at
        # Up to the rename the previous checkpoint stands whole; after it, the new one.
        renamed = kill_at >= n_events - 2
        assert _loads_as(path) == (gen if renamed else previous), kill_at
        previous = gen if renamed else previous
        # The killed saver's temporary file, if not renamed yet; its predecessors' are swept.
        assert len(_temporaries(tmp_path)) == (0 if renamed else 1), kill_at
    _save_in_child(path, 98, 0)
    assert _temporaries(tmp_path)  # a killed saver leaves its temporary file behind ...
    checkpoint.save(path, _shareds(_generation(99)), metadata={"gen": 99})
    assert _temporaries(tmp_path) == []  # ... and the next save() swept them
    assert _loads_as(path) == 99


def _save_forever(path, gens):
    """In a forked child: save generation 1, 2, 1, 2, ... until killed."""
    try:
        shareds = _shareds(gens[0])
        for k in range(10 ** 6):
            for var, value in zip(shareds, gens[k % 2]):
                var.set_value(value, borrow=True)
            checkpoint.save(path, shareds, metadata={"gen": 1 + k % 2})
    finally:
        os._exit(0)


def test_killed_while_saving_in_a_loop(tmp_path):
    # Not instrumented: the parent kills a child that saves generation after
    # generation, after random delays, wherever the child happens to be.
    path = tmp_path / "c.npz"
    checkpoint.save(path, _shareds(_generation(0)), metadata={"gen": 0})
    start = time.monotonic()
    checkpoint.save(path, _shareds(_generation(0)), metadata={"gen": 0})
    one_save = time.monotonic() - start
    rng = np.random.default_rng(0)
    gens = [_generation(1), _generation(2)]
    seen, stalls = [], 0
    while len(seen) < 15:
        pid = os.fork()
        if pid == 0:
            _save_forever(path, gens)
        # Up to three saves' time; longer while children get killed before their first save.
        time.sleep(rng.uniform(0.2, 3.0) * one_save * (1 + stalls))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        seen.append(_loads_as(path))
        stalls = stalls + 1 if set(seen) == {0} else 0
    assert set(seen) - {0}
