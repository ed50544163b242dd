"""A request's KV cache blocks: allocated on demand or reserved at admission, and shared
through the prefix cache (host side, pure Python).

``KVCacheManager`` keeps each request's block table over one ``blocks.BlockAllocator``:
``kv_allocation`` ``"on_demand"`` (blocks as positions arrive; the scheduler preempts where
none is free) or ``"reserve"`` (every block at admission). With ``enable_prefix_caching``, full
blocks are cached under a hash chained over the tokens before them (:func:`block_hashes`) once a
taken step wrote them, and an admitted request reuses its longest cached prefix (all but its
last token at most). Details: docs/SERVING.md#servingschedulingprefix_cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Sequence

from jax_tokenweave.serving.config import EngineConfig
from jax_tokenweave.serving.scheduling.blocks import BlockAllocator
from jax_tokenweave.serving.scheduling.request_state import Request


def block_hashes(tokens: Sequence[int], block_size: int, parent: bytes = b"") -> list[bytes]:
    """The chained hashes of the full blocks of ``tokens``: block ``i``'s is BLAKE2b (16
    bytes) of the hash before it (``parent`` for the first) and its ``block_size`` tokens
    (int32). A partial last block has none."""
    count = len(tokens) // block_size
    data = struct.pack(f"<{count * block_size}i", *tokens[: count * block_size])
    width, out = 4 * block_size, []
    for i in range(count):
        block = data[i * width : (i + 1) * width]
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        out.append(parent)
    return out


@dataclasses.dataclass
class KVCacheStats:
    """Counts since the engine was made: ``preemptions`` (requests whose blocks were taken
    back, to be recomputed); ``prefix_cache_queries`` / ``prefix_cache_hits``: prompt tokens
    looked up in the prefix cache at first admission, and those found (vLLM's names)."""

    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class KVCacheManager:
    """The block tables of a scheduler's requests (module docstring), sized by ``config``."""

    def __init__(self, config: EngineConfig) -> None:
        self.allocator = BlockAllocator(config.num_blocks, config.block_size)
        self.block_size = config.block_size
        self.on_demand = config.kv_allocation == "on_demand"
        self.caching = config.enable_prefix_caching
        self.stats = KVCacheStats()

    def hash_known(self, seq: Request) -> None:
        """Extend ``seq.block_hashes`` over its known full blocks (prefix caching only)."""
        bs, have = self.block_size, len(seq.block_hashes)
        if not self.caching or seq.num_known < (have + 1) * bs:
            return
        parent = seq.block_hashes[-1] if have else b""
        seq.block_hashes += block_hashes(seq.tokens(have * bs, seq.num_known), bs, parent)

    def lookup(self, seq: Request) -> list[int]:
        """The cached blocks of ``seq``'s longest cached prefix, at most its known tokens less
        one in whole blocks (no side effect); none where it asks for ``prompt_logprobs``,
        whose rows it must compute (as vLLM)."""
        if not self.caching or seq.params.prompt_logprobs is not None:
            return []
        hits = []
        for h in seq.block_hashes[: (seq.num_known - 1) // self.block_size]:
            block = self.allocator.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def admit(self, seq: Request, hits: list[int], first_chunk: int) -> bool:
        """Give a waiting ``seq`` (to prefill its known tokens) the cached blocks ``hits``
        (:meth:`lookup`) and new blocks for its first chunk of ``first_chunk`` tokens after
        them (reserve: for every position it may need). False, changing nothing, where too
        few blocks are free. Sets its ``num_prefill`` and ``num_computed`` (the hit tokens)."""
        alloc, bs = self.allocator, self.block_size
        computed = len(hits) * bs
        positions = seq.positions_needed() if not self.on_demand else computed + first_chunk
        new = alloc.blocks_for(positions) - len(hits)
        if new + sum(not alloc.is_used(b) for b in hits) > alloc.num_free:
            return False
        alloc.touch(hits)
        seq.blocks = hits + alloc.allocate(max(new, 0))
        seq.num_prefill, seq.num_computed = seq.num_known, computed
        seq.num_cached_blocks = len(hits)
        if not seq.preemptions:
            self.stats.prefix_cache_queries += seq.num_prefill
            self.stats.prefix_cache_hits += computed
        return True

    def unadmit(self, seq: Request) -> None:
        """Undo :meth:`admit` of ``seq`` before any step used it: its blocks back (:meth:`free`)
        and its prompt tokens out of the prefix-cache counts."""
        if not seq.preemptions:  # admit counted them
            self.stats.prefix_cache_queries -= seq.num_prefill
            self.stats.prefix_cache_hits -= seq.num_computed
        self.free(seq)

    def grow(self, seq: Request, positions: int) -> bool:
        """Give running ``seq`` the blocks to hold ``positions`` positions; False, changing
        nothing, where too few are free."""
        have = len(seq.blocks)
        if positions <= have * self.block_size:  # the common case: checked first
            return True
        need = -(-positions // self.block_size) - have
        if not self.allocator.can_allocate(need):
            return False
        seq.blocks += self.allocator.allocate(need)
        return True

    def reachable(self, seq: Request) -> int:
        """Positions ``seq`` could hold with its blocks and every free one."""
        return (len(seq.blocks) + self.allocator.num_free) * self.block_size

    def commit(self, seq: Request, written: int) -> None:
        """A taken step wrote ``seq``'s K/V up to position ``written``: its full blocks of
        known tokens up to there are cached (prefix caching). Ignored for a request
        preempted since (its positions were reset, its blocks freed)."""
        full = written // self.block_size
        if full <= seq.num_cached_blocks or written > seq.num_computed or not self.caching:
            return
        full = min(full, len(seq.block_hashes), len(seq.blocks))
        for i in range(seq.num_cached_blocks, full):
            self.allocator.cache(seq.blocks[i], seq.block_hashes[i])
        seq.num_cached_blocks = max(seq.num_cached_blocks, full)

    def free(self, seq: Request) -> None:
        """Give ``seq``'s blocks back (its last ones first, so they are evicted first; cached
        ones stay cached) and reset its positions."""
        if seq.blocks:
            self.allocator.free(reversed(seq.blocks))
        seq.blocks = []
        seq.num_computed = seq.num_cached_blocks = 0
