"""A collected step's metrics record, built from what the Trainer returned for it and what the
run knows beside: the learning rate, tokens per second, eval results, held-out exact match,
the family's state readings, failures and layout changes, what happened before it (resumed,
recovered), the batch's CRC-32. The training loop hands the record to its Sinks."""

from __future__ import annotations

import time
import zlib
from pathlib import Path

import numpy as np

import mpmd
from mpmd.recipes import config as config_lib
from mpmd.recipes import registry
from mpmd.recipes.config import Config
from mpmd.recipes.data import tokenizer as tokenizer_lib
from mpmd.recipes.run import run_log
from mpmd.recipes.run.build import learning_rate
from mpmd.report import html as report_html
from mpmd.report import record as report_record
from mpmd.stages import leaf_paths


class StepRecords:
    """Records of one run's steps. `marks`: what happened before the next record's step, for
    the report (mpmd.report.load's marks); `losses` and `scores` ({step: value}, a replayed
    step counted once) feed the summary."""

    def __init__(self, cfg: Config, tokens_per_step: int, start_step: int):
        self.lr = learning_rate(cfg)
        self.tokens_per_step = tokens_per_step
        self.marks: dict = {"resumed_from": start_step} if start_step else {}
        self.losses: dict[int, float] = {}
        self.scores: dict[int, float] = {}
        self.eval_loss = None
        self._logged_changes = 0  # trainer.layout_changes already in a record
        # What the family reads from its stages' state on eval steps (an MoE's routing counts),
        # when nothing runs ahead of the step, so the state is the step's own.
        self._read_state = registry.get_model_spec(cfg.model.kind).state_metrics(cfg)
        # step -> CRC-32 of its batch, for the data sources that record which data each step read.
        self._digests: dict[int, int] | None = {} if registry.get_data_source(cfg.data.source).batch_digests else None

    def sent(self, step: int, batch) -> None:
        """Step `step` was sent with `batch`."""
        if self._digests is not None:
            self._digests[step] = batch_crc32(batch)

    def rewind(self, step: int, why: str) -> None:
        """Every slice is back at `step` (mpmd.Rewound): later steps will be redone."""
        self.marks["recovered"] = why
        self.losses = {k: v for k, v in self.losses.items() if k <= step}
        self.scores = {k: v for k, v in self.scores.items() if k <= step}

    def build(self, trainer: mpmd.Trainer, step: int, out: dict, wall_s: float, step_eval, sinks) -> tuple[dict, dict]:
        """(record, extra) of collected step `step`: `out` is the Trainer's result, wall_s the
        time since the previous step was collected, step_eval its eval loss or None. A traced
        step's events go to `sinks` at once."""
        record = {
            "loss": out["loss"],
            "step_s": out["step_s"],
            "tokens_per_s": self.tokens_per_step / wall_s,
            # optax evaluates the schedule at the count of updates already applied.
            "lr": float(self.lr(step - 1)),
        }
        if "grad_norm" in out:
            record["grad_norm"] = out["grad_norm"]
        if "aux_loss" in out:  # the stages' auxiliary losses, included in "loss"
            record["aux_loss"] = out["aux_loss"]
        if "compiles" in out:  # a step that compiled: the first, or one after a recovery
            record["compiles"] = out["compiles"]
            if "cache_loads" in out:  # of them, loaded from the persistent compilation cache
                record["cache_loads"] = out["cache_loads"]
        if "checkpoint" in out:  # the tiers this step was saved to
            record["checkpoint"] = out["checkpoint"]
        if "events" in out:
            sinks.trace(step, out["events"])
            record["bubble"] = run_log.measured_bubble(out["events"])
        if step in self.scores:
            record["exact_match"] = self.scores[step]
        if step_eval is not None:
            self.eval_loss = record["eval_loss"] = step_eval
            if self._read_state is not None:
                record.update(self._read_state(step, state_by_path(trainer)))
        record.update(self._elastic(trainer))
        self.losses[step] = out["loss"]
        extra = {
            "time": time.time(),
            **self.marks,
            **({"batch_crc32": self._digests.pop(step)} if self._digests is not None else {}),
            **({"peak_bytes": out["peak_bytes"]} if "peak_bytes" in out else {}),
        }
        self.marks = {}
        return record, extra

    def summary(self, trainer: mpmd.Trainer, run_dir: Path, preempted: bool) -> dict:
        """The run's summary (what train.run returns), printed with the report's path and goodput."""
        losses, scores, eval_loss = self.losses, self.scores, self.eval_loss
        summary = {
            "first_loss": losses[min(losses)] if losses else None,
            "last_loss": losses[max(losses)] if losses else None,
            "eval_loss": eval_loss,
            "steps": len(losses),
            "run_dir": str(run_dir),
            "goodput": trainer.goodput(),
            "preempted": preempted,
        }
        if scores:
            summary["exact_match_before"], summary["exact_match"] = scores[min(scores)], scores[max(scores)]
        summary["report"] = str(report_html.write(run_dir))
        matched = f", exact match {summary['exact_match_before']:.3f} -> {summary['exact_match']:.3f}" if scores else ""
        print(
            f"done: {summary['steps']} steps, loss {_fmt(summary['first_loss'])} -> "
            f"{_fmt(summary['last_loss'])}, eval_loss {_fmt(eval_loss)}{matched}; wrote {run_dir}, "
            f"report {summary['report']}"
        )
        print(goodput_line(summary["goodput"]))
        return summary

    def _elastic(self, trainer: mpmd.Trainer) -> dict:
        """The layout changes since the last record ("layout_changes") and, once anything was
        lost, the run's goodput so far ("goodput", cumulative: the last record has the totals)."""
        out = {}
        if len(trainer.layout_changes) > self._logged_changes:
            out["layout_changes"] = trainer.layout_changes[self._logged_changes :]
            self._logged_changes = len(trainer.layout_changes)
        goodput = trainer.goodput()
        if goodput["failures"] or goodput["layout_changes"]:
            out["goodput"] = goodput
        return out


def state_by_path(trainer: mpmd.Trainer) -> dict:
    """{path in the model (blocks.1.mlp.routed): host array} of every stage's state leaf, as
    checkpoints name them (`stage<k>/...` where a stage's parameters cannot say)."""
    pipeline, out = trainer.pipeline, {}
    for k, (fn, leaves) in enumerate(zip(pipeline.fns, trainer.state())):
        if fn.state is not None:
            paths = leaf_paths.state_paths(fn, pipeline.param_paths[k], k, pipeline.scoped_paths)
            out.update({path: leaves[local] for path, local in zip(paths, fn.state.paths)})
    return out


def batch_crc32(batch) -> int:
    """CRC-32 over a batch's arrays, key by key in sorted order (a pair as inputs, targets)."""
    arrays = batch if isinstance(batch, tuple) else [batch[k] for k in sorted(batch)]
    crc = 0
    for a in arrays:
        crc = zlib.crc32(np.ascontiguousarray(a).tobytes(), crc)
    return crc


def goodput_line(g: dict) -> str:
    """The summary's line on time lost to failures and run at reduced width."""
    if not g["failures"] and not g["layout_changes"]:
        return "goodput: no worker lost"
    return (
        f"goodput: {g['failures']} worker(s) lost, {g['lost_s']:.1f} s lost (aborted steps and detection "
        f"{g['aborted_s']:.1f} s, replacing {g['replace_s']:.1f} s, waiting for capacity "
        f"{g['capacity_s']:.1f} s, relayout {g['relayout_s']:.1f} s, "
        f"restore {g['restore_s']:.1f} s, {g['replayed_steps']} replayed step(s) {g['replayed_s']:.1f} s); "
        f"{g['reduced_width_s']:.1f} s on fewer slices, {g['layout_changes']} layout change(s)"
    )


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def record_run(
    cfg: Config, trainer: mpmd.Trainer, micro: tuple, source: tuple[str | None, list[str]], memory: dict | None = None
) -> Path:
    """Writes what the run directory holds before the first step: config.yaml (resolved), the
    tokenizer's copy and run.json (mpmd.report.record; `micro`: one microbatch as (inputs,
    targets) or (batch dict, None); `memory`: its predicted memory, if traced already);
    returns the directory."""
    run_dir = Path(cfg.run_dir)
    config_lib.dump(cfg, run_dir / "config.yaml")
    tok = tokenizer_lib.of_config(cfg)
    tokenizer_lib.save_to_run(tok, run_dir)
    report_record.write_run_info(
        run_dir,
        trainer.pipeline,
        trainer.optimizer,
        trainer.schedule,
        *micro,
        *source,
        tokenizer={"spec": tok.spec, "hash": tok.hash, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id},
        layout=trainer.programs.layout,
        memory=memory,
    )
    return run_dir
