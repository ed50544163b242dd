"""The README's two set-up commands are the ones CI and the docs use, and its API example runs."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```([\w+-]*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def code_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced code block of a markdown text."""
    return [(lang.lower(), body.strip()) for lang, body in FENCE.findall(text)]


def shell_blocks() -> list[str]:
    return [body for lang, body in code_blocks(README.read_text()) if lang in SHELL_LANGS]


def ci_test_command() -> str:
    match = re.search(r"^TEST_COMMAND=(.+)$", CI.read_text(), re.MULTILINE)
    assert match, ".ci/run must define TEST_COMMAND='...'"
    (value,) = shlex.split(match.group(1))
    return value


def test_readme_has_exactly_two_shell_blocks_of_one_line_each():
    blocks = shell_blocks()
    assert len(blocks) == 2, f"README needs exactly two shell code blocks, found {blocks}"
    for block in blocks:
        assert "\n" not in block, f"a set-up command must be one line: {block!r}"


def test_first_command_runs_the_main_job():
    main_job = shell_blocks()[0]
    assert main_job.startswith("pip install ")
    assert main_job.endswith("python -m jax_tokenweave.bench")


def test_second_command_is_what_ci_runs():
    tests = shell_blocks()[1]
    assert "pytest" in tests and "[test,parity]" in tests
    assert ci_test_command() == tests


def test_ci_script_runs_the_command_and_fails_on_no_tests():
    text = CI.read_text()
    assert os.access(CI, os.X_OK), ".ci/run must be executable"
    assert "set -euo pipefail" in text
    assert re.search(r'^bash -c "[^"]*\$TEST_COMMAND"', text, re.MULTILINE)
    assert "python3 -m venv" in text
    assert "ruff check ." in text
    assert "-eq 5" in text  # pytest's 'no tests collected' is reported as a failure


def ci_status_snippet() -> str:
    """The part of .ci/run that runs ``$TEST_COMMAND`` and maps its exit status (from
    ``status=0`` to the ``fi`` closing the status checks), verbatim."""
    match = re.search(r"^status=0\n.*?^fi\n", CI.read_text(), re.MULTILINE | re.DOTALL)
    assert match, ".ci/run must run the test command after 'status=0' and check it in an if/fi"
    snippet = match.group(0)
    assert "$TEST_COMMAND" in snippet and "-eq 5" in snippet
    return snippet


@pytest.mark.parametrize(
    ("tests", "want"),
    [
        ("", 5),  # collects no tests
        ("def test_ok():\n    pass\n", 0),
        ("def test_bad():\n    assert False\n", 1),
    ],
    ids=["no-tests", "passing", "failing"],
)
def test_ci_status_handling_fails_on_no_tests(tmp_path, tests, want):
    """Behavioural: .ci/run's status handling (run verbatim with a stub ``TEST_COMMAND``, as the
    script has no override hook) exits non-zero when pytest collects no tests."""
    (tmp_path / "test_stub.py").write_text(tests)
    command = f"{shlex.quote(sys.executable)} -m pytest -q -p no:cacheprovider test_stub.py"
    env = {**os.environ, "TEST_COMMAND": command}
    result = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + ci_status_snippet()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == want, result.stdout + result.stderr
    if want == 5:
        assert "no tests ran" in result.stdout and "collected no tests" in result.stderr


@pytest.mark.parametrize("ci", ["", "0", "false", "1", "true"])
def test_hf_tests_fail_instead_of_skip_under_ci(monkeypatch, ci):
    """The HF tests' ``import_or_skip``: a missing module skips, but fails where CI is set."""
    from hf_testutil import import_or_skip

    monkeypatch.setenv("CI", ci)
    missing = "jax_tokenweave_no_such_module"
    expected = ModuleNotFoundError if ci in ("1", "true") else pytest.skip.Exception
    with pytest.raises(expected, match=missing):
        import_or_skip(missing)
    assert import_or_skip("json").__name__ == "json"


def test_docs_name_the_same_main_job():
    from jax_tokenweave.harness import job

    assert "python -m jax_tokenweave.bench" in (job.__doc__ or "")
    assert job.build_parser().prog == "python -m jax_tokenweave.bench"
    gpu_script = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    assert "-m jax_tokenweave.bench" in gpu_script


def test_version_matches_the_package_metadata():
    from importlib.metadata import version

    import jax_tokenweave

    assert jax_tokenweave.__version__ == version("jax-tokenweave")


def test_readme_options_exist():
    """Every ``--option`` the README mentions is one the main job accepts."""
    from jax_tokenweave.harness import job

    known = {o for a in job.build_parser()._actions for o in a.option_strings}
    mentioned = set(re.findall(r"`(--[a-z][a-z-]*)`", README.read_text()))
    assert mentioned, "README should name the main job's options"
    assert mentioned <= known, f"README names unknown options: {mentioned - known}"


def python_block(marker: str) -> str:
    """The README's one python code block that contains ``marker``."""
    (block,) = [
        body
        for lang, body in code_blocks(README.read_text())
        if lang == "python" and marker in body
    ]
    return block


def test_readme_api_example_runs():
    """The API example works on the CPU devices of the test session."""
    pytest.importorskip("jax_tokenweave.nn.decoder")
    pytest.importorskip("jax_tokenweave.models.configs")
    example = python_block("WeaveDecoder")
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    out, plan, config = namespace["out"], namespace["plan"], namespace["config"]
    assert plan.is_split
    assert out.shape == (plan.num_tokens, config.hidden_size)


@pytest.mark.slow
def test_readme_serving_example_runs(tmp_path, capsys):
    """The serving example, on a tiny checkpoint (made with ``transformers``, with a tokenizer)
    in place of ``/path/to/checkpoint``."""
    from hf_testutil import import_or_skip, make_hf_model, save_char_tokenizer, save_checkpoint

    import_or_skip("torch")
    import_or_skip("transformers")
    path = save_char_tokenizer(save_checkpoint(make_hf_model("llama"), str(tmp_path)))
    example = python_block("LLM(")
    assert example.count("/path/to/checkpoint") == 1
    namespace: dict = {}
    exec(compile(example.replace("/path/to/checkpoint", path), "README.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert namespace["out"].finish_reason in ("stop", "length")
    assert namespace["out"].text in printed and namespace["delta"].finished


def markdown_section(text: str, heading: str) -> str:
    """The body of the markdown section ``heading`` (up to the next heading of its level)."""
    match = re.search(rf"^{re.escape(heading)}\n(.*?)(?=^#{{1,2}} |\Z)", text, re.M | re.S)
    assert match, f"no section {heading!r}"
    return match.group(1)


def test_layout_sections_name_every_part():
    """The README's layout section names every part of the package (each subpackage and each
    module at its top); ARCHITECTURE.md's tree also every module of those parts."""
    package = ROOT / "jax_tokenweave"
    parts = sorted(p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    top = sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py")
    readme = markdown_section(README.read_text(), "## Layout")
    missing = [f"{p}/" for p in parts if f"`{p}/`" not in readme]
    missing += [m for m in top if f"`{m}`" not in readme]
    assert not missing, f"the README's layout section misses {missing}"
    tree = markdown_section((ROOT / "docs" / "ARCHITECTURE.md").read_text(), "## Layout")
    names = set(re.findall(r"[\w.]+", tree))
    for part in parts:
        files = sorted(p.name for p in (package / part).iterdir() if p.suffix in (".py", ".json"))
        listed = f"{part}/" in tree and (
            part in ("hf", "models", "serving", "openai_server")  # described in prose
            or all(f in names for f in files if f != "__init__.py")
        )
        assert listed, f"docs/ARCHITECTURE.md's tree misses {part}/ or one of {files}"
    assert all(m in names for m in top), top


def test_layout_sections_name_serving_rooms_and_ffi_parts():
    """The README's layout section names each room of ``serving/`` and each part of ``ffi/``;
    ARCHITECTURE.md's tree names them too, and every module of each room."""
    serving, ffi = ROOT / "jax_tokenweave" / "serving", ROOT / "ffi"
    rooms = sorted(p for p in serving.iterdir() if (p / "__init__.py").is_file())
    ffi_parts = sorted(p.name for p in ffi.iterdir() if p.is_dir())
    assert len(rooms) >= 7 and ffi_parts == ["attention", "collective", "common"], ffi_parts
    readme = markdown_section(README.read_text(), "## Layout")
    missing = [f"{d}/" for d in [p.name for p in rooms] + ffi_parts if f"`{d}/`" not in readme]
    assert not missing, f"the README's layout section misses {missing}"
    tree = markdown_section((ROOT / "docs" / "ARCHITECTURE.md").read_text(), "## Layout")
    names = set(re.findall(r"[\w.]+", tree))
    for room in rooms:
        files = sorted(p.name for p in room.glob("*.py") if p.name != "__init__.py")
        assert f"{room.name}/" in tree and set(files) <= names, f"{room.name}/: {files}"
    assert all(f"{d}/" in tree for d in ffi_parts), ffi_parts
