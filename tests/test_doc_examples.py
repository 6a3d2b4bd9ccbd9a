"""Every Python block of README.md and docs/*.md runs, each in a fresh process.

A block runs as it is, unless the line before its fence marks it:

- ``<!-- fragment -->``: part of a program the page describes around it; not run;
- ``<!-- fragment: NAME -->``: run with COMPLETIONS[NAME] around it, which
  defines what a reader would have from the rest of the page (a model, data)
  and checks what the block's comments claim;
- ``<!-- not run: REASON -->``: a whole program that cannot run here or in
  a few seconds (a cluster, minutes of sampling); REASON says where it is tested.

Every block must be one of these, so a new example is run or marked knowingly.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))
MARK = re.compile(r"<!-- (fragment(?:: (?P<name>[\w-]+))?|not run: (?P<why>.+)) -->")

_HEAD = """
import numpy as np
import pytensor as theano
import pytensor.tensor as T
import synkhronos as synk
"""

# A small classifier, as the deep-learning pages assume one: loss, params, x, y, data.
_MLP = _HEAD + """
from synkhronos.extensions import layers as L
rng = np.random.default_rng(0)
x, y = T.matrix("x"), T.ivector("y")
d1, d2 = L.Dense(8, 16), L.Dense(16, 3, init="glorot")
params = d1.params + d2.params
loss = L.softmax_cross_entropy(d2(L.relu(d1(x))), y).mean()
x_data = rng.standard_normal((64, 8)).astype("float32")      # NumPy arrays: calls take them
y_data = rng.integers(0, 3, 64).astype("int32")
batches = [rng.permutation(64)[:32] for _ in range(4)]
minibatches, idx = batches, batches[0]
"""

_FORKED = _MLP + """
synk.fork(2)
x_data, y_data = synk.data(x_data), synk.data(y_data)
"""

COMPLETIONS = {
    "mlp": (_MLP, ""),
    "mlp-forked": (_FORKED, ""),
    "function": (_HEAD + """
synk.fork(2)
x, y = T.matrix("x"), T.vector("y")
s = theano.shared(np.float32(0), name="s")
loss = T.mean(x.dot(y))
n_err = T.sum(T.lt(x.dot(y), 0))
""", """
synk.distribute()
a = np.random.default_rng(1).standard_normal((10, 4)).astype("float32")
b = np.ones(4, "float32")
got_loss, got_err = f(a, b)
assert np.allclose(got_loss, np.mean(a @ b), rtol=1e-5), (got_loss, np.mean(a @ b))
assert int(got_err) == int(np.sum(a @ b < 0))
"""),
    "data": (_HEAD + """
synk.fork(2)
x_train = np.random.rand(10, 3).astype("float32")
y = T.vector("y")
""", """
assert x_data.shape == (10, 3) and y_data.shape == (1000,) and y_data.dtype == y.dtype
assert m_data.minibatch and m_data.ndim == 2
"""),
    "collectives": (_HEAD + "synk.fork(2)\n", """
assert np.array_equal(synk.gather(s), [[10, 10], [10, 10]])   # every rank: [10, 10]
"""),
    "checkpoint": (_MLP + """
from synkhronos.extensions import make_train_function

def build_model_and_train_function():
    return make_train_function(loss, params, x, y, update_rule="adam")

n_steps, resuming = 4, False
""", """
from synkhronos import checkpoint as _ckpt
assert _ckpt.load("ckpt.npz") == {"step": 4}
"""),
    "checkpoint-file": (_HEAD + """
from synkhronos import checkpoint
w = theano.shared(np.arange(3.0), name="w")
checkpoint.save("ckpt.npz", [w])
""", """
assert manifest["format"] == "synkhronos-checkpoint" and list(first) == [0.0, 1.0, 2.0]
"""),
    "profile": (_FORKED + """
from synkhronos.extensions import make_train_function
train_step = make_train_function(loss, params, x, y, update_kwargs={"learning_rate": 0.1})
synk.distribute()
""", """
assert sorted(prof.records) == [0, 1] and os.path.getsize("steps.json") > 0
"""),
}


def blocks():
    """Every ```python block: (file, line, code, mark name or None, reason not run or None)."""
    found = []
    for name in FILES:
        with open(os.path.join(ROOT, name)) as f:
            lines = f.read().split("\n")
        k = 0
        while k < len(lines):
            if lines[k].strip() == "```python":
                end = lines.index("```", k + 1)
                mark = MARK.fullmatch(lines[k - 1].strip()) if k else None
                found.append((name, k + 1, "\n".join(lines[k + 1:end]),
                              mark and (mark.group("name") or "fragment"),
                              mark and mark.group("why")))
                k = end
            k += 1
    return found


BLOCKS = blocks()


def test_every_block_is_run_or_marked():
    assert len(BLOCKS) >= 20
    for name, line, _, mark, why in BLOCKS:
        if mark not in (None, "fragment") and why is None:
            assert mark in COMPLETIONS, f"{name}:{line}: no completion named {mark!r}"


RUN = [b for b in BLOCKS if b[3] != "fragment" and b[4] is None]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name,line,code,mark,why", RUN,
                         ids=[f"{b[0]}:{b[1]}" for b in RUN])
def test_block_runs(name, line, code, mark, why, tmp_path):
    before, after = COMPLETIONS.get(mark, ("", ""))
    program = "import os\n" + textwrap.dedent(before) + "\n" + code + "\n" + textwrap.dedent(after)
    script = tmp_path / "block.py"
    script.write_text(program)
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=140)
    assert p.returncode == 0, f"{name}:{line} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
