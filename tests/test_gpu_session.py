"""``benchmarks/gpu_session.sh``: a device call cut off by its time limit still brings back
what the finished stages wrote."""

from __future__ import annotations

import os
import signal
import subprocess
import tarfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_session.sh"


def test_a_cut_off_call_keeps_the_finished_stages(tmp_path):
    stuck = tmp_path / "test_stuck.py"  # a tests stage that outlives the call
    stuck.write_text("import time\n\ndef test_stuck():\n    time.sleep(120)\n")
    out = tmp_path / "out"
    env = dict(os.environ, STAGES="tests", TESTS=str(stuck), OUT=str(out))
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
    with tarfile.open(out / "session.tgz") as tgz:
        names = {Path(n).name for n in tgz.getnames()}
    assert "env.log" in names  # written before the stuck stage began
