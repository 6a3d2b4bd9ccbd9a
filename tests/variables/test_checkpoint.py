"""Checkpoints: the file format, per-rank values, other rank counts, and resuming after SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from synkhronos.variables import checkpoint

pytestmark = pytest.mark.timeout(115)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "helpers" / "ckpt_train.py"


def _script(*args, **kwargs):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, str(SCRIPT), *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _losses(text):
    return {int(k): v for _, k, v in (line.split() for line in text.splitlines()
                                      if line.startswith("step "))}


def _segments_of(pid):
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"synk_{pid}_")]


def test_resume_after_sigkill_gives_the_same_losses(tmp_path):
    ref = _script(2, tmp_path / "ref.npz", 6, "--dropout")
    out, err = ref.communicate(timeout=100)
    assert ref.returncode == 0, err
    reference = _losses(out)
    assert len(reference) == 6

    ckpt = tmp_path / "run.npz"
    run = _script(2, ckpt, 6, "--dropout", "--pause", stdin=subprocess.PIPE)
    seen = {}
    while len(seen) < 3:  # the third checkpoint is written, the run waits: kill it
        line = run.stdout.readline()
        assert line, run.stderr.read()
        seen.update(_losses(line))
        if len(seen) < 3:
            run.stdin.write("\n")  # go on to the next step
            run.stdin.flush()
    run.kill()  # SIGKILL
    run.wait(timeout=30)
    run.stdout.close()
    run.stderr.close()
    run.stdin.close()
    assert run.returncode == -signal.SIGKILL
    assert seen == {k: reference[k] for k in range(3)}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".synk-ckpt-")] == []
    deadline = time.monotonic() + 20
    while _segments_of(run.pid) and time.monotonic() < deadline:
        time.sleep(0.2)  # the killed run's janitor sweeps its segments
    assert not _segments_of(run.pid)

    resumed = _script(2, ckpt, 6, "--dropout", "--resume")
    out, err = resumed.communicate(timeout=100)
    assert resumed.returncode == 0, err
    # Bit for bit: parameters, Adam's state, the dropout generators of every rank.
    assert _losses(out) == {k: reference[k] for k in range(3, 6)}


def _model():
    x = pt.matrix("x")
    w = pytensor.shared(np.linspace(-1, 1, 3).astype("float32"), name="w")
    per = pytensor.shared(np.zeros(2, "float32"), name="per")
    gen = pytensor.shared(np.random.default_rng(5), name="gen")
    next_gen, noise = pt.random.normal(size=(2,), rng=gen, return_next_rng=True)
    f = synk.function([x], (pt.dot(x, w).sum() + per.sum(), "sum"),
                      updates=[(w, w * 0.5), (gen, next_gen), (per, pt.cast(noise, "float32"))],
                      mode="FAST_COMPILE")
    return f, w, per, gen


def test_format_per_rank_values_and_rank_counts(forked, tmp_path):
    forked(2)
    f, w, per, gen = _model()
    synk.distribute()
    synk.set_value(1, per, np.array([5.0, 6.0], "float32"))
    path = tmp_path / "c.npz"
    checkpoint.save(path, metadata={"step": 3})

    # Readable without synkhronos.
    with np.load(path, allow_pickle=False) as z:
        manifest = json.loads(str(z["manifest"]))
        names = {v["name"]: v for v in manifest["variables"]}
        assert manifest["n_parallel"] == 2 and manifest["metadata"] == {"step": 3}
        assert not names["w"]["per_rank"] and names["per"]["per_rank"]
        i_w, i_per = names["w"]["index"], names["per"]["index"]
        np.testing.assert_array_equal(z[f"v{i_w}"], w.get_value())
        np.testing.assert_array_equal(z[f"v{i_per}_r1"], [5.0, 6.0])
        assert names["gen"]["kind"] == "rng" and not names["gen"]["per_rank"]

    x = np.ones((4, 3), "float32")
    first = f(x)
    after = [synk.get_value(r, per) for r in range(2)]
    assert checkpoint.load(path) == {"step": 3}
    np.testing.assert_array_equal(synk.get_value(1, per), [5.0, 6.0])
    assert f(x) == first  # w restored
    for r in range(2):  # the generators restored on every rank
        np.testing.assert_array_equal(synk.get_value(r, per), after[r])

    synk.close()
    synk.fork(3, use_gpu=False)
    f, w, per, gen = _model()
    synk.distribute()
    with pytest.raises(ValueError, match="per rank from 2 ranks"):
        checkpoint.load(path)
    synk.set_value(1, per, np.zeros(2, "float32"))
    checkpoint.save(path, metadata={"step": 4})  # now equal on every rank: saved once
    synk.close()
    synk.fork(2, use_gpu=False)
    f, w, per, gen = _model()
    synk.distribute()
    w.set_value(np.zeros(3, "float32"))
    assert checkpoint.load(path) == {"step": 4}
    np.testing.assert_array_equal(synk.gather(w), [np.linspace(-1, 1, 3).astype("float32")] * 2)


def test_serial_save_and_load(tmp_path):
    w = pytensor.shared(np.arange(3.0), name="w")
    path = tmp_path / "s.npz"
    checkpoint.save(path, [w], metadata={"epoch": 1})
    w.set_value(np.zeros(3))
    assert checkpoint.load(path, [w]) == {"epoch": 1}
    np.testing.assert_array_equal(w.get_value(), np.arange(3.0))
    with pytest.raises(ValueError, match="name the shared_vars"):
        checkpoint.save(path)
    with pytest.raises(ValueError, match="JSON"):
        checkpoint.save(path, [w], metadata={"bad": object()})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.npz"]


# ---- what load() refuses ----------------------------------------------------------------

def test_load_refuses_another_shape(tmp_path):
    path = tmp_path / "w.npz"
    checkpoint.save(path, [pytensor.shared(np.ones((4, 3)), name="W")])
    w = pytensor.shared(np.zeros((5, 3)), name="W")
    with pytest.raises(ValueError, match=r"variable 0 \(W\): saved shape \(4, 3\); the "
                                         r"variable has shape \(5, 3\)"):
        checkpoint.load(path, [w])
    np.testing.assert_array_equal(w.get_value(), np.zeros((5, 3)))  # untouched
    w.set_value(np.zeros((4, 3)))
    checkpoint.load(path, [w])
    np.testing.assert_array_equal(w.get_value(), np.ones((4, 3)))


def test_load_refuses_another_shape_in_any_rank(forked, tmp_path):
    forked(2)
    f, w, per, gen = _model()
    synk.distribute()
    path = tmp_path / "c.npz"
    checkpoint.save(path)
    synk.set_value(1, per, np.zeros(3, "float32"))  # only rank 1's value has another shape
    for r in range(2):
        synk.set_value(r, w, np.zeros(3, "float32"))
    with pytest.raises(ValueError, match=r"\(per\): saved shape \(2,\); the variable has shape "
                                         r"\(3,\) in rank 1"):
        checkpoint.load(path)
    # Refused in the master before any value was stored.
    np.testing.assert_array_equal(synk.gather(w), [np.zeros(3, "float32")] * 2)
    synk.set_value(1, per, np.zeros(2, "float32"))
    checkpoint.load(path)
    np.testing.assert_array_equal(synk.gather(w), [np.linspace(-1, 1, 3).astype("float32")] * 2)


def test_variables_by_name(forked, tmp_path):
    w = pytensor.shared(np.arange(3.0), name="w")
    with pytest.raises(TypeError, match="shared_vars names 'w'; without a distributed run"):
        checkpoint.save(tmp_path / "s.npz", ["w"])
    with pytest.raises(TypeError, match="shared_vars must be a shared variable, its name.*int"):
        checkpoint.load(tmp_path / "s.npz", [3])
    forked(2)
    f, w, per, gen = _model()
    synk.distribute()
    path = tmp_path / "c.npz"
    checkpoint.save(path, ["w", gen], metadata={"k": 1})
    for r in range(2):
        synk.set_value(r, w, np.zeros(3, "float32"))
    assert checkpoint.load(path, ["w", "gen"]) == {"k": 1}
    np.testing.assert_array_equal(synk.gather(w), [np.linspace(-1, 1, 3).astype("float32")] * 2)
    with pytest.raises(ValueError, match="load: no shared variable named 'W' is used"):
        checkpoint.load(path, ["W"])
    with pytest.raises(ValueError, match="appears twice"):
        checkpoint.load(path, ["w", w])
    with pytest.raises(ValueError, match="not used by any function given to distribute"):
        checkpoint.load(path, [pytensor.shared(np.zeros(3, "float32"), name="w")])
    assert checkpoint.load(path, [w, gen]) == {"k": 1}  # still usable


def test_broken_file_in_a_run(forked, tmp_path):
    forked(2)
    f, w, per, gen = _model()
    synk.distribute()
    path = tmp_path / "c.npz"
    checkpoint.save(path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="is not a synkhronos checkpoint"):
        checkpoint.load(path)
    checkpoint.save(path)  # replaces the broken file
    checkpoint.load(path)
