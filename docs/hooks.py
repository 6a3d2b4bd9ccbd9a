"""MkDocs hooks: bench/RESULTS.md and bench/HISTORY.md as site pages, with links that work on both.

The docs link to ``../bench/RESULTS.md`` and ``../bench/HISTORY.md`` (the files, as a
repository browser shows them), and the two link to each other by file name; the site
holds them as ``results.md`` and ``history.md`` and their pictures under ``img/``.
"""

import os
import re

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = {"results.md": os.path.join(ROOT, "bench", "RESULTS.md"),
         "history.md": os.path.join(ROOT, "bench", "HISTORY.md")}


def _page(match):
    return f"]({match.group(1).lower()}.md"


def on_files(files, config):
    for page, path in PAGES.items():
        files.append(File.generated(config, page, abs_src_path=path))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri in PAGES:
        # bench/'s pages link to the docs' pictures as ../docs/img/...
        markdown = re.sub(r"\]\(\.\./docs/", "](", markdown)
        return re.sub(r"\]\((RESULTS|HISTORY)\.md", _page, markdown)
    return re.sub(r"\]\(\.\./bench/(RESULTS|HISTORY)\.md", _page, markdown)
