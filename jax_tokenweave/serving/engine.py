"""``Engine``: a KV cache, the jitted prefill/decode steps, and ``generate`` on top.

Static shapes (no recompilation per request):

* the cache is ``[L, max_batch, max_seq_len, KVH, D]``, made once (``serving.kv_cache``);
* prefill runs per group of prompts with the same *length bucket* ``Lb = next_pow2(len)``
  (at least ``min_prompt_bucket``), ``P = next_pow2(group size)`` prompts (at most
  ``max_batch``): one compilation per ``(P, Lb)`` pair;
* decode always runs all ``max_batch`` slots: one compilation.

So after one warm-up per bucket pair, a stream of requests compiles nothing. Sampling
parameters (``temperature``, ``top_p``) and the step's random key are traced values.

Each ``generate`` call serves its prompts in waves of ``max_batch``: prefill every prompt of
the wave into its own slot, then decode all slots together until each has produced
``max_new_tokens`` or an EOS token (which is kept in its output).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jax_tokenweave.serving import steps
from jax_tokenweave.serving.buckets import batch_bucket, length_bucket, next_pow2
from jax_tokenweave.serving.kv_cache import KVCache, init_cache
from jax_tokenweave.split import BatchPlan, plan_batch


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """Engine sizes and schedules.

    ``max_batch``: cache slots = sequences decoded together (rounded up to a power of two).
    ``max_seq_len``: cache rows per slot; a prompt plus its new tokens must fit.
    ``min_prompt_bucket``: smallest padded prompt length.
    ``schedule``: prefill schedule, ``"weave"`` or ``"baseline"``; ``comm``: its collectives
    (``"auto"``, ``"xla"``, ``"ffi"``, see ``WeaveDecoder``).
    ``weave_threshold``: the weave schedule splits a prefill batch of at least this many
    (padded) tokens in two halves; ``force_split``: True/False to always/never split.
    ``decode_impl``: ``allreduce_rmsnorm`` impl of decode steps (``"auto"``, ``"xla_rsag"``,
    ``"xla"``).
    """

    max_batch: int = 8
    max_seq_len: int = 512
    min_prompt_bucket: int = 16
    schedule: str = "weave"
    comm: str = "auto"
    weave_threshold: int = 1024
    force_split: bool | None = None
    decode_impl: str = "auto"

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_seq_len < 2 or self.min_prompt_bucket < 1:
            raise ValueError(f"bad serving sizes: {self}")
        if self.schedule not in ("weave", "baseline"):
            raise ValueError(f"schedule must be 'weave' or 'baseline', got {self.schedule!r}")
        if self.decode_impl not in steps.DECODE_IMPLS:
            raise ValueError(f"decode_impl must be one of {steps.DECODE_IMPLS}")


@functools.partial(jax.jit, static_argnames=("graphdef", "plan", "schedule", "comm"),
                   donate_argnums=(1,))
def _prefill_step(state, cache, tokens, last_index, slots, key, temperature, top_p, *,
                  graphdef, plan, schedule, comm):
    """``steps.prefill`` on ``nnx.merge(graphdef, state)``, jitted (shared by all engines of
    the same model structure, so equal shapes compile once)."""
    return steps.prefill(nnx.merge(graphdef, state), cache, tokens, last_index, slots, key,
                         temperature, top_p, plan=plan, schedule=schedule, comm=comm)


@functools.partial(jax.jit, static_argnames=("graphdef", "impl"), donate_argnums=(1,))
def _decode_step(state, cache, tokens, positions, key, temperature, top_p, *, graphdef, impl):
    """``steps.decode`` on ``nnx.merge(graphdef, state)``, jitted."""
    return steps.decode(nnx.merge(graphdef, state), cache, tokens, positions, key,
                        temperature, top_p, impl=impl)


class Engine:
    """Serves a causal LM (``LlamaModel`` or a subclass) with a KV cache.

    ``Engine(model, ServingConfig(...))``; then :meth:`generate`. The model's weights are read
    at construction (later changes to the model are not seen).
    """

    def __init__(self, model: Any, config: ServingConfig | None = None, *,
                 eos_token_ids: Sequence[int] | None = None) -> None:
        self.config = config = config or ServingConfig()
        self.model_config = model.config
        self.mesh = model.mesh
        self.axis_name = model.axis_name
        self.num_slots = next_pow2(config.max_batch)
        info = getattr(model, "hf_info", None)
        self.eos_token_ids = tuple(eos_token_ids if eos_token_ids is not None
                                   else (info.eos_token_ids if info is not None else ()))
        self._graphdef, self._state = nnx.split(model)
        dtype = model.embed.get_value().dtype
        self.cache: KVCache = init_cache(self.model_config, self.mesh, self.num_slots,
                                         config.max_seq_len, dtype, self.axis_name)

    # -- steps ----------------------------------------------------------------------------
    def plan(self, num_prompts: int, bucket: int) -> BatchPlan:
        """The prefill ``BatchPlan`` of ``num_prompts`` prompts padded to ``bucket`` tokens."""
        tp = self.mesh.shape[self.axis_name]
        return plan_batch([bucket] * num_prompts, tp=tp, threshold=self.config.weave_threshold,
                          split=self.config.force_split)

    def prefill(self, prompts: Sequence[Sequence[int]], slots: Sequence[int], key: jax.Array,
                temperature: float = 0.0, top_p: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """Prefill prompts (all of one length bucket) into ``slots``; returns each prompt's
        first new token int32 [n] and the logits of its last prompt token [n, V]."""
        n = len(prompts)
        bucket = length_bucket(max(len(p) for p in prompts), self.config.min_prompt_bucket)
        count = batch_bucket(n, self.num_slots)
        tokens = np.zeros((count, bucket), np.int32)
        last = np.zeros(count, np.int32)
        slot_ids = np.full(count, self.num_slots, np.int32)  # padding prompts: dropped
        for i, (p, s) in enumerate(zip(prompts, slots, strict=True)):
            tokens[i, :len(p)] = p
            last[i] = len(p) - 1
            slot_ids[i] = s
        nxt, logits, self.cache = _prefill_step(
            self._state, self.cache, tokens, last, slot_ids, key, np.float32(temperature),
            np.float32(top_p), graphdef=self._graphdef, plan=self.plan(count, bucket),
            schedule=self.config.schedule, comm=self.config.comm)
        return np.asarray(nxt)[:n], np.asarray(logits)[:n]

    def decode(self, tokens: np.ndarray, positions: np.ndarray, key: jax.Array,
               temperature: float = 0.0, top_p: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """One decode step over all slots: ``tokens``, ``positions`` int32 [num_slots].
        Returns the next tokens int32 [num_slots] and logits [num_slots, V]."""
        nxt, logits, self.cache = _decode_step(
            self._state, self.cache, np.asarray(tokens, np.int32),
            np.asarray(positions, np.int32), key, np.float32(temperature), np.float32(top_p),
            graphdef=self._graphdef, impl=self.config.decode_impl)
        return np.asarray(nxt), logits

    # -- generate -------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32, *,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 eos_token_ids: Sequence[int] | None = None) -> list[list[int]]:
        """New tokens for each prompt (lists of token ids), in order.

        Greedy when ``temperature <= 0``, else temperature + top-p sampling (``seed``). Each
        output stops after an EOS token (included) or ``max_new_tokens`` tokens.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompts = [list(map(int, p)) for p in prompts]
        vocab = self.model_config.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
            need = max(length_bucket(len(p), self.config.min_prompt_bucket),
                       len(p) + max_new_tokens - 1)
            if need > self.config.max_seq_len:
                raise ValueError(
                    f"prompt {i} ({len(p)} tokens, bucket "
                    f"{length_bucket(len(p), self.config.min_prompt_bucket)}) plus "
                    f"{max_new_tokens} new tokens needs {need} cache rows; max_seq_len is "
                    f"{self.config.max_seq_len}")
        eos = set(self.eos_token_ids if eos_token_ids is None else eos_token_ids)
        key = jax.random.key(seed)
        outputs: list[list[int]] = []
        for wave_start in range(0, len(prompts), self.num_slots):
            wave = prompts[wave_start:wave_start + self.num_slots]
            key, sub = jax.random.split(key)
            outputs.extend(self._generate_wave(wave, max_new_tokens, temperature, top_p, sub,
                                               eos))
        return outputs

    def _generate_wave(self, prompts: list[list[int]], max_new: int, temperature: float,
                       top_p: float, key: jax.Array, eos: set[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in prompts]
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(length_bucket(len(p), self.config.min_prompt_bucket), []).append(i)
        for members in groups.values():
            key, sub = jax.random.split(key)
            first, _ = self.prefill([prompts[i] for i in members], members, sub, temperature,
                                    top_p)
            for i, t in zip(members, first, strict=True):
                out[i].append(int(t))
        done = [len(o) >= max_new or o[-1] in eos for o in out]
        tokens = np.zeros(self.num_slots, np.int32)
        positions = np.zeros(self.num_slots, np.int32)
        for i, p in enumerate(prompts):
            tokens[i], positions[i] = out[i][-1], len(p)
        step = 0
        while not all(done):
            nxt, _ = self.decode(tokens, positions, jax.random.fold_in(key, step), temperature,
                                 top_p)
            step += 1
            for i in range(len(prompts)):
                if done[i]:
                    continue
                out[i].append(int(nxt[i]))
                tokens[i] = nxt[i]
                positions[i] += 1
                done[i] = len(out[i]) >= max_new or out[i][-1] in eos
        return out


def generate(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32, *,
             config: ServingConfig | None = None, **kwargs: Any) -> list[list[int]]:
    """One-shot ``Engine(model, config).generate(prompts, max_new_tokens, **kwargs)``.

    Builds a new engine (and compiles) per call; keep an :class:`Engine` to serve a stream.
    """
    if config is None:
        longest = max(len(p) for p in prompts)
        rows = max(length_bucket(longest), longest + max_new_tokens)
        config = ServingConfig(max_batch=min(len(prompts), 8), max_seq_len=next_pow2(rows))
    return Engine(model, config).generate(prompts, max_new_tokens, **kwargs)

