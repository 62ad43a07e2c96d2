"""Small inline-SVG charts for the report page: line charts of metrics, horizontal bars.

Plain SVG text, standard library only, no script: a page that embeds them needs no network.
Timelines are not drawn here: mpmd.schedules.render draws those, measured and simulated alike.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence
from xml.sax.saxutils import escape

FONT = 'font-family="system-ui, -apple-system, Segoe UI, sans-serif" font-size="11"'
_MARK_COLOURS = {"resume": "#4c78a8", "recovery": "#e45756", "relayout": "#f58518"}
_MAX_MARKERS = 60  # series with more points than this draw no point markers


class Series(NamedTuple):
    name: str
    colour: str
    xs: Sequence[float]
    ys: Sequence[float]


class VLine(NamedTuple):
    """A vertical marker at x: a resume, a recovery or a relayout."""

    x: float
    kind: str
    text: str


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if not hi > lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(f * power for f in (1, 2, 5, 10) if f * power >= raw)
    first = math.floor(lo / step) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    if ticks[-1] < hi:
        ticks.append(round(t, 12))
    return ticks


def fmt(value: float) -> str:
    """A short number for an axis or a table: 3 significant digits, k/M for large ones."""
    a = abs(value)
    if a >= 1e6:
        return f"{value / 1e6:.3g}M"
    if a >= 1e4:
        return f"{value / 1e3:.3g}k"
    if a >= 100 or value == int(value):
        return f"{value:.0f}"
    return f"{value:.3g}"


def line_chart(
    title: str, series: Sequence[Series], x_label: str, marks: Sequence[VLine] = (), width: int = 560, height: int = 240
) -> str:
    """A line chart of `series` on shared axes, with `marks` as dashed vertical lines."""
    left, right, top, bottom = 52, 14, 30, 38
    plot_w, plot_h = width - left - right, height - top - bottom
    points = [(x, y) for s in series for x, y in zip(s.xs, s.ys) if math.isfinite(y)]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" {FONT}>',
        f'<text x="{left}" y="16" font-size="13" font-weight="600">{escape(title)}</text>',
    ]
    if not points:
        out.append(f'<text x="{left}" y="{top + plot_h / 2}" fill="#777">not logged yet</text></svg>')
        return "\n".join(out)
    xs = [x for x, _ in points] + [m.x for m in marks]
    ys = [y for _, y in points]
    x_ticks, y_ticks = nice_ticks(min(xs), max(xs)), nice_ticks(min(ys), max(ys))
    x0, x1, y0, y1 = x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1]
    sx = lambda x: left + (x - x0) / ((x1 - x0) or 1) * plot_w
    sy = lambda y: top + plot_h - (y - y0) / ((y1 - y0) or 1) * plot_h
    for t in y_ticks:
        out.append(
            f'<line x1="{left}" y1="{sy(t):.1f}" x2="{left + plot_w}" y2="{sy(t):.1f}" stroke="#e6e6e6"/>'
            f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" text-anchor="end" fill="#555">{fmt(t)}</text>'
        )
    for t in x_ticks:
        out.append(
            f'<line x1="{sx(t):.1f}" y1="{top + plot_h}" x2="{sx(t):.1f}" y2="{top + plot_h + 4}" stroke="#555"/>'
            f'<text x="{sx(t):.1f}" y="{top + plot_h + 16}" text-anchor="middle" fill="#555">{fmt(t)}</text>'
        )
    out.append(f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#555"/>')
    out.append(
        f'<text x="{left + plot_w / 2}" y="{height - 4}" text-anchor="middle" fill="#555">{escape(x_label)}</text>'
    )
    for m in marks:
        colour = _MARK_COLOURS.get(m.kind, "#555")
        out.append(
            f'<line class="mark" x1="{sx(m.x):.1f}" y1="{top}" x2="{sx(m.x):.1f}" y2="{top + plot_h}" '
            f'stroke="{colour}" stroke-width="1.5" stroke-dasharray="4 3"><title>{escape(m.text)}</title></line>'
            f'<text x="{sx(m.x) + 3:.1f}" y="{top + 10}" fill="{colour}">{escape(m.kind)}</text>'
        )
    for s in series:
        pts = [(sx(x), sy(y)) for x, y in zip(s.xs, s.ys) if math.isfinite(y)]
        if not pts:
            continue
        out.append(
            f'<polyline class="series" fill="none" stroke="{s.colour}" stroke-width="1.8" '
            f'points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in pts)}"/>'
        )
        if len(pts) <= _MAX_MARKERS:
            out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.2" fill="{s.colour}"/>' for x, y in pts]
    legend_x = left + plot_w
    for s in reversed(series):
        legend_x -= 7 * len(s.name) + 24
        out.append(
            f'<rect x="{legend_x}" y="8" width="10" height="10" rx="2" fill="{s.colour}"/>'
            f'<text x="{legend_x + 14}" y="17">{escape(s.name)}</text>'
        )
    out.append("</svg>")
    return "\n".join(out)


class Bar(NamedTuple):
    label: str
    parts: Sequence[tuple[str, float, str]]  # (name, value, colour), stacked left to right


def bar_chart(title: str, bars: Sequence[Bar], value_format, width: int = 560) -> str:
    """Horizontal bars, each a stack of parts, on one scale; the total written after each."""
    left, right, row_h, gap, top = 130, 90, 18, 8, 28
    height = top + len(bars) * (row_h + gap) + 8
    largest = max((sum(v for _, v, _ in b.parts) for b in bars), default=0.0) or 1.0
    scale = (width - left - right) / largest
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" {FONT}>',
        f'<text x="8" y="16" font-size="13" font-weight="600">{escape(title)}</text>',
    ]
    for i, bar in enumerate(bars):
        y = top + i * (row_h + gap)
        out.append(f'<text x="{left - 6}" y="{y + row_h / 2 + 4}" text-anchor="end">{escape(bar.label)}</text>')
        x = left
        for name, value, colour in bar.parts:
            w = value * scale
            out.append(
                f'<rect class="bar" x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h}" fill="{colour}">'
                f'<title>{escape(name)}: {escape(value_format(value))}</title></rect>'
            )
            x += w
        total = sum(v for _, v, _ in bar.parts)
        out.append(f'<text x="{x + 5:.1f}" y="{y + row_h / 2 + 4}" fill="#333">{escape(value_format(total))}</text>')
    out.append("</svg>")
    return "\n".join(out)
