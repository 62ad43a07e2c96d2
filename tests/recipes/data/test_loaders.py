"""mpmd.recipes.data.loaders (corpora, resumable loaders) and mpmd.recipes.run.run_log (metrics, progress, traces)."""

import io
import json
import types

import numpy as np
import pytest

from mpmd.recipes import config
from mpmd.recipes.data import loaders as data
from mpmd.recipes.run import run_log
from mpmd.recipes.run.run_log import Event


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    for i in range(3):
        (root / f"part{i}.txt").write_bytes(rng.integers(32, 127, 3000, dtype=np.uint8).tobytes())
    (root / "sub").mkdir()
    (root / "sub" / "more.md").write_bytes(b"# heading\n" * 50)
    return root


def _files_cfg(*paths):
    return config.load(None, ["data.source=files", f"data.paths={list(map(str, paths))}"]).data


def test_stdlib_corpus_is_sorted_nonempty_code_without_tests():
    files = data.stdlib_files()
    root = files[0].parent  # __future__.py sorts first and sits at the stdlib root
    relative = [f.relative_to(root).as_posix() for f in files]
    assert len(files) > 100 and {"os.py", "json/__init__.py"} <= set(relative)
    assert relative == sorted(relative)
    assert not [f for f in files if {"test", "tests", "site-packages"} & set(f.parts)]
    train, eval_ = data.make_loaders(config.load(None, []))
    inputs, targets = train.next()
    assert inputs.shape == targets.shape == (16, 64) and inputs.dtype == np.int32
    assert eval_.source.num_examples > 0


def test_files_source_expands_globs_and_directories_and_names_missing_paths(text_files):
    files = data.listed_files(_files_cfg(text_files / "part*.txt", text_files / "sub", text_files / "part0.txt").paths)
    assert [f.name for f in files] == ["part0.txt", "part1.txt", "part2.txt", "more.md"]
    with pytest.raises(ValueError, match=r"no file found for '.*nope\.txt', '.*\*\.rst'"):
        data.listed_files(_files_cfg(text_files / "part0.txt", text_files / "nope.txt", text_files / "*.rst").paths)


def test_train_and_eval_split_by_position_and_targets_shift_inputs(text_files):
    files = data.listed_files(_files_cfg(text_files / "part*.txt").paths)
    corpus = data.ByteCorpus(files, seq_len=16, eval_fraction=0.1)
    full = b"".join(f.read_bytes() for f in files)
    assert corpus.train.tokens.tobytes() + corpus.eval.tokens.tobytes() == full
    assert len(corpus.eval.tokens) == len(full) - int(len(full) * 0.9)
    for split in (corpus.train, corpus.eval):
        inputs, targets = data.Loader(split, 8, seed=1).next()
        np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
        for row_in, row_t in zip(inputs, targets):  # each row is a contiguous piece of its split
            window = bytes(row_in.astype(np.uint8)) + bytes([row_t[-1]])
            assert window in split.tokens.tobytes()
    capped = data.ByteCorpus(files, seq_len=16, eval_fraction=0.1, max_bytes=4000)
    assert capped.tokens.tobytes() == full[:4000]
    with pytest.raises(ValueError, match="fewer than one window"):
        data.ByteCorpus(files, seq_len=16, eval_fraction=0.001, max_bytes=4000)


def test_batches_are_deterministic_and_an_epoch_visits_every_window_once(text_files):
    corpus = data.ByteCorpus(data.listed_files(_files_cfg(text_files / "part*.txt").paths), 16, 0.1)
    a, b = data.Loader(corpus.train, 8, seed=3), data.Loader(corpus.train, 8, seed=3)
    for _ in range(5):
        np.testing.assert_array_equal(a.next()[0], b.next()[0])
    other = data.Loader(corpus.train, 8, seed=4).next()[0]
    assert not np.array_equal(data.Loader(corpus.train, 8, seed=3).next()[0], other)
    per_epoch = corpus.train.num_examples // 8
    loader = data.Loader(corpus.train, 8, seed=3)
    rows = [bytes(r.astype(np.uint8)) for _ in range(per_epoch) for r in loader.next()[0]]
    assert len(set(rows)) == len(rows)  # no window twice within an epoch
    next_epoch = loader.next()[0]
    assert loader.position == per_epoch + 1
    assert not np.array_equal(next_epoch, data.Loader(corpus.train, 8, seed=3).next()[0])


@pytest.mark.parametrize("source", ["bytes", "tokens", "regression"])
def test_seek_and_state_resume_exactly(source, text_files):
    if source == "bytes":
        split = data.ByteCorpus(data.listed_files(_files_cfg(text_files).paths), 16, 0.1).train
    elif source == "tokens":
        split = data.SyntheticTokens(vocab_size=50, seq_len=8)
    else:
        split = data.SyntheticRegression(in_features=5, out_features=3)
    fresh = data.Loader(split, 4, seed=9)
    expected = [fresh.next() for _ in range(40)]  # crosses byte epochs
    for k in (0, 7, 39):
        loader = data.Loader(split, 4, seed=9)
        loader.seek(k)
        for got, want in zip(loader.next(), expected[k]):
            np.testing.assert_array_equal(got, want)
        resumed = data.Loader.from_state(split, {**fresh.state(), "position": k})
        np.testing.assert_array_equal(resumed.next()[1], expected[k][1])
        assert resumed.position == k + 1
    assert fresh.state() == {"position": 40, "seed": 9, "batch_size": 4}


def test_synthetic_sources(tmp_path):
    cfg = config.load(None, ["data.source=synthetic", "model.vocab_size=50"])
    train, eval_ = data.make_loaders(cfg)
    inputs, targets = train.next()
    assert inputs.shape == (16, 64) and inputs.dtype == np.int32
    assert 0 <= inputs.min() and targets.max() < 50
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    assert not np.array_equal(eval_.next()[0], inputs)  # eval is a different stream
    mlp = config.load(None, ["model.kind=mlp", "data.source=synthetic", "train.sample_tokens=0"])
    train, eval_ = data.make_loaders(mlp)
    x, y = train.next()
    assert x.shape == (16, 16) and y.shape == (16, 4) and x.dtype == y.dtype == np.float32
    # One fixed function: the same x gives the same y in every split and every run.
    task = data.SyntheticRegression(16, 4, stream=1)
    np.testing.assert_allclose(x @ task.linear + np.sin(x @ task.phase), y, rtol=1e-4, atol=1e-5)


def test_loader_rejects_a_batch_larger_than_the_split(text_files):
    corpus = data.ByteCorpus(data.listed_files(_files_cfg(text_files / "part0.txt").paths), 16, 0.1)
    with pytest.raises(ValueError, match="fewer than batch_size=64"):
        data.Loader(corpus.eval, 64, seed=0)


def test_encode_decode():
    text = "déf f(x): return x  # ✓"
    assert data.decode(data.encode(text)) == text
    assert data.decode(np.array([104, 105, 300, 0xC3])) == "hi\ufffd\ufffd"


# ---- run_log --------------------------------------------------------------------------------


def test_metrics_log_appends_replaces_and_truncates(tmp_path):
    log = run_log.MetricsLog(tmp_path)
    for step in (1, 2, 3):
        log.write(step, {"loss": np.float32(4.0 - step), "tokens": np.int64(step * 10)})
    log.write(2, {"loss": 9.5})  # the step ran again (after a recovery): its line is replaced
    assert [(r["step"], r["loss"]) for r in run_log.read(tmp_path)] == [(1, 3.0), (2, 9.5), (3, 1.0)]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    log.truncate_after(1)  # resumed from the checkpoint at step 1
    log.write(2, {"loss": 2.5})
    reopened = run_log.MetricsLog(tmp_path)  # a restarted controller sees the same history
    reopened.write(3, {"loss": 1.5})
    assert [(r["step"], r["loss"]) for r in run_log.read(tmp_path)] == [(1, 3.0), (2, 2.5), (3, 1.5)]
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "lo')  # a crash mid-append: step 4 never counted
    assert [r["step"] for r in run_log.MetricsLog(tmp_path).records()] == [1, 2, 3]
    assert [r["step"] for r in run_log.read(tmp_path)] == [1, 2, 3]


def tensorboard_scalars(tb_dir) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in tb_dir's event files, read with tensorboardX's
    own Event proto from the TFRecord framing (u64 length, u32 crc, data, u32 crc)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event as TBEvent

    out = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        raw, at = path.read_bytes(), 0
        while at < len(raw):
            (length,) = struct.unpack_from("<Q", raw, at)
            event = TBEvent.FromString(raw[at + 12 : at + 12 + length])
            at += 12 + length + 4
            out += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
    return out


def test_tensorboard_writes_event_files(tmp_path):
    tb = run_log.TensorBoard(tmp_path)
    tb.write(1, {"loss": np.float32(2.0), "note": "text is skipped"})
    tb.write(2, {"loss": 1.5})
    tb.close()
    assert tensorboard_scalars(tmp_path / "tb") == [(1, "loss", 2.0), (2, "loss", 1.5)]


def test_tensorboard_does_not_import_torch_and_leaves_it_importable(tmp_path):
    """tensorboardX imports torch at its own import where torch is installed (~1 s of a run's
    start); run_log imports it with torch hidden, and torch imports normally afterwards."""
    import subprocess
    import sys

    code = (
        "import importlib.util, sys\n"
        "from mpmd.recipes.run import run_log\n"
        "tb = run_log.TensorBoard(sys.argv[1]); tb.write(1, {'loss': 1.0}); tb.close()\n"
        "print('torch' in sys.modules)\n"
        "if importlib.util.find_spec('torch'):\n"
        "    import torch; print(torch.ones(2).sum().item())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.split()
    assert lines[0] == "False", proc.stdout  # not imported, and no None left in its place
    assert lines[1:] in ([], ["2.0"]), proc.stdout
    assert tensorboard_scalars(tmp_path / "tb") == [(1, "loss", 1.0)]


def test_progress_lines_mode_logs_every_n_steps():
    out = io.StringIO()
    progress = run_log.Progress(
        total_steps=20, tokens_per_step=1024, mode="auto", every=10, stream=out
    )  # a StringIO is no TTY: auto means lines
    for step in range(1, 21):
        metrics = {"loss": 3.0 / step, "bubble": 0.21}
        if step == 10:
            metrics["eval_loss"] = 3.3
        progress.update(step, metrics)
    progress.message("done")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[-1] == "done"
    assert lines[0].startswith("step 10/20 loss 0.30 eval_loss 3.30 tok/s ")
    assert lines[0].endswith(" bubble 0.21")
    bar_out = io.StringIO()
    bar = run_log.Progress(total_steps=5, tokens_per_step=10, mode="bar", stream=bar_out)
    for step in range(1, 6):
        bar.update(step, {"loss": 1.0})
    bar.close()
    assert "5/5" in bar_out.getvalue() and "loss=1.00" in bar_out.getvalue()


def test_progress_lines_give_an_eta_without_the_first_step(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(run_log, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    out = io.StringIO()
    progress = run_log.Progress(total_steps=100, tokens_per_step=10, mode="lines", every=10, stream=out)
    for step in range(1, 101):
        clock[0] = 30.0 + 2.0 * (step - 1)  # step 1 (compiling) took 30 s, every other 2 s
        progress.update(step, {"loss": 1.0})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 10/100 loss 1.00 tok/s ") and lines[0].endswith(" eta 3m00s")  # 90 x 2 s
    assert lines[8].endswith(" eta 20s") and lines[-1] == "step 100/100 loss 1.00 tok/s 5.00"
    assert [run_log._duration(s) for s in (0.4, 59.6, 3599, 7620)] == ["0s", "1m00s", "59m59s", "2h07m"]


def test_trace_has_every_slice_and_loads_as_json(tmp_path):
    base = 1_000_000_000
    events = {
        2: [
            [Event("F0", "run", base, base + 2000)],
            [("recv", "recv", base + 500, base + 2500), ("F1", "run", base + 2500, base + 4000)],
        ],
        3: [
            [Event("F0", "run", base + 9000, base + 9500), Event("s", "send", base + 9500, base + 9600)],
            [Event("F1", "run", base + 10_000, base + 11_000)],
        ],
    }
    path = run_log.write_trace(tmp_path / "traces" / "steps.json", events)
    trace = json.loads(path.read_text())["traceEvents"]
    complete = [e for e in trace if e["ph"] == "X"]
    assert {e["pid"] for e in complete} == {0, 1} and len(complete) == 6
    names = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert names == {0: "slice 0", 1: "slice 1"}
    first = min(complete, key=lambda e: e["ts"])
    assert first["ts"] == 0 and first["dur"] == 2.0 and first["args"] == {"step": 2}
    assert {e["cat"] for e in complete} == {"run", "recv", "send"}
    assert max(e["ts"] for e in complete) == 10_000 / 1e3


def test_measured_bubble_on_hand_made_timelines():
    # GPipe forward, p = 2 slices, m = 2 microbatches, unit cost: bubble (p-1)/(m+p-1) = 1/3.
    gpipe = [
        [("F0", "run", 0, 1), ("F1", "run", 1, 2)],
        [("F0", "run", 1, 2), ("F1", "run", 2, 3), ("r", "recv", 0, 1)],
    ]
    assert run_log.measured_bubble(gpipe) == pytest.approx(1 / 3)
    # Overlapping run events on a slice count once; an idle slice counts as all bubble.
    overlapping = [[("a", "run", 0, 10), ("b", "run", 5, 10), ("c", "run", 20, 40)], []]
    assert run_log.measured_bubble(overlapping) == pytest.approx(1 - 30 / 80)
    assert run_log.measured_bubble(gpipe, kinds=("run", "recv")) == pytest.approx(1 - 5 / 6)
    with pytest.raises(ValueError, match="no events of kinds"):
        run_log.measured_bubble([[("r", "recv", 0, 1)]])
