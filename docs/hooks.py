"""MkDocs hooks: bench/RESULTS.md as a page of the site, and links to it that work on both.

The docs link to ``../bench/RESULTS.md`` (the file, as a repository browser shows
it); the site holds it as ``results.md`` and its pictures under ``img/``.
"""

import os
import re

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "RESULTS.md")
RESULTS_PAGE = "results.md"


def on_files(files, config):
    files.append(File.generated(config, RESULTS_PAGE, abs_src_path=RESULTS))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == RESULTS_PAGE:
        # bench/RESULTS.md links to the docs' pictures as ../docs/img/...
        return re.sub(r"\]\(\.\./docs/", "](", markdown)
    return re.sub(r"\]\(\.\./bench/RESULTS\.md", f"]({RESULTS_PAGE}", markdown)
