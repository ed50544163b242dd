"""``benchmarks/gpu_session.sh``: a device call cut off by its time limit still brings back
what the finished stages wrote; a session's archive holds ``results/`` (JSON and markdown, a
README with every stage's command: what the tree keeps) apart from ``logs/``; and it refuses to
write into ``benchmarks/results``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"


def session_env(**variables: str) -> dict[str, str]:
    """The environment of a session run with this interpreter as its ``python3``."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return dict(os.environ, PATH=path, **variables)


def run_session(**variables: str) -> subprocess.CompletedProcess[str]:
    """One finished session with these variables."""
    env = session_env(**variables)
    return subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600
    )


def archive(out: Path) -> dict[str, bytes]:
    """``{member path: content}`` of the files in ``out/session.tgz``."""
    with tarfile.open(out / "session.tgz") as tgz:
        return {
            m.name.removeprefix("./"): tgz.extractfile(m).read()  # type: ignore[union-attr]
            for m in tgz.getmembers()
            if m.isfile()
        }


def test_a_cut_off_call_keeps_the_finished_stages(tmp_path):
    stuck = tmp_path / "test_stuck.py"  # a tests stage that outlives the call
    stuck.write_text("import time\n\ndef test_stuck():\n    time.sleep(120)\n")
    out = tmp_path / "out"
    env = session_env(STAGES="tests", TESTS=str(stuck), OUT=str(out))
    proc = subprocess.Popen(
        ["bash", str(SCRIPT)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (out / "session.tgz").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # what a device call's limit does to it
        proc.wait()
    assert "logs/env.log" in archive(out)  # written before the stuck stage began


def test_a_session_keeps_results_apart_from_logs(tmp_path):
    passing = tmp_path / "test_passing.py"
    passing.write_text("def test_one():\n    pass\n\ndef test_two():\n    pass\n")
    out = tmp_path / "out"
    env = session_env(
        STAGES="tests", TESTS=str(passing), OUT=str(out), JAX_TOKENWEAVE_COMMIT="abc1234"
    )
    proc = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = archive(out)
    results = sorted(n for n in files if n.startswith("results/"))
    assert results == ["results/README.md", "results/tests/gpu_tests.json"], sorted(files)
    assert {"logs/env.log", "logs/tests_1.log"} <= set(files)
    readme = files["results/README.md"].decode()
    assert "commit: abc1234" in readme and f"{passing}` | 0 |" in readme
    summary = json.loads(files["results/tests/gpu_tests.json"])
    assert summary["commit"] == "abc1234" and summary["runs"][0].startswith("2 passed")


@pytest.mark.slow
def test_a_benchmark_stage_writes_json_and_markdown_and_logs_the_rest(tmp_path):
    """The decode benchmark on CPU: its JSON and markdown in ``results/decode``, its output and
    its plot (where matplotlib is installed) in ``logs``."""
    out = tmp_path / "out"
    env = session_env(STAGES="decode", DECODE_ARGS="--steps 2", OUT=str(out))
    proc = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = archive(out)
    assert sorted(n for n in files if n.startswith("results/decode/")) == [
        "results/decode/decode.json",
        "results/decode/decode.md",
    ]
    assert "logs/decode.log" in files
    assert "`python3 -P benchmarks/decode_bench.py --out decode --steps 2` | 0 |" in (
        files["results/README.md"].decode()
    )
    if "logs/decode/decode.png" not in files:
        assert "matplotlib" in files["logs/decode.log"].decode()


def test_out_inside_the_results_tree_is_refused(tmp_path):
    out = ROOT / "benchmarks" / "results" / "not-a-session"
    proc = subprocess.run(
        ["bash", str(SCRIPT)],
        env=session_env(STAGES="tests", OUT=str(out)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "logs never go into the tree" in proc.stderr
    assert not out.exists()
