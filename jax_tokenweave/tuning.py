"""Per-(model, TP, tokens) tuning of the weave schedule: the fused kernel's CTA count and the split
offset.

A :class:`TuneEntry` says how to run one batch size: ``num_ctas`` (thread blocks of the fused
AllReduce + RMSNorm kernel, ``comm="ffi"`` only), ``first_num_ctas`` (the same for the stack's very
first fused call, layer 0 half A; None = ``num_ctas``) and ``offset`` (the split offset from the
midpoint, see :mod:`jax_tokenweave.split`; None = the split module's own rule). A table maps
``(model, tp, num_tokens)`` to entries; :func:`lookup` takes the entry with the nearest token count
at or below the batch's (a batch between two measured sizes uses the smaller one's settings) and
:data:`DEFAULT_ENTRY` where the table has none for that model and TP.

Defaults (:data:`DEFAULT_ENTRY`): 16 CTAs (what the paper uses for its
fused kernel), 8 for the stack's first fused call (layer 0, half A) as the paper does, offset
None (the split module's wave rule). These are the paper's choices, not measured on this code:
``benchmarks/tune.py`` measures and writes a table.
:data:`DEFAULT_TABLE` is empty (no hardware measurements recorded yet).

JSON format (:func:`save` / :func:`load`)::

    {"format": "jax-tokenweave-tuning/1",
     "entries": [{"model": "llama3-70b", "tp": 4, "tokens": 8192,
                  "num_ctas": 16, "first_num_ctas": 8, "offset": -128,
                  "latency_ms": 12.3}, ...]}

``first_num_ctas`` and ``offset`` may be null or absent; other keys (``latency_ms`` ...) are
informational and ignored by :func:`load`.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from jax_tokenweave import split as split_mod

__all__ = [
    "DEFAULT_ENTRY",
    "DEFAULT_TABLE",
    "FORMAT",
    "MAX_CTAS",
    "MIN_CTAS",
    "POLICY_ENTRY",
    "TuneEntry",
    "TuneTable",
    "from_json",
    "load",
    "lookup",
    "offsets",
    "plan_batch",
    "save",
    "to_json",
]

FORMAT = "jax-tokenweave-tuning/1"
MIN_CTAS, MAX_CTAS = 1, 32  # the extension's limits (tests/test_ffi.py pins them to limits())


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_ctas(name: str, value: object) -> None:
    if not _is_int(value) or not MIN_CTAS <= value <= MAX_CTAS:
        raise ValueError(f"{name} must be an int in [{MIN_CTAS}, {MAX_CTAS}], got {value!r}")


@dataclasses.dataclass(frozen=True)
class TuneEntry:
    """How to run one batch size (module docstring). Hashable: a valid static ``jit`` argument."""

    offset: int | None
    num_ctas: int | None
    first_num_ctas: int | None = None

    def __post_init__(self) -> None:
        if self.offset is not None and not _is_int(self.offset):
            raise ValueError(f"offset must be an int or None, got {self.offset!r}")
        for name in ("num_ctas", "first_num_ctas"):
            if getattr(self, name) is not None:
                _check_ctas(name, getattr(self, name))

    def ctas(self, first: bool) -> int | None:
        """CTAs of a fused call: ``first_num_ctas`` for the stack's first one, else ``num_ctas``."""
        if first and self.first_num_ctas is not None:
            return self.first_num_ctas
        return self.num_ctas


TuneTable = Mapping[tuple[str, int, int], TuneEntry]
"""``(model, tp, num_tokens) -> TuneEntry``."""

DEFAULT_ENTRY = TuneEntry(offset=None, num_ctas=16, first_num_ctas=8)
"""Used where a table has nothing for a (model, tp) at or below the token count."""

POLICY_ENTRY = TuneEntry(offset=None, num_ctas=None)
"""No CTA counts of its own: every fused call takes the kernel policy's (``kernel_policy``)."""

DEFAULT_TABLE: TuneTable = MappingProxyType({})
"""Built-in measured entries: none yet (run ``benchmarks/tune.py`` on the target machine)."""


def _check_key(model: object, tp: object, num_tokens: object) -> None:
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty string, got {model!r}")
    if not _is_int(tp) or tp < 1:
        raise ValueError(f"tp must be an int >= 1, got {tp!r}")
    if not _is_int(num_tokens) or num_tokens < 1:
        raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")


def lookup(model: str, tp: int, num_tokens: int, table: TuneTable | None = None, *,
           default: TuneEntry = DEFAULT_ENTRY) -> TuneEntry:
    """The entry for ``(model, tp)`` with the largest token count ``<= num_tokens``; ``default``
    where there is none. ``table`` defaults to :data:`DEFAULT_TABLE`."""
    _check_key(model, tp, num_tokens)
    table = DEFAULT_TABLE if table is None else table
    best: tuple[int, TuneEntry] | None = None
    for (m, t, tokens), entry in table.items():
        if m == model and t == tp and tokens <= num_tokens and (best is None or tokens > best[0]):
            best = (tokens, entry)
    return default if best is None else best[1]


def offsets(table: TuneTable) -> dict[tuple[str, int, int], int]:
    """The table's offsets as ``split.plan_batch(offsets=...)`` takes them (exact token counts,
    entries with ``offset=None`` left out)."""
    return {key: e.offset for key, e in table.items() if e.offset is not None}


def plan_batch(request_lengths: Sequence[int], *, model: str, tp: int,
               table: TuneTable | None = None, **kwargs: Any) -> split_mod.BatchPlan:
    """``split.plan_batch`` with the offset of :func:`lookup` (nearest token count at or below).

    An explicit ``offset=`` in ``kwargs`` wins. A looked-up offset (possibly tuned for a smaller
    token count) that would leave a half empty falls back to the split module's rule.
    """
    if kwargs.get("offset") is None:
        entry = lookup(model, tp, sum(int(n) for n in request_lengths), table)
        if entry.offset is not None:
            try:
                return split_mod.plan_batch(request_lengths, tp=tp, model=model,
                                            **{**kwargs, "offset": entry.offset})
            except ValueError:
                pass
    return split_mod.plan_batch(request_lengths, tp=tp, model=model, **kwargs)


# ------------------------------------------------------------------------------------ JSON ---

def to_json(table: TuneTable, extra: Mapping[tuple[str, int, int], Mapping[str, Any]]
            | None = None) -> dict[str, Any]:
    """The JSON-ready dict of ``table`` (sorted); ``extra`` adds informational keys per entry."""
    entries = []
    for key in sorted(table):
        model, tp, tokens = key
        _check_key(model, tp, tokens)
        e = table[key]
        if not isinstance(e, TuneEntry):
            raise ValueError(f"table[{key}] must be a TuneEntry, got {type(e).__name__}")
        row = {"model": model, "tp": int(tp), "tokens": int(tokens), "num_ctas": e.num_ctas,
               "first_num_ctas": e.first_num_ctas, "offset": e.offset}
        row.update({k: v for k, v in (extra or {}).get(key, {}).items() if k not in row})
        entries.append(row)
    return {"format": FORMAT, "entries": entries}


def from_json(data: Any) -> dict[tuple[str, int, int], TuneEntry]:
    """Parse :func:`to_json`'s dict; raises ``ValueError`` saying what is wrong."""
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise ValueError(f"not a tuning table: expected a JSON object with format {FORMAT!r}")
    rows = data.get("entries")
    if not isinstance(rows, list):
        raise ValueError("tuning table: 'entries' must be a list")
    table: dict[tuple[str, int, int], TuneEntry] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"tuning table entry {i} is not an object")
        missing = [k for k in ("model", "tp", "tokens", "num_ctas") if k not in row]
        if missing:
            raise ValueError(f"tuning table entry {i} lacks {missing}")
        key = (row["model"], row["tp"], row["tokens"])
        try:
            _check_key(*key)
            entry = TuneEntry(offset=row.get("offset"), num_ctas=row["num_ctas"],
                              first_num_ctas=row.get("first_num_ctas"))
        except ValueError as err:
            raise ValueError(f"tuning table entry {i}: {err}") from None
        if key in table:
            raise ValueError(f"tuning table entry {i}: duplicate key {key}")
        table[key] = entry
    return table


def save(table: TuneTable, path: str | os.PathLike,
         extra: Mapping[tuple[str, int, int], Mapping[str, Any]] | None = None) -> None:
    """Write ``table`` as JSON to ``path`` (see :func:`to_json`)."""
    Path(path).write_text(json.dumps(to_json(table, extra), indent=1) + "\n")


def load(path: str | os.PathLike) -> dict[tuple[str, int, int], TuneEntry]:
    """Read a table written by :func:`save` (or ``benchmarks/tune.py``)."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    try:
        return from_json(data)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
