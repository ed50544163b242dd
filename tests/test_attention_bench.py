"""``benchmarks/attention_bench.py`` on the CPU: its checks before the run, a tiny sweep (the
Pallas kernel in interpret mode, so its layout adaptation is checked against ``xla``), and the
bytes and FLOPs it reports, by hand."""

from __future__ import annotations

import json
import re
import sys

import pytest
from testutil import load_benchmark

TINY = [
    "--batch",
    "2",
    "--context",
    "40",
    "--chunks",
    "32",
    "--prefixes",
    "20",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "16",
    "--block-size",
    "4",
    "--key-chunk",
    "16",
    "--tile",
    "8",
    "--warmup",
    "1",
    "--iters",
    "2",
    "--inner",
    "2",
    "--copy-gb",
    "0.001",
    "--seed",
    "3",
]


@pytest.fixture(scope="module")
def bench():
    yield load_benchmark("attention_bench")
    sys.modules.pop("attention_bench", None)


@pytest.fixture(scope="module")
def cases(bench):
    """``benchmarks/attention_cases.py``, as ``attention_bench.py`` loads it."""
    return bench._attention_cases()


@pytest.mark.slow
def test_runs_every_implementation_on_tiny_shapes(bench, tmp_path, capsys):
    plot = [] if bench.bm.matplotlib_missing() is None else ["--no-plot"]
    assert bench.main(["--out", str(tmp_path), *TINY, "--pallas-interpret", *plot]) == 0
    report = json.loads((tmp_path / "attention.json").read_text())
    assert report["bandwidth"]["gb_s"] > 0 and report["environment"]["platform"] == "cpu"
    cell = {(r["kind"], r["impl"]): r for r in report["records"]}
    assert len(report["records"]) == 8
    for kind in ("decode", "prefill"):
        xla = cell[kind, "xla"]
        assert xla["status"] == "ok" and xla["median_us"] > 0 and xla["gb_s"] > 0
        assert xla["pct_bw"] == pytest.approx(100 * xla["gb_s"] / report["bandwidth"]["gb_s"])
        assert cell[kind, "cuda"]["status"] == "skipped"
        # Where the extension is built the reason is the platform, else the missing build.
        assert re.search("cpu|not built", cell[kind, "cuda"]["reason"])
        assert cell[kind, "cudnn"]["status"] == "skipped"
    assert "prompt tiles only" in cell["decode", "cudnn"]["reason"] or re.search(
        "cpu|not built", cell["decode", "cudnn"]["reason"]
    )
    pallas = cell["decode", "pallas"]
    assert pallas["status"] == "ok" and pallas["rel_err"] < 2e-2 and not pallas["flagged"]
    assert "decode kernel" in cell["prefill", "pallas"]["reason"]
    assert cell["prefill", "xla"]["tflop_s"] > 0
    md = (tmp_path / "attention.md").read_text()
    assert "## decode" in md and "## prefill" in md and "pallas err" in md
    assert "| 2 | 40 |" in capsys.readouterr().out
    assert plot or (tmp_path / "attention.png").stat().st_size > 0


def test_skips_caches_over_the_limit(bench, tmp_path):
    assert (
        bench.main(
            [
                "--out",
                str(tmp_path),
                *TINY,
                "--no-prefill",
                "--impls",
                "xla",
                "--max-cache-gb",
                "1e-6",
                "--no-plot",
            ]
        )
        == 0
    )
    (record,) = json.loads((tmp_path / "attention.json").read_text())["records"]
    assert record["status"] == "skipped" and "--max-cache-gb" in record["reason"]


def test_checks_before_running(bench, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "run", lambda *a: pytest.fail("ran"))
    for argv, message in (
        (["--batch", "0"], "--batch: values must be >= 1"),
        (["--no-decode", "--no-prefill"], "nothing to run"),
        (["--impls", "triton"], "invalid choice"),
        (["--context", "x"], "is not an integer"),
    ):
        with pytest.raises(SystemExit):
            bench.main(["--out", str(tmp_path), *argv])
        assert message in capsys.readouterr().err
    assert bench.main(["--out", str(tmp_path), *TINY, "--chunks", "12", "--no-plot"]) == 2
    assert "not multiples of --tile 8" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path)])
    assert "--no-plot" in capsys.readouterr().err


def test_bytes_and_flops_by_hand(cases):
    # decode: 2 requests x 10 keys x 2 kv heads x D 8 x 2 bytes x (K, V) = 1280, q + out:
    # 2 rows x 4 heads x 8 x 2 bytes x 2 = 256.
    decode = cases.Case("decode", batch=2, context=10)
    assert cases.moved_bytes(decode, 4, 2, 8, 2) == 1280 + 256
    assert cases.attention_flops(decode, 4, 8) == 4 * 8 * 4 * 20
    # prefill: 4 rows after 3 cached positions see 4, 5, 6, 7 keys: 22 pairs; 7 keys are read.
    prefill = cases.Case("prefill", chunk=4, prefix=3)
    assert prefill.pairs == 22 and prefill.keys == 7
    assert cases.attention_flops(prefill, 4, 8) == 4 * 8 * 4 * 22
    assert cases.moved_bytes(prefill, 4, 2, 8, 2) == 7 * 2 * 8 * 2 * 2 + 2 * 4 * 4 * 8 * 2
