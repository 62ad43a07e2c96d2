"""Where a run's scalars go beside metrics.jsonl (recipes/run/run_log.py): a Weights & Biases run
(`log.wandb: true`) logged in W&B's offline mode, no network, then read back from the run's own
.wandb file with W&B's protobuf records: every step's loss and eval loss are metrics.jsonl's."""

import json
import struct
from pathlib import Path

import pytest

from mpmd.recipes.run import run_log
from tests.support.processes import TINY_GPT, mpmd_train

pytestmark = pytest.mark.slow  # `mpmd train` as a command; W&B starts its own process
STEPS = 4


def wandb_history(run_file: Path) -> list[dict]:
    """The history rows ({key: value}) of a .wandb file: after a 7-byte header (":W&B", magic,
    version), LevelDB-log records (crc32 4, length 2, type 1; 1 whole, 2 first, 3 middle, 4
    last) in 32 KiB blocks, each record a serialized wandb Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B", run_file
    pos, pieces, rows = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            pos += left - 7
            continue
        pieces += data[pos : pos + length]
        pos += length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pieces)
            pieces = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return rows


def test_wandb_offline_logs_the_losses_of_metrics_jsonl(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # the command inherits the environment
    run_dir = tmp_path / "run"
    proc = mpmd_train(
        "configs/gpt_tiny.yaml",
        "cluster.backend=inprocess",
        f"train.steps={STEPS}",
        "train.eval_every=2",
        "train.sample_tokens=0",
        "log.wandb=true",
        "log.wandb_project=mpmd-test",
        f"run_dir={run_dir}",
        *TINY_GPT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    logged = {row["step"]: row for row in wandb_history(run_file)}
    want = run_log.read(run_dir)
    assert sorted(logged) == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for r in want:
        assert logged[r["step"]]["loss"] == r["loss"] and logged[r["step"]]["lr"] == r["lr"]
        assert logged[r["step"]].get("eval_loss") == r.get("eval_loss")
    assert [s for s in logged if "eval_loss" in logged[s]] == [2, 4]
