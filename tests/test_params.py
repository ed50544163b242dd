"""Parameters carry Flax's own sharding metadata: ``nnx.get_partition_spec`` gives the real specs,
and an Orbax save/restore driven by that metadata keeps shardings and values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_testutil import import_or_skip
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from testutil import build_decoder

from jax_tokenweave.models.configs import get_config
from jax_tokenweave.nn.decoder import WeaveDecoder
from jax_tokenweave.nn.params import named_params, param_spec, partition_specs

COL, ROW, REP = P(None, "tp"), P("tp", None), P()
EXPECTED = {  # the parameter tables of jax_tokenweave.nn.decoder_layer and jax_tokenweave.nn.moe
    "input_layernorm": REP,
    "post_attention_layernorm": REP,
    "qkv_proj": COL,
    "o_proj": ROW,
    "gate_up_proj": COL,
    "down_proj": ROW,
    "qkv_bias": P("tp"),
    "moe.router": REP,
    "moe.gate_up_proj": P(None, None, "tp"),
    "moe.down_proj": P(None, "tp", None),
}


def _expected(name: str) -> P:
    return REP if name == "final_norm" else EXPECTED[name.split(".", 2)[2]]


def _flat(tree) -> dict[str, object]:
    return {".".join(map(str, path)): leaf for path, leaf in nnx.to_flat_state(tree)}


@pytest.mark.parametrize("name", ["tiny-qwen", "tiny-moe"])
def test_get_partition_spec_gives_the_real_specs(cpu_mesh, name):
    mesh = cpu_mesh(4)
    dec = WeaveDecoder(get_config(name, num_layers=1), mesh, dtype=jnp.float32, rngs=nnx.Rngs(0))
    specs = _flat(nnx.get_partition_spec(nnx.state(dec)))
    params = named_params(dec)
    assert set(specs) == set(params)
    kinds = set()
    for key, var in specs.items():
        spec = var.get_value()
        assert spec == _expected(key) == param_spec(params[key]), key
        value = params[key].get_value()
        assert value.sharding.is_equivalent_to(NamedSharding(mesh, spec), value.ndim), key
        kinds.add(spec)
    assert {COL, ROW, REP} <= kinds  # not every spec the same
    assert not any(hasattr(p, "tp_spec") for p in params.values())
    # shard_map's in_specs come from the same metadata
    in_specs = dict(jax.tree_util.tree_flatten_with_path(partition_specs(dec))[0])
    assert sorted(map(str, in_specs.values())) == sorted(str(v.get_value()) for v in specs.values())


def test_orbax_round_trip_keeps_shardings_and_values(cpu_mesh, rng, tmp_path):
    ocp = import_or_skip("orbax.checkpoint")  # in the test extra: CI fails where it is missing
    mesh = cpu_mesh(8)
    config = get_config("tiny-moe", num_layers=2)
    dec = build_decoder(config, mesh, jnp.float32, rng)
    # random everywhere, so a value restored into the wrong place shows
    dec.load_weights({n: rng.standard_normal(p[...].shape) for n, p in named_params(dec).items()})
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", nnx.state(dec))
    checkpointer.wait_until_finished()

    # Restore the way a Flax user does: the target's shardings come from Flax's metadata.
    abstract = nnx.eval_shape(
        lambda: WeaveDecoder(config, mesh, dtype=jnp.float32, rngs=nnx.Rngs(0))
    )
    graphdef, abstract_state = nnx.split(abstract)
    shardings = nnx.get_named_sharding(abstract_state, mesh)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings
    )
    restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "ckpt", target))
    checkpointer.close()

    before, after = named_params(dec), named_params(restored)
    assert set(before) == set(after)
    sharded = 0
    for name, param in before.items():
        want, got = param.get_value(), after[name].get_value()
        assert got.sharding.is_equivalent_to(want.sharding, want.ndim), name
        assert param_spec(after[name]) == param_spec(param) == _expected(name)
        sharded += param_spec(param) != REP
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    assert sharded >= 8  # per layer: qkv, o, the experts' gate_up and down
