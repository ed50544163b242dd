"""``benchmarks/results/`` stays small enough to read: JSON and markdown only, within its file
and size budget, a README per session folder whose files exist, and every results path the
docs and the code cite exists (CONTRIBUTING.md, "Recording GPU results")."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MAX_FILES = 300
MAX_BYTES = 3 * 2**20
KEPT_SUFFIXES = {".json", ".md"}
SESSION = re.compile(r"\d{4}-\d{2}-\d{2}-(h100|h200)x\d+")
# A cited results path: `benchmarks/results/...`, or a session folder named on its own.
CITED = re.compile(
    r"benchmarks/results/[\w./-]*|(?<![\w/-])\d{4}-\d{2}-\d{2}-h[12]00x\d+(?:/[\w.-]+)*"
)
# Where results are cited: the docs, the package (docstrings, meta.source), the kernels'
# comments, the benchmarks and the tests.
CITING = [
    "README.md",
    "CHANGELOG.md",
    "CONTRIBUTING.md",
    "docs/*.md",
    "ffi/**/*",
    "jax_tokenweave/**/*.py",
    "jax_tokenweave/**/*.json",
    "benchmarks/*.py",
    "benchmarks/*.sh",
    "benchmarks/probes/*.py",
    "tests/*.py",
]


def result_files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.is_file())


def test_results_fit_their_budget():
    files = result_files()
    size = sum(p.stat().st_size for p in files)
    assert len(files) <= MAX_FILES, f"{len(files)} files (at most {MAX_FILES})"
    assert size <= MAX_BYTES, f"{size} bytes (at most {MAX_BYTES})"


def test_results_hold_json_and_markdown_only():
    """Logs, patches, call scripts, plots and profiler dumps stay out of the tree (a session's
    ``$OUT``); what a figure needs is in its JSON."""
    other = [str(p.relative_to(RESULTS)) for p in result_files() if p.suffix not in KEPT_SUFFIXES]
    assert not other, f"not JSON or markdown: {other}"


def test_every_session_folder_has_a_readme():
    folders = sorted(p for p in RESULTS.iterdir() if p.is_dir())
    assert folders, "benchmarks/results/ has no session folder"
    for folder in folders:
        assert SESSION.fullmatch(folder.name), f"{folder.name}: name it like 2026-11-24-h200x1"
        assert (folder / "README.md").is_file(), f"{folder.name} has no README.md"
    assert not [p for p in RESULTS.iterdir() if p.is_file()], "files belong in a session folder"


def _expand(pattern: str) -> list[str]:
    """``a/{b,c}_{1,2}.json`` -> its four paths (shell brace expansion, no nesting)."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _readme_paths(readme: Path) -> list[str]:
    """The files and folders a session README names in backticks, relative to its folder."""
    names = []
    for token in re.findall(r"`([^`\s]+)`", readme.read_text()):
        if token.startswith(".") and not token.startswith("../"):
            continue  # ".md": the markdown beside the JSON just named
        if token.startswith(("benchmarks/", "tests/", "jax_tokenweave/", "ffi/", "--", "$")):
            continue
        if token.endswith((".json", ".md", "/")):
            names += _expand(token)
    return names


@pytest.mark.parametrize("readme", sorted(RESULTS.glob("*/README.md")), ids=lambda p: p.parent.name)
def test_session_readme_names_existing_files(readme):
    missing = [n for n in _readme_paths(readme) if not list(readme.parent.glob(n))]
    assert not missing, f"{readme.relative_to(ROOT)} names missing files: {missing}"
    listed = {p for n in _readme_paths(readme) for p in readme.parent.glob(n)}
    listed |= {p.with_suffix(".md") for p in listed if p.suffix == ".json"}  # "`x.json`, `.md`"
    unlisted = [
        str(p.relative_to(readme.parent))
        for p in readme.parent.rglob("*")
        if p.is_file() and p != readme and not any(p == q or q in p.parents for q in listed)
    ]
    assert not unlisted, f"{readme.relative_to(ROOT)} does not say what these are: {unlisted}"


def cited_paths() -> dict[str, set[str]]:
    """``{cited path under benchmarks/results: files citing it}``; an output path of a command
    (after ``--out`` or ``OUT=``) is not a citation."""
    cited: dict[str, set[str]] = {}
    files = {p for pattern in CITING for p in ROOT.glob(pattern) if p.is_file()}
    for path in sorted(files - {Path(__file__)}):
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for match in CITED.finditer(text):
            before = text[max(0, match.start() - 6) : match.start()]
            if before.endswith(("--out ", "OUT=")):
                continue
            name = match.group(0).removeprefix("benchmarks/results/").rstrip(".-/")
            cited.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return cited


def test_cited_results_exist():
    cited = cited_paths()
    assert any("2026-11-26-h200x4" in name for name in cited), "the citation scan found nothing"
    missing = {name: sorted(by) for name, by in cited.items() if not (RESULTS / name).exists()}
    assert not missing, f"cited under benchmarks/results/ but missing: {missing}"
