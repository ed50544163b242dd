"""The tuning table: per (model, TP) the split threshold, per (model, TP, tokens) a
:class:`TuneEntry` (split offset, fused kernel CTA counts). Shipped (``tuning.json``) and read
by ``weave.plan.plan_batch``; ``benchmarks/tune.py`` regenerates it.

Lookups (:meth:`TuneTable.entry`, :meth:`TuneTable.threshold`): the model's rows, else the
wildcard ``"*"``'s, else :data:`DEFAULT_ENTRY` / :data:`DEFAULT_THRESHOLD`. A
``DecoderConfig`` finds its name by its layer shapes (:func:`signature`). The shipped rows and
the JSON format: docs/WEAVE.md#weavetuning.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import numbers
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard

from jax_tokenweave.kernel.policy import ALGOS

__all__ = [
    "ANY_MODEL",
    "DEFAULT_ENTRY",
    "DEFAULT_PATH",
    "DEFAULT_THRESHOLD",
    "FORMAT",
    "MAX_CTAS",
    "MIN_CTAS",
    "POLICY_ENTRY",
    "TUNING_ENV",
    "TuneEntry",
    "TuneTable",
    "from_json",
    "load",
    "lookup",
    "model_name",
    "save",
    "shipped",
    "signature",
    "to_json",
]

FORMAT = "jax-tokenweave-tuning/2"
_OLD_FORMAT = "jax-tokenweave-tuning/1"
MIN_CTAS, MAX_CTAS = 1, 64  # the extension's limits (tests/test_ffi.py pins them to limits())
ANY_MODEL = "*"
DEFAULT_THRESHOLD = 1024
"""Split batches of at least this many tokens where the table has no threshold (the paper's)."""
DEFAULT_PATH = Path(__file__).with_name("tuning.json")
SIGNATURE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "num_experts",
    "qkv_bias",
)
"""The ``DecoderConfig`` fields that identify a model's layer shapes (:func:`signature`)."""


def _is_int(value: object) -> TypeGuard[numbers.Integral]:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_ctas(name: str, value: object) -> None:
    if not _is_int(value) or not MIN_CTAS <= int(value) <= MAX_CTAS:
        raise ValueError(f"{name} must be an int in [{MIN_CTAS}, {MAX_CTAS}], got {value!r}")


@dataclasses.dataclass(frozen=True)
class TuneEntry:
    """How to run one batch size (module docstring). Hashable: a valid static ``jit`` argument."""

    offset: int | None
    num_ctas: int | None
    first_num_ctas: int | None = None
    algo: str | None = None  # the fused calls' variant (None: the kernel policy's, by size)

    def __post_init__(self) -> None:
        if self.offset is not None and not _is_int(self.offset):
            raise ValueError(f"offset must be an int or None, got {self.offset!r}")
        if self.algo is not None and self.algo not in ALGOS:
            raise ValueError(f"algo must be one of {ALGOS} or None, got {self.algo!r}")
        for name in ("num_ctas", "first_num_ctas"):
            if getattr(self, name) is not None:
                _check_ctas(name, getattr(self, name))

    def ctas(self, first: bool) -> int | None:
        """CTAs of a fused call: ``first_num_ctas`` for the stack's first one, else ``num_ctas``."""
        if first and self.first_num_ctas is not None:
            return self.first_num_ctas
        return self.num_ctas


DEFAULT_ENTRY = TuneEntry(offset=None, num_ctas=16, first_num_ctas=8)
"""Where a table has nothing for a (model, tp) at or below the token count: the paper's 16 CTAs,
8 for the stack's first fused call, the planner's offset."""

POLICY_ENTRY = TuneEntry(offset=None, num_ctas=None)
"""No CTA counts of its own: every fused call takes the kernel policy's (``kernel.policy``)."""

Key = tuple[str, int, int]


def signature(config: Any) -> dict[str, Any]:
    """The layer shapes of a ``DecoderConfig`` that identify a model (:data:`SIGNATURE_FIELDS`)."""
    return {f: getattr(config, f) for f in SIGNATURE_FIELDS}


def _check_key(model: object, tp: object, num_tokens: object = 1) -> None:
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty string, got {model!r}")
    if not _is_int(tp) or tp < 1:
        raise ValueError(f"tp must be an int >= 1, got {tp!r}")
    if not _is_int(num_tokens) or num_tokens < 1:
        raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")


@dataclasses.dataclass(frozen=True)
class TuneTable:
    """``entries``: ``(model, tp, tokens) -> TuneEntry``; ``thresholds``: ``(model, tp) ->``
    split at this many tokens or more; ``models``: name -> :func:`signature`; ``meta``:
    provenance and ``notes``: per entry, its informational keys (both kept through load/save,
    ignored by lookups)."""

    entries: Mapping[Key, TuneEntry] = dataclasses.field(default_factory=dict)
    thresholds: Mapping[tuple[str, int], int] = dataclasses.field(default_factory=dict)
    models: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    notes: Mapping[Key, Mapping[str, Any]] = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for key, entry in self.entries.items():
            _check_key(*key)
            if not isinstance(entry, TuneEntry):
                raise ValueError(f"entry {key} must be a TuneEntry, got {type(entry).__name__}")
        for (model, tp), value in self.thresholds.items():
            _check_key(model, tp)
            if not _is_int(value) or value < 2:
                raise ValueError(f"threshold of {(model, tp)} must be an int >= 2, got {value!r}")

    def entry(
        self, model: str | None, tp: int, num_tokens: int, *, default: TuneEntry = DEFAULT_ENTRY
    ) -> TuneEntry:
        """The entry of ``model`` (else ``"*"``) and ``tp`` with the largest token count at or
        below ``num_tokens``; ``default`` where there is none."""
        model = ANY_MODEL if model is None else model
        _check_key(model, tp, num_tokens)
        for name in dict.fromkeys((model, ANY_MODEL)):
            rows = [
                (t, e)
                for (m, p, t), e in self.entries.items()
                if m == name and p == tp and t <= num_tokens
            ]
            if rows:
                return max(rows, key=lambda row: row[0])[1]
        return default

    def threshold(self, model: str | None, tp: int) -> int:
        """The split threshold of ``model`` (else ``"*"``) at ``tp``; :data:`DEFAULT_THRESHOLD`
        where the table has none."""
        model = ANY_MODEL if model is None else model
        _check_key(model, tp)
        for name in (model, ANY_MODEL):
            if (name, tp) in self.thresholds:
                return self.thresholds[(name, tp)]
        return DEFAULT_THRESHOLD

    def model_name(self, config: Any) -> str | None:
        """The name of the model whose recorded shapes are ``config``'s (None if none)."""
        sig = signature(config)
        return next((name for name, s in self.models.items() if dict(s) == sig), None)

    def describe_thresholds(self) -> str:
        """The thresholds in words, e.g. ``"4096 at TP=2 (any model); else 1024"``."""
        rows = [
            f"{v} at TP={tp} ({'any model' if m == ANY_MODEL else m})"
            for (m, tp), v in sorted(self.thresholds.items())
        ]
        return "; ".join([*rows, f"else {DEFAULT_THRESHOLD}"])

    def merged(self, other: TuneTable) -> TuneTable:
        """This table with ``other``'s rows added, replacing rows of the same keys."""
        notes = {k: v for k, v in self.notes.items() if k not in other.entries}
        return TuneTable(
            {**self.entries, **other.entries},
            {**self.thresholds, **other.thresholds},
            {**self.models, **other.models},
            {**self.meta, **other.meta},
            {**notes, **other.notes},
        )


TUNING_ENV = "JAX_TOKENWEAVE_TUNING"
"""Names a tuning table (a path) whose rows :func:`shipped` merges over the package's."""


def shipped() -> TuneTable:
    """The table in use: the package's ``tuning.json``, with the rows of the table at
    ``$JAX_TOKENWEAVE_TUNING`` (a path, if set) merged over it (same keys replaced). Each file
    is read once."""
    return _in_use(os.environ.get(TUNING_ENV) or None)


@functools.cache
def _package_table() -> TuneTable:
    return load(DEFAULT_PATH)


@functools.cache
def _in_use(override: str | None) -> TuneTable:
    table = _package_table()
    if override is None:
        return table
    if not Path(override).is_file():
        raise FileNotFoundError(f"{TUNING_ENV}={override!r}: no such tuning table")
    try:
        return table.merged(load(Path(override)))
    except ValueError as err:
        raise ValueError(f"{TUNING_ENV}={override!r}: {err}") from None


def lookup(
    model: str | None,
    tp: int,
    num_tokens: int,
    table: TuneTable | None = None,
    *,
    default: TuneEntry = DEFAULT_ENTRY,
) -> TuneEntry:
    """:meth:`TuneTable.entry` of ``table`` (default: :func:`shipped`)."""
    return (shipped() if table is None else table).entry(model, tp, num_tokens, default=default)


def model_name(config: Any, table: TuneTable | None = None) -> str | None:
    """:meth:`TuneTable.model_name` of ``table`` (default: :func:`shipped`)."""
    return (shipped() if table is None else table).model_name(config)


# ------------------------------------------------------------------------------------ JSON ---

_ENTRY_KEYS = ("model", "tp", "tokens", "num_ctas", "first_num_ctas", "offset", "algo")


def to_json(
    table: TuneTable, extra: Mapping[Key, Mapping[str, Any]] | None = None
) -> dict[str, Any]:
    """The JSON-ready dict of ``table`` (rows sorted); its ``notes`` and ``extra`` add
    informational keys per entry."""
    entries = []
    for key in sorted(table.entries):
        e = table.entries[key]
        row = {
            "model": key[0],
            "tp": int(key[1]),
            "tokens": int(key[2]),
            "num_ctas": e.num_ctas,
            "first_num_ctas": e.first_num_ctas,
            "offset": e.offset,
        }
        if e.algo is not None:
            row["algo"] = e.algo
        info = {**table.notes.get(key, {}), **(extra or {}).get(key, {})}
        row.update({k: v for k, v in info.items() if k not in row})
        entries.append(row)
    thresholds = [
        {"model": m, "tp": int(t), "split_threshold": int(v)}
        for (m, t), v in sorted(table.thresholds.items())
    ]
    return {
        "format": FORMAT,
        "meta": dict(table.meta),
        "models": {k: dict(v) for k, v in sorted(table.models.items())},
        "thresholds": thresholds,
        "entries": entries,
    }


def _rows(data: Mapping[str, Any], name: str, required: tuple[str, ...]) -> list[Mapping]:
    rows = data.get(name, [])
    if not isinstance(rows, list):
        raise ValueError(f"tuning table: {name!r} must be a list")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"tuning table {name} {i} is not an object")
        missing = [k for k in required if k not in row]
        if missing:
            raise ValueError(f"tuning table {name} {i} lacks {missing}")
    return rows


def from_json(data: Any) -> TuneTable:
    """Parse :func:`to_json`'s dict (or a format ``/1`` table); ``ValueError`` saying what is
    wrong."""
    if not isinstance(data, Mapping) or data.get("format") not in (FORMAT, _OLD_FORMAT):
        raise ValueError(f"not a tuning table: expected a JSON object with format {FORMAT!r}")
    if "entries" not in data:
        raise ValueError("tuning table: 'entries' must be a list")
    entries: dict[Key, TuneEntry] = {}
    notes: dict[Key, dict[str, Any]] = {}
    for i, row in enumerate(_rows(data, "entries", ("model", "tp", "tokens", "num_ctas"))):
        key = (row["model"], row["tp"], row["tokens"])
        try:
            _check_key(*key)
            entry = TuneEntry(
                offset=row.get("offset"),
                num_ctas=row["num_ctas"],
                first_num_ctas=row.get("first_num_ctas"),
                algo=row.get("algo"),
            )
        except ValueError as err:
            raise ValueError(f"tuning table entry {i}: {err}") from None
        if key in entries:
            raise ValueError(f"tuning table entry {i}: duplicate key {key}")
        entries[key] = entry
        notes[key] = {k: v for k, v in row.items() if k not in _ENTRY_KEYS}
    thresholds: dict[tuple[str, int], int] = {}
    for i, row in enumerate(_rows(data, "thresholds", ("model", "tp", "split_threshold"))):
        model_tp = (row["model"], row["tp"])
        if model_tp in thresholds:
            raise ValueError(f"tuning table threshold {i}: duplicate key {model_tp}")
        thresholds[model_tp] = row["split_threshold"]
    models = data.get("models", {})
    if not isinstance(models, Mapping) or not all(isinstance(v, Mapping) for v in models.values()):
        raise ValueError("tuning table: 'models' must map names to shape objects")
    try:
        return TuneTable(
            entries,
            thresholds,
            dict(models),
            dict(data.get("meta", {})),
            {k: v for k, v in notes.items() if v},
        )
    except ValueError as err:
        raise ValueError(f"tuning table: {err}") from None


def save(
    table: TuneTable, path: str | os.PathLike, extra: Mapping[Key, Mapping[str, Any]] | None = None
) -> None:
    """Write ``table`` as JSON to ``path`` (see :func:`to_json`)."""
    Path(path).write_text(json.dumps(to_json(table, extra), indent=1) + "\n")


def load(path: str | os.PathLike) -> TuneTable:
    """Read a table written by :func:`save` (or ``benchmarks/tune.py``)."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    try:
        return from_json(data)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
