"""`mpmd report` and mpmd.report.load on a real run: 2 local worker processes, worker 1
SIGKILLed once (replaced; the run recovers), then the same command with two more steps
(a resume), a report taken while the run is going and the one `mpmd train` writes at its
end, checked against the run's own files and in a real browser (Debian's chromium, headless)."""

import json
import shutil
import signal
import subprocess
import os
import uuid
from pathlib import Path

import pytest

import mpmd
from mpmd.recipes.run import run_log
from mpmd.report import record
from mpmd.report.load import CAUSES
from mpmd.schedules import core as schedules
from mpmd.schedules.simulate import simulate
from tests.support.processes import Controller, mpmd_command, processes_tagged, wait_gone

pytestmark = pytest.mark.slow  # real worker processes and a controller subprocess (tests/README.md)

STEPS, TRACED, KILL_AFTER, MORE = 10, [2, 3], 6, 2
OVERRIDES = [
    "model.d_model=32",
    "model.num_layers=2",
    "model.seq_len=32",
    "train.batch_size=8",
    f"train.steps={STEPS}",
    "train.eval_every=5",
    "train.eval_batches=2",
    "train.sample_tokens=0",
    "checkpoint.every=3",
    "log.progress=lines",
    "log.every=1",
    f"log.trace_steps={TRACED}",
    "log.tensorboard=false",
    "data.max_bytes=300000",
]
TAG = "MPMD_TEST_REPORT"


class Run:
    def __init__(self, run_dir: Path, stdout: str, during: mpmd.report.Report, during_html: Path):
        self.run_dir, self.stdout, self.during, self.during_html = run_dir, stdout, during, during_html


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """gpt_tiny on 2 workers: a report read after step 4 (in progress), worker 1 SIGKILLed after
    step KILL_AFTER, the run finished, then resumed for MORE steps."""
    base = tmp_path_factory.mktemp("report")
    run_dir, tag = base / "run", uuid.uuid4().hex
    ctl = Controller(run_dir, ["configs/gpt_tiny.yaml", *OVERRIDES], {TAG: tag})
    try:
        ctl.wait_for_step(4)
        during = mpmd.report.load(run_dir)
        during_html = mpmd.report.write(run_dir, base / "during.html")
        ctl.wait_for_step(KILL_AFTER)
        workers = ctl.workers()
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        ctl.succeed()
        ctl = Controller(run_dir, ["configs/gpt_tiny.yaml", *OVERRIDES, f"train.steps={STEPS + MORE}"], {TAG: tag})
        stdout = ctl.succeed()
    finally:
        if ctl.proc.poll() is None:
            ctl.proc.kill()
    assert wait_gone(processes_tagged(TAG, tag)) == []
    return Run(run_dir, stdout, during, during_html)


def _trace_events(run_dir: Path, step: int) -> list[dict]:
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and e["args"]["step"] == step]


def test_report_of_the_run_holds_its_metrics_traces_goodput_and_memory(run):
    r = mpmd.report.load(run.run_dir)
    records = run_log.read(run.run_dir)
    assert r.finished and r.total_steps == STEPS + MORE
    assert [m["step"] for m in r.metrics] == list(range(1, STEPS + MORE + 1))
    assert r.series("loss") == ([m["step"] for m in records], [m["loss"] for m in records])
    assert r.series("eval_loss")[0] == [5, 10, STEPS + MORE]
    # The summary line names the page mpmd train wrote.
    assert f"report {run.run_dir}/report.html" in run.stdout and (run.run_dir / "report.html").exists()

    # The newest traced step, measured exactly as trace.json has it and as metrics.jsonl's bubble.
    c = r.pipeline
    assert r.traced_steps == TRACED and c.step == TRACED[-1]
    assert c.measured_bubble == pytest.approx(next(m["bubble"] for m in records if m["step"] == c.step), abs=1e-9)
    runs = [e for e in _trace_events(run.run_dir, c.step) if e["cat"] == "run"]
    makespan_us = max(e["ts"] + e["dur"] for e in runs) - min(e["ts"] for e in runs)
    assert c.measured_makespan_s == pytest.approx(makespan_us / 1e6, rel=1e-9)
    forwards = [e["dur"] for e in runs if e["name"].startswith("F s1 ")]
    assert c.costs[1]["F"] == pytest.approx(sum(forwards) / len(forwards) / 1e6, rel=1e-9)
    assert sorted(s.name for spans in c.measured for s in spans) == sorted(
        e["name"] for e in _trace_events(run.run_dir, c.step)
    )
    # The simulated timeline is the simulator's for the configured schedule at those costs.
    sim = simulate(schedules.make("1f1b", 2, 4), c.costs, c.comm_s)
    for spans, want in zip(c.simulated, sim.spans):
        tasks = [(s.name, s.start_s, s.end_s) for s in spans if s.task is not None]
        assert tasks == [(f"{t.kind} s{t.stage} mb{t.microbatch}", a, b) for t, a, b in want]
    assert c.simulated_makespan_s >= sim.makespan and c.makespan_ratio == c.measured_makespan_s / c.simulated_makespan_s
    assert c.departures and all(d.name in {s.name for s in c.measured[d.slice]} for d in c.departures)

    # One recovery, marked before the first step trained again, and the resume; goodput as the
    # run's last record of it says (the resumed run lost nothing).
    (marked,) = [m for m in records if "recovered" in m]
    assert [(m.step, m.kind) for m in r.marks] == [(marked["step"], "recovery"), (STEPS + 1, "resume")]
    assert marked["step"] <= KILL_AFTER + 1 and f"checkpoint of step {STEPS}" in r.marks[1].text
    assert r.goodput == [m for m in records if "goodput" in m][-1]["goodput"] and r.goodput["failures"] == 1
    for key, cause in CAUSES.items():
        assert sum(e.seconds for e in r.goodput_events if e.cause == cause) == pytest.approx(r.goodput[key])

    # Memory: the dry run's prediction from run.json, the measured peak of the traced steps.
    predicted = record.read_run_info(run.run_dir)["memory"]["slices"]
    assert [m.predicted for m in r.memory] == predicted
    peaks = [m["peak_bytes"] for m in records if "peak_bytes" in m]
    assert [m.measured_peak_bytes for m in r.memory] == [max(p[s] for p in peaks) for s in range(2)]
    assert all(m.measured_peak_bytes > m.predicted["params"] for m in r.memory)

    # Config: which keys the file and the command line set; layout, versions, checkpoints, logs.
    assert r.config_file == "configs/gpt_tiny.yaml" and r.overrides[: len(OVERRIDES)] == OVERRIDES
    src = r.config_sources
    assert (src["train.steps"], src["train.sample_prompt"], src["model.kind"]) == ("command line", "file", "default")
    assert r.layout["placement"] == [0, 1] and r.checkpoints[-1] == STEPS + MORE
    assert {"jax", "mpmd", "flax"} <= set(r.versions)
    assert {l.name for l in r.logs} >= {"worker_0.log", "worker_1.log", "controller.log"}

    page = (run.run_dir / "report.html").read_text()
    for region in (
        "loss",
        "loss-time",
        "lr",
        "grad-norm",
        "tokens-per-s",
        "step-time",
        "timeline",
        "goodput-bars",
        "goodput-timeline",
        "memory",
    ):
        assert f"data-region='{region}'" in page, region
    assert f"{c.makespan_ratio:.2f}×" in page and f"{c.measured_bubble:.1%}" in page
    assert "recovered:" in page and "resumed from the checkpoint of step" in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page


def test_a_run_in_progress_gives_a_report(run):
    r = run.during
    assert not r.finished and 4 <= r.metrics[-1]["step"] < STEPS
    assert r.pipeline is not None and r.pipeline.step == TRACED[-1]
    assert r.goodput is None and not r.marks
    assert "in progress or stopped: step" in run.during_html.read_text()


def test_report_command_writes_the_page_and_refuses_what_is_not_a_run(run, tmp_path):
    out = tmp_path / "step2.html"
    proc = mpmd_command("report", run.run_dir, "-o", out, "--step", 2)
    assert proc.returncode == 0, proc.stderr
    c = mpmd.report.load(run.run_dir, step=2).pipeline
    assert f"step 2 (1f1b, 2 slices, m=4): makespan measured {c.measured_makespan_s * 1e3:.2f} ms" in proc.stdout
    assert "Pipeline: step 2 measured" in out.read_text()
    for args, message in (
        ([tmp_path / "nowhere"], "does not exist"),
        ([tmp_path], "holds no metrics.jsonl"),
        ([run.run_dir, "--step", 7], "step 7 was not traced"),
    ):
        proc = mpmd_command("report", *args)
        assert proc.returncode == 2 and proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr


CHROMIUM = shutil.which("chromium")
_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,4000",
    "--enable-logging=stderr",
    "--v=0",
]


def _chromium(profile: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, *_FLAGS, f"--user-data-dir={profile}", *map(str, args)], capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install -y chromium)")
def test_the_page_renders_in_a_headless_browser(run, tmp_path):
    """The page loads without script errors, and the screenshot shows the curves, the timelines,
    goodput and memory where the page says they are."""
    from PIL import Image

    url = (run.run_dir / "report.html").as_uri()
    dom = _chromium(tmp_path / "p1", "--dump-dom", url)
    assert dom.returncode == 0 and "Uncaught" not in dom.stderr, dom.stderr[-2000:]
    regions = json.loads(dom.stdout.split('data-regions="', 1)[1].split('"', 1)[0].replace("&quot;", '"'))
    shot = tmp_path / "report.png"
    proc = _chromium(tmp_path / "p2", f"--screenshot={shot}", url)
    assert proc.returncode == 0 and "Uncaught" not in proc.stderr, proc.stderr[-2000:]
    image = Image.open(shot).convert("RGB")
    # Each region holds its own colours: the loss curve's blue, the timelines' F and B boxes, ...
    expect = {
        "loss": ["#4c78a8"],
        "lr": ["#54a24b"],
        "grad-norm": ["#b279a2"],
        "tokens-per-s": ["#e45756"],
        "timeline": ["#4c78a8", "#9ecae9", "#54a24b", "#a1d99b"],
        "goodput-bars": ["#e45756"],
        "memory": ["#54a24b", "#4c78a8"],
    }
    for name, colours in expect.items():
        left, top, width, height = regions[name]
        assert width > 100 and height > 50 and top + height <= image.height, (name, regions[name])
        crop = image.crop((int(left), int(top), int(left + width), int(top + height)))
        counts = {c: n for n, c in crop.getcolors(maxcolors=1 << 20)}
        inked = sum(n for c, n in counts.items() if c != (255, 255, 255))
        assert inked > 0.01 * width * height, (name, inked)
        for colour in colours:
            rgb = tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))
            assert counts.get(rgb, 0) > 20, (name, colour, "not drawn")
