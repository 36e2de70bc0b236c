"""`boosttune report RUN_DIR`: a training run's summary, finished or not, and its figure (RUN_DIR/report.png)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_commands(sub) -> dict:
    """Add the report subcommand; returns its handler by name."""
    r = sub.add_parser("report", help="summarise a training run (finished or interrupted) and plot it to "
                                      "RUN_DIR/report.png",
                       description="Print a run's stages, drafters' τ / c / speed-up (alone, with prompt lookup, "
                                   "merged), its scheduler's choices and the next commands; draw the same figures.")
    r.add_argument("run_dir", metavar="RUN_DIR", help="a `boosttune train` run directory")
    r.add_argument("--plot", default=None, metavar="PNG", help="where to write the figure (default RUN_DIR/report.png)")
    return {"report": cmd_report}


def cmd_report(args: argparse.Namespace) -> int:
    from boosttune.core.rundir import RunDir
    from boosttune.report import collect, summary_lines
    from boosttune.report_plot import plot_report

    state = collect(RunDir(args.run_dir))
    print("\n".join(summary_lines(state)), flush=True)
    path = Path(args.plot) if args.plot else state.run.report_plot
    try:
        plot_report(state.report, f"boosttune run {state.run.root}", path)
    except OSError as e:
        raise ValueError(f"cannot write the figure {path}: {e.strerror or e}; pass --plot PATH elsewhere") from None
    print(f"figure: {path}")
    return 0
