"""Hugging Face checkpoint reading: config mapping, per-rank sharded reads, clear errors."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import numpy as np
import pytest
from hf_testutil import hf_config, import_or_skip, make_hf_model, save_checkpoint
from jax.sharding import PartitionSpec as P

from jax_tokenweave import from_pretrained, hf
from jax_tokenweave.config import RopeScaling

import_or_skip("torch")  # make_hf_model builds the checkpoints with torch
import_or_skip("transformers")  # under CI (env CI set): fail, never skip


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf_loading")
    return {
        kind: save_checkpoint(make_hf_model(kind, seed=i), str(root / kind))
        for i, kind in enumerate(("llama", "qwen2", "mixtral"))
    }


def _all_tensors(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def _copy(src: str, dst) -> str:
    dst = str(dst)
    shutil.copytree(src, dst)
    return dst


# ---- config.json -> DecoderConfig ----------------------------------------------------------


def test_config_mapping(ckpts):
    llama = hf.load_hf_config(ckpts["llama"])
    assert llama.model_type == "llama" and llama.eos_token_ids == (2,)
    c = llama.config
    assert (c.hidden_size, c.intermediate_size, c.num_layers) == (64, 128, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (8, 4, 8, 256)
    assert c.tie_word_embeddings and not c.qkv_bias and c.num_experts == 0
    assert c.rope_theta == 10000.0
    assert c.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32)

    qwen = hf.load_hf_config(ckpts["qwen2"]).config
    assert qwen.qkv_bias and qwen.rope_scaling is None and not qwen.tie_word_embeddings

    mix = hf.load_hf_config(ckpts["mixtral"]).config
    assert (mix.num_experts, mix.experts_per_token) == (4, 2)


def test_config_legacy_rope_keys():
    raw = hf_config("llama").to_dict()
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 500000.0
    raw["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    c = hf.decoder_config_from_hf(raw)
    assert c.rope_theta == 500000.0 and c.rope_scaling.factor == 32.0


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
        ({"num_key_value_heads": 3}, "multiple"),
    ],
)
def test_unsupported_config(change, match):
    raw = {**hf_config("llama").to_dict(), **change}
    with pytest.raises(hf.UnsupportedConfigError, match=match):
        hf.decoder_config_from_hf(raw)


def test_sliding_window_warns():
    raw = hf_config("qwen2", use_sliding_window=True, sliding_window=64).to_dict()
    with pytest.warns(UserWarning, match="sliding_window"):
        hf.decoder_config_from_hf(raw)
    raw = hf_config("qwen2").to_dict()  # use_sliding_window=False: silent
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf.decoder_config_from_hf(raw)
    raw = hf_config("mixtral", sliding_window=4096).to_dict()
    with pytest.warns(UserWarning, match="ignored"):
        hf.decoder_config_from_hf(raw)


# ---- per-rank reads ------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_sharded_reads_match_and_read_only_own_slice(ckpts, cpu_mesh, tp, monkeypatch):
    mesh = cpu_mesh(tp)
    ckpt = hf.SafetensorsCheckpoint(ckpts["mixtral"])
    ref = _all_tensors(ckpts["mixtral"])
    reads: list[tuple[str, tuple]] = []
    real_read = hf.SafetensorsCheckpoint.read

    def spy(self, name, index=()):
        out = real_read(self, name, index)
        reads.append((name, out.shape))
        return out

    monkeypatch.setattr(hf.SafetensorsCheckpoint, "read", spy)
    q = "model.layers.0.self_attn.q_proj.weight"
    o = "model.layers.0.self_attn.o_proj.weight"
    experts = tuple(f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight" for e in range(4))
    cases = [
        (hf.Source(q, (64, 64), transpose=True), P(None, "tp"), ref[q].T),  # column-parallel
        (hf.Source(o, (64, 64), transpose=True), P("tp", None), ref[o].T),  # row-parallel
        (
            hf.Source(experts, (128, 64), transpose=True),
            P(None, None, "tp"),
            np.stack([ref[n].T for n in experts]),
        ),
        (hf.Source("model.norm.weight", (64,)), P(), ref["model.norm.weight"]),  # replicated
    ]
    parts = tuple(
        hf.Source(
            f"model.layers.0.self_attn.{x}_proj.weight",
            (64 if x == "q" else 32, 64),
            transpose=True,
        )
        for x in "qkv"
    )
    fused_want = np.concatenate(
        [np.concatenate([np.split(ref[p.names].T, tp, 1)[r] for p in parts], 1) for r in range(tp)],
        1,
    )
    for src, spec, want in cases:
        reads.clear()
        arr = hf.load_sharded(ckpt, src, mesh, spec, np.float32)
        assert arr.shape == want.shape
        np.testing.assert_array_equal(np.asarray(arr), want)
        for shard in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
        sharded = spec != P()
        full = int(np.prod(src.shape))
        for _, shape in reads:  # every read is one device's slice, never the whole tensor
            assert int(np.prod(shape)) == (full // tp if sharded else full)
        assert len(reads) == (tp if sharded else 1) * (len(experts) if src.stacked else 1)
    # q, k and v fused rank-blocked: each device reads its own rows of each of the three
    reads.clear()
    arr = hf.load_sharded(ckpt, hf.Fused(parts, tp), mesh, P(None, "tp"), np.float32)
    np.testing.assert_array_equal(np.asarray(arr), fused_want)
    assert sorted(reads) == sorted(
        (p.names, (p.shape[0] // tp, 64)) for p in parts for _ in range(tp)
    )


def test_dtype_cast(ckpts, cpu_mesh):
    import jax.numpy as jnp

    ckpt = hf.SafetensorsCheckpoint(ckpts["llama"])
    arr = hf.load_sharded(
        ckpt, hf.Source("model.norm.weight", (64,)), cpu_mesh(2), P(), jnp.bfloat16
    )
    assert arr.dtype == jnp.bfloat16


def test_bfloat16_file(tmp_path, cpu_mesh):
    import ml_dtypes
    from safetensors.numpy import save_file

    data = np.arange(32, dtype=np.float32).reshape(4, 8).astype(ml_dtypes.bfloat16)
    save_file({"w": data}, str(tmp_path / "model.safetensors"))
    ckpt = hf.SafetensorsCheckpoint(str(tmp_path))
    arr = hf.load_sharded(
        ckpt, hf.Source("w", (4, 8), transpose=True), cpu_mesh(2), P(None, "tp"), np.float32
    )
    np.testing.assert_array_equal(np.asarray(arr), data.astype(np.float32).T)


# ---- errors --------------------------------------------------------------------------------


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(hf.CheckpointError, match="does not exist"):
        hf.load_hf_config(str(tmp_path / "nope"))
    with pytest.raises(hf.CheckpointError, match=r"config\.json"):
        hf.load_hf_config(str(tmp_path))
    with pytest.raises(hf.CheckpointError, match="no safetensors"):
        hf.SafetensorsCheckpoint(str(tmp_path))


def test_missing_shard_file(ckpts, tmp_path):
    path = _copy(ckpts["llama"], tmp_path / "c")
    victim = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[1]
    os.remove(os.path.join(path, victim))
    with pytest.raises(hf.CheckpointError, match=f"missing shard file .*{victim}"):
        hf.SafetensorsCheckpoint(path)


def test_truncated_file(ckpts, tmp_path):
    path = _copy(ckpts["llama"], tmp_path / "c")
    victim = os.path.join(
        path, sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[0]
    )
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(hf.CheckpointError, match="truncated"):
        hf.SafetensorsCheckpoint(path)
    with open(victim, "r+b") as f:
        f.truncate(4)
    with pytest.raises(hf.CheckpointError, match="truncated"):
        hf.SafetensorsCheckpoint(path)


def test_index_lists_absent_tensor(ckpts, tmp_path):
    path = _copy(ckpts["llama"], tmp_path / "c")
    index_path = os.path.join(path, hf.INDEX_FILE)
    with open(index_path) as f:
        index = json.load(f)
    first_file = next(iter(index["weight_map"].values()))
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = first_file
    with open(index_path, "w") as f:
        json.dump(index, f)
    with pytest.raises(hf.CheckpointError, match=r"layers\.9\.mlp\.up_proj"):
        hf.SafetensorsCheckpoint(path)


def test_wrong_shape_and_missing_key(ckpts, cpu_mesh):
    ckpt = hf.SafetensorsCheckpoint(ckpts["llama"])
    with pytest.raises(hf.CheckpointError, match=r"shape \(64, 64\).*implies \(32, 64\)"):
        hf.load_sharded(
            ckpt,
            hf.Source("model.layers.0.self_attn.q_proj.weight", (32, 64)),
            cpu_mesh(1),
            P(),
            np.float32,
        )
    with pytest.raises(hf.CheckpointError, match=r"missing tensors: lm_head\.weight"):
        hf.load_sharded(ckpt, hf.Source("lm_head.weight", (256, 64)), cpu_mesh(1), P(), np.float32)


# ---- from_pretrained -----------------------------------------------------------------------


def _rewrite_without(path: str, victim: str) -> None:
    """Drop tensor ``victim`` from its shard file and from the index."""
    from safetensors.numpy import load_file, save_file

    index_path = os.path.join(path, hf.INDEX_FILE)
    with open(index_path) as f:
        index = json.load(f)
    shard = os.path.join(path, index["weight_map"].pop(victim))
    tensors = load_file(shard)
    tensors.pop(victim)
    save_file(tensors, shard, metadata={"format": "pt"})
    with open(index_path, "w") as f:
        json.dump(index, f)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mixtral"])
def test_from_pretrained_weights(ckpts, cpu_mesh, kind):
    from jax_tokenweave.models import MODEL_CLASSES
    from jax_tokenweave.nn.params import logical_weights, named_params, param_spec

    model = from_pretrained(ckpts[kind], cpu_mesh(4), np.float32)
    assert type(model) is MODEL_CLASSES[kind]
    ref = _all_tensors(ckpts[kind])
    params, logical = named_params(model), logical_weights(model)
    np.testing.assert_array_equal(
        np.asarray(params["embed"].get_value()), ref["model.embed_tokens.weight"]
    )
    attn = "model.layers.1.self_attn."
    np.testing.assert_array_equal(logical["decoder.layers.1.q_proj"], ref[attn + "q_proj.weight"].T)
    qkv = params["decoder.layers.1.qkv_proj"].get_value()
    assert qkv.sharding.spec == param_spec(params["decoder.layers.1.qkv_proj"]) == P(None, "tp")
    for r, shard in enumerate(sorted(qkv.addressable_shards, key=lambda s: s.index[1].start)):
        own = [np.split(ref[attn + f"{x}_proj.weight"].T, 4, axis=1)[r] for x in "qkv"]
        np.testing.assert_array_equal(np.asarray(shard.data), np.concatenate(own, 1))
    if kind == "llama":
        assert "lm_head" not in params  # tied
    if kind == "qwen2":
        np.testing.assert_array_equal(
            logical["decoder.layers.0.k_bias"], ref["model.layers.0.self_attn.k_proj.bias"]
        )
    if kind == "mixtral":
        w2 = np.asarray(params["decoder.layers.0.moe.down_proj"].get_value())
        np.testing.assert_array_equal(
            w2[3], ref["model.layers.0.block_sparse_moe.experts.3.w2.weight"].T
        )


def test_from_pretrained_missing_key(ckpts, cpu_mesh, tmp_path):
    path = _copy(ckpts["qwen2"], tmp_path / "c")
    _rewrite_without(path, "model.layers.1.self_attn.v_proj.bias")
    with pytest.raises(hf.CheckpointError, match=r"missing tensors: .*layers\.1\.self_attn\.v_"):
        from_pretrained(path, cpu_mesh(2), np.float32)


def test_from_pretrained_untied_without_lm_head(ckpts, cpu_mesh, tmp_path):
    path = _copy(ckpts["llama"], tmp_path / "c")
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw["tie_word_embeddings"] = False
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    with pytest.raises(hf.CheckpointError, match=r"missing tensors: lm_head\.weight"):
        from_pretrained(path, cpu_mesh(1), np.float32)


def test_from_pretrained_wrong_shape(ckpts, cpu_mesh, tmp_path):
    path = _copy(ckpts["mixtral"], tmp_path / "c")
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw["intermediate_size"] = 96
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)
    with pytest.raises(
        hf.CheckpointError,
        match=r"wrong shape.*w1\.weight: \(128, 64\), "
        r"expected \(96, 64\)",
    ):
        from_pretrained(path, cpu_mesh(2), np.float32)


def test_from_pretrained_truncated_and_bad_tp(ckpts, cpu_mesh, tmp_path):
    with pytest.raises(ValueError, match="num_kv_heads=4 is not divisible"):
        from_pretrained(ckpts["llama"], cpu_mesh(8), np.float32)
    path = _copy(ckpts["mixtral"], tmp_path / "c")
    victim = os.path.join(
        path, sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[-1]
    )
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    with pytest.raises(hf.CheckpointError, match="truncated"):
        from_pretrained(path, cpu_mesh(2), np.float32)


def test_from_pretrained_warns_unused(ckpts, cpu_mesh, tmp_path):
    from safetensors.numpy import save_file

    path = _copy(ckpts["llama"], tmp_path / "c")
    save_file(
        {"model.extra.weight": np.zeros(3, np.float32)}, os.path.join(path, "extra.safetensors")
    )
    index_path = os.path.join(path, hf.INDEX_FILE)
    with open(index_path) as f:
        index = json.load(f)
    index["weight_map"]["model.extra.weight"] = "extra.safetensors"
    with open(index_path, "w") as f:
        json.dump(index, f)
    with pytest.warns(UserWarning, match=r"not used by the model: model\.extra\.weight"):
        from_pretrained(path, cpu_mesh(1), np.float32)


@pytest.mark.slow
def test_generate_cli_with_token_ids(ckpts, capsys):
    """``python -m jax_tokenweave.generate`` on a checkpoint without a tokenizer: ids in, ids
    out."""
    from jax_tokenweave.generate import main

    assert (
        main(
            [
                ckpts["llama"],
                "--tp",
                "2",
                "--ids",
                "5,6,7",
                "--max-tokens",
                "4",
                "--dtype",
                "float32",
                "--max-model-len",
                "32",
                "--max-num-batched-tokens",
                "64",
                "--max-num-seqs",
                "8",
                "--prefill-tile",
                "8",
                "--key-chunk",
                "16",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.strip()
    assert line.startswith("5,6,7 -> ") and line.endswith("]")
    assert 1 <= len(line.split("->")[1].split()[0].split(",")) <= 4
