"""docs/internals.md's map is the package as it is: every module in it, nothing that is gone.

The map is the tree in the page's first code block: a name ending in ``/`` opens a
folder, and the indentation says which folder a line belongs to.  The PyMC
extension's modules have a table of their own further down.
"""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "internals.md")
SOURCES = (".py", ".c", ".h")


def _page():
    with open(PAGE, encoding="utf-8") as f:
        return f.read()


def _mapped():
    """The paths the map names, relative to the project root (folders end in /)."""
    block = re.search(r"## The map\s+```\n(.*?)```", _page(), re.S).group(1)
    paths, stack = [], []  # stack: (indent, folder) of the folders open at this line
    for line in block.splitlines():
        m = re.match(r"( *)(\S+)", line)
        # A continuation line of a job starts far right; a name starts at an indent of
        # 2 per level and is a path-like word.
        if not m or not re.fullmatch(r"[\w.]+/?", m.group(2)):
            continue
        indent, name = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if stack and indent - stack[-1][0] != 2:
            continue  # deeper than one level below the open folder: the text of a job
        path = "".join(folder for _, folder in stack) + name
        paths.append(path)
        if name.endswith("/"):
            stack.append((indent, name))
    return paths


def _modules():
    found = []
    for folder, dirs, files in os.walk(os.path.join(ROOT, "synkhronos")):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = os.path.relpath(folder, ROOT) + "/"
        found += [rel + f for f in sorted(files) if f.endswith(SOURCES)]
    return found


def test_every_module_is_on_the_map():
    mapped = set(_mapped())
    missing = [m for m in _modules()
               if m not in mapped and not (m.endswith("/__init__.py") and m != "synkhronos/__init__.py")]
    assert not missing, f"docs/internals.md's map lacks {missing}"


def test_the_map_names_nothing_that_is_gone():
    gone = [p for p in _mapped() if not os.path.exists(os.path.join(ROOT, p.rstrip("/")))]
    assert not gone, f"docs/internals.md's map names {gone}, which do not exist"


def test_every_folder_of_the_package_is_on_the_map():
    folders = {m.rsplit("/", 1)[0] + "/" for m in _modules()}
    assert folders <= set(_mapped()), sorted(folders - set(_mapped()))


def test_the_pymc_table_names_every_pymc_module():
    table = _page().split("## The PyMC extension", 1)[1]
    named = set(re.findall(r"^\| `(\w+)` \|", table, re.M))
    folder = os.path.join(ROOT, "synkhronos", "extensions", "pymc")
    modules = {f[:-3] for f in os.listdir(folder) if f.endswith(".py") and f != "__init__.py"}
    assert named == modules, (sorted(modules - named), sorted(named - modules))


def test_the_map_parser_reads_nesting():
    # The parser itself: a module under a folder gets the folder's path.
    mapped = _mapped()
    assert "synkhronos/runtime/worker.py" in mapped
    assert "synkhronos/comm/leaders.py" in mapped
