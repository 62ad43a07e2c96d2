"""The report page: one self-contained HTML file (inline CSS and SVG, no network).

    path = write("runs/gpt_tiny")              # runs/gpt_tiny/report.html
    text = render(mpmd.report.load("runs/gpt_tiny", step=3))

Sections, each drawn from mpmd.report.load's Report: training curves (loss and eval loss
against step and wall time, learning rate, grad norm, tokens/s, step time; the held-out exact
match, and an rl run's reward and completion length, where logged) with resumes,
recoveries and relayouts marked; the traced step's measured timeline above the simulated one
on one time axis (mpmd.schedules.render draws both) with makespans, bubbles and the runs that
depart most; goodput; memory per slice; config, layout, versions, checkpoints and logs.

Every figure sits in an element with a data-region name; one small inline script writes, once
the page has loaded, each region's box in page pixels to <html data-regions="{...}"> (what a
headless browser's test reads to look at those pixels of its screenshot). The page shows the
same without it.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from xml.sax.saxutils import escape

from mpmd.report import charts
from mpmd.report.charts import Bar, Series, VLine, fmt
from mpmd.report.load import CAUSES, Report, flatten, load
from mpmd.report.pipeline import Comparison
from mpmd.schedules import render

REPORT_FILE = "report.html"
_BLUE, _ORANGE, _GREEN, _RED, _PURPLE, _GREY = "#4c78a8", "#f58518", "#54a24b", "#e45756", "#b279a2", "#9d9d9d"
_CAUSE_COLOURS = dict(
    zip(CAUSES.values(), ("#e45756", "#f58518", "#eeca3b", "#4c78a8", "#b279a2", "#72b7b2", "#bab0ac"))
)
_MEMORY_PARTS = (("params", "#4c78a8"), ("grads", "#72b7b2"), ("optimizer", "#f58518"), ("activations", "#54a24b"))
_UPDATE_COLOUR, _OTHER_RUN_COLOUR, _RECV_COLOUR = "#b279a2", "#bab0ac", "#c9c9c9"

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;background:#f5f6f8;color:#222}
header{background:#1f2a3a;color:#fff;padding:18px 28px}
header h1{margin:0 0 4px;font-size:20px;font-weight:600} header p{margin:0;color:#c8d0dc;font-size:13px}
main{padding:12px 28px 40px;max-width:1400px}
section{background:#fff;border-radius:8px;box-shadow:0 1px 3px rgba(0,0,0,.08);margin:16px 0;padding:14px 18px}
h2{font-size:16px;margin:2px 0 10px} h3{font-size:13px;margin:12px 0 6px;color:#444}
.grid{display:flex;flex-wrap:wrap;gap:8px 16px} .note{color:#666;font-size:12px;margin:6px 0}
.figures{display:flex;flex-wrap:wrap;gap:10px;margin:4px 0 10px}
.figure{background:#f0f3f7;border-radius:6px;padding:6px 12px;min-width:120px}
.figure b{display:block;font-size:18px} .figure span{font-size:11px;color:#555}
table{border-collapse:collapse;font-size:12px} td,th{padding:3px 10px 3px 0;text-align:left;vertical-align:top}
th{color:#555;font-weight:600;border-bottom:1px solid #ddd} td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.changed td{background:#fff6e0} .badge{display:inline-block;border-radius:8px;padding:1px 8px;font-size:11px}
.running{background:#fde7c0;color:#7a4b00} .done{background:#d6f0d2;color:#22562b}
.timeline{overflow-x:auto} details summary{cursor:pointer;color:#345;font-size:13px}
.cols{display:flex;flex-wrap:wrap;gap:24px}
"""


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s" if s < 120 else f"{s / 60:.1f} min"


def _figure(value: str, what: str) -> str:
    return f'<div class="figure"><b>{escape(value)}</b><span>{escape(what)}</span></div>'


def _table(header: list[str], rows: list[list], numeric=(), row_class=None) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{row_class(i)}"' if row_class and row_class(i) else ""
        cells = "".join(
            f'<td class="num">{escape(str(c))}</td>' if j in numeric else f"<td>{escape(str(c))}</td>"
            for j, c in enumerate(row)
        )
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


# -- sections ------------------------------------------------------------------------------
# After load: {region: [left, top, width, height]} in page pixels, on <html data-regions>.
_SCRIPT = """addEventListener('load', () => { const out = {};
for (const e of document.querySelectorAll('[data-region]')) { const b = e.getBoundingClientRect();
  out[e.dataset.region] = [b.left + scrollX, b.top + scrollY, b.width, b.height]; }
document.documentElement.dataset.regions = JSON.stringify(out); });"""


def _region(name: str, content: str, cls: str = "") -> str:
    cls_attr = f" class='{cls}'" if cls else ""
    return f"<div data-region='{name}'{cls_attr}>{content}</div>"


def _header(r: Report) -> str:
    last = r.metrics[-1]["step"]
    status = (
        '<span class="badge done">finished</span>'
        if r.finished
        else f'<span class="badge running">in progress or stopped: step {last} of {r.total_steps or "?"}</span>'
    )
    p = r.config.get("pipeline", {})
    what = (
        f"{r.config.get('model', {}).get('kind', '?')} model, {p.get('schedule', '?')} over "
        f"{p.get('num_stages', '?')} stages, {p.get('num_microbatches', '?')} microbatches"
    )
    made = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    return (
        f"<header><h1>mpmd run: {escape(r.run_dir)} {status}</h1>"
        f"<p>{escape(what)} &middot; report made {made} from the run directory's files</p></header>"
    )


def _marks_at(r: Report, xs_of_step) -> list[VLine]:
    out = []
    for m in r.marks:
        x = xs_of_step(m.step)
        if x is not None:
            out.append(VLine(x, m.kind, f"step {m.step}: {m.text}"))
    return out


def _training(r: Report) -> str:
    steps, elapsed = [m["step"] for m in r.metrics], r.elapsed_s()
    at_step = dict(zip(steps, elapsed))
    by_step = _marks_at(r, lambda s: s - 0.5)  # before the step the mark precedes
    by_time = _marks_at(r, lambda s: at_step.get(s))

    def series(key, name, colour, x="step"):
        pairs = [
            (m["step"] if x == "step" else t, m[key])
            for m, t in zip(r.metrics, elapsed)
            if isinstance(m.get(key), (int, float)) and (x == "step" or t is not None)
        ]
        return Series(name, colour, [a for a, _ in pairs], [b for _, b in pairs])

    charts_html = [
        _region(name, chart)
        for name, chart in zip(
            ("loss", "loss-time", "lr", "grad-norm", "tokens-per-s", "step-time"),
            [
                charts.line_chart(
                    "loss", [series("loss", "loss", _BLUE), series("eval_loss", "eval loss", _ORANGE)], "step", by_step
                ),
                charts.line_chart(
                    "loss against wall time",
                    [series("loss", "loss", _BLUE, "time"), series("eval_loss", "eval loss", _ORANGE, "time")],
                    "seconds since the first logged step",
                    by_time,
                ),
                charts.line_chart("learning rate", [series("lr", "lr", _GREEN)], "step", by_step),
                charts.line_chart(
                    "gradient norm (before clipping)", [series("grad_norm", "grad norm", _PURPLE)], "step", by_step
                ),
                charts.line_chart("tokens/s", [series("tokens_per_s", "tokens/s", _RED)], "step", by_step),
                charts.line_chart("step time (s)", [series("step_s", "step_s", _GREY)], "step", by_step),
            ],
        )
    ]
    charts_html += [_region(name, chart) for name, chart in _scores(r, by_step)]
    t = r.step_time
    figures = [_figure(fmt(r.metrics[-1]["loss"]), f"loss at step {r.metrics[-1]['step']}")]
    matched = _exact_match(r)
    if matched[0]:
        figures.append(_figure(f"{fmt(matched[1][0])} → {fmt(matched[1][-1])}", "held-out exact match"))
    evals = r.series("eval_loss")
    if evals[0]:
        figures.append(_figure(fmt(evals[1][-1]), f"eval loss at step {evals[0][-1]}"))
    figures += [
        _figure(_seconds(t.median_s), f"median step time ({t.num_steps} steps)"),
        _figure(f"{_seconds(t.p10_s)} – {_seconds(t.p90_s)}", "step time, 10th – 90th percentile"),
        _figure(f"{_seconds(t.min_s)} – {_seconds(t.max_s)}", "step time, min – max"),
    ]
    if r.wall_s is not None:
        figures.append(_figure(_seconds(r.wall_s), "wall time of the logged steps"))
    marks = "".join(f"<li>step {m.step}: <b>{escape(m.kind)}</b> — {escape(m.text)}</li>" for m in r.marks)
    marks_html = (
        f"<h3>Marked on the curves</h3><ul class='note'>{marks}</ul>"
        if marks
        else "<p class='note'>No resume, recovery or relayout so far.</p>"
    )
    return (
        f"<section id='training'><h2>Training</h2><div class='figures'>{''.join(figures)}</div>"
        f"<div class='grid'>{''.join(charts_html)}</div>{marks_html}</section>"
    )


def _exact_match(r: Report) -> tuple[list[int], list[float]]:
    """(steps, scores) of the held-out exact match, the score before training at step 0."""
    steps, scores = r.series("exact_match")
    before = r.metrics[0].get("exact_match_before")
    return ([0] + steps, [before] + scores) if isinstance(before, (int, float)) else (steps, scores)


def _scores(r: Report, marks) -> list[tuple[str, str]]:
    """(region, chart) of what a fine-tuning or rl run scores beside its loss, those it logged:
    the held-out exact match, and an rl run's reward, completion length and KL (recipes/run/rl.py)."""
    out = []
    steps, scores = _exact_match(r)
    if steps:
        chart = charts.line_chart("held-out exact match", [Series("exact match", _GREEN, steps, scores)], "step", marks)
        out.append(("exact-match", chart))
    for region, key, title, colour in (
        ("reward", "reward", "reward (mean over the step's completions)", _ORANGE),
        ("completion-length", "completion_length", "completion length (tokens)", _PURPLE),
        ("kl", "kl", "KL to the starting model (nats per completion token)", _RED),
    ):
        xs, ys = r.series(key)
        if xs:
            out.append(
                (region, charts.line_chart(title, [Series(key.replace("_", " "), colour, xs, ys)], "step", marks))
            )
    return out


def _run_box(span, colour) -> render.Box:
    return render.Box(
        span.start_s * 1e3,
        span.end_s * 1e3,
        colour,
        "",
        "white",
        f"{span.name} [{span.start_s * 1e3:.3f}, {span.end_s * 1e3:.3f}) ms",
    )


def _lane(spans) -> list[render.Box]:
    boxes = []
    for span in spans:
        if span.kind != "run":
            continue
        task = span.task
        if task is not None:
            box = render.task_box(task, span.start_s * 1e3, span.end_s * 1e3)
            boxes.append(box._replace(tooltip=f"{span.name} [{span.start_s * 1e3:.3f}, {span.end_s * 1e3:.3f}) ms"))
        else:
            boxes.append(_run_box(span, _UPDATE_COLOUR if span.name.startswith("U ") else _OTHER_RUN_COLOUR))
    return boxes


def timeline_svg(c: Comparison) -> str:
    """The traced step's slices (runs, and below each its receives) above the simulated slices,
    on one axis in milliseconds."""
    rows = []
    for r, spans in enumerate(c.measured):
        rows.append(
            render.Row(f"slice {r}", _lane(spans), heading=f"measured (trace of step {c.step})" if r == 0 else "")
        )
        recvs = [_run_box(s._replace(start_s=max(0.0, s.start_s)), _RECV_COLOUR) for s in spans if s.kind == "recv"]
        rows.append(render.Row("recv", recvs, height_px=8))
    for r, spans in enumerate(c.simulated):
        rows.append(
            render.Row(
                f"slice {r}",
                _lane(spans),
                heading="simulated (same schedule, the step's measured costs)" if r == 0 else "",
            )
        )
    end_ms = 1e3 * max(s.end_s for group in (c.measured, c.simulated) for spans in group for s in spans)
    names = render.task_names(c.schedule.split_backward)
    kinds = [k for k in names if any(s.task and s.task.kind == k for spans in c.measured for s in spans)]
    legend = [(render.kind_colour(k), names[k]) for k in kinds]
    legend += [
        (_UPDATE_COLOUR, "optimizer update"),
        (_OTHER_RUN_COLOUR, "clipping norm, other"),
        (_RECV_COLOUR, "receive posted → data in"),
    ]
    title = (
        f"{c.schedule.name}: {c.schedule.num_slices} slices, {c.schedule.num_stages} stages, "
        f"m={c.schedule.num_microbatches}; measured {c.measured_makespan_s * 1e3:.2f} ms, "
        f"simulated {c.simulated_makespan_s * 1e3:.2f} ms"
    )
    return render.draw_rows(rows, end_ms, title, legend, axis_label="ms")


def _pipeline(r: Report) -> str:
    c = r.pipeline
    if c is None:
        return f"<section id='pipeline'><h2>Pipeline</h2><p class='note'>{escape(r.pipeline_note)}</p></section>"
    figures = "".join(
        [
            _figure(f"{c.makespan_ratio:.2f}×", "measured / simulated makespan"),
            _figure(_seconds(c.measured_makespan_s), "measured makespan"),
            _figure(_seconds(c.simulated_makespan_s), "simulated makespan"),
            _figure(f"{c.measured_bubble:.1%}", "bubble measured"),
            _figure(f"{c.simulated_bubble:.1%}", "bubble simulated"),
            _figure(_seconds(c.comm_s), "transfer latency (median wait after the producer)"),
        ]
    )
    ran = {(s.task.stage, s.task.kind) for spans in c.measured for s in spans if s.task is not None}
    costs = _table(
        ["stage", "F", "B", "W"],
        [[k, *(_seconds(cost[x]) if (k, x) in ran else "— (no run)" for x in "FBW")] for k, cost in enumerate(c.costs)],
        numeric={1, 2, 3},
    )
    departures = _table(
        ["slice", "run", "measured start", "measured", "simulated start", "simulated", "delay it adds"],
        [
            [
                d.slice,
                d.name,
                _seconds(d.measured_start_s),
                _seconds(d.measured_s),
                _seconds(d.simulated_start_s),
                _seconds(d.simulated_s),
                f"{d.added_s * 1e3:+.2f} ms",
            ]
            for d in c.departures
        ],
        numeric={2, 3, 4, 5, 6},
    )
    others = ", ".join(str(s) for s in r.traced_steps if s != c.step)
    return (
        f"<section id='pipeline'><h2>Pipeline: step {c.step} measured against the simulator</h2>"
        f"<div class='figures'>{figures}</div>"
        f"{_region('timeline', timeline_svg(c), 'timeline')}"
        f"<p class='note'>Both timelines start at the step's first run. The simulator prices each stage's "
        f"F, B and W at their mean measured time in this step and each cross-slice transfer at the latency "
        f"above; the norm and update run after each slice's last task at their measured times. Bubble = "
        f"1 − busy / (slices × makespan) over runs, as metrics.jsonl's <code>bubble</code>. Sends are not "
        f"traced (a send does not block): a transfer shows as the receiver's wait."
        f"{f' Other traced steps: {others} (mpmd report --step N).' if others else ''}</p>"
        f"<div class='cols'><div><h3>Costs measured in step {c.step}, per stage</h3>{costs}</div>"
        f"<div><h3>Runs that depart most from the simulated timeline</h3>{departures}</div></div></section>"
    )


def _goodput(r: Report) -> str:
    g = r.goodput
    if g is None:
        return "<section id='goodput'><h2>Goodput</h2><p class='note'>No worker lost: no time lost to failures.</p></section>"
    lost = [(cause, g.get(key, 0.0)) for key, cause in CAUSES.items() if key != "reduced_width_s"]
    bars = [Bar(cause, [(cause, s, _CAUSE_COLOURS[cause])]) for cause, s in lost]
    bars.append(
        Bar("narrower layout", [("narrower layout", g.get("reduced_width_s", 0.0), _CAUSE_COLOURS["narrower layout"])])
    )
    figures = [
        _figure(str(g["failures"]), "worker(s) lost"),
        _figure(_seconds(g["lost_s"]), "time lost"),
        _figure(str(g["replayed_steps"]), "steps replayed"),
        _figure(str(g["layout_changes"]), "layout changes"),
    ]
    if r.wall_s:
        figures.append(_figure(f"{1 - g['lost_s'] / r.wall_s:.1%}", "goodput (1 − lost / wall time)"))
    timed = [e for e in r.goodput_events if e.elapsed_s is not None]
    timeline = ""
    if timed and r.wall_s:
        rows = [
            render.Row(
                cause,
                [
                    render.Box(
                        e.elapsed_s - e.seconds,
                        e.elapsed_s,
                        _CAUSE_COLOURS[cause],
                        "",
                        "white",
                        f"{cause}: {e.seconds:.2f} s, seen at step {e.step}",
                    )
                    for e in timed
                    if e.cause == cause
                ],
            )
            for cause in CAUSES.values()
            if any(e.cause == cause for e in timed)
        ]
        start = min(0.0, min(e.elapsed_s - e.seconds for e in timed))
        rows = [
            row._replace(boxes=[b._replace(start=b.start - start, end=b.end - start) for b in row.boxes])
            for row in rows
        ]
        timeline = render.draw_rows(
            rows,
            r.wall_s - start,
            "when the time was lost (each box ends at the record of the step that saw it)",
            axis_label="s",
        )
    return (
        f"<section id='goodput'><h2>Goodput</h2><div class='figures'>{''.join(figures)}</div>"
        f"{_region('goodput-bars', charts.bar_chart('time per cause', bars, _seconds))}"
        f"{_region('goodput-timeline', timeline, 'timeline') if timeline else ''}"
        f"<p class='note'>Detection is the aborted attempt up to the loss being declared; replay the steps "
        f"trained again after the restore; narrower layout the time run on fewer slices than configured "
        f"(not lost, but slower).</p></section>"
    )


def _memory(r: Report) -> str:
    if not r.memory:
        return "<section id='memory'><h2>Memory per slice</h2><p class='note'>No prediction (run.json) and no traced step.</p></section>"
    bars, rows = [], []
    for m in r.memory:
        if m.predicted:
            bars.append(Bar(f"slice {m.slice} predicted", [(k, m.predicted[k], c) for k, c in _MEMORY_PARTS]))
        if m.measured_peak_bytes is not None:
            bars.append(Bar(f"slice {m.slice} measured", [("peak of buffers", m.measured_peak_bytes, _GREY)]))
        rows.append(
            [
                m.slice,
                *(_bytes(m.predicted[k]) if m.predicted else "—" for k, _ in _MEMORY_PARTS),
                _bytes(m.predicted["total"]) if m.predicted else "—",
                _bytes(m.measured_peak_bytes) if m.measured_peak_bytes is not None else "not traced",
            ]
        )
    legend = " ".join(f"<span class='badge' style='background:{c};color:#fff'>{k}</span>" for k, c in _MEMORY_PARTS)
    table = _table(
        ["slice", "params", "grads", "optimizer", "activations (peak)", "predicted total", "measured peak"],
        rows,
        numeric={1, 2, 3, 4, 5, 6},
    )
    return (
        f"<section id='memory'><h2>Memory per slice</h2>{legend}"
        f"{_region('memory', charts.bar_chart('predicted (dry run, from shapes) and measured', bars, _bytes, width=760))}{table}"
        f"<p class='note'>Predicted: mpmd.stages.costs.slice_memory, as <code>mpmd train --dry-run</code> prints it "
        f"(not counted: activations in transit, XLA temporaries). Measured: the most bytes of the slice's buffers "
        f"and outstanding receives at once in a traced step, as the executor counts them; JAX reports no device "
        f"memory statistics on the CPU.</p></section>"
    )


def _config(r: Report) -> str:
    changed = [(k, v) for k, v in r.config_sources.items() if v != "default"]
    flat = flatten(r.config)
    rows = [[k, _value(flat[k]), src] for k, src in r.config_sources.items()]
    overrides = ", ".join(r.overrides) or "none"
    source = (
        f"from <code>{escape(r.config_file)}</code>, command-line overrides: <code>{escape(overrides)}</code>"
        if r.config_file
        else "config file not recorded (run.json missing)"
    )
    changed_table = _table(
        ["key", "value", "set by"],
        [[k, _value(flat[k]), v] for k, v in changed],
        row_class=lambda i: "changed" if changed[i][1] == "command line" else "",
    )
    layout = ""
    if r.layout:
        layout = _table(
            ["", ""],
            [
                ["schedule", r.layout.get("schedule")],
                ["stages", r.layout.get("num_stages")],
                ["slices", r.layout.get("num_slices")],
                ["placement (stage → slice)", r.layout.get("placement")],
                ["virtual stages", r.layout.get("virtual_stages")],
                ["mesh per slice", "; ".join(r.layout.get("mesh", []))],
            ],
        )
    versions = (
        _table(["package", "version"], sorted(r.versions.items()))
        if r.versions
        else "<p class='note'>not recorded (run.json missing)</p>"
    )
    ckpts = ", ".join(map(str, r.checkpoints)) or "none committed yet"
    logs = _table(
        ["log", "lines", "warnings", "errors", "last warning or error"],
        [[l.name, l.num_lines, l.num_warnings, l.num_errors, (l.last_problem or "")[:160]] for l in r.logs],
        numeric={1, 2, 3},
    )
    return (
        f"<section id='config'><h2>Config, layout, versions</h2><p class='note'>Resolved config {source}.</p>"
        f"<div class='cols'><div><h3>Keys not at their default</h3>{changed_table}</div>"
        f"<div><h3>Layout (newest committed checkpoint)</h3>{layout or '<p class=note>no checkpoint yet</p>'}"
        f"<h3>Versions</h3>{versions}<h3>Committed checkpoints</h3><p class='note'>{escape(ckpts)}</p></div></div>"
        f"<h3>Logs</h3>{logs}"
        f"<details><summary>every key ({len(rows)})</summary>{_table(['key', 'value', 'set by'], rows)}</details></section>"
    )


def _value(v) -> str:
    return "null" if v is None else str(v)


def render_page(r: Report) -> str:
    """The whole page for a Report."""
    body = "".join([_training(r), _pipeline(r), _goodput(r), _memory(r), _config(r)])
    return (
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>mpmd report: {escape(r.run_dir)}</title>"
        f"<style>{_CSS}</style></head><body>{_header(r)}<main>{body}</main><script>{_SCRIPT}</script></body></html>\n"
    )


def write(
    run_dir: str | Path, output: str | Path | None = None, step: int | None = None, report: Report | None = None
) -> Path:
    """Writes the report of `run_dir` to `output` (default <run_dir>/report.html) and returns its
    path; `step`: the traced step to compare (default the most recent); `report`: one already
    loaded from run_dir (else it is loaded here)."""
    path = Path(output) if output is not None else Path(run_dir) / REPORT_FILE
    text = render_page(report if report is not None else load(run_dir, step))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path
