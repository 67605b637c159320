"""PNG plots of the scaling analysis and the all-reduce benchmark (matplotlib, Agg backend).

Each function takes the report dictionary its command writes as JSON, so a plot can be redrawn
from the JSON alone: `plot_scaling(json.load(open("scaling.json")), "scaling.png")`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

IDEAL_STYLE = {"linestyle": "--", "color": "0.45", "linewidth": 1.2}
SPLIT_COLORS = {"compute": "#4C72B0", "exposed comm": "#DD8452", "data loading": "#55A868"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def plot_scaling(report: Mapping, path: str) -> str:
    """Throughput, efficiency and the time split of each step, against world size."""
    plt = _pyplot()
    rows = report["rows"]
    nps = [row["np"] for row in rows]
    base = rows[0]
    ideal = [base["samples_per_s"] * n / base["np"] for n in nps]

    fig, (ax_thr, ax_eff, ax_split) = plt.subplots(1, 3, figsize=(14, 4.2))
    fig.suptitle(f"{report['mode']} scaling of {os.path.basename(report['program'])} "
                 f"({report['cores']} cores, {report['threads_per_rank']} thread(s) per rank)")

    ax_thr.plot(nps, ideal, label="ideal (linear)", **IDEAL_STYLE)
    ax_thr.plot(nps, [row["samples_per_s"] for row in rows], "o-", label="measured")
    for row in rows:
        ax_thr.annotate(f"{row['speedup']:.2f}x", (row["np"], row["samples_per_s"]),
                        textcoords="offset points", xytext=(0, 8), ha="center", fontsize=9)
    ax_thr.set(xlabel="world size (ranks)", ylabel="throughput (samples/s)", title="Throughput")
    ax_thr.set_ylim(bottom=0)

    ax_eff.axhline(100, label="ideal (100 %)", **IDEAL_STYLE)
    ax_eff.plot(nps, [row["efficiency"] * 100 for row in rows], "o-", label="measured")
    for row in rows:
        ax_eff.annotate(f"{row['efficiency']:.0%}", (row["np"], row["efficiency"] * 100),
                        textcoords="offset points", xytext=(0, -15), ha="center", fontsize=9)
    ax_eff.set(xlabel="world size (ranks)", ylabel="scaling efficiency (%)", title="Efficiency")
    ax_eff.set_ylim(0, max(110, max(row["efficiency"] * 100 for row in rows) + 10))

    bottom = [0.0] * len(rows)
    for label, key in (("compute", "compute_s"), ("exposed comm", "comm_s"),
                       ("data loading", "data_s")):
        heights = [row[key] * 1e3 for row in rows]
        ax_split.bar([str(n) for n in nps], heights, bottom=bottom, label=label,
                     color=SPLIT_COLORS[label])
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax_split.set(xlabel="world size (ranks)", ylabel="time per step (ms)",
                 title="Where a step's time goes")

    for ax in (ax_thr, ax_eff):
        ax.set_xticks(nps)
        ax.margins(x=0.12)  # room for the labels of the first and last points
        ax.grid(alpha=0.3)
        for row in rows:
            if row["oversubscribed"]:
                ax.axvspan(row["np"] - 0.25, row["np"] + 0.25, color="red", alpha=0.08)
    for ax in (ax_thr, ax_eff, ax_split):
        ax.legend(loc="best", fontsize=9)
    if any(row["oversubscribed"] for row in rows):
        fig.text(0.01, -0.02, "shaded: oversubscribed (more threads than cores; timing not "
                 "meaningful)", fontsize=9, color="darkred")
    fig.tight_layout()
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


def _size_label(size: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g}{unit}"
    return f"{size:g}"


def plot_bandwidth(report: Mapping, path: str, labels: Mapping[str, str] | None = None) -> str:
    """Bus bandwidth against message size, one line per variant (`tandem bench allreduce`).

    `report` is `tandem.bench.allreduce.run()`'s result: `sizes` and `busbw_gbps` (variant ->
    GB/s per size); `labels` names the variants in the legend.
    """
    plt = _pyplot()
    labels = labels or {}
    fig, ax = plt.subplots(figsize=(8, 4.8))
    sizes = list(report["sizes"])
    for name, values in report["busbw_gbps"].items():
        style = "o--" if name.endswith("_checks") else "o-"
        ax.plot(sizes, values, style, label=labels.get(name, name), markersize=4)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([_size_label(size) for size in sizes], rotation=45)
    ax.set(xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)",
           title=f"all-reduce bus bandwidth, {report['np']} ranks (float32 sum, in place)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    fig.tight_layout()
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)
