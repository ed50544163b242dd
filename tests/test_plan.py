"""Tests of ``jax_tokenweave.weave.plan``: wave-aware split planning and the ragged batch layout."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_tokenweave.config import DecoderConfig
from jax_tokenweave.weave.plan import (
    BatchPlan,
    WaveModel,
    midpoint,
    plan_batch,
    round_up,
    wave_offset,
)
from jax_tokenweave.weave.tuning import TuneEntry, TuneTable

FAST = settings(max_examples=60, deadline=None)
PAD_HALF = 256 // 2  # |midpoint - T/2| < 128

lengths_st = st.lists(st.integers(1, 3000), min_size=1, max_size=10)
small_lengths_st = st.lists(st.integers(1, 300), min_size=1, max_size=8)
wave_st = st.builds(
    WaveModel,
    num_sms=st.integers(1, 200),
    tile_m=st.sampled_from([16, 64, 128, 256]),
    tile_n=st.sampled_from([64, 128, 256]),
    gemm_n=st.integers(1, 30000),
    max_steps=st.integers(0, 6),
)


def check_layout(plan: BatchPlan) -> None:
    """The structural invariants every plan satisfies."""
    lengths = plan.request_lengths
    total = sum(lengths)
    assert plan.num_tokens == total
    assert len(plan.halves) in (1, 2)
    assert plan.is_split == (len(plan.halves) == 2)
    # Halves contiguous and covering [0, T), none empty.
    cursor = 0
    for half in plan.halves:
        assert half.start == cursor and half.length >= 1
        assert sum(p.length for p in half.pieces) == half.length
        # Pieces contiguous inside the half, in request order, each non-empty.
        piece_cursor = half.start
        for piece in half.pieces:
            assert piece.start == piece_cursor and piece.length >= 1
            assert piece.position >= 0 and piece.position + piece.length <= lengths[piece.request]
            assert piece.prefix == piece.position
            piece_cursor = piece.end
        requests = [p.request for p in half.pieces]
        assert requests == sorted(set(requests))
        cursor = half.end
    assert cursor == total
    # Every request's pieces sum to its length, in order, positions continuing.
    per_request: dict[int, list] = {}
    for half in plan.halves:
        for piece in half.pieces:
            per_request.setdefault(piece.request, []).append(piece)
    assert sorted(per_request) == list(range(len(lengths)))
    for request, pieces in per_request.items():
        assert sum(p.length for p in pieces) == lengths[request]
        assert pieces[0].position == 0
        if len(pieces) == 2:
            assert pieces[1].position == pieces[0].length
            assert pieces[0].end == pieces[1].start
        assert len(pieces) <= 2
    cut = [r for r, pieces in per_request.items() if len(pieces) == 2]
    assert len(cut) <= 1
    assert plan.cut_request == (cut[0] if cut else None)
    if not plan.is_split:
        assert plan.cut_request is None and plan.offset == 0
    else:
        first = plan.halves[0].length
        assert first == midpoint(total) + plan.offset
        boundaries = set(np.cumsum(lengths).tolist())
        assert (plan.cut_request is None) == (first in boundaries)
    # Token arrays agree with the request lengths and with the per-half helpers.
    positions, segments = plan.positions(), plan.segment_ids()
    assert positions.dtype == np.int32 and segments.dtype == np.int32
    assert positions.shape == segments.shape == (total,)
    expected_pos = np.concatenate([np.arange(n) for n in lengths])
    expected_seg = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])
    np.testing.assert_array_equal(positions, expected_pos)
    np.testing.assert_array_equal(segments, expected_seg)
    for half in plan.halves:
        np.testing.assert_array_equal(half.positions(), positions[half.start : half.end])
        np.testing.assert_array_equal(half.segment_ids(), segments[half.start : half.end])
    if plan.is_split:
        # prefix_lengths of the second half: tokens of the same request in the first half.
        second = plan.halves[1]
        in_first = np.bincount(plan.halves[0].segment_ids(), minlength=len(lengths))
        np.testing.assert_array_equal(second.prefix_lengths(), in_first[second.segment_ids()])
        np.testing.assert_array_equal(plan.halves[0].prefix_lengths(), 0)


@FAST
@given(lengths=lengths_st, threshold=st.integers(2, 4096), tp=st.sampled_from([1, 2, 4, 8]))
def test_layout_invariants_default(lengths, threshold, tp):
    plan = plan_batch(lengths, tp=tp, threshold=threshold)
    check_layout(plan)
    total = sum(lengths)
    assert plan.is_split == (total >= threshold)


@FAST
@given(lengths=small_lengths_st, wave=wave_st, split=st.sampled_from([None, True, False]))
def test_layout_invariants_any_wave_model(lengths, wave, split):
    total = sum(lengths)
    if split is True and total < 2:
        with pytest.raises(ValueError, match="split"):
            plan_batch(lengths, wave=wave, split=True)
        return
    plan = plan_batch(lengths, wave=wave, split=split, threshold=64)
    check_layout(plan)
    assert plan.is_split == (total >= 64 if split is None else split)


@FAST
@given(lengths=lengths_st, wave=wave_st)
def test_halves_near_equal(lengths, wave):
    total = sum(lengths)
    if total < 2:
        return
    plan = plan_batch(lengths, wave=wave, split=True)
    first = plan.halves[0].length
    assert abs(first - total / 2) <= PAD_HALF + wave.max_steps * wave.tile_m


@FAST
@given(lengths=lengths_st)
def test_below_threshold_no_split(lengths):
    total = sum(lengths)
    plan = plan_batch(lengths, threshold=total + 1)
    assert not plan.is_split and plan.offset == 0 and plan.cut_request is None
    assert plan.halves[0].length == total
    assert plan_batch(lengths, threshold=max(2, total)).is_split == (total >= 2)
    assert not plan_batch(lengths, split=False, threshold=2).is_split


@FAST
@given(lengths=lengths_st, data=st.data())
def test_explicit_offset_honoured(lengths, data):
    total = sum(lengths)
    if total < 2:
        return
    mid = midpoint(total)
    offset = data.draw(st.integers(1 - mid, total - 1 - mid))
    plan = plan_batch(lengths, offset=offset, split=True, wave=WaveModel(num_sms=7))
    assert plan.offset == offset and plan.halves[0].length == mid + offset
    check_layout(plan)
    # An explicit offset also beats the tuning table's.
    table = TuneTable({("m", 2, 1): TuneEntry(1 - mid, 8)})
    assert (
        plan_batch(lengths, offset=offset, split=True, tp=2, model="m", table=table).offset
        == offset
    )


@FAST
@given(lengths=lengths_st, data=st.data())
def test_offset_emptying_a_half_raises(lengths, data):
    total = sum(lengths)
    if total < 2:
        return
    mid = midpoint(total)
    # offsets that leave the first half (<= -mid) or the second (>= total - mid) empty; the
    # ranges move with mid, which exceeds 10_000 for the longest batches (up to 30_000 tokens)
    bad = data.draw(
        st.one_of(st.integers(-mid - 10_000, -mid), st.integers(total - mid, total - mid + 10_000))
    )
    with pytest.raises(ValueError, match="non-empty"):
        plan_batch(lengths, offset=bad, split=True)


@FAST
@given(lengths=lengths_st, wave=wave_st)
def test_wave_rule_never_worse_than_midpoint(lengths, wave):
    total = sum(lengths)
    if total < 2:
        return
    mid = midpoint(total)
    plan = plan_batch(lengths, wave=wave, split=True)
    assert plan.offset == wave_offset(total, wave)
    first = plan.halves[0].length
    chosen = wave.split_cost(total, first)
    if 1 <= mid <= total - 1:
        plain = wave.split_cost(total, mid)
        assert chosen[0] <= plain[0]
        if chosen[0] == plain[0] and chosen[1:] == plain[1:]:
            assert plan.offset == 0  # nothing gained: the midpoint
    # Optimal among the documented candidates.
    candidates = [mid + k * wave.tile_m for k in range(-wave.max_steps, wave.max_steps + 1)]
    valid = [a for a in candidates if 1 <= a <= total - 1]
    if valid:
        assert first in valid
        assert chosen == min(wave.split_cost(total, a) for a in valid)
    else:
        assert first == total // 2


@FAST
@given(lengths=lengths_st, tp=st.sampled_from([1, 2, 8]), threshold=st.integers(2, 3000))
def test_plan_hashable_and_deterministic(lengths, tp, threshold):
    a = plan_batch(lengths, tp=tp, threshold=threshold)
    b = plan_batch(tuple(np.asarray(lengths, np.int64)), tp=tp, threshold=threshold)
    assert a == b and hash(a) == hash(b)
    assert all(type(n) is int for n in b.request_lengths)
    assert len({a, b}) == 1
    if sum(lengths) >= 2:
        other = plan_batch(lengths, split=not a.is_split, threshold=threshold)
        assert other != a


def test_hand_example_2048_even():
    # T=2048: mid=1024 (8 tile rows -> 8*28=224 tiles, 2 waves per half); no candidate does
    # better than 4 waves in all, so the midpoint stays and the boundary cuts nothing.
    plan = plan_batch([1024, 1024])
    assert plan.is_split and plan.offset == 0 and plan.half_lengths == (1024, 1024)
    assert plan.cut_request is None
    assert plan.halves[0].pieces == (plan.halves[0].pieces[0],)
    assert plan.halves[1].pieces[0].request == 1 and plan.halves[1].pieces[0].position == 0


def test_hand_example_2560_offset():
    # T=2560: mid=1280 = 10 rows -> 280 tiles -> 3 waves per half (6 in all). k=-1 gives
    # 9 rows (252 tiles, 2 waves) + 11 rows (308 tiles, 3 waves) = 5; k=+1 ties, smaller k wins.
    wave = WaveModel()
    assert wave.waves(1280) == 3 and wave.waves(1152) == 2 and wave.waves(1408) == 3
    plan = plan_batch([1000, 1560])
    assert plan.offset == -128 and plan.half_lengths == (1152, 1408)
    assert plan.cut_request == 1
    a, b = plan.halves
    assert [(p.request, p.start, p.length, p.position) for p in a.pieces] == [
        (0, 0, 1000, 0),
        (1, 1000, 152, 0),
    ]
    assert [(p.request, p.start, p.length, p.position) for p in b.pieces] == [(1, 1152, 1408, 152)]


def test_hand_example_1536_and_threshold():
    # T=1536: mid=768 (6 rows, 168 tiles, 2 waves each) -> k=-2: 4 rows (112 tiles, 1 wave)
    # + 8 rows (224 tiles, 2 waves) = 3 waves.
    assert wave_offset(1536) == -256
    assert plan_batch([1536]).half_lengths == (512, 1024)
    assert plan_batch([1536]).cut_request == 0
    assert not plan_batch([1023]).is_split
    assert plan_batch([1024]).is_split
    assert plan_batch([10, 20], split=True).half_lengths == (15, 15)  # no candidate in range


def test_round_up_and_midpoint():
    assert round_up(1, 256) == 256 and round_up(256, 256) == 256 and round_up(257, 256) == 512
    assert midpoint(1000) == 512 and midpoint(1024) == 512 and midpoint(1025) == 640


def test_wave_model_from_config():
    cfg = DecoderConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
    )
    assert WaveModel.from_config(cfg, 8) == WaveModel()
    assert WaveModel.from_config(cfg, 4, num_sms=120).gemm_n == 14336
    with pytest.raises(ValueError):
        WaveModel.from_config(cfg, 3)
    with pytest.raises(ValueError, match="num_sms"):
        WaveModel(num_sms=0)
    with pytest.raises(ValueError, match="max_steps"):
        WaveModel(max_steps=-1)


def test_tuning_table_offset_threshold_and_ctas():
    """One table: the plan's split threshold, offset correction and CTA counts all come from
    it (its model's rows, else the wildcard rows)."""
    table = TuneTable(
        {("llama3-70b", 8, 2048): TuneEntry(128, 32, 4), ("*", 8, 1): TuneEntry(None, 12)},
        thresholds={("llama3-70b", 8): 2048, ("*", 8): 1500},
    )
    plan = plan_batch([2048], tp=8, model="llama3-70b", table=table)
    assert plan.offset == 128 and plan.half_lengths == (1152, 896)  # wave rule's 0, + 128
    assert plan.tuning == TuneEntry(128, 32, 4)
    assert plan_batch([2047], tp=8, model="llama3-70b", table=table).tuning == TuneEntry(None, 12)
    assert not plan_batch([2047], tp=8, model="llama3-70b", table=table).is_split
    assert plan_batch([1500], tp=8, model="other", table=table).is_split  # wildcard threshold
    assert not plan_batch([1499], tp=8, table=table).is_split
    # No rows for TP 4: the paper's defaults (split from 1024 tokens, 16/8 CTAs, wave rule).
    plan = plan_batch([2048], tp=4, model="llama3-70b", table=table)
    assert plan.offset == 0 and plan.tuning == TuneEntry(None, 16, 8)
    # A correction that would empty a half is dropped, an explicit one is refused.
    far = TuneTable({("x", 8, 16): TuneEntry(1024, 8)})
    assert plan_batch([16, 16], tp=8, model="x", table=far, split=True).half_lengths == (16, 16)
    with pytest.raises(ValueError, match="non-empty"):
        plan_batch([2048], tp=8, offset=1024)
    # Offsets only matter when the plan splits; the unsplit plan still carries its CTAs.
    assert plan_batch([100], offset=5).offset == 0
    assert plan_batch([100], tp=8, table=table).tuning == TuneEntry(None, 12)


def test_shipped_table_rule():
    """The shipped table at TP=2 (2 x H200 measurements): no split below 4096 tokens, the fused
    kernel unsplit with 32 CTAs from 1024 tokens (the default 16/8 below), 16 CTAs split."""
    from jax_tokenweave.models.configs import get_config

    llama, qwen = get_config("llama3-70b", num_layers=8), get_config("qwen2.5-72b")
    for config in (llama, qwen):
        small = plan_batch([1024, 1024], tp=2, config=config)
        assert not small.is_split and small.tuning.num_ctas == 32
        assert plan_batch([1024] * 4, tp=2, config=config).is_split
        assert plan_batch([100], tp=2, config=config).tuning == TuneEntry(None, 16, 8)
    big = plan_batch([1024] * 8, tp=2, config=llama)
    assert big.half_lengths == (4096, 4096) and big.tuning == TuneEntry(0, 16)
    assert plan_batch([1024] * 8, tp=2, config=qwen).tuning == TuneEntry(None, 16)
    assert plan_batch([1024] * 2, tp=4, config=llama).is_split  # TP 4: not measured, paper's 1024


@pytest.mark.parametrize(
    ("lengths", "kwargs", "message"),
    [
        ([], {}, "empty batch"),
        ([3, 4, 5, 0], {}, "request 3 has length 0"),
        ([3, -1], {}, "request 1 has length -1"),
        ([3, 2.5], {}, "request 1 has a non-integer length"),
        ([3, True], {}, "request 1 has a non-integer length"),
        (5, {}, "sequence of ints"),
        ([4], {"tp": 0}, "tp must be"),
        ([4], {"threshold": 1}, "threshold must be"),
        ([1], {"split": True}, "cannot split"),
        ([4], {"split": 1}, "split must be"),
        ([4], {"offset": 1.5, "split": True}, "offset must be"),
    ],
)
def test_bad_inputs_raise(lengths, kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_batch(lengths, **kwargs)


def test_wave_offset_needs_two_tokens():
    with pytest.raises(ValueError, match="at least 2"):
        wave_offset(1)
    assert wave_offset(2) == 1 - midpoint(2)
