"""Checkpoint reading without transformers: a bfloat16 checkpoint written from our own model loads
back exactly; corrupt files and configs raise ``CheckpointError`` naming the file; the dtype is
checked; the model registry picks the class."""

from __future__ import annotations

import json
import os
import re
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jax_tokenweave import from_pretrained, hf
from jax_tokenweave.models import MODEL_CLASSES, register_model
from jax_tokenweave.models.configs import get_config
from jax_tokenweave.models.llama import LlamaModel
from jax_tokenweave.nn.params import logical_weights, named_params

CONFIG = get_config("tiny", num_layers=1)
HF_CONFIG = {  # config.json of CONFIG (tiny: llama3 rope scaling, untied)
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 8,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "eos_token_id": [7, 9],
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}


def write_checkpoint(path, weights: dict[str, np.ndarray], config: dict | None = None) -> str:
    """``weights`` (our logical parameter names) saved as a Hugging Face bfloat16 checkpoint."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {}
    for name, src in hf.hf_sources(CONFIG).items():
        value = np.asarray(weights[name]).astype(ml_dtypes.bfloat16)
        tensors[src.names] = np.ascontiguousarray(
            np.swapaxes(value, -1, -2) if src.transpose else value
        )
    save_file(tensors, os.path.join(path, hf.SINGLE_FILE))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(HF_CONFIG if config is None else config, f)
    return str(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, cpu_mesh_module):
    model = LlamaModel(
        CONFIG,
        cpu_mesh_module,
        dtype=jnp.float32,
        rngs=nnx.Rngs(int(np.random.SeedSequence().entropy % 2**31)),
    )
    weights = logical_weights(model)
    return write_checkpoint(tmp_path_factory.mktemp("bf16"), weights), weights


@pytest.fixture(scope="module")
def cpu_mesh_module():
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices("cpu")[:4]), ("tp",))


def test_bfloat16_checkpoint_round_trip(checkpoint, cpu_mesh_module):
    path, weights = checkpoint
    model = from_pretrained(path, cpu_mesh_module, jnp.float32)
    assert type(model) is LlamaModel and model.hf_info.eos_token_ids == (7, 9)
    got = logical_weights(model)
    for name, want in weights.items():
        exact = np.asarray(want).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(got[name][...]), exact, err_msg=name)
    qkv = named_params(model)["decoder.layers.0.qkv_proj"][...]  # 16 + 8 + 8 heads of 8
    assert qkv.addressable_shards[0].data.shape == (64, 64)


@pytest.mark.parametrize("dtype", [jnp.int32, np.uint8, "bool", "no-such-dtype"])
def test_from_pretrained_rejects_non_float_dtypes(checkpoint, cpu_mesh_module, dtype):
    with pytest.raises(ValueError, match="floating-point dtype"):
        from_pretrained(checkpoint[0], cpu_mesh_module, dtype)


def test_registry(checkpoint, cpu_mesh_module, monkeypatch):
    assert set(hf.SUPPORTED_MODEL_TYPES) <= set(MODEL_CLASSES)

    class Custom(LlamaModel):
        pass

    monkeypatch.setitem(MODEL_CLASSES, "llama", MODEL_CLASSES["llama"])
    register_model("llama", Custom)
    assert type(from_pretrained(checkpoint[0], cpu_mesh_module, jnp.float32)) is Custom
    with pytest.raises(ValueError, match="subclass LlamaModel"):
        register_model("llama", dict)


# ---- corrupt files ---------------------------------------------------------------------------


def _write_raw(path, header: bytes, body: bytes = b"") -> str:
    os.makedirs(path, exist_ok=True)
    file = os.path.join(path, hf.SINGLE_FILE)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + body)
    return file


@pytest.mark.parametrize(
    "header",
    [
        b"[]",  # not an object
        json.dumps({"w": {"shape": [2], "data_offsets": [0, 8]}}).encode(),  # no dtype
        b"\xff\xfe\x00garbage",  # not UTF-8
        b"{not json",
        json.dumps({"w": "F32"}).encode(),  # entry not an object
        json.dumps({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode(),
    ],
    ids=["list", "no-dtype", "garbage", "bad-json", "entry-string", "wrong-size"],
)
def test_corrupt_header_names_the_file(tmp_path, header):
    file = _write_raw(tmp_path / "c", header, b"\0" * 8)
    with pytest.raises(hf.CheckpointError, match=re.escape(file)):
        hf.SafetensorsCheckpoint(str(tmp_path / "c"))


def test_corrupt_header_through_from_pretrained(tmp_path, cpu_mesh_module):
    path = tmp_path / "c"
    file = _write_raw(path, b"[]")
    with open(path / "config.json", "w") as f:
        json.dump(HF_CONFIG, f)
    with pytest.raises(hf.CheckpointError, match=re.escape(file)):
        from_pretrained(str(path), cpu_mesh_module)


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("config.json", "[1, 2, 3]"),
        ("config.json", '"llama"'),
        ("config.json", "{"),
        ("generation_config.json", "[]"),
        ("generation_config.json", '{"eos_token_id": "x"}'),
        ("config.json", json.dumps({**HF_CONFIG, "eos_token_id": [1.5]})),
        ("model.safetensors.index.json", "[]"),
        ("model.safetensors.index.json", '{"weight_map": {"w": ["a"]}}'),
        ("model.safetensors.index.json", '{"weight_map": {"w": "../outside.safetensors"}}'),
    ],
)
def test_bad_json_files_name_the_file(checkpoint, tmp_path, cpu_mesh_module, name, content):
    import shutil

    path = tmp_path / "c"
    shutil.copytree(checkpoint[0], path)
    (path / name).write_text(content)
    with pytest.raises(hf.CheckpointError, match=re.escape(str(path / name))):
        from_pretrained(str(path), cpu_mesh_module)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_size": "64"}, "hidden_size must be int"),
        ({"num_hidden_layers": 1.5}, "num_hidden_layers must be int"),
        ({"rope_scaling": [1]}, "rope_scaling"),
        ({"rms_norm_eps": True}, "rms_norm_eps must be float"),
    ],
)
def test_mistyped_config_fields(tmp_path, change, match):
    path = tmp_path / "c"
    os.makedirs(path)
    with open(path / "config.json", "w") as f:
        json.dump({**HF_CONFIG, **change}, f)
    with pytest.raises(
        hf.UnsupportedConfigError, match=re.escape(str(path / "config.json")) + ".*" + match
    ):
        hf.load_hf_config(str(path))
