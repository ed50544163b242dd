"""``attention_bench.py``'s report: the markdown tables and the decode bandwidth plot."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any


def to_markdown(report: dict[str, Any]) -> str:
    """A decode table and a prefill table: per implementation time, GB/s, % of the copy's."""
    env, cfg, bw = report["environment"], report["config"], report["bandwidth"]
    impls = cfg["impls"]
    lines = [
        f"# Paged attention, one layer, one rank ({env['device_kind']})",
        "",
        f"jax {env['jax_version']}, commit {env['git_commit']}, {env['date']}; Hq "
        f"{cfg['heads']}, KVH {cfg['kv_heads']}, D {cfg['head_dim']}, block "
        f"{cfg['block_size']}, {cfg['dtype']}; per call, median of {cfg['iters']} "
        f"dispatches of {cfg['inner']} chained calls. Copy bandwidth {bw['gb_s']:.0f} GB/s "
        f"(read + write). err: relative error vs xla (* above {cfg['tolerance']:g}).",
        "",
    ]
    notes: dict[str, int] = {}
    for kind, keys, extra in (
        ("decode", ("batch", "context"), ()),
        ("prefill", ("chunk", "prefix"), ("TFLOP/s",)),
    ):
        recs = [r for r in report["records"] if r["kind"] == kind]
        if not recs:
            continue
        profiled = any("device_us" in r or "profile" in r for r in recs)
        cols = functools.partial(_columns, extra + (("dev µs", "dev %BW") if profiled else ()))
        head = [f"{i} {c}" for i in impls for c in cols(i)]
        lines += [
            f"## {kind}",
            "",
            "| " + " | ".join([*keys, *head]) + " |",
            "|---" * (len(keys) + len(head)) + "|",
        ]
        cell = {(tuple(r[k] for k in keys), r["impl"]): r for r in recs}
        for point in dict.fromkeys(tuple(r[k] for k in keys) for r in recs):
            row = [str(v) for v in point]
            for impl in impls:
                r = cell.get((point, impl), {})
                if r.get("status") != "ok":
                    reason = r.get("reason", "missing")
                    notes.setdefault(reason, len(notes) + 1)
                    row += [f"{r.get('status', '-')} [{notes[reason]}]"]
                    row += ["-"] * (len(cols(impl)) - 1)
                    continue
                err = r.get("rel_err")
                row += [
                    _num(r["median_us"]),
                    _num(r["gb_s"]),
                    _num(r["pct_bw"]),
                    *([_num(r["tflop_s"])] if kind == "prefill" else []),
                ]
                if profiled:
                    dev = r.get("device_us")
                    row += ["-", "-"] if dev is None else [_num(dev), _num(r["device_pct_bw"])]
                if impl != "xla":
                    row.append("-" if err is None else f"{err:.1e}" + "*" * r["flagged"])
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines + [f"[{n}] {reason}" for reason, n in notes.items()])


def _columns(extra: tuple[str, ...], impl: str) -> tuple[str, ...]:
    return ("µs", "GB/s", "%BW", *extra, *(("err",) if impl != "xla" else ()))


def _num(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def write_plot(report: dict[str, Any], path: Path) -> bool:
    """Decode GB/s vs context, a panel per batch, a line per implementation, the copy's line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report["records"] if r["kind"] == "decode" and r.get("status") == "ok"]
    batches = sorted({r["batch"] for r in ok})
    if not batches:
        return False
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.8), squeeze=False)
    for ax, batch in zip(axes[0], batches, strict=True):
        for impl in report["config"]["impls"]:
            pts = sorted(
                (r["context"], r["gb_s"]) for r in ok if r["batch"] == batch and r["impl"] == impl
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=impl)
        ax.axhline(report["bandwidth"]["gb_s"], color="gray", ls="--", label="copy")
        ax.set_xscale("log", base=2)
        ax.set(title=f"decode, batch {batch}", xlabel="context (keys per request)", ylabel="GB/s")
        ax.legend(fontsize=8)
    fig.suptitle(f"paged attention, one layer ({report['environment']['device_kind']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
