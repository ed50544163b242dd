"""The size policy of the fused kernel: which variant ("algo") and how many CTAs ``auto`` runs
for a group of N ranks and a message of B bytes per rank (``T * H * itemsize``).

The table ships with the package (``policy.json``, regenerated from measurements by
``benchmarks/kernel_bench.py --write-policy``); its ``meta.source`` says where its numbers come
from. Rows are tried in order; the first whose ``max_bytes`` is at least the message (or None)
wins. A group size missing from the table uses the next larger one present (else the largest).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ALGOS = ("two_shot", "one_shot", "direct", "ce")
DEFAULT_PATH = Path(__file__).with_name("policy.json")


@dataclasses.dataclass(frozen=True)
class PolicyRow:
    """One size class: messages of at most ``max_bytes`` (None: any size) run ``algo`` on
    ``num_ctas`` CTAs."""

    max_bytes: int | None
    algo: str
    num_ctas: int

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise ValueError(f"algo must be one of {ALGOS}, got {self.algo!r}")
        if self.max_bytes is not None and (
            not isinstance(self.max_bytes, int) or self.max_bytes < 0
        ):
            raise ValueError(
                f"max_bytes must be a non-negative int or None, got {self.max_bytes!r}"
            )
        if not isinstance(self.num_ctas, int) or self.num_ctas < 1:
            raise ValueError(f"num_ctas must be a positive int, got {self.num_ctas!r}")


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    """Rows per group size (``by_ranks[N]``), each list ending with an unbounded row."""

    by_ranks: Mapping[int, tuple[PolicyRow, ...]]
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.by_ranks:
            raise ValueError("the kernel policy has no group sizes")
        for n, rows in self.by_ranks.items():
            if not rows or rows[-1].max_bytes is not None:
                raise ValueError(f"policy for {n} ranks must end with a row of max_bytes=None")
            bounds = [r.max_bytes for r in rows[:-1] if r.max_bytes is not None]
            if len(bounds) != len(rows) - 1 or bounds != sorted(bounds):
                raise ValueError(f"policy rows for {n} ranks must have increasing max_bytes")

    def rows(self, num_ranks: int) -> Sequence[PolicyRow]:
        """The rows for ``num_ranks`` (the next larger group size in the table, else the
        largest)."""
        sizes = sorted(self.by_ranks)
        key = next((n for n in sizes if n >= num_ranks), sizes[-1])
        return self.by_ranks[key]

    def choose(self, num_ranks: int, message_bytes: int) -> PolicyRow:
        """The row for a message of ``message_bytes`` per rank over ``num_ranks`` ranks."""
        for row in self.rows(num_ranks):
            if row.max_bytes is None or message_bytes <= row.max_bytes:
                return row
        raise AssertionError("unreachable: the last row is unbounded")

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": dict(self.meta),
            "by_ranks": {
                str(n): [dataclasses.asdict(r) for r in rows]
                for n, rows in sorted(self.by_ranks.items())
            },
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> KernelPolicy:
        try:
            by_ranks = {
                int(n): tuple(PolicyRow(**row) for row in rows)
                for n, rows in data["by_ranks"].items()
            }
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"not a kernel policy table: {err}") from err
        return cls(by_ranks, dict(data.get("meta", {})))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


@functools.cache
def load(path: str | Path = DEFAULT_PATH) -> KernelPolicy:
    """The policy table at ``path`` (default: the one shipped with the package)."""
    return KernelPolicy.from_json(json.loads(Path(path).read_text()))
