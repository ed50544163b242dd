"""Parity with ``transformers``: logits and greedy generation of tiny Llama, Qwen2 and Mixtral
checkpoints loaded at TP 1, 2 and 4, with the weave schedule on and off (float32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_testutil import KINDS, import_or_skip, make_hf_model, save_checkpoint

from jax_tokenweave import from_pretrained
from jax_tokenweave.serving import Engine, ServingConfig
from jax_tokenweave.split import plan_batch

torch = import_or_skip("torch")             # under CI (env CI set): fail, never skip
import_or_skip("transformers")

LOGIT_LENGTHS = (5, 11, 3)          # ragged; a forced split cuts request 1
GEN_LENGTHS = (5, 12, 16)           # one bucket: 16 tokens, P=4 prompts (one padding)
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per kind: checkpoint path, prompts, HF logits per prompt, HF greedy continuations."""
    rng = np.random.default_rng(1234)
    out = {}
    for i, kind in enumerate(KINDS):
        model = make_hf_model(kind, seed=10 + i)
        path = save_checkpoint(model, str(tmp_path_factory.mktemp(kind)))
        logit_prompts = [rng.integers(0, 256, n) for n in LOGIT_LENGTHS]
        gen_prompts = [rng.integers(3, 256, n).tolist() for n in GEN_LENGTHS]
        with torch.no_grad():
            logits = [model(torch.tensor(p)[None]).logits[0].numpy() for p in logit_prompts]
            gens = []
            for p in gen_prompts:
                ids = model.generate(torch.tensor(p)[None], max_new_tokens=NEW_TOKENS,
                                     min_new_tokens=NEW_TOKENS, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
                gens.append(ids[0, len(p):].tolist())
        out[kind] = dict(path=path, logit_prompts=logit_prompts, logits=logits,
                         gen_prompts=gen_prompts, gens=gens)
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_parity(reference, cpu_mesh, kind, tp):
    ref = reference[kind]
    mesh = cpu_mesh(tp)
    model = from_pretrained(ref["path"], mesh, jnp.float32)
    assert type(model).__name__ == {"llama": "LlamaModel", "qwen2": "Qwen2Model",
                                    "mixtral": "MixtralModel"}[kind]

    # Logits of a ragged packed batch, baseline and weave (forced split cutting a request).
    tokens = jnp.asarray(np.concatenate(ref["logit_prompts"]), jnp.int32)
    want = np.concatenate(ref["logits"])
    graphdef, state = nnx.split(model)

    @jax.jit(static_argnames=("plan", "schedule"))
    def forward(state, tokens, *, plan, schedule):
        return nnx.merge(graphdef, state)(tokens, plan, schedule=schedule, comm="xla")

    for schedule, split in (("baseline", False), ("weave", True)):
        plan = plan_batch(LOGIT_LENGTHS, tp=tp, split=split)
        assert plan.split == split and (not split or plan.cut_request is not None)
        got = np.asarray(forward(state, tokens, plan=plan, schedule=schedule))
        rel = np.abs(got - want).max() / np.abs(want).max()
        assert rel < 1e-4, (schedule, rel)

    # Greedy generation: weave (prefill forced to split, token-sharded decode) and baseline.
    for schedule, force in (("weave", True), ("baseline", False)):
        engine = Engine(model, ServingConfig(max_batch=4, max_seq_len=64, schedule=schedule,
                                             force_split=force))
        assert engine.plan(4, 16).split == force
        got = engine.generate(ref["gen_prompts"], NEW_TOKENS, eos_token_ids=())
        assert got == ref["gens"], schedule
