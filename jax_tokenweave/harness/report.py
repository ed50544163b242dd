"""The main job's report: one result per token count, the run's configuration, and their
forms: the text table and header line it prints, the plot it writes (``--plot``)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jax_tokenweave.harness import timing


def result(
    tokens: int,
    lengths: Sequence[int],
    plan: Any,
    rel_err: float | None,
    collective: str,
    stats: dict[str, timing.Stats],
    compile_s: dict[str, float],
) -> dict[str, Any]:
    med = {name: s.median_ms for name, s in stats.items()}
    ratios = {}
    for a, b in (("baseline", "weave"), ("baseline", "nocomm"), ("weave", "nocomm")):
        if a in med and b in med:
            ratios[f"{a}_over_{b}"] = med[a] / med[b]
    return {
        "tokens": tokens,
        "num_requests": len(lengths),
        "request_lengths": list(lengths),
        "split": bool(plan.is_split),
        "half_lengths": [h.length for h in plan.halves],
        "split_offset": plan.offset,
        "weave_comm": collective,
        "tuning": dataclasses.asdict(plan.tuning) if getattr(plan, "tuning", None) else None,
        "rel_err_weave_vs_baseline": rel_err,
        "compile_s": compile_s,
        "schedules": {n: s.summary() for n, s in stats.items()},
        "ratios": ratios,
    }


def config_dict(args: argparse.Namespace) -> dict[str, Any]:
    c = args.config
    return {
        "model": args.model,
        "layers": args.layers,
        "tp": args.tp,
        "dtype": args.dtype,
        "tokens": args.tokens,
        "request_len": args.request_len,
        "comm": args.collective,  # the key of recorded results
        "schedules": args.schedules,
        "warmup": args.warmup,
        "iters": args.iters,
        "split_threshold": args.split_threshold,
        "tolerance": args.tol,
        "seed": args.seed,
        "shapes": {
            "hidden": c.hidden_size,
            "intermediate": c.intermediate_size,
            "heads": c.num_heads,
            "kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "experts": c.num_experts,
        },
    }


def format_table(report: dict[str, Any]) -> str:
    """The results as a fixed-width text table (medians in ms and ratios)."""
    schedules = report["config"]["schedules"]
    cols = ["tokens", "split", *[f"{s} ms" for s in schedules]]
    ratio_cols = [
        k
        for k in ("baseline_over_weave", "baseline_over_nocomm", "weave_over_nocomm")
        if any(k in r["ratios"] for r in report["results"])
    ]
    labels = {
        "baseline_over_weave": "speedup weave",
        "baseline_over_nocomm": "speedup nocomm",
        "weave_over_nocomm": "weave/nocomm",
    }
    cols += [labels[k] for k in ratio_cols] + ["rel err"]
    rows = []
    for r in report["results"]:
        split = "x".join(str(n) for n in r["half_lengths"]) if r["split"] else "no"
        row = [str(r["tokens"]), split]
        row += [f"{r['schedules'][s]['median_ms']:.3f}" for s in schedules]
        row += [f"{r['ratios'][k]:.3f}" if k in r["ratios"] else "-" for k in ratio_cols]
        err = r["rel_err_weave_vs_baseline"]
        row.append("-" if err is None else f"{err:.2e}")
        rows.append(row)
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))
    out = [line(cols), line(["-" * w for w in widths]), *(line(r) for r in rows)]
    return "\n".join(out)


def describe(report: dict[str, Any]) -> str:
    """A header line saying what was measured, and on what."""
    c, e = report["config"], report["environment"]
    return (
        f"{c['model']}, {c['layers']} layers, TP={c['tp']}, {c['dtype']}, requests of "
        f"{c['request_len']} tokens, weave comm={c['comm']}; {e['num_devices']} x "
        f"{e['device_kind']} ({e['platform']}), jax {e['jax_version']}; median of "
        f"{c['iters']} runs after {c['warmup']} warm-up"
    )


def write_plot(report: dict[str, Any], path: Path) -> None:
    """A grouped bar chart of the median latency per token count and schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schedules = report["config"]["schedules"]
    results = report["results"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(schedules)
    x = np.arange(len(results))
    for i, name in enumerate(schedules):
        meds = [r["schedules"][name]["median_ms"] for r in results]
        lo = [m - r["schedules"][name]["p10_ms"] for m, r in zip(meds, results, strict=True)]
        hi = [r["schedules"][name]["p90_ms"] - m for m, r in zip(meds, results, strict=True)]
        ax.bar(
            x + (i - (len(schedules) - 1) / 2) * width,
            meds,
            width,
            yerr=[lo, hi],
            capsize=3,
            label=name,
        )
    ax.set_xticks(x, [str(r["tokens"]) for r in results])
    ax.set_xlabel("tokens in the batch")
    ax.set_ylabel("median latency (ms), p10-p90 bars")
    c = report["config"]
    ax.set_title(
        f"{c['model']} x{c['layers']} layers, TP={c['tp']}, {report['environment']['device_kind']}",
        fontsize=10,
    )
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
