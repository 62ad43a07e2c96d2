"""`mpmd report RUN_DIR [-o FILE.html] [--step N]`: write a run's report page.

`main(argv)` takes the arguments after the word `report` and returns the exit status: 0 when
the page was written (its path and the measured-vs-simulated figures printed), 2 when the
run directory cannot give one (it does not exist, holds no metrics, --step was not traced:
one line "error: ...").
"""

from __future__ import annotations

import argparse
import sys

from mpmd.report.html import REPORT_FILE, write
from mpmd.report.load import load


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpmd report",
        description="One self-contained HTML page of a run: curves, measured vs simulated pipeline, "
        "goodput, memory, config. Works while the run is going.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (run_dir of the config)")
    parser.add_argument(
        "-o", "--output", metavar="FILE.html", help=f"where to write the page (default RUN_DIR/{REPORT_FILE})"
    )
    parser.add_argument(
        "--step",
        type=int,
        default=None,
        metavar="N",
        help="the traced step to compare with the simulator (default the most recent; "
        "log.trace_steps chooses which are traced)",
    )
    return parser


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        report = load(args.run_dir, args.step)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = write(args.run_dir, args.output, report=report)
    c = report.pipeline
    if c is not None:
        print(
            f"step {c.step} ({c.schedule.name}, {c.schedule.num_slices} slices, m={c.schedule.num_microbatches}): "
            f"makespan measured {c.measured_makespan_s * 1e3:.2f} ms, simulated {c.simulated_makespan_s * 1e3:.2f} ms "
            f"(ratio {c.makespan_ratio:.2f}); bubble measured {c.measured_bubble:.3f}, simulated {c.simulated_bubble:.3f}"
        )
    else:
        print(f"no pipeline comparison: {report.pipeline_note}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
