"""Checks of what a caller hands the serving loop; each raises ``ValueError`` naming the problem.

Integers are anything ``operator.index`` takes (Python and NumPy ints, integer JAX scalars),
never a bool or a float: ``1.7`` is refused, not truncated to ``1``.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Iterable
from typing import Any

import numpy as np


def integer(value: Any, what: str) -> int:
    """``value`` as an int; ``ValueError`` naming ``what`` where it is no integer."""
    if isinstance(value, bool | np.bool_):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None


def at_least(value: Any, minimum: int, what: str) -> int:
    """:func:`integer` ``>= minimum``."""
    out = integer(value, what)
    if out < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value!r}")
    return out


def token_ids(values: Any, vocab_size: int, what: str = "prompt") -> list[int]:
    """A non-empty sequence of integer token ids in ``[0, vocab_size)``, as a list."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise ValueError(f"{what} must be a sequence of token ids, got {values!r}")
    ids = [integer(t, f"{what}'s token id") for t in values]
    if not ids:
        raise ValueError(f"{what} is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} has token ids outside [0, {vocab_size}): {bad[:5]}")
    return ids


def unicode_text(text: str, what: str) -> str:
    """``text`` where it is valid Unicode; ``ValueError`` naming ``what`` where it holds a lone
    surrogate (JSON's ``"\\ud800"`` decodes to one), which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{what} is not valid Unicode: a lone surrogate {text[err.start]!r} at character "
            f"{err.start}"
        ) from None
    return text


MODEL_ATTRIBUTES = ("mesh", "axis_name", "config", "embed", "embed_tokens", "logits", "decoder")
"""What the engine reads of a model object (``models.llama.LlamaModel`` has them all)."""


def model_object(model: Any, what: str, forms: str = "a model (models.llama.LlamaModel)") -> Any:
    """``model`` where it has :data:`MODEL_ATTRIBUTES`; ``TypeError`` naming ``what`` (which
    must be one of ``forms``) else."""
    missing = [a for a in MODEL_ATTRIBUTES if not hasattr(model, a)]
    if missing:
        raise TypeError(
            f"{what} must be {forms}, got {type(model).__name__} {model!r:.40} (it has no "
            f"{missing[0]!r})"
        )
    return model


def eos_token_ids(value: Any) -> tuple[int, ...]:
    """One token id or a sequence of them (as Hugging Face's ``eos_token_id``) -> a tuple."""
    if value is None:
        return ()
    if isinstance(value, numbers.Integral) or getattr(value, "ndim", None) == 0:
        return (integer(value, "eos_token_ids"),)
    if isinstance(value, Iterable) and not isinstance(value, str | bytes):
        return tuple(integer(t, "an eos token id") for t in value)
    raise ValueError(f"eos_token_ids must be a token id or a sequence of them, got {value!r}")


def single_process_mesh(mesh: Any, process: int = 0) -> None:
    """``ValueError`` where ``mesh`` holds devices of a process other than ``process`` (this
    one's ``jax.process_index()``): the engine schedules on one host thread and reads its
    results back, so it drives every GPU of its tensor-parallel axis from one process."""
    owners = sorted({d.process_index for d in np.asarray(mesh.devices).flat})
    if len(owners) > 1:
        raise ValueError(
            f"the serving engine drives every tensor-parallel GPU from one process, but this "
            f"mesh spans processes {owners} (started by jax_tokenweave.launch or "
            f"jax.distributed): run the engine, LLM or server in one process over all its GPUs; "
            f"one process per GPU is for SPMD programs, where every process runs the same code"
        )
    if owners != [process]:
        raise ValueError(
            f"the mesh's devices belong to process {owners[0]}, not to this one ({process}): "
            f"the serving engine runs on its own devices"
        )
