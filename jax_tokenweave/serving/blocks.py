"""The paged KV cache's block allocator (host side, pure Python).

The cache holds ``num_blocks`` blocks of ``block_size`` token positions each
(``serving.paged_cache``). A sequence owns a list of blocks, its *block table*: its token at
position ``p`` lives at block ``table[p // block_size]``, offset ``p % block_size``. The
allocator hands out free block ids and takes them back; asking for more than are free raises
:class:`OutOfBlocksError` saying how many were asked for and how many are free.
"""

from __future__ import annotations

from collections.abc import Iterable

from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.serving import checks


class OutOfBlocksError(RuntimeError):
    """Raised when the KV cache has fewer free blocks than asked for."""


class BlockAllocator:
    """Free-list allocator of ``num_blocks`` cache blocks of ``block_size`` positions."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = checks.at_least(num_blocks, 1, "num_blocks")
        self.block_size = checks.at_least(block_size, 1, "block_size")
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() gives 0, 1, 2, ...
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        """Blocks not owned by any sequence."""
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions."""
        return ceil_div(checks.at_least(num_tokens, 0, "num_tokens"), self.block_size)

    def can_allocate(self, count: int) -> bool:
        """Whether ``count`` blocks are free now."""
        return count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        """``count`` free block ids; :class:`OutOfBlocksError` where fewer are free."""
        count = checks.at_least(count, 0, "count")
        if count > len(self._free):
            raise OutOfBlocksError(
                f"out of KV cache blocks: asked for {count}, {len(self._free)} of "
                f"{self.num_blocks} free (block size {self.block_size}); finish or abort "
                f"requests, or make the cache larger (num_blocks)"
            )
        out = [self._free.pop() for _ in range(count)]
        self._used.update(out)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Give ``blocks`` back; ``ValueError`` for a block that is not allocated."""
        blocks = list(blocks)
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated (double free?)")
            self._used.remove(b)
        self._free.extend(reversed(blocks))
