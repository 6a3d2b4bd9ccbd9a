"""The documentation builds (MkDocs, strict), reads well offline and documents the public API.

One build serves every check: no table wider than the text column, every link
and picture reachable inside the site, nothing loaded from another host, code
highlighted, the API reference complete for the public names and free of
internal ones, and docstrings rendered as written (no split Returns items, no
literal ``::``, no dunder turned into bold).  Where Chromium is installed the
widths are measured in the browser as well (tests/helpers/browser_pages.py).
"""

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from urllib.parse import unquote, urlparse

import pytest

import synkhronos as synk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPERS = os.path.join(ROOT, "tests", "helpers")
sys.path.insert(0, HELPERS)
import browser_pages  # noqa: E402

pytestmark = pytest.mark.timeout(170)

# The text column at a 1280 px window (docs/css/extra.css: 1000 px less the padding),
# and what the browser's table layout needs per column: the longest word (code may
# break at / _ , . = -) at about 7.6 px a character, plus the cell's padding.
COLUMN_PX = 876
CHAR_PX = 7.6
CODE_PAD_PX = 10
CELL_PAD_PX = 21

# Methods and names that are the library's own business, never on a public page.
INTERNAL = ["Function.attach", "Function.plan_call", "Function.runtime", "Function.forget_run",
            "Function.spec", "Data.describe", "Data.belongs_to", "Data.ready_for", "Data.memory",
            "Data.detach", "PlacedData.check_layout", "PlacedData.placed_on", "SaveMsg",
            "LoadMsg", "OverlapMsg", "DistributeMsg", "compressed.check_16bit", "CallMsg",
            "ProfileMsg", "LayoutMsg"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs", reason="docs tooling not installed (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings_handlers.python", reason="docs tooling not installed")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return str(out)


def _pages(site):
    return [os.path.join(site, p) for p in browser_pages.pages_of(site)]


def _read(path):
    with open(path) as f:
        return f.read()


class _Page(HTMLParser):
    """Tables (rows of cells of (text, in code)), links, ids and remote resources of a page."""

    def __init__(self):
        super().__init__()
        self.tables, self.links, self.ids, self.remote = [], [], set(), []
        self._open, self._cell, self._code = [], None, 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        for key in ("href", "src"):
            if a.get(key):
                self.links.append((tag, a[key]))
        if tag in ("script", "link", "img") and re.match(r"https?://", a.get("src") or
                                                        (a.get("href") if a.get("rel") == "stylesheet"
                                                         else "") or ""):
            self.remote.append(a.get("src") or a.get("href"))
        if tag == "table":
            self._open.append([])
        elif tag == "tr" and self._open:
            self._open[-1].append([])
        elif tag in ("td", "th") and self._open and self._open[-1]:
            self._cell = []
            self._open[-1][-1].append(self._cell)
        elif tag == "code":
            self._code += 1

    def handle_endtag(self, tag):
        if tag == "table" and self._open:
            self.tables.append(self._open.pop())
        elif tag in ("td", "th"):
            self._cell = None
        elif tag == "code":
            self._code = max(self._code - 1, 0)

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append((data, self._code > 0))


def _parse(path):
    page = _Page()
    page.feed(_read(path))
    return page


def table_min_width(rows):
    """Pixels a table needs at least: per column its longest unbreakable word, plus padding."""
    cols = {}
    for row in rows:
        for j, cell in enumerate(row):
            need = 0
            for text, code in cell:
                for word in re.split(r"[\s/_,.=-]+" if code else r"\s+", text):
                    if word:
                        need = max(need, len(word) * CHAR_PX + (CODE_PAD_PX if code else 0))
            cols[j] = max(cols.get(j, 0), need + CELL_PAD_PX)
    return sum(cols.values())


def test_table_width_estimate_flags_a_wide_table():
    wide = [[[("a-very-long-column-heading-word", False)]] * 12]
    narrow = [[[("rank", False)], [("what it holds, in a few words", False)]]]
    assert table_min_width(wide) > COLUMN_PX > table_min_width(narrow)


def test_no_table_is_wider_than_the_page(site):
    too_wide = []
    for path in _pages(site):
        for k, rows in enumerate(_parse(path).tables):
            width = table_min_width(rows)
            if width > COLUMN_PX:
                head = " | ".join("".join(t for t, _ in c) for c in rows[0])[:80] if rows else ""
                too_wide.append(f"{os.path.relpath(path, site)} table {k} ({head}): "
                                f"needs {width:.0f} px of {COLUMN_PX}")
    assert not too_wide, "\n".join(too_wide)
    # The stylesheet that lets cells wrap is on every page.
    for path in _pages(site):
        assert "css/extra.css" in _read(path), path


def test_every_link_and_picture_is_reachable(site):
    missing = []
    ids = {}
    for path in _pages(site):
        page = _parse(path)
        for tag, link in page.links:
            url = urlparse(link)
            if url.scheme or link.startswith("//") or link.startswith("mailto:"):
                continue
            target = os.path.normpath(os.path.join(os.path.dirname(path), unquote(url.path)))
            if not url.path:
                target = path
            if os.path.isdir(target):
                target = os.path.join(target, "index.html")
            if not os.path.exists(target):
                missing.append(f"{os.path.relpath(path, site)}: {link}")
                continue
            if url.fragment and target.endswith(".html"):
                if target not in ids:
                    ids[target] = _parse(target).ids
                if unquote(url.fragment) not in ids[target]:
                    missing.append(f"{os.path.relpath(path, site)}: {link} (no such anchor)")
    assert not missing, "\n".join(missing)
    # bench/RESULTS.md, which the docs cite for every figure, is a page of the site.
    assert os.path.exists(os.path.join(site, "results", "index.html"))


def test_pages_render_offline_with_highlighted_code(site):
    for path in _pages(site):
        page = _parse(path)
        assert not page.remote, f"{path} loads {page.remote}"
        assert "cdnjs" not in _read(path) and "hljs" not in _read(path), path
    home = _read(os.path.join(site, "index.html"))
    assert '<div class="highlight">' in home and 'class="kn"' in home  # Pygments' spans
    assert os.path.exists(os.path.join(site, "css", "pygments.css"))


def _api_pages(site):
    folder = os.path.join(site, "api")
    return {name: _read(os.path.join(folder, name, "index.html")) for name in os.listdir(folder)}


def test_api_reference_documents_the_public_api(site):
    api = _api_pages(site)
    ids = set()
    for text in api.values():
        ids |= set(re.findall(r'id="(synkhronos[\w.]*)"', text))
    names = {i.rsplit(".", 1)[-1] for i in ids}
    missing = [n for n in synk.__all__ if n not in names]
    assert not missing, f"not in the API reference: {missing}"
    for module, public in (("synkhronos.ingraph", ["psum", "pmean", "pmax", "pmin", "all_gather"]),
                           ("synkhronos.checkpoint", ["save", "load", "read"]),
                           ("synkhronos.extensions.train", ["make_train_function"]),
                           ("synkhronos.extensions.updates", ["adam", "make_flat_grad"]),
                           ("synkhronos.extensions.layers", ["Dense", "Conv2D"]),
                           ("synkhronos.extensions.pymc", ["data_parallel"])):
        for name in public:
            assert f"{module}.{name}" in ids, f"{module}.{name}"
    # The heart of the API, and distribute() the function (not its module's message).
    for want in ("synkhronos.Function.__call__", "synkhronos.distribute", "synkhronos.profile"):
        assert want in ids, want
    core = api["core"]
    i = core.index('id="synkhronos.Function.__call__"')
    for arg in ("batch_s", "num_slices", "output_subset"):
        assert arg in core[i:i + 8000], arg


def test_api_reference_shows_nothing_internal(site):
    for name, text in _api_pages(site).items():
        ids = re.findall(r'id="(synkhronos[\w.]*)"', text)
        for internal in INTERNAL:
            assert not [i for i in ids if i.endswith(internal)], f"{internal} on api/{name}"
        assert not [i for i in ids if i.endswith("Msg")], f"a message class on api/{name}"
        assert "where=" not in re.sub(r"<[^>]+>", "", text), f"an internal where= on api/{name}"


def test_docstrings_render_as_written(site):
    for name, text in _api_pages(site).items():
        plain = re.sub(r"<[^>]+>", "", text)
        assert not re.search(r"\w::\s*$", plain, re.M), f"a literal '::' on api/{name}"
        assert not re.search(r"[\w.]<strong>\w+</strong>", text), f"a dunder in bold on api/{name}"
        # A Returns section is one description (mkdocs.yml: returns_multiple_items: false).
        for section in re.findall(r"Returns:</th>(.*?)</td>", text, re.S):
            assert section.count("<li") <= 1, f"a Returns section split on api/{name}"


@pytest.mark.skipif(browser_pages.chromium() is None,
                    reason="Chromium not installed (make docs-screenshots installs it)")
def test_tables_fit_in_the_browser(site):
    pages = ["installation/index.html", "clusters/index.html", "internals/index.html",
             "pymc/index.html", "results/index.html", "compressed/index.html"]
    p = subprocess.run([sys.executable, os.path.join(HELPERS, "browser_pages.py"), site, *pages],
                       capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout + p.stderr


def _tested_versions():
    """docs/installation.md's "Tested versions" table: environment -> {column: text}."""
    text = open(os.path.join(ROOT, "docs", "installation.md")).read()
    table = text.split("## Tested versions", 1)[1].split("\n\n| environment", 1)[1]
    lines = ("| environment" + table).split("\n\n", 1)[0].splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = dict(zip(head, cells))
    return rows


def test_tested_versions_table_is_this_environment():
    """The row of the environment this run is in names what is installed here (major.minor),
    and "-" what is not."""
    import importlib.metadata
    import platform

    rows = _tested_versions()
    assert {".venv-current", ".venv", ".venv-pt236", ".venv-pymc", ".venv-openmpi"} <= set(rows)
    env = os.path.basename(sys.prefix)
    if env not in rows:
        pytest.skip(f"{sys.prefix} is not one of make test's environments")
    row = rows[env]
    assert row["Python"] == ".".join(platform.python_version_tuple()[:2]), row
    for column, dist in (("PyTensor", "pytensor"), ("NumPy", "numpy"), ("Numba", "numba"),
                         ("PyMC", "pymc"), ("nutpie", "nutpie"), ("ArviZ", "arviz")):
        try:
            installed = ".".join(importlib.metadata.version(dist).split(".")[:2])
        except importlib.metadata.PackageNotFoundError:
            installed = "-"
        assert row[column] == installed, (
            f"docs/installation.md's Tested versions say {column} {row[column]} for {env}; it has "
            f"{installed}: a new release came (or went), so run the suite and update the table")
