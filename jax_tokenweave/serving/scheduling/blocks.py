"""The paged KV cache's block allocator (host side, pure Python).

``num_blocks`` blocks of ``block_size`` positions (``serving.attention.paged_cache``); a request's
block table maps its position ``p`` to block ``table[p // block_size]``. Blocks are
reference-counted (requests sharing a cached prefix share blocks); a full block may carry a hash
(``serving.scheduling.prefix_cache``) and stays cached without users until handed out again (blocks
without a hash first, then cached ones least recently freed first). Asking for more blocks than
are free raises :class:`OutOfBlocksError`. Details: docs/SERVING.md#servingschedulingblocks.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.serving import checks


class OutOfBlocksError(RuntimeError):
    """Raised when the KV cache has fewer free blocks than asked for."""


class BlockAllocator:
    """Reference-counted allocator of ``num_blocks`` cache blocks of ``block_size`` positions,
    cached blocks kept until evicted (module docstring)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = checks.at_least(num_blocks, 1, "num_blocks")
        self.block_size = checks.at_least(block_size, 1, "block_size")
        self._refs = [0] * self.num_blocks
        self._hash: list[bytes | None] = [None] * self.num_blocks
        self._cached: dict[bytes, int] = {}  # hash -> block
        # Blocks without users, in the order they are handed out: uncached ones (a stack,
        # pop() gives 0, 1, 2, ... at first), then cached ones least recently freed first.
        self._uncached = list(range(self.num_blocks - 1, -1, -1))
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.evictions = 0  # cached blocks handed out again (their hash dropped)

    @property
    def num_free(self) -> int:
        """Blocks no request uses (cached ones included: they can be evicted)."""
        return len(self._uncached) + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Blocks that carry a hash (used or not)."""
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions."""
        return ceil_div(checks.at_least(num_tokens, 0, "num_tokens"), self.block_size)

    def can_allocate(self, count: int) -> bool:
        """Whether ``count`` blocks are free now."""
        return count <= self.num_free

    def allocate(self, count: int) -> list[int]:
        """``count`` blocks without users, each now used once (cached ones lose their hash);
        :class:`OutOfBlocksError` where fewer are free."""
        count = checks.at_least(count, 0, "count")
        if count > self.num_free:
            raise OutOfBlocksError(
                f"out of KV cache blocks: asked for {count}, {self.num_free} of "
                f"{self.num_blocks} free (block size {self.block_size}); finish or abort "
                f"requests, or make the cache larger (num_blocks)"
            )
        out = []
        for _ in range(count):
            if self._uncached:
                block = self._uncached.pop()
            else:
                block, _ = self._lru.popitem(last=False)
                self._evict(block)
            self._refs[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """One more user of each of ``blocks`` (cached blocks a request reuses); a block
        without users leaves the free blocks."""
        for b in blocks:
            if not self._refs[b]:
                if self._hash[b] is None:
                    raise ValueError(f"block {b} is neither in use nor cached")
                del self._lru[b]
            self._refs[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """One user less of each of ``blocks``; ``ValueError`` for a block no one uses. A
        block left without users is free: cached ones after the others, in the order given
        (free a table's last blocks first: they are evicted first)."""
        blocks = list(blocks)
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is not allocated (double free?)")
            self._refs[b] -= 1
            if not self._refs[b]:
                if self._hash[b] is None:
                    self._uncached.append(b)
                else:
                    self._lru[b] = None

    def cache(self, block: int, block_hash: bytes) -> bool:
        """Give a used, full ``block`` its hash (``prefix_cache.block_hashes``), so it stays
        cached; False where another block already holds that hash (this one stays uncached)."""
        if not self._refs[block]:
            raise ValueError(f"block {block} is not allocated")
        if self._hash[block] is not None or block_hash in self._cached:
            return self._hash[block] == block_hash
        self._hash[block] = block_hash
        self._cached[block_hash] = block
        return True

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding ``block_hash``, or None."""
        return self._cached.get(block_hash)

    def is_used(self, block: int) -> bool:
        """Whether a request uses ``block``."""
        return self._refs[block] > 0

    def reset_cache(self) -> bool:
        """Drop every hash, where no block is in use (else False, nothing dropped)."""
        if self.num_free != self.num_blocks:
            return False
        self._cached.clear()
        self._hash = [None] * self.num_blocks
        self._uncached.extend(reversed(self._lru))
        self._lru.clear()
        return True

    def _evict(self, block: int) -> None:
        block_hash = self._hash[block]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hash[block] = None
            self.evictions += 1
