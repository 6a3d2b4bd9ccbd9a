"""The ResNet demo on one GPU (GPU machines only): it trains and reports images/s."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.gpu_env import needs_gpu

pytestmark = needs_gpu

DEMO = Path(__file__).resolve().parents[2] / "demos" / "resnet" / "train_resnet.py"


@pytest.mark.skipif(not DEMO.exists(), reason="demos/resnet/train_resnet.py not present")
def test_resnet_demo_on_one_gpu():
    out = subprocess.run([sys.executable, str(DEMO), "--n-parallel", "1", "--no-serial",
                          "--steps", "3", "--warmup", "1"],
                         capture_output=True, text=True, timeout=550, cwd=DEMO.parents[2])
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    m = re.search(r"data-parallel \(1 ranks?\): ([0-9.]+) images/s", text)
    assert m and float(m.group(1)) > 0, text[-4000:]
