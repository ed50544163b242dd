"""Shape buckets: every step has one of a few static shapes, so a stream of requests reuses
compiled code. A step's packed batch is ``[decode segment | prompt chunks | padding]``; the
decode segment and the whole step round up to powers of two (with floors and a cap)."""

from __future__ import annotations


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= max(n, 1)``."""
    return 1 << (max(n, 1) - 1).bit_length()


def decode_rows(num_decodes: int, tile: int) -> int:
    """Rows of a step's decode segment: 0 for none, else the next power of two, at least
    ``tile`` (so the prompt chunks after it start on a tile boundary)."""
    return 0 if num_decodes == 0 else max(next_pow2(num_decodes), tile)


DECODE_FLOOR = 8
"""Fewest rows of a step that holds only decodes. Such a step needs no tile alignment, and its
row count is the M of every GEMM of the step, which XLA splits over K with float32 partials of
M rows: at batch 1 on one H200 (Llama-3-8B shapes), 64 padded rows cost about 0.6 ms per step
in split-K reductions, residual adds and norms alone."""


def decode_only_rows(num_decodes: int, tile: int) -> int:
    """Rows of a step with ``num_decodes`` decodes and no prompt chunk: the next power of two,
    at least :data:`DECODE_FLOOR`, never more than :func:`decode_rows` gives."""
    return min(max(next_pow2(num_decodes), DECODE_FLOOR), decode_rows(num_decodes, tile))


def step_rows(num_rows: int, budget: int, tile: int) -> int:
    """A step's bucketed row count: the next power of two of ``num_rows`` (at least ``tile``),
    capped at the budget (a multiple of ``tile``)."""
    return min(max(next_pow2(num_rows), tile), budget)


TRIM_MIN_PADDING = 256
"""Padding rows a step with prompt chunks must otherwise carry before :func:`trim_rows` cuts it
to the bucket below. Past about 200 rows an H200's GEMMs are bound by their FLOPs (matmul rate /
copy bandwidth), so padding costs its rows' time; an extra step costs a read of the weights."""


def trim_rows(decode: int, chunk_rows: int, budget: int, tile: int) -> int:
    """Rows of prompt chunks to leave for a later step so that a step of ``decode`` decode rows
    and ``chunk_rows`` rows of chunks (multiples of ``tile``) fills the bucket below rather than
    padding up to the next one: 0 where it fills its bucket, where the padding is under
    :data:`TRIM_MIN_PADDING` rows, or where the bucket below would leave no chunk."""
    want = decode + chunk_rows
    padding = step_rows(want, budget, tile) - want
    below = next_pow2(want) // 2  # the largest power of two under want (padded: not one)
    if padding < TRIM_MIN_PADDING or below < decode + tile:
        return 0
    return want - below
