"""``benchmarks/decode_bench.py`` and ``benchmarks/prefill_bench.py`` on the CPU (tiny config):
their checks before the run, a tiny run of each writing valid outputs with no compilation while
timed, and the roofline's bytes by hand."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
from testutil import load_benchmark

MODEL = [
    "--model",
    "tiny",
    "--layers",
    "1",
    "--block-size",
    "4",
    "--key-chunk",
    "8",
    "--prefill-tile",
    "8",
    "--dtype",
    "float32",
    "--copy-gb",
    "0.001",
]
DECODE = [
    *MODEL,
    "--batch",
    "2",
    "--context",
    "20",
    "--steps",
    "3",
    "--warm-steps",
    "1",
    "--max-num-batched-tokens",
    "64",
]


load = load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load("decode_bench")


@pytest.mark.slow
def test_decode_bench_times_pure_decode_steps(bench, tmp_path, capsys):
    plot = [] if bench.bm.matplotlib_missing() is None else ["--no-plot"]
    assert bench.main(["--out", str(tmp_path), *DECODE, *plot]) == 0
    report = json.loads((tmp_path / "decode.json").read_text())
    assert report["environment"]["device_kind"] and report["environment"]["git_commit"] != ""
    (r,) = report["records"]
    assert r["status"] == "ok" and r["compilations"] == 0 and r["steps"] == 3
    assert r["step_p90_ms"] >= r["step_p50_ms"] > 0 and r["tok_s"] > 0
    # Both prompts prefill in one step; keys read by the step timed call i (0, 1, 2) dispatches,
    # per request: the 20 prompt positions, the warm step's token, the token of the step still
    # in flight (async scheduling, the default) and i + 1 more (its own), 24 on average.
    assert r["prefill_steps"] == 1 and r["mean_keys"] == 2 * 24
    rf = bench.roofline()
    assert r["bytes"] == r["weight_bytes"] + rf.kv_bytes(48, 8, 8, 4, 1)
    assert r["roofline_ms"] == pytest.approx(r["bytes"] / report["bandwidth"]["gb_s"] / 1e6)
    assert r["ratio"] == pytest.approx(r["step_p50_ms"] / r["roofline_ms"])
    assert r["layout"] == {"rows": 8, "split": False, "attention": "xla"}
    assert r["floor_ms"] > 0 and r["floor_ratio"] == pytest.approx(r["step_p50_ms"] / r["floor_ms"])
    assert report["matmul"]["tflop_s"] > 0
    clocks = r["gpu_clocks"]  # nvidia-smi's samples, or why there are none
    assert (clocks["status"] == "ok" and clocks["samples"] > 0) or clocks["reason"]
    assert "| 2 | 20 |" in (tmp_path / "decode.md").read_text()
    assert plot or (tmp_path / "decode.png").stat().st_size > 0
    assert "roofline" in capsys.readouterr().out


@pytest.mark.slow
def test_decode_bench_with_penalties_compiles_nothing_while_timed(bench, tmp_path):
    """Every request its own penalty values: the timed steps run the processed sampler (its
    first use compiled in the warm step) and compile nothing."""
    argv = ["--out", str(tmp_path), *DECODE, "--penalties", "--profile-steps", "0", "--no-plot"]
    assert bench.main(argv) == 0
    (r,) = json.loads((tmp_path / "decode.json").read_text())["records"]
    assert r["status"] == "ok" and r["penalties"] and r["compilations"] == 0


@pytest.mark.slow
def test_prefill_bench_compares_engine_and_bare_stack(tmp_path):
    prefill = load("prefill_bench")
    argv = [
        "--out",
        str(tmp_path),
        *MODEL,
        "--workloads",
        "24x1",
        "8x2",
        "40x1",
        "--max-num-batched-tokens",
        "24",
        "--iters",
        "2",
        "--warmup",
        "1",
    ]
    assert prefill.main(argv) == 0
    records = json.loads((tmp_path / "prefill.json").read_text())["records"]
    assert [r["engine_steps"] for r in records] == [1, 1, 2]  # 40 tokens: chunks of 24
    for r in records:
        assert r["status"] == "ok" and r["compilations"] == 0
        # --schedule auto: the engine's default (weave), the bare stack in the same mode
        assert r["bare"]["mode"] == "weave-auto" and r["bare"]["status"] == "ok"
        assert r["ratio"] == pytest.approx(r["engine_ms"] / r["bare_ms"])
    assert "| 2 x 8 | 1 |" in (tmp_path / "prefill.md").read_text()


def test_checks_before_running(bench, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "run", lambda *a: pytest.fail("ran"))
    for argv, message in (
        (["--key-chunk", "6", "--block-size", "4"], "not a multiple of"),
        (["--model", "nope"], "unknown model config"),
        (["--max-num-batched-tokens", "100"], "multiple of --prefill-tile"),
        (["--batch", "0"], "must be >= 1"),
    ):
        with pytest.raises(SystemExit):
            bench.main(["--out", str(tmp_path), *argv])
        assert message in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path)])
    assert "--no-plot" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load("prefill_bench").parse_args(["--out", "x", "--workloads", "2048"])
    assert "is not LENxN" in capsys.readouterr().err


def test_roofline_bytes_by_hand(bench, cpu_mesh):
    import jax.numpy as jnp
    from flax import nnx

    from jax_tokenweave.harness import benchmarking as bm
    from jax_tokenweave.models.llama import LlamaModel

    rf = bench.roofline()
    # 1000 weight bytes + 2 requests x 10 keys x 2 kv heads x D 8 x 2 bytes x (K, V) x 3 layers.
    assert rf.decode_step_bytes(1000, 2, 10, 2, 8, 2, 3) == 1000 + 3840
    # tiny, 1 layer, float32: qkv 64x(16+8+8)x8, o 128x64, gate_up 64x256, down 128x64, two
    # norms and the final norm (64 each), the LM head 64x256; the embedding is not read.
    mesh = cpu_mesh(1)
    model = LlamaModel(bm.load_config("tiny", 1), mesh, dtype=jnp.float32, rngs=nnx.Rngs(0))
    elements = 64 * 256 + 128 * 64 + 64 * 256 + 128 * 64 + 3 * 64 + 64 * 256
    assert rf.weight_bytes(model, mesh.devices.flat[0]) == 4 * elements
    # TP 2: each device holds half of every sharded matrix and the whole norms.
    model2 = LlamaModel(bm.load_config("tiny", 1), cpu_mesh(2), dtype=jnp.float32, rngs=nnx.Rngs(0))
    sharded = elements - 3 * 64
    assert rf.weight_bytes(model2, cpu_mesh(2).devices.flat[0]) == 4 * (sharded // 2 + 3 * 64)


def test_decode_bench_sync_engine_reads_one_key_less(bench, tmp_path):
    """--sync: no step in flight when a timed call dispatches, so 23 keys on average."""
    assert bench.main(["--out", str(tmp_path), *DECODE, "--sync", "--no-plot"]) == 0
    (r,) = json.loads((tmp_path / "decode.json").read_text())["records"]
    assert r["status"] == "ok" and r["mean_keys"] == 2 * 23


def test_serial_floor_by_hand(bench):
    """tiny: GEMMs (K, N) (64, 256), (128, 64), (64, 256), (128, 64) and the head (64, 256):
    65536 weights, 4 bytes each. At 1 GB/s and 1 GFLOP/s (1e-3 TFLOP/s) a GEMM reads its
    weights in 4 KN ns and multiplies R rows in 2 R KN ns: bytes bound at R = 1, FLOPs at R = 4."""
    from jax_tokenweave.harness import benchmarking as bm

    rf, config = bench.roofline(), bm.load_config("tiny", 1)
    assert rf.projections(config, 1) == [(64, 256), (128, 64), (64, 256), (128, 64)]
    kv = 10**6  # 1 ms at 1 GB/s
    assert rf.serial_floor_ms(config, 1, 1, kv, 4, 1.0, 1e-3) == pytest.approx(1 + 0.262144)
    assert rf.serial_floor_ms(config, 1, 4, kv, 4, 1.0, 1e-3) == pytest.approx(1 + 0.524288)
    assert rf.serial_floor_ms(config, 2, 1, 0, 4, 1.0, 1e-3) == pytest.approx(0.131072)
    moe = dataclasses.replace(config, num_experts=4)
    assert rf.serial_floor_ms(moe, 1, 1, kv, 4, 1.0, 1e-3) is None
