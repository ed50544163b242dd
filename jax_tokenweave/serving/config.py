"""``EngineConfig``: the serving engine's sizes and schedule, checked at construction."""

from __future__ import annotations

import dataclasses
import os

from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.serving import checks
from jax_tokenweave.serving.attention.paged_attention import ATTENTION_IMPLS
from jax_tokenweave.serving.buckets import decode_rows
from jax_tokenweave.serving.compilation.compilation_cache import DEFAULT_DIR
from jax_tokenweave.weave.schedules import COLLECTIVES
from jax_tokenweave.weave.tuning import TuneEntry

SERVING_SCHEDULES = ("weave", "baseline")
KV_ALLOCATIONS = ("on_demand", "reserve")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes and schedule of an ``LLMEngine``; a bad field raises ``ValueError`` naming it.

    Each field's meaning is in its comment; how they shape a step:
    docs/SERVING.md#servingconfigengineconfig.
    """

    # Step composition (serving.scheduling.scheduler).
    # The token budget of one step, in rows of the packed batch (decode tokens, prompt chunks
    # and their padding); a multiple of prefill_tile.
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256  # requests running at once (each decodes one token per step)
    # A step with prompt chunks that would pad 256+ rows up to its power-of-two bucket leaves
    # the chunks' last tokens to a later step and fills the bucket below
    # (serving.buckets.trim_rows); False: it pads.
    trim_to_bucket: bool = True
    # Positions per request (prompt + new tokens); the block tables are that long.
    max_model_len: int = 8192
    # Paged KV cache (serving.attention.paged_cache).
    block_size: int = 16  # positions per block
    num_blocks: int = 4096  # blocks in all (each layer, each rank its kv heads)
    # "on_demand": a request gets a block when its last one fills; where none is free the
    # most recently admitted requests are preempted (recomputed later), as vLLM v1 does.
    # "reserve": a request is admitted with every block it may need (prompt + max_tokens).
    kv_allocation: str = "on_demand"
    # Full blocks stay cached under the hash of their prefix; a request reuses the cached
    # blocks of its longest cached prefix (serving.scheduling.prefix_cache). vLLM's name.
    enable_prefix_caching: bool = True
    # Prompt chunks start on multiples of this many rows and attend to the cache in tiles of
    # this many queries (a power of two). 128: cuDNN's prompt attention runs at about 500
    # TFLOP/s on an H200 with tiles of 128 rows, 255 with tiles of 64
    # (serving.attention.cudnn_attention).
    prefill_tile: int = 128
    # Keys per step of the pure-JAX attention's online-softmax loop (a multiple of
    # block_size); the CUDA kernels choose their own.
    key_chunk: int = 512
    # "weave" (TokenWeave: steps of >= split_threshold rows split in two wave-aware halves,
    # overlapped; smaller ones unsplit, token-sharded residual, the fused kernel where it runs)
    # or "baseline" (plain TP, psum).
    schedule: str = "weave"
    # Weave's reductions: "auto", "xla" or "ffi".
    collective: str = "auto"
    split_threshold: int | None = None  # None: the tuning table's for the model and TP degree
    # The fused kernel's CTA counts and the split offset for every step (None: the tuning
    # table's entry for the step's size).
    tuning: TuneEntry | None = None
    # The paged-attention kernel (serving.attention.paged_attention.ATTENTION_IMPLS): "auto" (the
    # CUDA kernel where the extension is built and the mesh is on GPUs, else the pure-JAX loop),
    # "cuda" or "xla".
    attention: str = "auto"
    max_logprobs: int = 20  # the most top log-probabilities a request may ask for
    # The most tokens one request may bias (serving.sampling.processors): its logit_bias entries,
    # plus its stop and EOS ids while min_tokens holds them back.
    max_biased_tokens: int = 512
    seed: int = 0  # seeds the requests that bring none
    # Schedule and dispatch step n+1 before step n's tokens reach the host (its decodes take
    # them on the device); False: one step at a time (serving.core.engine). Same tokens either way.
    async_scheduling: bool = True
    # Decode-only steps replay from XLA's command buffers (CUDA graphs on GPUs;
    # serving.runner.step_io); False: XLA launches their kernels one by one.
    command_buffers: bool = True
    # JAX's persistent compilation cache for the engine's programs
    # (serving.compilation.compilation_cache: a user-set JAX cache directory wins) and, in its
    # executables/, the step programs themselves (serving.compilation.executable_cache: a restart
    # skips tracing and compiling); None: none.
    compilation_cache_dir: str | None = DEFAULT_DIR

    def __post_init__(self) -> None:
        for name, minimum in (
            ("max_num_batched_tokens", 1),
            ("max_num_seqs", 1),
            ("max_model_len", 2),
            ("block_size", 1),
            ("num_blocks", 1),
            ("prefill_tile", 1),
            ("key_chunk", 1),
            ("split_threshold", 2),
            ("max_logprobs", 0),
            ("max_biased_tokens", 1),
            ("seed", 0),
        ):
            if name != "split_threshold" or self.split_threshold is not None:
                checks.at_least(getattr(self, name), minimum, f"EngineConfig.{name}")
        tile = self.prefill_tile
        if tile & (tile - 1):
            raise ValueError(f"EngineConfig.prefill_tile must be a power of two, got {tile}")
        if self.max_num_batched_tokens % tile:
            raise ValueError(
                f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens})"
                f" must be a multiple of prefill_tile ({tile})"
            )
        if self.max_num_batched_tokens < self.max_decode_rows + tile:
            raise ValueError(
                f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) leaves no "
                f"room for a prompt chunk beside {self.max_num_seqs} decode tokens (padded to "
                f"{self.max_decode_rows} rows); it must be >= {self.max_decode_rows + tile}"
            )
        if self.key_chunk % self.block_size:
            raise ValueError(
                f"EngineConfig.key_chunk ({self.key_chunk}) must be a multiple of "
                f"block_size ({self.block_size})"
            )
        if self.schedule not in SERVING_SCHEDULES:
            raise ValueError(
                f"EngineConfig.schedule must be one of {SERVING_SCHEDULES}, got {self.schedule!r}"
            )
        if self.collective not in COLLECTIVES:
            raise ValueError(
                f"EngineConfig.collective must be one of {COLLECTIVES}, got {self.collective!r}"
            )
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(
                f"EngineConfig.attention must be one of {ATTENTION_IMPLS}, got {self.attention!r}"
            )
        if self.compilation_cache_dir is not None and not isinstance(
            self.compilation_cache_dir, str | os.PathLike
        ):
            raise ValueError(
                f"EngineConfig.compilation_cache_dir must be a path or None, got "
                f"{self.compilation_cache_dir!r}"
            )
        if self.kv_allocation not in KV_ALLOCATIONS:
            raise ValueError(
                f"EngineConfig.kv_allocation must be one of {KV_ALLOCATIONS}, got "
                f"{self.kv_allocation!r}"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"EngineConfig.enable_prefix_caching must be a bool, got "
                f"{self.enable_prefix_caching!r}"
            )
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(
                f"EngineConfig.async_scheduling must be a bool, got {self.async_scheduling!r}"
            )
        if not isinstance(self.command_buffers, bool):
            raise ValueError(
                f"EngineConfig.command_buffers must be a bool, got {self.command_buffers!r}"
            )
        if self.tuning is not None and not isinstance(self.tuning, TuneEntry):
            raise ValueError(
                f"EngineConfig.tuning must be a tuning.TuneEntry or None, got "
                f"{type(self.tuning).__name__}"
            )

    @property
    def max_decode_rows(self) -> int:
        """Rows the decode segment can take: ``max_num_seqs`` padded (``decode_rows``)."""
        return decode_rows(self.max_num_seqs, self.prefill_tile)

    @property
    def table_width(self) -> int:
        """Block-table entries per request: ``max_model_len`` positions, padded to whole
        ``key_chunk``s."""
        per_chunk = self.key_chunk // self.block_size
        blocks = ceil_div(self.max_model_len, self.block_size)
        return ceil_div(blocks, per_chunk) * per_chunk
