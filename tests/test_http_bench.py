"""``benchmarks/http_bench.py`` on CPU: one layer of the tiny config with random weights, a
server subprocess and the in-process engine on the same closed-loop workload; its outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jax_tokenweave.harness import benchmarking as bm

pytest.importorskip("httpx")
pytest.importorskip("fastapi")


@pytest.mark.slow
def test_http_bench_runs_both_ways(tmp_path, capsys):
    bench_file = Path(__file__).resolve().parents[1] / "benchmarks" / "http_bench.py"
    bench = bm.sibling_module(str(bench_file), "http_bench")
    assert (
        bench.main(
            [
                "--out",
                str(tmp_path),
                "--platform",
                "cpu",
                "--clients",
                "3",
                "--num-requests",
                "6",
                "--seed",
                "5",
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "http.json").read_text())
    args = bench.resolve(
        bench.build_parser().parse_args(
            [
                "--out",
                "x",
                "--platform",
                "cpu",
                "--clients",
                "3",
                "--num-requests",
                "6",
                "--seed",
                "5",
            ]
        )
    )
    made = sum(n for _, n in bench.make_requests(args, 256))
    for name in ("http", "inprocess"):
        run = report["runs"][name]
        assert run["requests"] == 6 and run["output_tokens"] == made
        assert run["output_tok_s"] > 0 and run["ttft_p99_ms"] >= run["ttft_p50_ms"] > 0
    assert report["runs"]["http"]["kv_blocks_in_use_after"] == ["tokenweave_kv_blocks_in_use 0.0"]
    assert report["http_over_inprocess"] > 0
    assert "HTTP / in-process" in (tmp_path / "http.md").read_text()
    assert "| inprocess |" in capsys.readouterr().out
