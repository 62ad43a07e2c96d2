"""Draw a simulated schedule as an SVG timeline: one row per slice, one box per task.

Colour says the kind (F blue, B green, W orange); lighter and darker shades alternate with
the microbatch number, and the number is written in each box wide enough to hold it (white
on the dark shade, black on the light one). The legend lists the kinds the schedule has.
Plain SVG text, standard library only.

A picture shows only so much: past MAX_ROWS slices it draws MAX_ROWS of them, evenly
spaced (first and last included, each labelled with its real index) and says so in the
title; past MAX_BOXES tasks in the drawn rows it refuses (ValueError), since boxes would be
narrower than a pixel. `not_drawable` says why before anyone tries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple
from xml.sax.saxutils import escape

from mpmd.schedules.core import Schedule
from mpmd.schedules.simulate import Simulation

# Two shades per kind, alternated by microbatch parity, so neighbouring microbatches of the
# same kind stay distinguishable even where boxes are too narrow for a label.
_COLOURS = {"F": ("#4c78a8", "#9ecae9"), "B": ("#54a24b", "#a1d99b"), "W": ("#f58518", "#ffbf79")}
_TIMELINE_PX = 1200  # width of the time axis; one time unit gets _TIMELINE_PX / makespan px
_ROW_PX, _ROW_GAP_PX, _LEFT_PX, _TOP_PX, _BOTTOM_PX = 28, 6, 70, 44, 40
_LABEL_MIN_PX = 14  # narrower boxes get no microbatch label
_TEXT_COLOURS = ("white", "black")  # on the dark / light shade of _COLOURS
_CHAR_PX = 6  # rough width of one 11 px sans-serif character, for laying out the legend
MAX_ROWS = 32  # slices drawn at most
MAX_BOXES = 20_000  # tasks drawn at most: 1200 px over more is under a pixel per 16 tasks


def rows_drawn(num_slices: int) -> list[int]:
    """The slices a picture shows: all of them, or MAX_ROWS evenly spaced ones."""
    if num_slices <= MAX_ROWS:
        return list(range(num_slices))
    step = (num_slices - 1) / (MAX_ROWS - 1)
    return sorted({round(i * step) for i in range(MAX_ROWS)})


def not_drawable(simulation: Simulation) -> str | None:
    """Why the timeline cannot be drawn (too many tasks in the rows it would show), or None."""
    rows = rows_drawn(len(simulation.spans))
    boxes = sum(simulation.spans.num_tasks(r) for r in rows)
    if boxes > MAX_BOXES:
        return (
            f"the {len(rows)} slices it would draw hold {boxes} tasks, more than {MAX_BOXES} "
            f"boxes can show in {_TIMELINE_PX} px; use fewer microbatches or slices"
        )
    return None


def _tick_step(makespan: float) -> float:
    # A 1, 2 or 5 times a power of ten giving about ten ticks.
    raw = makespan / 10
    power = 10 ** math.floor(math.log10(raw))
    return next(f * power for f in (1, 2, 5, 10) if f * power >= raw)


def _fmt(x: float) -> str:
    return f"{x:.6g}"


class Box(NamedTuple):
    """One interval on a row: [start, end) in the axis' unit, filled with `colour`; `text`
    is written inside when the box is wide enough, in `text_colour`; `tooltip` on hover."""

    start: float
    end: float
    colour: str
    text: str = ""
    text_colour: str = "black"
    tooltip: str = ""


class Row(NamedTuple):
    """A labelled row of boxes; `height_px` (thin rows for transfers); `heading` is written
    above the row (a group of rows: "measured", "simulated")."""

    label: str
    boxes: Sequence[Box]
    height_px: int = _ROW_PX
    heading: str = ""


def task_box(task, start: float, end: float) -> Box:
    """A schedule task's box: its kind's colour, the shade and text by microbatch parity."""
    parity = task.microbatch % 2
    return Box(
        start,
        end,
        _COLOURS[task.kind][parity],
        str(task.microbatch),
        _TEXT_COLOURS[parity],
        f"{task} [{_fmt(start)}, {_fmt(end)})",
    )


def task_names(split_backward: bool) -> dict:
    """Legend names of the task kinds: without split_backward a B task is the whole backward;
    with it, B and W are its halves."""
    return {
        "F": "forward",
        "B": "backward (input grad)" if split_backward else "backward",
        "W": "backward (weight grad)",
    }


def kind_colour(kind: str) -> str:
    """The dark shade of a task kind, as its legend swatch shows it."""
    return _COLOURS[kind][0]


def draw_rows(
    rows: Sequence[Row],
    span: float,
    title: str,
    legend: Sequence[tuple[str, str]] = (),
    axis_label: str = "time",
    tick_format=None,
) -> str:
    """SVG text of rows of boxes on one time axis from 0 to `span` (the same scale for every
    row, so rows of two timelines compare box by box); `legend`: (colour, name) pairs;
    `tick_format(value) -> str` labels the axis ticks."""
    span = span if span > 0 else 1.0
    tick_format = tick_format or _fmt
    px_per_unit = _TIMELINE_PX / span
    headings_px = sum(18 for row in rows if row.heading)
    rows_px = sum(row.height_px + _ROW_GAP_PX for row in rows) + headings_px
    width, height = _LEFT_PX + _TIMELINE_PX + 20, _TOP_PX + rows_px + _BOTTOM_PX
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<text x="{_LEFT_PX}" y="20" font-size="14">{escape(title)}</text>',
    ]
    y = _TOP_PX
    for row in rows:
        if row.heading:
            out.append(f'<text x="{_LEFT_PX}" y="{y + 12}" font-weight="bold">{escape(row.heading)}</text>')
            y += 18
        out.append(
            f'<text x="{_LEFT_PX - 8}" y="{y + row.height_px / 2 + 4}" text-anchor="end">{escape(row.label)}</text>'
        )
        for box in row.boxes:
            x, w = _LEFT_PX + box.start * px_per_unit, (box.end - box.start) * px_per_unit
            tip = f'<title>{escape(box.tooltip)}</title>' if box.tooltip else ""
            out.append(
                f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row.height_px}" '
                f'fill="{box.colour}" stroke="white" stroke-width="0.5">{tip}</rect>'
            )
            if box.text and w >= _LABEL_MIN_PX and row.height_px >= _LABEL_MIN_PX:
                out.append(
                    f'<text x="{x + w / 2:.2f}" y="{y + row.height_px / 2 + 4}" '
                    f'text-anchor="middle" fill="{box.text_colour}">{escape(box.text)}</text>'
                )
        y += row.height_px + _ROW_GAP_PX
    axis_y = _TOP_PX + rows_px
    out.append(f'<line x1="{_LEFT_PX}" y1="{axis_y}" x2="{_LEFT_PX + _TIMELINE_PX}" y2="{axis_y}" stroke="black"/>')
    out.append(f'<text x="{_LEFT_PX - 8}" y="{axis_y + 18}" text-anchor="end">{escape(axis_label)}</text>')
    step = _tick_step(span)
    for k in range(int(span / step + 1e-9) + 1):
        x = _LEFT_PX + k * step * px_per_unit
        out.append(
            f'<line x1="{x:.2f}" y1="{axis_y}" x2="{x:.2f}" y2="{axis_y + 5}" '
            f'stroke="black"/><text x="{x:.2f}" y="{axis_y + 18}" '
            f'text-anchor="middle">{tick_format(k * step)}</text>'
        )
    entries_px = [10 + 4 + _CHAR_PX * len(name) + 16 for _, name in legend]  # swatch, gap, text, gap
    x = _LEFT_PX + _TIMELINE_PX - sum(entries_px)
    for (colour, name), entry_px in zip(legend, entries_px):
        out.append(
            f'<rect x="{x}" y="{height - 14}" width="10" height="10" '
            f'fill="{colour}"/><text x="{x + 14}" y="{height - 5}">'
            f'{escape(name)}</text>'
        )
        x += entry_px
    out.append("</svg>\n")
    return "\n".join(out)


def render_svg(schedule: Schedule, simulation: Simulation, path_or_none=None) -> str:
    """SVG text of the timeline; also written to `path_or_none` unless it is None.
    ValueError (saying why) when the drawn rows hold more than MAX_BOXES tasks."""
    why = not_drawable(simulation)
    if why:
        raise ValueError(f"timeline not drawn: {why}")
    num_slices = len(simulation.spans)
    rows = rows_drawn(num_slices)
    sampled = "" if len(rows) == num_slices else f" ({len(rows)} of them drawn)"
    title = (
        f"{schedule.name}: p={num_slices} slices{sampled}, {schedule.num_stages} stages, "
        f"m={schedule.num_microbatches}, makespan={_fmt(simulation.makespan)}, "
        f"bubble={simulation.bubble_fraction:.1%}"
    )
    drawn = [Row(f"slice {r}", [task_box(*span) for span in simulation.spans[r]]) for r in rows]
    names = task_names(schedule.split_backward)
    kinds = [k for k in names if any(t.kind == k for r in rows for t, _, _ in simulation.spans[r])]
    svg = draw_rows(drawn, simulation.makespan, title, [(kind_colour(k), names[k]) for k in kinds])
    if path_or_none is not None:
        with open(path_or_none, "w", encoding="utf-8") as f:
            f.write(svg)
    return svg
