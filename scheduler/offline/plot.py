"""The report's picture: tokens/s by policy, replayed (bars) and measured (markers)."""

from __future__ import annotations

from pathlib import Path


def plot_tokens_per_s(report: dict, path: str | Path) -> None:
    """Write a PNG bar chart of each policy's tokens/s from a scheduler report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["policies"])
    replayed = [report["policies"][n]["replay"]["tokens_per_s"] for n in names]
    real = [
        (i, report["policies"][n]["real"]["tokens_per_s"])
        for i, n in enumerate(names)
        if report["policies"][n].get("real")
    ]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names)), 4.0))
    colors = ["tab:green" if n == "learned" else "tab:gray" if n == "oracle" else "tab:blue" for n in names]
    ax.bar(
        range(len(names)), replayed, color=colors, label="replay (full-information labels + measured costs)"
    )
    if real:
        ax.scatter(
            [i for i, _ in real],
            [v for _, v in real],
            color="black",
            marker="D",
            zorder=3,
            label="real engine run",
        )
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("tokens/s (mean over eval requests)")
    head = report["headline"]
    llm = report["llm"]
    ssm_dtype = llm.get("ssm_dtype") or llm["dtype"]
    ax.set_title(
        f"{llm['ref']} ({llm['dtype']}, SSMs {ssm_dtype}), {report['requests']['eval']} eval requests; "
        f"learned/best fixed {head['learned_vs_best_fixed_replay']:.3f} replay"
        + (f", {head['learned_vs_best_fixed_real']:.3f} real" if head.get("learned_vs_best_fixed_real") else "")
        + f"; learned/oracle {head['learned_vs_oracle_replay']:.3f}",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
