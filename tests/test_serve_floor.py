"""``benchmarks/serve_floor.py``: a served run's floor (GEMMs at the slower of their FLOPs and a
weight read per step, then the K/V reads), from a run and from a written ``serve.json``."""

from __future__ import annotations

import dataclasses
import json

import pytest
from testutil import load_benchmark

from jax_tokenweave.models.configs import CONFIGS


def _requests() -> list[dict]:
    return [
        {"prompt": [1, 2, 3], "max_tokens": 9, "output_len": 2},
        {"prompt": [1, 2, 3, 4, 5], "max_tokens": 1},  # ran to max_tokens
    ]


def _run(steps: int) -> dict:
    return {
        "prompt_tokens": 8,
        "prefix_cache_hits": 2,
        "output_tokens": 3,
        "steps": steps,
        "seconds": 2000.0,
    }


def test_floor_by_hand_for_the_tiny_config():
    """tiny (h 64, f 128, 2 layers, 16 x 8 query and 8 x 8 K/V dims, vocab 256) at TP 1:
    49,152 GEMM weights a layer, an LM head of 16,384; 2 bytes each."""
    floor = load_benchmark("serve_floor")
    tiny = CONFIGS["tiny"]
    assert floor.gemm_params(tiny, 1) == 2 * 49152
    assert floor.weight_bytes(tiny, 1, 2) == (2 * 49152 + 16384) * 2
    assert floor.context_positions(_requests()) == (3 + 4) + 5
    # 1 MFLOP/s and 1 kB/s: the FLOPs 2 * (98,304 * (8 - 2 + 3) rows + 16,384 * (2 + 3) head
    # rows) = 1,933,312 -> 1.93 s; 4 weight reads of 229,376 B -> 917.5 s; K/V of 12
    # positions * 8 heads * 8 dims * 2 (K, V) * 2 B * 2 layers = 6,144 B -> 6.144 s.
    f = floor.run_floor(tiny, 1, 2, _requests(), _run(4), tflop_s=1e-6, gb_s=1e-6)
    assert f["gemm_flops_s"] == pytest.approx(1.933312)
    assert f["gemm_weight_reads_s"] == pytest.approx(917.504)
    assert f["kv_reads_s"] == pytest.approx(6.144)
    assert f["floor_s"] == pytest.approx(917.504 + 6.144)
    assert f["measured_over_floor"] == pytest.approx(2000.0 / (917.504 + 6.144))
    # FLOPs bound where the weights are read once: the max takes the FLOPs.
    f = floor.run_floor(tiny, 1, 2, _requests(), _run(0), tflop_s=1e-6, gb_s=1e-6)
    assert f["floor_s"] == pytest.approx(1.933312 + 6.144)
    # TP 2 halves every rank's GEMMs, head and K/V heads.
    half = floor.run_floor(tiny, 2, 2, _requests(), _run(4), tflop_s=1e-6, gb_s=1e-6)
    assert half["gemm_weight_reads_s"] == pytest.approx(917.504 / 2)
    assert half["kv_reads_s"] == pytest.approx(6.144 / 2)


def test_no_floor_for_experts():
    floor = load_benchmark("serve_floor")
    moe = dataclasses.replace(CONFIGS["tiny"], num_experts=4, experts_per_token=2)
    assert floor.run_floor(moe, 1, 2, _requests(), _run(4), tflop_s=1.0, gb_s=1.0) is None


def test_cli_regenerates_the_workload_of_a_serve_json(tmp_path, capsys):
    """The floors of a written report are those of its seeded workload, run by run."""
    bench, floor = load_benchmark("serve_bench"), load_benchmark("serve_floor")
    argv = ["--out", "x", "--model", "tiny", "--layers", "2", "--workloads", "chat"]
    argv += ["--num-requests", "6", "--chat-prompt-median", "10", "--chat-output-median", "4"]
    argv += ["--chat-prompt-max", "40", "--chat-output-max", "8", "--chat-max-tokens", "8"]
    args = bench.parse_args(argv)
    requests = bench.make_requests(args, 256)["chat"]
    run = _run(20) | {
        "prompt_tokens": sum(len(r["prompt"]) for r in requests),
        "output_tokens": sum(r["output_len"] for r in requests),
    }
    config = {k: str(v) if k == "out" else v for k, v in vars(args).items()}
    report = {"model": "tiny", "layers": 2, "tp": 1, "config": config}
    report["runs"] = {"chat": {"weave": {"on-demand": run}}}
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(report))
    got = floor.from_report(report, 1e-6, 1e-6)["chat"]["weave"]["on-demand"]
    want = floor.run_floor(CONFIGS["tiny"], 1, 2, requests, run, tflop_s=1e-6, gb_s=1e-6)
    assert got == pytest.approx(want)
    assert floor.main([str(path), "--tflop-s", "1e-6", "--gb-s", "1e-6"]) == 0
    assert f"floor {want['floor_s']:.1f} s" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        floor.main([str(path), "--tflop-s", "0", "--gb-s", "1"])
    assert "must be positive" in capsys.readouterr().err


def test_report_shows_each_run_over_its_floor():
    """serve.md: an ``x floor`` column and the rates the floors were taken at."""
    report_lib = load_benchmark("serve_report")
    keys = ("output_tok_s", "total_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")
    run = dict.fromkeys((*keys, "tpot_p99_ms"), 1.0) | _run(4) | {"split_steps": 0}
    run |= {"preemptions": 0, "prefix_cache_queries": 0, "peak_running": 1, "failed": 0}
    run |= {"compilations": 0, "floor": {"measured_over_floor": 1.526}}
    report = {
        "model": "tiny",
        "layers": 2,
        "tp": 1,
        "environment": {"device_kind": "cpu"},
        "engine": {"num_blocks": 8, "block_size": 4, "max_num_seqs": 2},
        "kv_sizing": "--num-blocks",
        "runs": {"chat": {"weave": {"on-demand": run, "reserve": run | {"floor": None}}}},
        "throughput_ratio_weave_over_baseline": {},
        "rates": {"tflop_s": 790.0, "gb_s": 4200.0},
    }
    markdown = report_lib.to_markdown(report)
    assert "| x floor |" in markdown and "| 0 | 1.53 |" in markdown and "| 0 | - |" in markdown
    assert "at 790 TFLOP/s and 4200 GB/s" in markdown
