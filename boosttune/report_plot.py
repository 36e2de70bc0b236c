"""The run's figure (``RUN/report.png``, `boosttune report`): one panel per thing the run has measured.

Panels, each only where the run has its figures: pool size and held-out top-1 per stage; τ and speed-up per
drafter (alone, with prompt lookup; the merged options are drafters here); held-out coverage per stage,
each SSM's and the union's; the learned scheduler's choices on its evaluation requests. The input is
:func:`boosttune.report.collect`'s report; matplotlib draws with the Agg backend (no display needed).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from boosttune.report import drafter_rows, scheduler_choices

WIDTH = 0.4  # of each of a pair of bars


def _stages_panel(ax, report: dict) -> None:
    stages = report["stages"]
    ks = [s.get("stage", i) for i, s in enumerate(stages, 1)]
    ax.bar(ks, [s.get("pool_before", 0) for s in stages], color="tab:gray", label="pool (samples trained on)")
    ax.set_xlabel("stage")
    ax.set_ylabel("samples")
    ax.set_xticks(ks)
    top1 = ax.twinx()
    top1.plot(ks, [s.get("heldout_top1") for s in stages], "o-", color="tab:blue", label="held-out top-1")
    top1.set_ylabel("held-out top-1")
    top1.set_ylim(0, 1)
    ax.set_title("pool size and held-out top-1 per stage")
    _legend(ax, top1)


def _drafters_panel(field: str, label: str, baseline: float | None) -> Callable:
    def panel(ax, report: dict) -> None:
        rows = drafter_rows(report.get("evaluation"))
        xs = range(len(rows))
        alone = [getattr(r, field) or 0.0 for r in rows]
        lookup = [getattr(r, f"lookup_{field}") or 0.0 for r in rows]
        ax.bar([x - WIDTH / 2 for x in xs], alone, WIDTH, color="tab:blue", label="alone")
        if any(lookup):
            ax.bar([x + WIDTH / 2 for x in xs], lookup, WIDTH, color="tab:orange", label="with prompt lookup")
        if baseline is not None:
            ax.axhline(baseline, color="black", linewidth=0.8, linestyle="--", label="plain decoding")
        ax.set_xticks(list(xs), [r.name for r in rows], rotation=30, ha="right")
        ax.set_ylabel(label)
        ax.set_title(f"{label} per drafter")
        ax.legend(fontsize=8)
    return panel


def _coverage_panel(ax, report: dict) -> None:
    stages = [s for s in report["stages"] if s.get("union_coverage") is not None]
    ks = [s.get("stage", i) for i, s in enumerate(stages, 1)]
    k = stages[0].get("coverage_k", "k")
    ax.bar(ks, [s.get("heldout_coverage", 0.0) for s in stages], color="tab:gray", label=f"stage's SSM, top-{k}")
    ax.plot(ks, [s["union_coverage"] for s in stages], "o-", color="tab:green", label=f"SSMs 1..k together, top-{k}")
    union = (report.get("feature") or {}).get("union_coverage")
    if union is not None:
        ax.axhline(union, color="tab:purple", linestyle="--", label="feature heads together")
    ax.set_xticks(ks)
    ax.set_xlabel("stage")
    ax.set_ylabel("held-out answer tokens covered")
    ax.set_title("coverage per stage")
    ax.legend(fontsize=8)


def _scheduler_panel(ax, report: dict) -> None:
    choices = scheduler_choices(report.get("scheduler"))
    names = list(choices)
    ax.barh(range(len(names)), [choices[n] for n in names], color="tab:green")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("eval requests")
    ax.set_title("the learned scheduler's choices (replayed)")


def _legend(*axes) -> None:
    handles, labels = [], []
    for ax in axes:
        h, lab = ax.get_legend_handles_labels()
        handles += h
        labels += lab
    axes[0].legend(handles, labels, fontsize=8, loc="upper right")


def panels(report: dict) -> list[Callable]:
    """The panels the report has figures for, in order."""
    out: list[Callable] = []
    if report.get("stages"):
        out.append(_stages_panel)
    if drafter_rows(report.get("evaluation")):
        out += [_drafters_panel("tau", "τ", 1.0), _drafters_panel("speedup", "speed-up", 1.0)]
    if any(s.get("union_coverage") is not None for s in report.get("stages") or []):
        out.append(_coverage_panel)
    if scheduler_choices(report.get("scheduler")):
        out.append(_scheduler_panel)
    return out


def plot_report(report: dict, title: str, path: str | Path) -> None:
    """Write the figure of ``report`` (titled ``title``) as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = panels(report)
    cols = 2 if len(drawn) > 1 else 1
    rows = max(1, -(-len(drawn) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(6.0 * cols, 3.8 * rows), squeeze=False)
    flat = list(axes.flat)
    for draw, ax in zip(drawn, flat, strict=False):
        draw(ax, report)
    for ax in flat[len(drawn):]:
        ax.axis("off")
    if not drawn:
        flat[0].text(0.5, 0.5, "nothing measured yet", ha="center", va="center")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
