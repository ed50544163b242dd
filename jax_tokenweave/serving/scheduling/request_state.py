"""``Request``: one sample's state in the scheduler (``serving.scheduling.scheduler``): its tokens,
its place in the paged KV cache (block table, positions scheduled and written, prefix-cache
hashes) and the steps holding it. Host side, pure Python and NumPy."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jax_tokenweave.serving.sampling import processors
from jax_tokenweave.serving.sampling_params import SamplingParams


@dataclasses.dataclass(eq=False)
class Request:
    """One request's state (one sample of it: ``n`` samples are ``n`` of these with one
    ``request_id``). ``num_computed``: its positions whose K/V are in the cache or
    written by a scheduled step; ``num_pending``: its tokens sampled by scheduled steps whose
    tokens have not arrived; ``in_flight``: scheduled steps holding it, not yet updated.

    Since its last admission it prefills ``num_prefill`` tokens: its prompt, or after a
    preemption its prompt and the tokens it made (recomputed). ``num_cached_blocks``: leading
    blocks of its table that carry their hash (``block_hashes``: of its known full blocks,
    prefix caching)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    index: int = 0  # which sample of its request (SamplingParams.n)
    output: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    num_pending: int = 0
    in_flight: int = 0
    sample_step: int = -1  # serial of the last step that samples it,
    sample_step_index: int = -1  # and its index among that step's sampled requests
    num_prefill: int = -1  # -1: len(prompt)
    num_cached_blocks: int = 0
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    preemptions: int = 0  # times its blocks were taken back to be recomputed
    slot: int = (
        -1
    )  # its row of the device's processor state while it runs (serving.sampling.processors)
    _prefill_array: np.ndarray | None = dataclasses.field(default=None, init=False, repr=False)
    _table: tuple[list[int], int, np.ndarray] | None = dataclasses.field(
        default=None, init=False, repr=False
    )

    def __post_init__(self) -> None:
        if self.num_prefill < 0:
            self.num_prefill = len(self.prompt)

    def prefill_array(self) -> np.ndarray:
        """The tokens it prefills, int32 [num_prefill]: the prompt, after a preemption followed
        by the tokens made before it (made once per admission)."""
        cached = self._prefill_array
        if cached is None or cached.shape[0] != self.num_prefill:
            made = self.output[: self.num_prefill - len(self.prompt)]
            self._prefill_array = cached = np.asarray(self.prompt + made, np.int32)
        return cached

    def tokens(self, start: int, stop: int) -> list[int]:
        """Its known tokens (prompt, then those made) at positions ``[start, stop)``."""
        p = len(self.prompt)
        if stop <= p:
            return self.prompt[start:stop]
        return self.prompt[start:] + self.output[max(start - p, 0) : stop - p]

    @property
    def num_known(self) -> int:
        """Tokens on the host: the prompt and those made (not those in flight)."""
        return len(self.prompt) + len(self.output)

    def table_row(self, width: int) -> np.ndarray:
        """The block table as int32 [width], zero-padded (made again when ``blocks`` is
        replaced or grows)."""
        cached = self._table
        if (
            cached is None
            or cached[0] is not self.blocks
            or cached[1] != len(self.blocks)
            or cached[2].shape[0] != width
        ):
            row = np.zeros(width, np.int32)
            row[: len(self.blocks)] = self.blocks
            self._table = cached = (self.blocks, len(self.blocks), row)
        return cached[2]

    @property
    def max_tokens(self) -> int:
        """``params.max_tokens``, which the engine resolved (``None`` is up to the model's
        length: ``LLMEngine.check_request``)."""
        if self.params.max_tokens is None:
            raise ValueError(
                f"request {self.request_id!r}: max_tokens=None must be resolved against "
                f"max_model_len first (LLMEngine.check_request does)"
            )
        return self.params.max_tokens

    @functools.cached_property
    def processed_until(self) -> int:
        """Its tokens before this count are sampled with ``serving.sampling.processors``."""
        return processors.processed_until(self.params)

    @property
    def prefilled(self) -> bool:
        """Whether every token it prefills is scheduled (the request decodes)."""
        return self.num_computed >= self.num_prefill

    @property
    def num_made(self) -> int:
        """New tokens made or in flight."""
        return len(self.output) + self.num_pending

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def positions_needed(self) -> int:
        """Cache positions it may ever use: the prompt and every new token but the last."""
        return len(self.prompt) + self.max_tokens - 1
