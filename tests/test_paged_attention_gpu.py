"""The CUDA paged-attention kernels against the pure-JAX loop and a float64 reference: decode rows
(split-K, contexts over many splits) and prompt tiles (tensor cores), grouped-query heads,
bf16 and fp16, block tables in random order, ragged contexts, padding rows; and the engine
serving the same greedy tokens with either implementation. CPU tests of the choice of
implementation and of the decode split sit at the end."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gpu_devices
from flax import nnx

from jax_tokenweave.kernel._util import ceil_div
from jax_tokenweave.serving.attention import attention_kernel, cudnn_attention
from jax_tokenweave.serving.attention.paged_attention import paged_attention, resolve_implementation

needs_kernel = pytest.mark.skipif(
    not gpu_devices()
    or attention_kernel.unavailable_reason("gpu", jnp.bfloat16, 128, 4) is not None,
    reason="needs a GPU and the CUDA extension",
)
PROMPT_IMPLS = [
    "cuda",
    pytest.param(
        "cudnn",
        marks=pytest.mark.skipif(
            not gpu_devices()
            or cudnn_attention.unavailable_reason("gpu", jnp.bfloat16, 128) is not None,
            reason="needs cuDNN with paged attention",
        ),
    ),
]


def _reference(q, k_cache, v_cache, tables, positions, tile):
    """Float64: each row attends to its group's request positions 0..p."""
    q, k_cache, v_cache = (np.asarray(a, np.float64) for a in (q, k_cache, v_cache))
    rows, hq, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = np.zeros_like(q)
    for r in range(rows):
        table = tables[r // tile]
        ctx = positions[r] + 1
        slots = np.arange(ctx)
        keys = k_cache[table[slots // bs], slots % bs]  # [ctx, KVH, D]
        values = v_cache[table[slots // bs], slots % bs]
        keys = np.repeat(keys, hq // kvh, axis=1)
        values = np.repeat(values, hq // kvh, axis=1)
        logits = np.einsum("hd,shd->hs", q[r], keys) / np.sqrt(d)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[r] = np.einsum("hs,shd->hd", probs, values)
    return out


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _case(rng, *, groups, tile, contexts, hq, kvh, d, bs, dtype, width=None):
    """Random ``(q, k_cache, v_cache)`` in ``dtype`` and the int32 ``tables``, ``positions``:
    group i's rows end at context ``contexts[i]`` (a prompt tile holds positions
    ``ctx - tile .. ctx - 1``); blocks in random order."""
    width = width or max(ceil_div(c, bs) for c in contexts) + 1
    num_blocks = groups * width + 3
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = perm[: groups * width].reshape(groups, width)
    k_cache = rng.standard_normal((num_blocks, bs, kvh, d)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks, bs, kvh, d)).astype(np.float32)
    positions = np.concatenate(
        [np.arange(c - tile, c) if tile > 1 else [c - 1] for c in contexts]
    ).astype(np.int32)
    q = rng.standard_normal((groups * tile, hq, d)).astype(np.float32)
    cast = lambda a: jnp.asarray(a, dtype)
    return cast(q), cast(k_cache), cast(v_cache), tables, positions


def _as_f32(case):
    """The case's arrays as the float32 values the kernels see (the reference's inputs)."""
    q, k, v, tables, positions = case
    return (*(np.asarray(a.astype(jnp.float32)) for a in (q, k, v)), tables, positions)


def _run(impl, q, k, v, tables, positions, tile, tight=False, key_chunk=64):
    fn = jax.jit(
        lambda q, k, v, t, p: paged_attention(
            q, k, v, t, p, tile=tile, key_chunk=key_chunk, implementation=impl, tight=tight
        )
    )
    out, k_back, v_back = fn(q, k, v, jnp.asarray(tables), jnp.asarray(positions))
    return np.asarray(out.astype(jnp.float32)), k_back, v_back


@needs_kernel
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    ("hq", "kvh", "d", "bs"),
    [
        (32, 8, 128, 16),
        (8, 8, 64, 16),
        (16, 2, 128, 16),
        (32, 8, 128, 8),  # contexts past the 128 table entries read with the row's position
        (32, 8, 128, 32),
        (32, 8, 128, 12),  # not a power of two: the kernel divides instead of shifting
    ],
)
@pytest.mark.parametrize("tight", [False, True])
def test_decode_rows_match_reference(rng, dtype, hq, kvh, d, bs, tight):
    contexts = [1, 7, 64, 65, 513, 3000, 1024, 200]  # one split up to several
    case = _case(
        rng,
        groups=len(contexts),
        tile=1,
        contexts=contexts,
        hq=hq,
        kvh=kvh,
        d=d,
        bs=bs,
        dtype=dtype,
    )
    want = _reference(*_as_f32(case), tile=1)
    got, k_back, _ = _run("cuda", *case, tile=1, tight=tight, key_chunk=4 * bs)
    xla, _, _ = _run("xla", *case, tile=1, key_chunk=4 * bs)
    assert np.isfinite(got).all()
    assert _rel(got, want) < 1e-2, _rel(got, want)
    assert _rel(got, xla) < 1e-2
    np.testing.assert_array_equal(np.asarray(k_back), np.asarray(case[1]))


def _decode_chain(qs, k_cache, v_cache, tables, positions, tight):
    """Decode calls back to back in one jitted program (call c: ``qs[c]`` [R, Hq, D],
    ``tables[c]``, ``positions[c]``, one cache); their outputs [calls, R, Hq, D] in float32."""

    def chain(qs, k, v, tables, positions):
        outs = []
        for c in range(qs.shape[0]):
            out, k, v = paged_attention(
                qs[c],
                k,
                v,
                tables[c],
                positions[c],
                tile=1,
                key_chunk=64,
                implementation="cuda",
                tight=tight,
            )
            outs.append(out)
        return jnp.stack(outs)

    out = jax.jit(chain)(qs, k_cache, v_cache, jnp.asarray(tables), jnp.asarray(positions))
    return np.asarray(out.astype(jnp.float32))


def _check_decode_chain(got, qs, k_cache, v_cache, tables, positions):
    """Each call's live rows (position >= 0) against float64, its padding rows zeros."""
    f32 = lambda a: np.asarray(a.astype(jnp.float32))
    for c in range(qs.shape[0]):
        live = positions[c] >= 0
        want = _reference(
            f32(qs[c])[live], f32(k_cache), f32(v_cache), tables[c][live], positions[c][live], 1
        )
        assert np.isfinite(got[c]).all(), c
        assert _rel(got[c][live], want) < 1e-2, (c, _rel(got[c][live], want))
        assert not np.any(got[c][~live]), c


@needs_kernel
@pytest.mark.gpu
def test_decode_calls_back_to_back_with_changing_pieces(rng):
    """Decode calls back to back in one program (programmatic launches: each kernel's blocks
    may start while the one before drains), whose rows are cut into 1 to 32 pieces, each
    match float64; padding rows get zeros."""
    hq, kvh, d, bs, rows, calls = 32, 8, 128, 16, 16, 5
    width, num_blocks = ceil_div(3000, bs), 400
    cast = lambda a: jnp.asarray(a, jnp.bfloat16)
    k_cache = cast(rng.standard_normal((num_blocks, bs, kvh, d)))
    v_cache = cast(rng.standard_normal((num_blocks, bs, kvh, d)))
    qs = cast(rng.standard_normal((calls, rows, hq, d)))
    tables = rng.integers(0, num_blocks, (calls, rows, width)).astype(np.int32)
    positions = np.full((calls, rows), -1, np.int32)
    for c, live in enumerate([16, 1, 9, 16, 3]):  # 1 to 32 pieces per row
        positions[c, :live] = rng.integers(0, 3000, live)

    got = _decode_chain(qs, k_cache, v_cache, tables, positions, tight=False)
    _check_decode_chain(got, qs, k_cache, v_cache, tables, positions)


@needs_kernel
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    ("rows", "live", "hq", "kvh", "d", "bs"),
    [
        (16, 16, 32, 8, 128, 16),
        (16, 11, 32, 8, 128, 16),
        (16, 13, 32, 8, 128, 8),  # past the 256 table entries read with the row's position
        (16, 16, 8, 8, 128, 16),  # whole rows, one head per kv head
        (16, 14, 16, 8, 128, 16),  # whole rows, two heads per kv head
        (32, 32, 32, 8, 128, 16),
        (12, 12, 64, 8, 64, 16),
        (24, 20, 16, 8, 128, 16),
    ],
)
def test_decode_rows_on_the_tight_grid(rng, dtype, rows, live, hq, kvh, d, bs):
    """The engine's decode-only grids of 12-32 rows (12-16 rows: two pieces per row fill one
    wave, so each row runs whole in a block of 8 warps; 24-32: one piece each). Ragged
    contexts from one key to several thousand, padding rows (position -1) get zeros, blocks
    in random order, calls back to back."""
    assert 1 <= attention_kernel.decode_splits(rows, kvh, tight=True) <= 8
    calls = 3
    contexts = rng.integers(1, 3000, (calls, live))
    contexts[:, :3] = [1, 65, 2999]
    width = ceil_div(3000, bs)
    num_blocks = rows * width + 5
    cast = lambda a: jnp.asarray(a, dtype)
    k_cache = cast(rng.standard_normal((num_blocks, bs, kvh, d)))
    v_cache = cast(rng.standard_normal((num_blocks, bs, kvh, d)))
    qs = cast(rng.standard_normal((calls, rows, hq, d)))
    tables = np.stack(
        [rng.permutation(num_blocks)[: rows * width].reshape(rows, width) for _ in range(calls)]
    ).astype(np.int32)
    positions = np.full((calls, rows), -1, np.int32)
    positions[:, :live] = contexts - 1

    got = _decode_chain(qs, k_cache, v_cache, tables, positions, tight=True)
    _check_decode_chain(got, qs, k_cache, v_cache, tables, positions)


@needs_kernel
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    ("tile", "hq", "kvh", "d", "bs"),
    [
        (64, 32, 8, 128, 16),
        (128, 32, 8, 128, 16),
        (16, 8, 8, 64, 16),
        (64, 16, 2, 128, 8),
        (32, 4, 4, 128, 32),
    ],
)
@pytest.mark.parametrize("impl", PROMPT_IMPLS)
def test_prompt_tiles_match_reference(rng, dtype, tile, hq, kvh, d, bs, impl):
    # Chunks at the start of a prompt, after a cached prefix, and across many key tiles.
    contexts = [tile, 3 * tile, 777 + tile, 2048]
    case = _case(
        rng,
        groups=len(contexts),
        tile=tile,
        contexts=contexts,
        hq=hq,
        kvh=kvh,
        d=d,
        bs=bs,
        dtype=dtype,
    )
    want = _reference(*_as_f32(case), tile=tile)
    got, _, _ = _run(impl, *case, tile=tile)
    xla, _, _ = _run("xla", *case, tile=tile)
    assert np.isfinite(got).all()
    assert _rel(got, want) < 1e-2, _rel(got, want)
    assert _rel(got, xla) < 1e-2


@needs_kernel
@pytest.mark.gpu
@pytest.mark.parametrize("impl", PROMPT_IMPLS)
def test_padding_rows_and_every_output_written(rng, impl):
    """A tile whose last rows are padding (position 0, as the engine packs them) and a whole
    padding group (zero table): every output row is written and finite (the output buffer is
    checked finite and equal to the reference, which a row left unwritten would not be)."""
    tile, hq, kvh, d, bs = 64, 32, 8, 128, 16
    q, k, v, tables, positions = _case(
        rng,
        groups=3,
        tile=tile,
        contexts=[100, 64, 500],
        hq=hq,
        kvh=kvh,
        d=d,
        bs=bs,
        dtype=jnp.bfloat16,
    )
    positions = positions.copy()
    positions[tile + 40 : 2 * tile] = 0  # group 1: 40 real rows, 24 padding
    tables = tables.copy()
    tables[2] = 0
    positions[2 * tile :] = 0  # group 2: padding only
    got, _, _ = _run(impl, q, k, v, tables, positions, tile)
    want = _reference(*_as_f32((q, k, v, tables, positions)), tile)
    assert np.isfinite(got).all()
    # cuDNN's path leaves padding rows finite but not the reference's (nothing reads them).
    real = np.r_[np.ones(tile + 40, bool), np.full(2 * tile - 40, impl != "cudnn")]
    assert _rel(got[real], want[real]) < 1e-2
    dec, _, _ = _run("cuda", q[:3], k, v, tables[:3], np.zeros(3, np.int32), 1)
    assert np.isfinite(dec).all()


@needs_kernel
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("rows", "live", "kvh"), [(64, 1, 8), (64, 5, 8), (64, 64, 8), (256, 256, 8), (256, 130, 2)]
)
def test_decode_rows_cut_by_live_rows_and_padding_rows_zero(rng, rows, live, kvh):
    """The decode kernel cuts rows by how many are live (position >= 0): one live row over
    many pieces, a full segment in one piece per row (written without a merge). Padding
    rows (position -1) get zeros; blocks are shared between rows in random order."""
    hq, d, bs, num_blocks = 4 * kvh, 128, 16, 300
    contexts = rng.integers(1, 2500, live)
    contexts[0] = 2500
    width = ceil_div(2500, bs)
    tables = rng.integers(0, num_blocks, (rows, width)).astype(np.int32)
    k_cache = rng.standard_normal((num_blocks, bs, kvh, d)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks, bs, kvh, d)).astype(np.float32)
    q = rng.standard_normal((rows, hq, d)).astype(np.float32)
    positions = np.full(rows, -1, np.int32)
    positions[:live] = contexts - 1
    cast = lambda a: jnp.asarray(a, jnp.bfloat16)
    got, _, _ = _run("cuda", cast(q), cast(k_cache), cast(v_cache), tables, positions, 1)
    as_f32 = lambda a: np.asarray(cast(a).astype(jnp.float32))
    want = _reference(
        as_f32(q[:live]), as_f32(k_cache), as_f32(v_cache), tables[:live], positions[:live], 1
    )
    assert np.isfinite(got).all()
    assert _rel(got[:live], want) < 1e-2, _rel(got[:live], want)
    assert not np.any(got[live:])


@needs_kernel
@pytest.mark.gpu
def test_engine_serves_the_same_tokens_with_either_kernel(rng):
    """Greedy decoding through the engine (chunked prefill over tiles, decode rows) gives the
    same tokens with the CUDA kernels as with the pure-JAX loop (float32 math would differ in
    rounding only; with bf16 a few late tokens may flip on near-ties, so compare the first)."""
    from jax.sharding import Mesh

    from jax_tokenweave.models.configs import get_config
    from jax_tokenweave.models.llama import LlamaModel
    from jax_tokenweave.serving import EngineConfig, LLMEngine, SamplingParams

    config = get_config("tiny", head_dim=128, num_heads=8, num_kv_heads=2, hidden_size=256)
    mesh = Mesh(np.array(gpu_devices()[:1]), ("tp",))
    model = LlamaModel(config, mesh, dtype=jnp.float16, rngs=nnx.Rngs(0))
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (5, 130, 77, 300)]
    outs = {}
    impls = ["cuda", "xla"]
    if cudnn_attention.unavailable_reason("gpu", jnp.float16, 128) is None:
        impls.append("cudnn")
    for impl in impls:
        cfg = EngineConfig(
            max_num_batched_tokens=256,
            max_num_seqs=8,
            prefill_tile=64,
            block_size=16,
            num_blocks=256,
            max_model_len=512,
            attention=impl,
        )
        engine = LLMEngine(model, cfg)
        res = engine.run_to_completion(prompts, SamplingParams(temperature=0.0, max_tokens=12))
        outs[impl] = [r.token_ids for r in res]
    for impl in impls[:1] + impls[2:]:
        for a, b in zip(outs[impl], outs["xla"], strict=True):
            assert a[:4] == b[:4], impl


# ------------------------------------------------------------------------------------- CPU


def test_auto_takes_xla_on_cpu_and_cuda_refuses_with_a_reason():
    assert resolve_implementation("auto", "cpu", jnp.bfloat16, 128, 4) == "xla"
    assert resolve_implementation("xla", "gpu", jnp.bfloat16, 128, 4) == "xla"
    with pytest.raises(ValueError, match="cannot run"):
        resolve_implementation("cuda", "cpu", jnp.bfloat16, 128, 4)
    with pytest.raises(ValueError, match="one of"):
        resolve_implementation("flash", "gpu", jnp.bfloat16, 128, 4)


@pytest.mark.parametrize(
    ("platform", "dtype", "d", "g", "why"),
    [
        ("cpu", jnp.bfloat16, 128, 4, "not on CUDA"),
        ("gpu", jnp.float32, 128, 4, "bfloat16 or float16"),
        ("gpu", jnp.bfloat16, 96, 4, "head_dim 96"),
        ("gpu", jnp.bfloat16, 128, 3, "3 query heads"),
    ],
)
def test_unavailable_reasons(platform, dtype, d, g, why):
    reason = attention_kernel.unavailable_reason(platform, dtype, d, g)
    assert reason is not None
    if attention_kernel._extension.import_error() is None:
        assert why in reason
    else:
        assert "not built" in reason


@needs_kernel
@pytest.mark.gpu
@pytest.mark.parametrize("impl", PROMPT_IMPLS)
def test_split_step_updates_the_cache_in_place(impl):
    """With the split, half B writes the cache half A's prompt tiles read: the compiled step
    still holds no copy of a whole cache buffer (cuDNN reads the cache without aliasing it)."""
    import re

    from jax.sharding import Mesh

    from jax_tokenweave.models.configs import get_config
    from jax_tokenweave.models.llama import LlamaModel
    from jax_tokenweave.serving import EngineConfig, LLMEngine
    from jax_tokenweave.serving.runner import batch as batch_lib
    from jax_tokenweave.serving.runner.step import jitted_forward

    config = get_config("tiny", head_dim=128, num_heads=8, num_kv_heads=2, hidden_size=256)
    mesh = Mesh(np.array(gpu_devices()[:1]), ("tp",))
    model = LlamaModel(config, mesh, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    cfg = EngineConfig(
        max_num_batched_tokens=512,
        max_num_seqs=8,
        prefill_tile=64,
        num_blocks=128,
        max_model_len=512,
        schedule="weave",
        split_threshold=128,
        attention=impl,
    )
    engine = LLMEngine(model, cfg)
    layout = batch_lib.make_layout(64, 512, engine.config, engine.model_config, engine.tp)
    assert layout.plan.is_split
    runner = engine.runner
    text = (
        jitted_forward.lower(*runner.padding_args(layout), **runner._static(layout))
        .compile()
        .as_text()
    )
    shape = f"bf16[{cfg.num_blocks},{cfg.block_size},{config.num_kv_heads},"
    copies = [
        ln for ln in text.splitlines() if re.search(rf"= {re.escape(shape)}\d+\]\S* copy\(", ln)
    ]
    assert text.count(shape) > 0 and copies == []
