"""NumPy references of vLLM's sampling formulas for the tests: the processed logits of one row
(logit bias and min_tokens' mask, then repetition, frequency and presence penalties) and greedy
decoding with them on ``transformers``' float32 logits."""

from __future__ import annotations

import numpy as np


def vllm_processed(logits, prompt, output, presence, frequency, repetition, bias, until, made):
    """vLLM's processed logits of one row (NumPy, float64): the logit-bias entries that hold
    (``made < until``) added, then the repetition penalty over prompt and output tokens
    (positive logits divided, others multiplied), then frequency and presence over the output
    tokens' counts."""
    out = np.array(logits, np.float64)
    for token, value, end in zip(bias[0], bias[1], until, strict=True):
        if made < end:
            out[token] += value
    counts = np.bincount(np.asarray(output, np.int64), minlength=out.size)[: out.size]
    seen = counts > 0
    seen[np.asarray(prompt, np.int64)] = True
    scale = np.where(seen, repetition, 1.0)
    out = np.where(out > 0, out / scale, out * scale)
    return out - frequency * counts - presence * (counts > 0)


def reference_greedy(hf, prompt, params, eos=()):
    """Greedy tokens of ``transformers``' float32 logits processed by :func:`vllm_processed`
    (``eos``: the checkpoint's EOS ids, which ``min_tokens`` holds back too)."""
    import torch

    out: list[int] = []
    stops = set(params.stop_token_ids) | set(eos)
    entries = [(t, b, 1 << 31) for t, b in (params.logit_bias or {}).items()]
    if params.min_tokens:
        entries += [(t, -np.inf, params.min_tokens) for t in sorted(stops)]
    ids, values, until = (
        (list(column) for column in zip(*entries, strict=True)) if entries else ([], [], [])
    )
    bias = (ids, values)
    penalties = (params.presence_penalty, params.frequency_penalty, params.repetition_penalty)
    while len(out) < params.max_tokens:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].numpy()
        token = int(
            np.argmax(vllm_processed(logits, prompt, out, *penalties, bias, until, len(out)))
        )
        out.append(token)
        if token in stops and len(out) >= params.min_tokens:
            break
    return out
