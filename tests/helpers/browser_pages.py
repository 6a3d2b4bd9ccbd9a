"""Look at the built documentation in a real browser (headless Chromium): widths and screenshots.

    python tests/helpers/browser_pages.py SITE [--shots DIR] [PAGE ...]

For every page (paths under SITE such as ``installation/index.html``; default:
every page), Chromium loads a copy with a small script added that measures, in
the laid-out page, every table and code block against the width of the text
column, and whether any stylesheet, script or font came from another host.
Prints one JSON line per page; exits 1 if a table is wider than the column.
With ``--shots``, saves a full-page PNG of each page there (1280 px wide).

``make docs-screenshots`` installs Chromium (Debian's package) and runs this;
tests/test_docs.py runs it where Chromium is installed.
"""

import argparse
import html
import json
import os
import shutil
import subprocess
import sys
import tempfile

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
WIDTH = 1280

MEASURE = """
<script>
window.addEventListener("load", function () {
  var main = document.querySelector("[role=main]") || document.body;
  var column = main.clientWidth;
  var out = {column: column, height: document.documentElement.scrollHeight,
             tables: [], remote: []};
  main.querySelectorAll("table").forEach(function (t, i) {
    var r = t.getBoundingClientRect(), m = main.getBoundingClientRect();
    out.tables.push({index: i, width: Math.round(t.scrollWidth),
                     overflows: t.scrollWidth > column + 1 || r.right > m.right + 1,
                     head: (t.rows[0] ? t.rows[0].innerText : "").slice(0, 60)});
  });
  document.querySelectorAll("script[src], link[href]").forEach(function (e) {
    var u = e.src || e.href;
    if (/^https?:/.test(u) && u.indexOf(location.host || "file:") < 0
        && (e.tagName == "SCRIPT" || e.rel == "stylesheet")) out.remote.push(u);
  });
  var pre = document.createElement("pre");
  pre.id = "synk-measure";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>
"""


def chromium():
    for name in CHROMIUM:
        path = shutil.which(name)
        if path:
            return path
    return None


def _run(browser, args, timeout=60):
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--no-first-run", "--disable-dev-shm-usage", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def measure(browser, site, page, tmp):
    """Load ``page`` of ``site`` with the measuring script; return what it found."""
    src = os.path.join(site, page)
    with open(src) as f:
        text = f.read()
    copy = os.path.join(os.path.dirname(src), "_synk_measure.html")
    with open(copy, "w") as f:
        f.write(text.replace("</body>", MEASURE + "</body>"))
    try:
        p = _run(browser, [f"--window-size={WIDTH},1000", "--virtual-time-budget=3000",
                           "--dump-dom", "file://" + copy])
    finally:
        os.remove(copy)
    start = p.stdout.find('<pre id="synk-measure">')
    if start < 0:
        raise RuntimeError(f"{page}: the browser gave no measurement: {p.stderr[-500:]}")
    body = p.stdout[start + len('<pre id="synk-measure">'):p.stdout.find("</pre>", start)]
    return json.loads(html.unescape(body))


def screenshot(browser, site, page, height, out):
    height = min(max(height, 800), 16000)
    p = _run(browser, [f"--window-size={WIDTH},{height}", f"--screenshot={out}",
                       "--virtual-time-budget=3000", "file://" + os.path.join(site, page)])
    if not os.path.exists(out):
        raise RuntimeError(f"{page}: no screenshot: {p.stderr[-500:]}")


def pages_of(site):
    found = []
    for folder, _, files in os.walk(site):
        for name in files:
            if name == "index.html" or (name.endswith(".html") and folder == site):
                found.append(os.path.relpath(os.path.join(folder, name), site))
    return sorted(p for p in found if p not in ("404.html", "search.html"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("site")
    ap.add_argument("pages", nargs="*")
    ap.add_argument("--shots", help="folder for full-page PNGs")
    args = ap.parse_intermixed_args(argv)
    browser = chromium()
    if browser is None:
        print("no Chromium found (make docs-screenshots installs it)", file=sys.stderr)
        return 2
    site = os.path.abspath(args.site)
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for page in args.pages or pages_of(site):
            got = measure(browser, site, page, tmp)
            wide = [t for t in got["tables"] if t["overflows"]]
            bad += len(wide) + len(got["remote"])
            print(json.dumps({"page": page, "column": got["column"], "tables": len(got["tables"]),
                              "too_wide": wide, "remote": got["remote"]}))
            if args.shots:
                os.makedirs(args.shots, exist_ok=True)
                name = page.replace("/index.html", "").replace("/", "_").replace(".html", "")
                screenshot(browser, site, page, got["height"],
                           os.path.join(args.shots, f"{name or 'home'}.png"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
