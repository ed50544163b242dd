"""``serve_bench.py``'s report: the markdown table (a row per workload, schedule and KV policy),
the ratios (weave / baseline, on-demand / reserve, prefix cache on / off) and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jax_tokenweave.harness import benchmarking as bm


def ratios(runs: dict[str, dict[str, dict[str, dict[str, Any]]]]) -> dict[str, Any]:
    """From ``runs[workload][schedule][policy]``: output throughput weave / baseline per
    (workload, policy); total throughput on-demand / reserve and, prefix cache on / off, total
    throughput and TTFT p50 (off / on: how many times lower) per (workload, schedule)."""
    weave: dict[str, dict[str, float]] = {}
    policy: dict[str, dict[str, dict[str, float]]] = {}
    for workload, per in runs.items():
        if {"weave", "baseline"} <= set(per):
            weave[workload] = {
                p: per["weave"][p]["output_tok_s"] / per["baseline"][p]["output_tok_s"]
                for p in per["weave"]
                if p in per["baseline"]
            }
        for schedule, by in per.items():
            out: dict[str, float] = {}
            if {"on-demand", "reserve"} <= set(by):
                out["total_tok_s_on_demand_over_reserve"] = (
                    by["on-demand"]["total_tok_s"] / by["reserve"]["total_tok_s"]
                )
            if {"on-demand", "no-prefix-cache"} <= set(by):
                on, off = by["on-demand"], by["no-prefix-cache"]
                out["total_tok_s_cache_on_over_off"] = on["total_tok_s"] / off["total_tok_s"]
                if on["ttft_p50_ms"] and off["ttft_p50_ms"]:
                    out["ttft_p50_cache_off_over_on"] = off["ttft_p50_ms"] / on["ttft_p50_ms"]
            if out:
                policy.setdefault(workload, {})[schedule] = out
    return {"throughput_ratio_weave_over_baseline": weave, "policy_ratios": policy}


def to_markdown(report: dict[str, Any]) -> str:
    """The table (with each run's time over its floor where the rates were measured), the
    ratios and the warm-ups (layouts loaded from the executable cache / compiled)."""
    fmt = bm.number_or_dash
    rows = [
        "| workload | schedule | KV policy | output tok/s | total tok/s | TTFT p50 / p99 ms | "
        "TPOT p50 / p99 ms | steps (woven / cut) | preemptions | prefix hits | peak running | "
        "failed | compiles | x floor |",
        "|---" * 14 + "|",
    ]
    for workload, per in report["runs"].items():
        for schedule, by in per.items():
            for policy, r in by.items():
                floor, cut = r.get("floor") or {}, r.get("trimmed_steps", "-")
                hits = (
                    f"{100 * r['prefix_cache_hits'] / r['prefix_cache_queries']:.0f}%"
                    if r["prefix_cache_queries"]
                    else "-"
                )
                rows.append(
                    f"| {workload} | {schedule} | {policy} | {fmt(r['output_tok_s'])} | "
                    f"{fmt(r['total_tok_s'])} | {fmt(r['ttft_p50_ms'])} / "
                    f"{fmt(r['ttft_p99_ms'])} | {fmt(r['tpot_p50_ms'], 2)} / "
                    f"{fmt(r['tpot_p99_ms'], 2)} | {r['steps']} ({r['split_steps']} / {cut}) | "
                    f"{r['preemptions']} | {hits} | {r['peak_running']} | {r['failed']} | "
                    f"{r['compilations']} | {fmt(floor.get('measured_over_floor'), 2)} |"
                )
    engine = report["engine"]
    lines = [
        f"Serving: {report['model']}, {report['layers']} layers, TP {report['tp']}, "
        f"{report['environment']['device_kind']}; KV cache {engine['num_blocks']} blocks of "
        f"{engine['block_size']} ({report['kv_sizing']}), max_num_seqs {engine['max_num_seqs']}",
        "",
        *rows,
    ]
    if report.get("rates"):
        lines += [
            "",
            f"x floor: the run's time over its floor at {report['rates']['tflop_s']:.0f} TFLOP/s "
            f"and {report['rates']['gb_s']:.0f} GB/s, measured here (serve_floor.py: the GEMMs "
            "at the slower of their FLOPs and a weight read per step, then the K/V reads).",
        ]
    weave = report["throughput_ratio_weave_over_baseline"]
    if weave:
        lines += [
            "",
            "Output throughput, weave / baseline: "
            + "; ".join(
                f"{w} " + ", ".join(f"{p} {r:.3f}x" for p, r in per.items())
                for w, per in weave.items()
            ),
        ]
    names = {
        "total_tok_s_on_demand_over_reserve": "total throughput on-demand / reserve",
        "total_tok_s_cache_on_over_off": "total throughput prefix cache on / off",
        "ttft_p50_cache_off_over_on": "TTFT p50 prefix cache off / on",
    }
    for workload, per in report.get("policy_ratios", {}).items():
        for schedule, out in per.items():
            lines.append(
                f"{workload}, {schedule}: "
                + ", ".join(f"{names[k]} {v:.2f}x" for k, v in out.items())
            )
    warm = report.get("warmup", {})
    if warm:
        lines += [
            "",
            "Warm-up, in run order (a later engine reuses what this process compiled "
            "before it, so only the first is a cold start): "
            + "; ".join(
                f"{s} {w['layouts']} layouts ({w['loaded']} loaded, {w['compiled']} compiled) "
                f"in {w['warmup_s']:.1f} s, {w['seconds']:.1f} s with the first runs"
                for s, w in warm.items()
            ),
        ]
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: Path) -> None:
    """Total throughput, TTFT and TPOT per workload, a bar per (schedule, KV policy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("total_tok_s", None, "total tokens / s"),
        ("ttft_p50_ms", "ttft_p99_ms", "TTFT ms (p50, p99 line)"),
        ("tpot_p50_ms", "tpot_p99_ms", "TPOT ms (p50, p99)"),
    )
    workloads = list(report["runs"])
    engines = list(
        dict.fromkeys(
            (s, p) for per in report["runs"].values() for s, by in per.items() for p in by
        )
    )
    width = 0.8 / max(len(engines), 1)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (key, p99, title) in zip(axes, panels, strict=True):
        for k, (schedule, policy) in enumerate(engines):
            here = [w for w in workloads if policy in report["runs"][w].get(schedule, {})]
            xs = [workloads.index(w) + width * k for w in here]
            per = [report["runs"][w][schedule][policy] for w in here]
            ax.bar(xs, [r[key] or 0 for r in per], width=width, label=f"{schedule} {policy}")
            if p99:
                ax.scatter(xs, [r[p99] or 0 for r in per], marker="_", s=200, color="black")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], workloads)
        ax.set_title(title)
    axes[0].legend(fontsize="small")
    fig.suptitle(
        f"{report['model']} x{report['layers']} layers, TP {report['tp']}, "
        f"{report['environment']['device_kind']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
