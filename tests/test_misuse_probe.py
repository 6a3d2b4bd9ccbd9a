"""The misuse probe (tests/helpers/misuse_probe.py): every case a clear error, the library usable after."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(180)
def test_every_probed_misuse_is_a_clear_error():
    p = subprocess.run([sys.executable, os.path.join(HERE, "helpers", "misuse_probe.py")],
                       cwd=HERE, capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stdout + p.stderr
    assert " 0 clear" not in p.stdout and "vague" not in p.stdout and "silent" not in p.stdout
