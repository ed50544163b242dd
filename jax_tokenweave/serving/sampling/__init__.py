"""Sampling on the device: per-row token sampling and log-probabilities (``sampling``),
vLLM's logits processors with their per-request state (``processors``) and prompt
log-probabilities (``prompt_logprobs``). ``SamplingParams`` is ``serving.sampling_params``. See
docs/SERVING.md#servingsampling.
"""
