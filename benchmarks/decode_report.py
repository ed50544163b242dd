"""``decode_bench.py``'s report: the markdown table (a row per batch and context, and the
profiled steps' busy time and top kernels), the plot (step and roofline time against batch, a
panel per context), and the writer of ``<stem>.json`` / ``.md`` / ``.png`` that
``prefill_bench.py`` shares."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jax_tokenweave.harness import benchmarking as bm


def to_markdown(report: dict[str, Any]) -> str:
    """One table: a row per (batch, context)."""
    env, bw = report["environment"], report["bandwidth"]
    lines = [
        f"# Decode step vs roofline: {report['model']}, {report['layers']} layers, TP "
        f"{report['tp']} ({env['device_kind']})",
        "",
        f"jax {env['jax_version']}, commit {env['git_commit']}, {env['date']}; weights "
        f"{report['weight_bytes'] / 1e9:.2f} GB per GPU, copy bandwidth {bw['gb_s']:.0f} "
        f"GB/s (read + write), matmul {report.get('matmul', {}).get('tflop_s', 0):.0f} TFLOP/s. "
        "Ratio = step p50 / roofline; serial floor: each GEMM at the slower of its weight bytes "
        "and its FLOPs, then the K/V bytes (decode_bench.py).",
        "",
        "SM clock: nvidia-smi's samples over the timed and profiled steps (median MHz; the "
        "share held down by the power cap).",
        "",
        "| batch | context | step p50 ms | step p90 ms | roofline ms | ratio | serial floor ms "
        "| step / floor | tok/s | compiles | SM clock |",
        "|---" * 11 + "|",
    ]
    for r in report["records"]:
        if r["status"] != "ok":
            lines.append(
                f"| {r['batch']} | {r['context']} | {r['status']}: {r['reason']} |" + " - |" * 8
            )
            continue
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['step_p50_ms']:.3f} | "
            f"{r['step_p90_ms']:.3f} | {r['roofline_ms']:.3f} | {r['ratio']:.2f} | "
            f"{bm.number_or_dash(r.get('floor_ms'), 3)} | "
            f"{bm.number_or_dash(r.get('floor_ratio'), 2)} | "
            f"{r['tok_s']:.0f} | {r['compilations']} | {clock_cell(r.get('gpu_clocks', {}))} |"
        )
    profiled = [r for r in report["records"] if r.get("profile", {}).get("status") == "ok"]
    if profiled:
        lines += [
            "",
            "## Profiled steps (PyTorch CUDA profiler)",
            "",
            "GPU busy = union of the kernels' intervals; host gap = wall - busy.",
            "",
            "| batch | context | wall ms | GPU busy ms | host gap ms | top kernels (ms per step) |",
            "|---" * 6 + "|",
        ]
        for r in profiled:
            prof = r["profile"]
            top = "; ".join(f"{k['name'][:48]} {k['ms_per_step']:.3f}" for k in prof["kernels"][:5])
            lines.append(
                f"| {r['batch']} | {r['context']} | {prof['wall_ms']:.3f} | "
                f"{prof['busy_ms']:.3f} | {prof['gap_ms']:.3f} | {top} |"
            )
    return "\n".join(lines)


def clock_cell(clocks: dict[str, Any]) -> str:
    """``1530 MHz, 700 W, 100% power-capped`` (``gpu_clocks.summarize``), or ``-``."""
    if clocks.get("status") != "ok":
        return "-"
    return (
        f"{clocks['sm_mhz_min_p50_max'][1]:.0f} MHz, {clocks['power_w_p50']:.0f} W, "
        f"{clocks['power_capped']:.0%} power-capped"
    )


def write_plot(report: dict[str, Any], path: Path) -> bool:
    """Step time and roofline time vs batch, a panel per context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report["records"] if r["status"] == "ok"]
    contexts = sorted({r["context"] for r in ok})
    if not contexts:
        return False
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 3.8), squeeze=False)
    for ax, context in zip(axes[0], contexts, strict=True):
        pts = sorted(
            (r["batch"], r["step_p50_ms"], r["roofline_ms"], r.get("floor_ms"))
            for r in ok
            if r["context"] == context
        )
        xs, step, roof, floor = zip(*pts, strict=True)
        ax.plot(xs, step, marker="o", label="step p50")
        ax.plot(xs, roof, marker="x", ls="--", label="roofline (bytes)")
        if None not in floor:
            ax.plot(xs, floor, marker="+", ls=":", label="serial floor (bytes or FLOPs)")
        ax.set_xscale("log", base=2)
        ax.set(title=f"context {context}", xlabel="batch (requests)", ylabel="ms per step")
        ax.legend(fontsize=8)
    fig.suptitle(  # two lines: one panel is narrower than the title on one line
        f"decode step, {report['model']} x{report['layers']}, TP {report['tp']}\n"
        f"{report['environment']['device_kind']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(
    report: dict[str, Any], out: Path, stem: str, markdown: str, plot: Any = None
) -> None:
    """``<stem>.json``, ``<stem>.md`` and (``plot(report, path)``) ``<stem>.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown + "\n")
    if plot is not None:
        plot(report, out / f"{stem}.png")
    print(markdown)
