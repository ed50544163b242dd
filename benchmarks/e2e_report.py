"""``e2e_bench.py``'s report: the markdown tables (median ms and speedup over baseline per
mode, one per kind, model and TP; device-busy ms beside them where profiled), the plot
(speedup against tokens, a panel each) and the writer of ``e2e.json`` / ``e2e.md`` /
``e2e.png``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jax_tokenweave.kernel._util import ceil_div


def _groups(records: list[dict[str, Any]]) -> dict[tuple[str, str, int], list[dict[str, Any]]]:
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["kind"], r["model"], r["tp"]), []).append(r)
    return groups


def to_markdown(report: dict[str, Any]) -> str:
    """One table per (kind, model, TP): median ms per mode, and speedups over baseline; where
    the run profiled device time (``--device-time``), a second table of device-busy ms."""
    env, cfg = report["environment"], report["config"]
    lines = [
        f"# End-to-end latency ({env['num_devices']} x {env['device_kind']})",
        "",
        f"jax {env['jax_version']}, commit {env['git_commit']}, {env['date']}; "
        f"{cfg['layers']} layers, {cfg['dtype']}, prefill requests of "
        f"{cfg['request_len']} tokens; median of {cfg['iters']} runs "
        f"(after {cfg['warmup']} warm-up), {cfg.get('dispatch_ahead', 1)} run(s) dispatched "
        "back to back per sample. Speedup = baseline / mode.",
        "",
    ]
    for (kind, model, tp), recs in _groups(report["records"]).items():
        lines += [f"## {kind}: {model}, TP={tp}", ""]
        lines += _table(recs, "median_ms", "wall ms per run (host clock, dispatch included)")
        if any("device_ms" in r or "device_reason" in r for r in recs):
            lines += _table(
                recs,
                "device_ms",
                f"device-busy ms per run (PyTorch's CUDA profiler, {cfg.get('device_time')} "
                "runs, median over GPUs)",
            )
    return "\n".join(lines)


def _table(recs: list[dict[str, Any]], key: str, title: str) -> list[str]:
    """The markdown lines of one table: ``key`` per mode and tokens, and baseline / mode."""
    modes = list(dict.fromkeys(r["mode"] for r in recs))
    tokens = list(dict.fromkeys(r["tokens"] for r in recs))
    cell = {(r["tokens"], r["mode"]): r for r in recs}
    speed = [m for m in modes if m != "baseline"]
    lines = [
        f"{title}:",
        "",
        "| tokens | "
        + " | ".join(f"{m} ms" for m in modes)
        + " | "
        + " | ".join(f"speedup {m}" for m in speed)
        + " |",
        "|---" * (1 + len(modes) + len(speed)) + "|",
    ]
    notes: dict[str, int] = {}
    for t in tokens:
        row = [str(t)]
        for m in modes:
            r = cell.get((t, m), {})
            if r.get("status") == "ok" and key in r:
                row.append(f"{r[key]:.2f}")
            else:
                reason = r.get("device_reason" if r.get("status") == "ok" else "reason", "missing")
                notes.setdefault(reason, len(notes) + 1)
                row.append(f"{r.get('status', '-')} [{notes[reason]}]")
        base = cell.get((t, "baseline"), {})
        for m in speed:
            r = cell.get((t, m), {})
            ok = key in r and key in base and r.get("status") == base.get("status") == "ok"
            row.append(f"{base[key] / r[key]:.3f}" if ok else "-")
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines += [f"[{n}] {reason}" for reason, n in notes.items()]
    if notes:
        lines.append("")
    return lines


def write_plot(report: dict[str, Any], path: Path) -> bool:
    """Speedup over baseline vs tokens, a panel per (kind, model, TP). False if nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {
        k: v
        for k, v in _groups(report["records"]).items()
        if any(r.get("status") == "ok" and r["mode"] != "baseline" for r in v)
    }
    if not groups:
        return False
    ncols = min(2, len(groups))
    nrows = ceil_div(len(groups), ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 3.6 * nrows), squeeze=False)
    for ax, ((kind, model, tp), recs) in zip(axes.flat, groups.items(), strict=False):
        base = {
            r["tokens"]: r["median_ms"]
            for r in recs
            if r["mode"] == "baseline" and r.get("status") == "ok"
        }
        for mode in dict.fromkeys(r["mode"] for r in recs):
            if mode == "baseline":
                continue
            pts = sorted(
                (r["tokens"], base[r["tokens"]] / r["median_ms"])
                for r in recs
                if r["mode"] == mode and r.get("status") == "ok" and r["tokens"] in base
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=mode)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{kind}: {model}, TP={tp}", fontsize=10)
        ax.set_xlabel("tokens")
        ax.set_ylabel("speedup over baseline")
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(groups) :]:
        ax.set_visible(False)
    fig.suptitle(
        f"{report['environment']['num_devices']} x {report['environment']['device_kind']}",
        fontsize=11,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(report: dict[str, Any], out: Path, plot: bool = True) -> None:
    """``e2e.json``, ``e2e.md`` and (with ``plot``, where anything ran) ``e2e.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "e2e.md").write_text(to_markdown(report) + "\n")
    wrote = [out / "e2e.json", out / "e2e.md"]
    if plot and write_plot(report, out / "e2e.png"):
        wrote.append(out / "e2e.png")
    print("wrote " + ", ".join(map(str, wrote)))
