"""``benchmarks/serve_bench.py`` on the tiny config (CPU): both engines, both workloads, the
outputs it writes, its checks before the run."""

from __future__ import annotations

import json
import sys

import pytest
from testutil import load_benchmark

TINY = [
    "--model",
    "tiny",
    "--layers",
    "1",
    "--tp",
    "2",
    "--num-requests",
    "5",
    "--prompt-len",
    "8",
    "40",
    "--output-len",
    "2",
    "6",
    "--rate",
    "200",
    "--max-num-batched-tokens",
    "16",
    "--max-num-seqs",
    "4",
    "--prefill-tile",
    "8",
    "--block-size",
    "4",
    "--key-chunk",
    "8",
    "--split-threshold",
    "16",
    "--collective",
    "xla",
    "--dtype",
    "float32",
]


def load():
    return load_benchmark("serve_bench")


@pytest.mark.slow
def test_serve_bench_runs_both_engines_on_both_workloads(tmp_path, capsys):
    bench = load()
    assert bench.main(["--out", str(tmp_path), *TINY]) == 0
    report = json.loads((tmp_path / "serve.json").read_text())
    assert set(report["runs"]) == {"all-at-once", "poisson"}
    for per in report["runs"].values():
        assert set(per) == {"weave", "baseline"}
        for schedule, r in per.items():
            assert r["output_tokens"] == sum(
                q["output_len"]
                for q in bench.make_requests(bench.parse_args(["--out", "x", *TINY]), 256)
            )
            assert r["output_tok_s"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0
            assert r["compilations"] == 0  # warm-up compiled every layout
            assert (r["split_steps"] > 0) == (schedule == "weave")
    assert set(report["throughput_ratio_weave_over_baseline"]) == {"all-at-once", "poisson"}
    for w in report["warmup"].values():
        assert w["loaded"] + w["compiled"] == w["layouts"] > 0 and w["seconds"] >= w["warmup_s"]
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert "weave / baseline" in (tmp_path / "serve.md").read_text()
    markdown = (tmp_path / "serve.md").read_text()
    assert "0 loaded" in markdown  # tests run with caching off
    assert "Warm-up, in run order" in markdown  # a later schedule's warm-up is not cold
    assert "| poisson | baseline |" in capsys.readouterr().out


def test_serve_bench_checks_before_running(monkeypatch, tmp_path, capsys):
    bench = load()
    monkeypatch.setattr(bench, "run", lambda *a: pytest.fail("ran"))
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), *TINY, "--prompt-len", "50", "10"])
    assert "MIN (50) exceeds MAX (10)" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), *TINY])
    err = capsys.readouterr().err
    assert "jax-tokenweave[plot]" in err and "--no-plot" in err
    text = " ".join(bench.build_parser().format_help().split())
    assert "(default: 128 4096)" in text and "(default: 64 512)" in text
