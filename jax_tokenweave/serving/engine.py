"""``Engine``: a KV cache, the jitted prefill/decode steps, and ``generate`` on top.

Static shapes (no recompilation per request):

* the cache is ``[L, max_batch, max_seq_len, KVH, D]``, made once (``serving.kv_cache``): one
  cache row per sequence decoded together;
* prefill runs per group of prompts with the same *length bucket* ``Lb = next_pow2(len)``
  (at least ``min_prompt_bucket``), ``P = next_pow2(group size)`` prompts (at most
  ``max_batch``): one compilation per ``(P, Lb)`` pair;
* decode always runs all ``max_batch`` cache rows: one compilation.

So after one warm-up per bucket pair, a stream of requests compiles nothing. Sampling
parameters (``temperature``, ``top_p``) and the step's random key are traced values.

Each ``generate`` call serves its prompts in waves of ``max_batch``: prefill every prompt of
the wave into its own cache row, then decode all rows together until each has produced
``max_new_tokens`` or an EOS token (which is kept in its output). Every argument is checked
first (``serving.checks``): a bad one raises ``ValueError`` naming it, before any work.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jax_tokenweave.layers import COMMS
from jax_tokenweave.serving import checks, steps
from jax_tokenweave.serving.buckets import batch_bucket, length_bucket, next_pow2
from jax_tokenweave.serving.kv_cache import KVCache, init_cache
from jax_tokenweave.split import BatchPlan, plan_batch


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """Engine sizes and schedules, checked at construction (``ValueError`` naming the field).

    ``max_batch``: cache rows = sequences decoded together (rounded up to a power of two).
    ``max_seq_len``: positions per cache row; a prompt's bucket and its new tokens must fit.
    ``min_prompt_bucket``: smallest padded prompt length (at most ``max_seq_len``).
    ``schedule``: ``"weave"`` or ``"baseline"``, of prefill and (unless ``decode_schedule`` is
    set) of decode; ``comm``: how weave's reductions are done (``"auto"``, ``"xla"``, ``"ffi"``,
    see ``WeaveDecoder``). ``weave_threshold``: the weave schedule splits a prefill batch of at
    least this many (padded) tokens in two halves (None: the shipped tuning table's for the
    model's shapes and TP degree, ``jax_tokenweave.tuning``); ``force_split``: True/False to
    always/never split. ``decode_schedule``: the decode steps' schedule where it differs from
    ``schedule``.
    """

    max_batch: int = 8
    max_seq_len: int = 512
    min_prompt_bucket: int = 16
    schedule: str = "weave"
    comm: str = "auto"
    weave_threshold: int | None = None
    force_split: bool | None = None
    decode_schedule: str | None = None

    def __post_init__(self) -> None:
        for name, minimum in (("max_batch", 1), ("max_seq_len", 2), ("min_prompt_bucket", 1),
                              ("weave_threshold", 2)):
            if getattr(self, name) is not None or name != "weave_threshold":
                checks.at_least(getattr(self, name), minimum, f"ServingConfig.{name}")
        if self.min_prompt_bucket > self.max_seq_len:
            raise ValueError(f"ServingConfig.min_prompt_bucket ({self.min_prompt_bucket}) "
                             f"exceeds max_seq_len ({self.max_seq_len}): no prompt would fit")
        for name in ("schedule", "decode_schedule"):
            value = getattr(self, name)
            if value not in steps.SERVING_SCHEDULES and (name == "schedule" or value is not None):
                raise ValueError(f"ServingConfig.{name} must be one of "
                                 f"{steps.SERVING_SCHEDULES}, got {value!r}")
        if self.comm not in COMMS:
            raise ValueError(f"ServingConfig.comm must be one of {COMMS}, got {self.comm!r}")
        if self.force_split is not None and not isinstance(self.force_split, bool):
            raise ValueError(f"ServingConfig.force_split must be True, False or None, got "
                             f"{self.force_split!r}")


@functools.partial(jax.jit, static_argnames=("graphdef", "plan", "schedule", "comm"),
                   donate_argnums=(1,))
def _prefill_step(state, cache, tokens, last_index, rows, key, temperature, top_p, *,
                  graphdef, plan, schedule, comm):
    """``steps.prefill`` on ``nnx.merge(graphdef, state)``, jitted (shared by all engines of
    the same model structure, so equal shapes compile once)."""
    return steps.prefill(nnx.merge(graphdef, state), cache, tokens, last_index, rows, key,
                         temperature, top_p, plan=plan, schedule=schedule, comm=comm)


@functools.partial(jax.jit, static_argnames=("graphdef", "schedule", "comm"),
                   donate_argnums=(1,))
def _decode_step(state, cache, tokens, positions, key, temperature, top_p, *, graphdef,
                 schedule, comm):
    """``steps.decode`` on ``nnx.merge(graphdef, state)``, jitted."""
    return steps.decode(nnx.merge(graphdef, state), cache, tokens, positions, key,
                        temperature, top_p, schedule=schedule, comm=comm)


class Engine:
    """Serves a causal LM (``LlamaModel`` or a subclass) with a KV cache.

    ``Engine(model, ServingConfig(...))``; then :meth:`generate`. The model's weights are read
    at construction (later changes to the model are not seen).
    """

    def __init__(self, model: Any, config: ServingConfig | None = None, *,
                 eos_token_ids: int | Sequence[int] | None = None) -> None:
        if config is not None and not isinstance(config, ServingConfig):
            raise ValueError(f"config must be a ServingConfig, got {type(config).__name__}")
        self.config = config = config or ServingConfig()
        self.model_config = model.config
        self.mesh = model.mesh
        self.axis_name = model.axis_name
        self.num_rows = next_pow2(config.max_batch)
        info = getattr(model, "hf_info", None)
        self.eos_token_ids = checks.eos_token_ids(
            eos_token_ids if eos_token_ids is not None
            else (info.eos_token_ids if info is not None else None))
        self._graphdef, self._state = nnx.split(model)
        dtype = model.embed.get_value().dtype
        self.cache: KVCache = init_cache(self.model_config, self.mesh, self.num_rows,
                                         config.max_seq_len, dtype, self.axis_name)
        self.decode_schedule = config.decode_schedule or config.schedule

    # -- steps ----------------------------------------------------------------------------
    def plan(self, num_prompts: int, bucket: int) -> BatchPlan:
        """The prefill ``BatchPlan`` of ``num_prompts`` prompts padded to ``bucket`` tokens: the
        split and the fused kernel's CTAs from the shipped tuning table (``split.plan_batch``
        with the model's config), unless ``weave_threshold`` / ``force_split`` say otherwise."""
        tp = self.mesh.shape[self.axis_name]
        return plan_batch([bucket] * num_prompts, tp=tp, config=self.model_config,
                          threshold=self.config.weave_threshold, split=self.config.force_split)

    def prefill(self, prompts: Sequence[Sequence[int]], rows: Sequence[int], key: jax.Array,
                temperature: float = 0.0, top_p: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """Prefill prompts (all of one length bucket, already checked) into cache ``rows``;
        returns each prompt's first new token int32 [n] and the logits of its last prompt
        token [n, V]."""
        n = len(prompts)
        bucket = length_bucket(max(len(p) for p in prompts), self.config.min_prompt_bucket)
        count = batch_bucket(n, self.num_rows)
        tokens = np.zeros((count, bucket), np.int32)
        last = np.zeros(count, np.int32)
        row_ids = np.full(count, self.num_rows, np.int32)  # padding prompts: dropped
        for i, (p, row) in enumerate(zip(prompts, rows, strict=True)):
            tokens[i, :len(p)] = p
            last[i] = len(p) - 1
            row_ids[i] = row
        nxt, logits, self.cache = _prefill_step(
            self._state, self.cache, tokens, last, row_ids, key, np.float32(temperature),
            np.float32(top_p), graphdef=self._graphdef, plan=self.plan(count, bucket),
            schedule=self.config.schedule, comm=self.config.comm)
        return np.asarray(nxt)[:n], np.asarray(logits)[:n]

    def decode(self, tokens: np.ndarray, positions: np.ndarray, key: jax.Array,
               temperature: float = 0.0, top_p: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """One decode step over all cache rows: ``tokens``, ``positions`` int32 [num_rows].
        Returns the next tokens int32 [num_rows] and logits [num_rows, V]."""
        nxt, logits, self.cache = _decode_step(
            self._state, self.cache, np.asarray(tokens, np.int32),
            np.asarray(positions, np.int32), key, np.float32(temperature), np.float32(top_p),
            graphdef=self._graphdef, schedule=self.decode_schedule, comm=self.config.comm)
        return np.asarray(nxt), logits

    # -- generate -------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32, *,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 eos_token_ids: int | Sequence[int] | None = None) -> list[list[int]]:
        """New tokens for each prompt (a non-empty sequence of token-id sequences), in order.

        Greedy when ``temperature == 0``, else temperature + top-p sampling (``seed``);
        ``temperature`` must be finite and >= 0, ``top_p`` in (0, 1]. Each output stops after
        an EOS token (included; ``eos_token_ids``: one id or several, default the engine's) or
        ``max_new_tokens`` tokens. Bad arguments raise ``ValueError`` before any work.
        """
        max_new_tokens = checks.max_new_tokens(max_new_tokens)
        temperature, top_p = checks.sampling(temperature, top_p)
        prompts = checks.prompts(prompts, self.model_config.vocab_size)
        seed = checks.integer(seed, "seed")
        eos = set(self.eos_token_ids if eos_token_ids is None
                  else checks.eos_token_ids(eos_token_ids))
        for i, p in enumerate(prompts):
            bucket = length_bucket(len(p), self.config.min_prompt_bucket)
            need = max(bucket, len(p) + max_new_tokens - 1)
            if need > self.config.max_seq_len:
                raise ValueError(
                    f"prompt {i} ({len(p)} tokens, bucket {bucket}) plus {max_new_tokens} new "
                    f"tokens needs {need} cache positions; max_seq_len is "
                    f"{self.config.max_seq_len}")
        key = jax.random.key(seed)
        outputs: list[list[int]] = []
        for wave_start in range(0, len(prompts), self.num_rows):
            wave = prompts[wave_start:wave_start + self.num_rows]
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
        tokens = np.zeros(self.num_rows, np.int32)
        positions = np.zeros(self.num_rows, np.int32)
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
    Without ``config``, one just large enough for these prompts.
    """
    if config is None:
        checked = checks.prompts(prompts, model.config.vocab_size)
        longest = max(len(p) for p in checked)
        positions = max(length_bucket(longest), longest + checks.max_new_tokens(max_new_tokens))
        config = ServingConfig(max_batch=min(len(checked), 8), max_seq_len=next_pow2(positions))
    return Engine(model, config).generate(prompts, max_new_tokens, **kwargs)
