"""The tuning table (``jax_tokenweave.weave.tuning``): entries, thresholds, model names, JSON,
and the table shipped with the package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jax_tokenweave.models.configs import get_config
from jax_tokenweave.weave import tuning
from jax_tokenweave.weave.tuning import DEFAULT_ENTRY, TuneEntry, TuneTable

ROOT = Path(__file__).resolve().parents[1]


def test_tune_entry_and_defaults():
    assert TuneEntry(offset=None, num_ctas=16, first_num_ctas=8) == DEFAULT_ENTRY
    assert DEFAULT_ENTRY.ctas(True) == 8 and DEFAULT_ENTRY.ctas(False) == 16
    assert TuneEntry(0, 4).ctas(True) == 4
    assert tuning.POLICY_ENTRY.ctas(True) is None  # the kernel policy decides
    hash(TuneEntry(-128, 32, 2))
    for bad in (
        dict(offset=None, num_ctas=0),
        dict(offset=None, num_ctas=65),
        dict(offset=None, num_ctas=8.0),
        dict(offset=1.5, num_ctas=8),
        dict(offset=None, num_ctas=8, first_num_ctas=65),
        dict(offset=None, num_ctas=True),
    ):
        with pytest.raises(ValueError):
            TuneEntry(**bad)


def test_lookup_nearest_at_or_below_and_wildcard():
    table = TuneTable(
        {
            ("m", 4, 1024): TuneEntry(0, 8),
            ("m", 4, 4096): TuneEntry(-128, 16, 8),
            ("m", 2, 2048): TuneEntry(128, 32),
            ("*", 4, 1): TuneEntry(None, 4),
            ("*", 4, 8192): TuneEntry(None, 2),
        },
        thresholds={("m", 4): 3000, ("*", 4): 5000},
    )
    assert table.entry("m", 4, 1024) == TuneEntry(0, 8)
    assert table.entry("m", 4, 4095) == TuneEntry(0, 8)
    assert table.entry("m", 4, 4096) == TuneEntry(-128, 16, 8)
    assert table.entry("m", 4, 100000) == TuneEntry(-128, 16, 8)  # its own rows first
    assert table.entry("m", 4, 1023) == TuneEntry(None, 4)  # below its own: wildcard
    assert table.entry("other", 4, 9000) == TuneEntry(None, 2)
    assert table.entry(None, 4, 10) == TuneEntry(None, 4)
    assert table.entry("m", 8, 4096) == DEFAULT_ENTRY  # no rows for TP 8
    mine = TuneEntry(None, 2)
    assert table.entry("m", 1, 5, default=mine) is mine
    assert (table.threshold("m", 4), table.threshold("x", 4), table.threshold("m", 2)) == (
        3000,
        5000,
        tuning.DEFAULT_THRESHOLD,
    )
    assert tuning.lookup("m", 4, 4096, table) == TuneEntry(-128, 16, 8)
    for bad in (("", 4, 8), ("m", 0, 8), ("m", 4, 0), ("m", 4, 8.0)):
        with pytest.raises(ValueError):
            table.entry(*bad)
    with pytest.raises(ValueError, match="threshold"):
        TuneTable(thresholds={("m", 2): 1})
    merged = table.merged(TuneTable({("m", 4, 1024): TuneEntry(5, 6)}, {("m", 4): 10}))
    assert merged.entry("m", 4, 2000) == TuneEntry(5, 6) and merged.threshold("m", 4) == 10
    assert merged.entry("m", 4, 5000) == TuneEntry(-128, 16, 8)


def test_model_name_by_shapes():
    llama = get_config("llama3-70b")
    table = TuneTable(models={"llama3-70b": tuning.signature(llama)})
    assert (
        table.model_name(get_config("llama3-70b", num_layers=4, vocab_size=1000)) == "llama3-70b"
    )  # layer shapes only
    assert table.model_name(get_config("qwen2.5-72b")) is None
    assert table.model_name(get_config("llama3-70b", intermediate_size=28160)) is None


def test_json_round_trip(tmp_path):
    table = TuneTable(
        {
            ("llama3-70b", 4, 8192): TuneEntry(-128, 16, 8),
            ("llama3-70b", 4, 2048): TuneEntry(None, 8),
            ("*", 2, 1): TuneEntry(None, None),
            ("qwen2.5-72b", 2, 4096): TuneEntry(256, 32, None),
        },
        thresholds={("*", 2): 4096, ("llama3-70b", 4): 2048},
        models={"llama3-70b": tuning.signature(get_config("llama3-70b"))},
        meta={"source": "a test"},
    )
    path = tmp_path / "tune.json"
    tuning.save(table, path, extra={("llama3-70b", 4, 8192): {"latency_ms": 1.5}})
    data = json.loads(path.read_text())
    assert data["format"] == tuning.FORMAT and len(data["entries"]) == 4
    assert data["entries"][2]["latency_ms"] == 1.5  # sorted: ("*", ...) and the 2048 row first
    loaded = tuning.load(path)
    assert loaded == table and loaded.meta == {"source": "a test"}
    assert tuning.from_json(tuning.to_json(TuneTable())) == TuneTable()


def test_reads_the_first_format():
    """The recorded 2 x H200 tuning run (format /1, entries only) still loads."""
    table = tuning.load(ROOT / "benchmarks/results/2026-11-23-h200x2/tune_llama3-70b_tp2.json")
    assert table.entry("llama3-70b", 2, 8192) == TuneEntry(0, 16)
    assert table.threshold("llama3-70b", 2) == tuning.DEFAULT_THRESHOLD


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ([], "format"),
        ({"format": "v0", "entries": []}, "format"),
        ({"format": tuning.FORMAT}, "entries"),
        ({"format": tuning.FORMAT, "entries": [1]}, "not an object"),
        ({"format": tuning.FORMAT, "entries": [{"model": "m", "tp": 2, "tokens": 8}]}, "num_ctas"),
        (
            {
                "format": tuning.FORMAT,
                "entries": [{"model": "m", "tp": 2, "tokens": 8, "num_ctas": 65}],
            },
            r"\[1, 64\]",
        ),
        (
            {
                "format": tuning.FORMAT,
                "entries": [{"model": "m", "tp": "2", "tokens": 8, "num_ctas": 8}],
            },
            "tp",
        ),
        (
            {
                "format": tuning.FORMAT,
                "entries": [{"model": "m", "tp": 2, "tokens": 8, "num_ctas": 8, "offset": "x"}],
            },
            "offset",
        ),
        (
            {
                "format": tuning.FORMAT,
                "entries": [{"model": "m", "tp": 2, "tokens": 8, "num_ctas": 8}] * 2,
            },
            "duplicate",
        ),
        (
            {"format": tuning.FORMAT, "entries": [], "thresholds": [{"model": "m", "tp": 2}]},
            "split_threshold",
        ),
        (
            {
                "format": tuning.FORMAT,
                "entries": [],
                "thresholds": [{"model": "m", "tp": 2, "split_threshold": 0}],
            },
            "threshold",
        ),
        ({"format": tuning.FORMAT, "entries": [], "models": {"m": 3}}, "models"),
    ],
)
def test_json_bad_input(tmp_path, data, match):
    with pytest.raises(ValueError, match=match):
        tuning.from_json(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        tuning.load(path)


def test_load_invalid_json(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        tuning.load(path)


def test_shipped_table():
    """The package's table loads, cites its measurements, and encodes the TP=2 rule."""
    table = tuning.shipped()
    assert tuning.DEFAULT_PATH.parent.parts[-2:] == ("jax_tokenweave", "weave")
    assert "2026-11-23-h200x2" in table.meta["source"]
    assert table.threshold("llama3-70b", 2) == table.threshold("qwen2.5-72b", 2) == 4096
    assert table.threshold("llama3-70b", 4) == tuning.DEFAULT_THRESHOLD
    assert table.model_name(get_config("llama3-70b", num_layers=8)) == "llama3-70b"
    assert table.model_name(get_config("qwen2.5-72b", num_layers=8)) == "qwen2.5-72b"
    assert table.entry("qwen2.5-72b", 2, 2048).num_ctas == 32
    assert "4096 at TP=2" in table.describe_thresholds()


def test_a_table_named_by_the_environment_merges_over_the_shipped(tmp_path, monkeypatch):
    """``JAX_TOKENWEAVE_TUNING``: its rows replace the shipped rows of the same keys (here the
    TP=2 split at 4096 tokens on copy engines, the threshold 2048), the others stay."""
    shipped = tuning.shipped()
    override = TuneTable(
        {("llama3-70b", 2, 4096): TuneEntry(None, 16, algo="ce")}, {("llama3-70b", 2): 2048}
    )
    path = tmp_path / "ce.json"
    tuning.save(override, path)
    monkeypatch.setenv(tuning.TUNING_ENV, str(path))
    table = tuning.shipped()
    assert table.entry("llama3-70b", 2, 4096) == TuneEntry(None, 16, algo="ce")
    assert table.threshold("llama3-70b", 2) == 2048
    assert table.threshold("qwen2.5-72b", 2) == shipped.threshold("qwen2.5-72b", 2)
    assert tuning.lookup("llama3-70b", 2, 4096).algo == "ce"  # what the planner reads
    monkeypatch.setenv(tuning.TUNING_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="JAX_TOKENWEAVE_TUNING"):
        tuning.shipped()
    (tmp_path / "bad.json").write_text("{")
    monkeypatch.setenv(tuning.TUNING_ENV, str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match=r"JAX_TOKENWEAVE_TUNING=.*not valid JSON"):
        tuning.shipped()
    monkeypatch.delenv(tuning.TUNING_ENV)
    assert (
        tuning.shipped() is tuning.shipped() and tuning.shipped().threshold("llama3-70b", 2) == 4096
    )


def test_the_copy_engine_override_holds_tp2_ce_rows():
    """``benchmarks/tuning_ce_tp2.json`` (measured rows for ``JAX_TOKENWEAVE_TUNING``) loads,
    and every row is TP 2 on copy engines."""
    table = tuning.load(Path(__file__).parents[1] / "benchmarks" / "tuning_ce_tp2.json")
    assert table.entries and all(k[1] == 2 and e.algo == "ce" for k, e in table.entries.items())
    assert "2026-11-28-h200x2" in table.meta["source"]
