"""What a completed step tells each request: its :class:`StreamDelta` (the new token, its
text and log-probabilities), the delta that ends a failed sample, and which delta is the last
of its request. Pure functions of the engine's request records (``serving.core.requests``)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

from jax_tokenweave.serving.core.requests import EngineRequest, Sample
from jax_tokenweave.serving.outputs import StreamDelta, TokenLogprob
from jax_tokenweave.serving.scheduling.scheduler import Request


def sample_delta(
    request: EngineRequest,
    seq: Request,
    row: int,
    outputs: Any,
    now: float,
    finish: Callable[[Request, str], None],
) -> StreamDelta:
    """The delta of ``seq``'s newest token: row ``row`` of the step's host ``outputs``
    (``StepOutputs``), its log-probabilities where the sample keeps them, its text where it is
    detokenized (a stop string found there ends the sample through ``finish(seq, "stop")``);
    ``now``: when the step's tokens arrived (first-token and finish times)."""
    sample = request.samples[seq.index]
    token = seq.output[-1]
    if request.metrics.first_token_time is None:
        request.metrics.first_token_time = now
    logprob = None
    if sample.logprobs is not None:
        k = seq.params.logprobs
        top = zip(
            outputs.top_ids[row, :k].tolist(), outputs.top_logprobs[row, :k].tolist(), strict=True
        )
        logprob = TokenLogprob(token, float(outputs.logprob[row]), tuple(top))
        sample.logprobs.append(logprob)
    text = None
    if sample.text is not None:
        check = len(seq.output) > seq.params.min_tokens  # vLLM's: stop strings after it
        if sample.text.update(seq.output, check):
            if not seq.finished:
                finish(seq, "stop")
            elif seq.finish_reason == "length":  # vLLM's: the stop string is why it ended
                seq.finish_reason = "stop"
        text = sample.text.delta(final=seq.finished)
    if request.finished:
        request.metrics.finish_time = now
    prompt_lps = request.prompt_logprobs
    first = seq.index == 0 and len(seq.output) == 1 and prompt_lps is not None
    return StreamDelta(
        seq.request_id,
        (token,),
        text,
        None if logprob is None else (logprob,),
        seq.finish_reason,
        seq.index,
        prompt_logprobs=tuple(prompt_lps) if first and prompt_lps is not None else None,
    )


def add_prompt_logprobs(requests: Mapping[str, EngineRequest], asked: Any, prompt: Any) -> None:
    """Append a step's prompt log-probabilities (host ``prompt_logprobs.PromptLogprobs``) to
    the requests that asked: ``asked`` holds ``(scheduler request, first row, position,
    count)`` per chunk; rows ``first ..`` score prompt tokens ``position + 1 ..``."""
    for seq, first, position, count in asked:
        request = requests.get(seq.request_id)
        if request is None or request.prompt_logprobs is None:
            continue
        k = seq.params.prompt_logprobs or 0
        have = len(request.prompt_logprobs)  # positions 1 .. have scored (a preempted
        for j in range(max(have - position, 0), count):  # request recomputes its prompt)
            row, token = first + j, seq.prompt[position + 1 + j]
            top = zip(
                prompt.top_ids[row, :k].tolist(), prompt.top_logprobs[row, :k].tolist(), strict=True
            )
            request.prompt_logprobs.append(
                TokenLogprob(token, float(prompt.logprob[row]), tuple(top), int(prompt.rank[row]))
            )


def end_delta(request: EngineRequest, sample: Sample) -> StreamDelta:
    """The token-less delta that ends ``sample`` (failed or aborted), with its error."""
    if request.finished:
        request.metrics.finish_time = time.perf_counter()
    text = None if sample.text is None else ""
    return StreamDelta(
        request.request_id,
        (),
        text,
        None,
        sample.seq.finish_reason,
        sample.seq.index,
        request.finished,
        sample.error,
    )


def mark_last(
    deltas: list[StreamDelta], requests: Mapping[str, EngineRequest]
) -> list[StreamDelta]:
    """``request_finished`` on the last delta of each finished request only (its samples may
    all finish in one step)."""
    seen: set[str] = set()
    for k in range(len(deltas) - 1, -1, -1):
        d = deltas[k]
        last = d.request_id not in seen and requests[d.request_id].finished
        seen.add(d.request_id)
        if d.request_finished != last:
            deltas[k] = dataclasses.replace(d, request_finished=last)
    return deltas
