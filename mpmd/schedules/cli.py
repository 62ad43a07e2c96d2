"""`mpmd schedule NAME --stages P --microbatches M [-o OUT.svg]`: simulate a schedule (and draw it when asked).

`main(argv)` takes the arguments after the word `schedule` and returns the exit status:
0 on success, 2 when the schedule or costs are impossible (message "error: ..." on stderr).
Malformed command lines exit 2 through argparse, as usual.

Past SUMMARY_SLICES slices the per-slice figures are summarised (min / median / max)
instead of listed, and the SVG (-o) shows what mpmd.schedules.render can draw (a sample of the slices; no
picture at all past its box limit, saying so): `mpmd schedule zb-v --stages 2048
--microbatches 8192` prints a few lines in seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from mpmd.schedules import core as schedules
from mpmd.schedules.render import not_drawable, render_svg
from mpmd.schedules.simulate import simulate


def _parse_costs(text: str) -> dict:
    parts = text.split(",")
    try:
        values = [float(x) for x in parts]
    except ValueError:
        values = []
    if len(values) not in (3, 4):
        raise argparse.ArgumentTypeError(
            f"--costs needs three or four comma-separated numbers F,B,W[,BW] (e.g. 1,1,1 or 1,1.1,2,2), got {text!r}"
        )
    return dict(zip(("F", "B", "W", "BW"), values))


def _range(spec) -> str:
    least, most = spec.virtual_stages
    return f">= {least}" if most is None else str(least) if least == most else f"{least}..{most}"


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpmd schedule",
        description="Simulate a pipeline schedule: makespan, bubble and live activations. Nothing is "
        "written unless -o names a file for the timeline picture.",
        epilog="examples:\n  mpmd schedule 1f1b --stages 4 --microbatches 8\n"
        "  mpmd schedule zb-h1 --stages 4 --microbatches 8 --costs 1,1.1,0.9 -o zb.svg",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", metavar="NAME", help=f"schedule: {', '.join(sorted(schedules.SCHEDULES))}")
    parser.add_argument(
        "--stages", type=int, required=True, metavar="P", help="number of pipeline stages (slices times virtual stages)"
    )
    parser.add_argument("--microbatches", type=int, required=True, metavar="M")
    parser.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        metavar="V",
        help="stages per slice, in the schedule's range ("
        + "; ".join(f"{n}: {_range(s)}" for n, s in schedules.SCHEDULES.items() if s.virtual_stages != (1, 1))
        + "; others 1); default the schedule's own",
    )
    parser.add_argument(
        "--costs",
        type=_parse_costs,
        default=None,
        metavar="F,B,W[,BW]",
        help="time of one forward, input-gradient backward and weight-gradient "
        "task, and optionally of one full backward (default B+W); default "
        "1,1,1. Measure a pipeline's own with mpmd.stages.costs.measure",
    )
    parser.add_argument(
        "-o", "--output", metavar="OUT.svg", help="also draw the timeline as SVG into this file (default: no picture)"
    )
    return parser


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        schedule = schedules.make(args.name, args.stages, args.microbatches, args.virtual_stages)
        simulation = simulate(schedule, args.costs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    why_not = not_drawable(simulation) if args.output else None
    if args.output and why_not is None:
        render_svg(schedule, simulation, args.output)
    print(
        f"schedule:          {schedule.name}  (stages={schedule.num_stages}, "
        f"slices={len(schedule.slices)}, microbatches={schedule.num_microbatches}, "
        f"virtual_stages={schedule.virtual_stages})"
    )
    print(f"makespan:          {simulation.makespan:g}")
    print(f"bubble fraction:   {simulation.bubble_fraction:.4f}")
    print(f"peak live activations per slice: {_per_slice(simulation.peak_live_activations, '')}")
    print(f"bubble per slice:  {_per_slice(simulation.bubble_fraction_per_slice, '.4f')}")
    if schedule.split_backward and (args.costs is None or "BW" not in args.costs):
        print(
            "note:              assumes B + W = one full backward; pass measured --costs "
            "F,B,W,BW (mpmd.stages.costs.measure) for figures of a pipeline of mpmd itself"
        )
    if args.output:
        print(f"wrote {args.output}" if why_not is None else f"svg not written: {why_not}")
    return 0


SUMMARY_SLICES = 32  # more slices than this: min / median / max instead of one per slice


def _per_slice(values, fmt: str) -> str:
    if len(values) <= SUMMARY_SLICES:
        return " ".join(format(v, fmt) for v in values)
    return (
        f"min {format(min(values), fmt)}, median {format(statistics.median(values), fmt)}, "
        f"max {format(max(values), fmt)} over {len(values)} slices"
    )


if __name__ == "__main__":
    sys.exit(main())
