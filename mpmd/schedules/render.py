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
from xml.sax.saxutils import escape

from mpmd.schedules.core import Schedule
from mpmd.schedules.simulate import Simulation

# Two shades per kind, alternated by microbatch parity, so neighbouring microbatches of the
# same kind stay distinguishable even where boxes are too narrow for a label.
_COLOURS = {"F": ("#4c78a8", "#9ecae9"), "B": ("#54a24b", "#a1d99b"),
            "W": ("#f58518", "#ffbf79")}
_TIMELINE_PX = 1200  # width of the time axis; one time unit gets _TIMELINE_PX / makespan px
_ROW_PX, _ROW_GAP_PX, _LEFT_PX, _TOP_PX, _BOTTOM_PX = 28, 6, 70, 44, 40
_LABEL_MIN_PX = 14  # narrower boxes get no microbatch label
_TEXT_COLOURS = ("white", "black")  # on the dark / light shade of _COLOURS
_CHAR_PX = 6  # rough width of one 11 px sans-serif character, for laying out the legend
MAX_ROWS = 32          # slices drawn at most
MAX_BOXES = 20_000     # tasks drawn at most: 1200 px over more is under a pixel per 16 tasks


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
        return (f"the {len(rows)} slices it would draw hold {boxes} tasks, more than {MAX_BOXES} "
                f"boxes can show in {_TIMELINE_PX} px; use fewer microbatches or slices")
    return None


def _tick_step(makespan: float) -> float:
    # A 1, 2 or 5 times a power of ten giving about ten ticks.
    raw = makespan / 10
    power = 10 ** math.floor(math.log10(raw))
    return next(f * power for f in (1, 2, 5, 10) if f * power >= raw)


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def render_svg(schedule: Schedule, simulation: Simulation, path_or_none=None) -> str:
    """SVG text of the timeline; also written to `path_or_none` unless it is None.
    ValueError (saying why) when the drawn rows hold more than MAX_BOXES tasks."""
    why = not_drawable(simulation)
    if why:
        raise ValueError(f"timeline not drawn: {why}")
    makespan = simulation.makespan if simulation.makespan > 0 else 1.0
    px_per_unit = _TIMELINE_PX / makespan
    num_slices = len(simulation.spans)
    rows = rows_drawn(num_slices)
    rows_px = len(rows) * (_ROW_PX + _ROW_GAP_PX)
    width, height = _LEFT_PX + _TIMELINE_PX + 20, _TOP_PX + rows_px + _BOTTOM_PX
    sampled = "" if len(rows) == num_slices else f" ({len(rows)} of them drawn)"
    title = (f"{schedule.name}: p={num_slices} slices{sampled}, {schedule.num_stages} stages, "
             f"m={schedule.num_microbatches}, makespan={_fmt(simulation.makespan)}, "
             f"bubble={simulation.bubble_fraction:.1%}")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<text x="{_LEFT_PX}" y="20" font-size="14">{escape(title)}</text>']
    drawn = [(r, simulation.spans[r]) for r in rows]
    for row, (r, spans) in enumerate(drawn):
        y = _TOP_PX + row * (_ROW_PX + _ROW_GAP_PX)
        out.append(f'<text x="{_LEFT_PX - 8}" y="{y + _ROW_PX / 2 + 4}" '
                   f'text-anchor="end">slice {r}</text>')
        for task, start, end in spans:
            x, w = _LEFT_PX + start * px_per_unit, (end - start) * px_per_unit
            colour = _COLOURS[task.kind][task.microbatch % 2]
            out.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{_ROW_PX}" '
                       f'fill="{colour}" stroke="white" stroke-width="0.5">'
                       f'<title>{escape(str(task))} [{_fmt(start)}, {_fmt(end)})</title></rect>')
            if w >= _LABEL_MIN_PX:
                out.append(f'<text x="{x + w / 2:.2f}" y="{y + _ROW_PX / 2 + 4}" '
                           f'text-anchor="middle" fill="{_TEXT_COLOURS[task.microbatch % 2]}">'
                           f'{task.microbatch}</text>')
    axis_y = _TOP_PX + rows_px
    out.append(f'<line x1="{_LEFT_PX}" y1="{axis_y}" x2="{_LEFT_PX + _TIMELINE_PX}" '
               f'y2="{axis_y}" stroke="black"/>')
    out.append(f'<text x="{_LEFT_PX - 8}" y="{axis_y + 18}" text-anchor="end">time</text>')
    step = _tick_step(makespan)
    for k in range(int(makespan / step + 1e-9) + 1):
        x = _LEFT_PX + k * step * px_per_unit
        out.append(f'<line x1="{x:.2f}" y1="{axis_y}" x2="{x:.2f}" y2="{axis_y + 5}" '
                   f'stroke="black"/><text x="{x:.2f}" y="{axis_y + 18}" '
                   f'text-anchor="middle">{_fmt(k * step)}</text>')
    # Without split_backward a B task is the whole backward; with it, B and W are its halves.
    names = {"F": "forward", "B": "backward (input grad)" if schedule.split_backward else "backward",
             "W": "backward (weight grad)"}
    kinds = [k for k in names if any(t.kind == k for _, spans in drawn for t, _, _ in spans)]
    entries_px = [10 + 4 + _CHAR_PX * len(names[k]) + 16 for k in kinds]  # swatch, gap, text, gap
    x = _LEFT_PX + _TIMELINE_PX - sum(entries_px)
    for kind, entry_px in zip(kinds, entries_px):
        out.append(f'<rect x="{x}" y="{height - 14}" width="10" height="10" '
                   f'fill="{_COLOURS[kind][0]}"/><text x="{x + 14}" y="{height - 5}">'
                   f'{names[kind]}</text>')
        x += entry_px
    out.append("</svg>\n")
    svg = "\n".join(out)
    if path_or_none is not None:
        with open(path_or_none, "w", encoding="utf-8") as f:
            f.write(svg)
    return svg
