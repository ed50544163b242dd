"""The fused kernel's size policy (``jax_tokenweave/kernel/policy.json``) from kernel_bench rows.

Per TP degree, for each measured message size (T * H * itemsize per rank) the fastest ffi row
(profiled device time where the row has it, else wall time) gives the variant and CTA count that
ran. A size keeps the smaller size's choice where that is within 5% of the fastest (noise between
near-equal CTA counts); consecutive sizes with the same choice share one table row, and the
largest size's choice covers every larger message. Group sizes that no row measured keep the
rows of the table already at ``--out`` (if any), so runs on machines of different sizes combine:

    python benchmarks/policy_table.py results/a/kernel_bench.json results/b/kernel_bench.json \\
        --out jax_tokenweave/kernel/policy.json

``kernel_bench.py --write-policy PATH`` calls the same code on the rows it just measured.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jax_tokenweave.kernel.policy import KernelPolicy, PolicyRow

Row = Mapping[str, Any]
TOLERANCE = 0.05  # a choice within 5% of the fastest counts as a tie


def time_of(row: Row) -> float:
    """A row's time per call: profiled device time where measured, else wall time (us)."""
    return row.get("device_us", row["us"])


def ran(row: Row) -> tuple[str, int]:
    """The variant and CTA count an ffi row ran (rows of older files: as asked)."""
    return row.get("ran_algo", row["algo"]), row.get("ran_ctas", row["num_ctas"])


def _message_bytes(row: Row) -> int:
    return row["tokens"] * row["hidden"] * jnp.dtype(row["dtype"]).itemsize


def rows_for(rows: Iterable[Row], tp: int, tolerance: float = TOLERANCE) -> tuple[PolicyRow, ...]:
    """The policy rows of one TP degree from its measured ffi rows (see the module doc): at each
    size the previous size's choice stays if it is within ``tolerance`` of the fastest there,
    so noise between near-equal CTA counts adds no rows."""
    by_size: dict[int, dict[tuple[str, int], float]] = {}
    for r in rows:
        if r["impl"] == "ffi" and r["tp"] == tp:
            times, key = by_size.setdefault(_message_bytes(r), {}), ran(r)
            times[key] = min(time_of(r), times.get(key, float("inf")))
    if not by_size:
        raise ValueError(f"no ffi rows for TP={tp}")
    sizes = sorted(by_size)
    out: list[PolicyRow] = []
    for i, size in enumerate(sizes):
        bound = None if i == len(sizes) - 1 else size
        times = by_size[size]
        choice = min(times, key=times.__getitem__)
        prev = (out[-1].algo, out[-1].num_ctas) if out else None
        if prev in times and times[prev] <= (1 + tolerance) * times[choice]:
            choice = prev
        if choice == prev:
            out[-1] = PolicyRow(bound, *choice)  # the same choice: widen the previous row
        else:
            out.append(PolicyRow(bound, *choice))
    return tuple(out)


def policy_from_rows(
    rows: list[Row], meta: Mapping[str, Any], keep: KernelPolicy | None = None
) -> KernelPolicy:
    """The table from kernel_bench rows (``meta``: the run's, for the source line); group sizes
    measured in no row keep ``keep``'s rows and their own source (``meta.sources``, per group
    size; a table without it gives its whole ``source``), so rewriting a table never nests the
    sources of the degrees it replaces."""
    measured = sorted({r["tp"] for r in rows if r["impl"] == "ffi"})
    by_ranks = dict(keep.by_ranks) if keep is not None else {}
    by_ranks.update({tp: rows_for(rows, tp) for tp in measured})
    run = (
        f"measured by benchmarks/kernel_bench.py on {meta['device']} x{meta['n_devices']}, "
        f"{meta['date']}, commit {meta['commit']}: {meta['argv']}"
    )
    old = dict(keep.meta.get("sources", {})) if keep is not None else {}
    fallback = str(keep.meta.get("source", "no source given")) if keep is not None else ""
    sources = {
        str(tp): run if tp in measured else old.get(str(tp), fallback) for tp in sorted(by_ranks)
    }
    by_text: dict[str, list[str]] = {}
    for tp, text in sources.items():
        by_text.setdefault(text, []).append(tp)
    source = ". ".join(f"TP {', '.join(tps)}: {text}" for text, tps in by_text.items())
    return KernelPolicy(
        by_ranks, {"source": source, "sources": sources, "generated": meta["date"][:10]}
    )


def write(rows: list[Row], meta: Mapping[str, Any], path: str | Path) -> KernelPolicy:
    """Write the table made from ``rows`` to ``path``, keeping unmeasured group sizes of the
    table already there."""
    path = Path(path)
    keep = KernelPolicy.from_json(json.loads(path.read_text())) if path.exists() else None
    policy = policy_from_rows(rows, meta, keep)
    policy.save(path)
    return policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="kernel_bench.json files")
    ap.add_argument("--out", required=True, type=Path, help="policy table to write")
    args = ap.parse_args()
    rows: list[Row] = []
    metas = []
    for path in args.results:
        data = json.loads(path.read_text())
        rows += data["rows"]
        metas.append(data["meta"])
    meta = dict(metas[0])
    meta["commit"] = ", ".join(sorted({m["commit"] for m in metas}))
    meta["argv"] = " / ".join(m["argv"] for m in metas)
    meta["n_devices"] = max(m["n_devices"] for m in metas)
    policy = write(rows, meta, args.out)
    print(json.dumps(policy.to_json()["by_ranks"], indent=1))


if __name__ == "__main__":
    main()
