"""The documentation builds with MkDocs in strict mode (a warning is an error)."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="docs tooling not installed (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings", reason="docs tooling not installed")
    pytest.importorskip("mkdocstrings_handlers.python", reason="docs tooling not installed")
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(site)], cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for page in ("index.html", "deep_learning/index.html", "pymc/index.html",
                 "troubleshooting/index.html", "api/core/index.html", "api/extensions/index.html"):
        assert (site / page).exists(), page
    # The API reference is generated from the docstrings.
    api = (site / "api" / "extensions" / "index.html").read_text()
    assert "make_flat_grad" in api and "Conv2D" in api
    core = (site / "api" / "core" / "index.html").read_text()
    assert "distribute" in core and "num_slices" in core
    shutil.rmtree(site)
