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
CHAT = [
    "--chat-prompt-median",
    "10",
    "--chat-output-median",
    "4",
    "--chat-prompt-max",
    "30",
    "--chat-output-max",
    "10",
    "--chat-max-tokens",
    "12",
    "--system-len",
    "20",
    "--question-len",
    "2",
    "6",
]


def load():
    return load_benchmark("serve_bench")


@pytest.mark.slow
def test_serve_bench_runs_both_engines_on_both_workloads(tmp_path, capsys):
    bench = load()
    argv = [*TINY, "--policies", "on-demand"]
    assert bench.main(["--out", str(tmp_path), *argv]) == 0
    report = json.loads((tmp_path / "serve.json").read_text())
    assert set(report["runs"]) == {"all-at-once", "poisson"}
    requests = bench.make_requests(bench.parse_args(["--out", "x", *argv]), 256)
    for workload, per in report["runs"].items():
        assert set(per) == {"weave", "baseline"}
        for schedule, by in per.items():
            (r,) = by.values()
            assert r["output_tokens"] == sum(q["output_len"] for q in requests[workload])
            assert r["output_tok_s"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0
            assert r["compilations"] == 0  # warm-up compiled every layout
            assert (r["split_steps"] > 0) == (schedule == "weave")
            assert r["failed"] == r["ended_by_client"] == 0
    assert set(report["throughput_ratio_weave_over_baseline"]) == {"all-at-once", "poisson"}
    for w in report["warmup"].values():
        assert w["loaded"] + w["compiled"] == w["layouts"] > 0 and w["seconds"] >= w["warmup_s"]
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert "weave / baseline" in (tmp_path / "serve.md").read_text()
    markdown = (tmp_path / "serve.md").read_text()
    assert "0 loaded" in markdown  # tests run with caching off
    assert "Warm-up, in run order" in markdown  # a later schedule's warm-up is not cold
    assert "| poisson | baseline | on-demand |" in capsys.readouterr().out


@pytest.mark.slow
def test_serve_bench_compares_the_kv_policies_on_chat_and_shared_prefix(tmp_path):
    """Chat lengths ended by the client below max_tokens, and a shared system prompt, under
    the three KV policies with a pool of 24 blocks: the reservation runs fewer at once and
    never preempts; the prefix cache hits only where it is on."""
    bench = load()
    argv = [*TINY, *CHAT, "--workloads", "chat", "shared-prefix", "--schedules", "weave"]
    argv += ["--num-requests", "8", "--num-blocks", "24", "--output-len", "4", "12", "--no-plot"]
    assert bench.main(["--out", str(tmp_path), *argv]) == 0
    report = json.loads((tmp_path / "serve.json").read_text())
    requests = bench.make_requests(bench.parse_args(["--out", "x", *argv]), 256)
    assert report["engine"]["num_blocks"] == 24 and report["kv_sizing"] == "--num-blocks"
    for workload in ("chat", "shared-prefix"):
        by = report["runs"][workload]["weave"]
        assert set(by) == {"on-demand", "reserve", "no-prefix-cache"}
        want = sum(q["output_len"] for q in requests[workload])
        for r in by.values():
            assert r["output_tokens"] == want and r["failed"] == 0
        assert by["reserve"]["preemptions"] == 0
        assert by["reserve"]["peak_running"] <= by["on-demand"]["peak_running"]
        assert by["no-prefix-cache"]["prefix_cache_hits"] == 0
    chat = report["runs"]["chat"]["weave"]
    assert all(r["ended_by_client"] == 8 for r in chat.values())  # every one below max_tokens
    assert all(q["max_tokens"] == 12 for q in requests["chat"])
    shared = report["runs"]["shared-prefix"]["weave"]
    assert shared["on-demand"]["prefix_cache_hits"] >= 16 * 4
    ratios = report["policy_ratios"]["shared-prefix"]["weave"]
    assert set(ratios) == {
        "total_tok_s_on_demand_over_reserve",
        "total_tok_s_cache_on_over_off",
        "ttft_p50_cache_off_over_on",
    }
    markdown = (tmp_path / "serve.md").read_text()
    assert "| chat | weave | reserve |" in markdown and "prefix cache off / on" in markdown


def test_serve_bench_checks_before_running(monkeypatch, tmp_path, capsys):
    bench = load()
    monkeypatch.setattr(bench, "run", lambda *a: pytest.fail("ran"))
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), *TINY, "--prompt-len", "50", "10"])
    assert "MIN (50) exceeds MAX (10)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), *TINY, "--chat-output-max", "4096"])
    assert "--chat-output-max (4096) exceeds --chat-max-tokens (2048)" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), *TINY])
    err = capsys.readouterr().err
    assert "jax-tokenweave[plot]" in err and "--no-plot" in err
    text = " ".join(bench.build_parser().format_help().split())
    assert "(default: 128 4096)" in text and "(default: 64 512)" in text
