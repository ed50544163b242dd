"""Every docstring of the package (module, class, function) is at most ten lines.

A docstring states role, contract and shapes; the design prose lives in ``docs/``.
"""

import ast
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jax_tokenweave"
MAX_LINES = 10

ALLOWED: set[str] = set()  # files exempt from the limit (none)


def long_docstrings() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        kinds = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        for node in [tree, *(n for n in ast.walk(tree) if isinstance(n, kinds))]:
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc.splitlines()) > MAX_LINES and rel not in ALLOWED:
                name = getattr(node, "name", "<module>")
                found.append(f"{rel}:{getattr(node, 'lineno', 1)} {name}")
    return found


def test_docstrings_are_at_most_ten_lines():
    assert long_docstrings() == [], "move the prose into docs/ and link it from the docstring"


def test_allowlist_names_existing_files():
    for rel in ALLOWED:
        assert (PACKAGE / rel).is_file(), rel


def test_docstrings_link_existing_docs():
    docs = PACKAGE.parent / "docs"
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in re.findall(r"docs/([A-Za-z0-9_]+\.md)", path.read_text(encoding="utf-8")):
            assert (docs / name).is_file(), f"{path}: docs/{name}"


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a markdown text's headings (lower case, punctuation but ``-`` and
    ``_`` dropped, spaces as ``-``): ``## serving.runner.step`` -> ``servingrunnerstep``."""
    headings = re.findall(r"^#+ (.+)$", markdown, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_docstrings_link_existing_doc_sections():
    """A moved or renamed module keeps its docstring's link to its section true."""
    docs = PACKAGE.parent / "docs"
    assert "servingrunnerstep" in heading_anchors("## serving.runner.step\n")
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for name, anchor in re.findall(r"docs/([A-Za-z0-9_]+\.md)#([\w-]+)", text):
            anchors = heading_anchors((docs / name).read_text(encoding="utf-8"))
            assert anchor in anchors, f"{path}: docs/{name}#{anchor}"
