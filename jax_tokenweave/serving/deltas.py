"""What a completed step tells each request: its :class:`StreamDelta` (the new token, its
text and log-probabilities), the delta that ends a failed sample, and which delta is the last
of its request. Pure functions of the engine's request records (``serving.requests``)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

from jax_tokenweave.serving.outputs import StreamDelta, TokenLogprob
from jax_tokenweave.serving.requests import EngineRequest, Sample
from jax_tokenweave.serving.scheduler import Request


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
        if sample.text.update(seq.output) and not seq.finished:
            finish(seq, "stop")
        text = sample.text.delta(final=seq.finished)
    if request.finished:
        request.metrics.finish_time = now
    return StreamDelta(
        seq.request_id,
        (token,),
        text,
        None if logprob is None else (logprob,),
        seq.finish_reason,
        seq.index,
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
