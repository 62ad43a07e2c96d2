"""See a run: one page with its loss curves, the measured pipeline next to the simulated one,
goodput and memory, read from the run directory alone.

    report = mpmd.report.load("runs/gpt_tiny")           # a Report (mpmd/report/load.py)
    steps, losses = report.series("loss")                # any metric of metrics.jsonl
    c = report.pipeline                                  # the traced step, measured vs simulated
    c.makespan_ratio, c.measured_bubble, c.simulated_bubble, c.departures
    mpmd.report.write("runs/gpt_tiny")                   # runs/gpt_tiny/report.html

`mpmd report RUN_DIR [-o FILE.html] [--step N]` writes the page; `mpmd train` writes
<run_dir>/report.html at the end of every run. A run still going gives a report too (the
steps logged so far). Nothing here imports JAX or the recipes.
"""

from mpmd.report.html import render_page, write
from mpmd.report.load import Report, load
from mpmd.report.pipeline import Comparison, compare

__all__ = ["Comparison", "Report", "compare", "load", "render_page", "write"]
