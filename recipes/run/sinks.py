"""Where a run's step records go: metrics.jsonl (every key), TensorBoard and Weights & Biases
(the scalars), the console's progress, trace.json (the traced steps' events). One object the
training loop hands each record to, in the manner of torchtitan's MetricsProcessor; the loop
never names a sink."""

from __future__ import annotations

from pathlib import Path

from mpmd.recipes.config import Config
from mpmd.recipes.run import run_log


class Sinks:
    """The sinks of one run from `start_step` on (metric lines after it are dropped: their
    steps are about to be redone)."""

    def __init__(self, cfg: Config, run_dir: Path, tokens_per_step: int, start_step: int):
        self.every = cfg.log.every
        self.metrics = run_log.MetricsLog(run_dir)
        self.metrics.truncate_after(start_step)
        self.boards = ([run_log.TensorBoard(run_dir)] if cfg.log.tensorboard else []) + (
            [run_log.WandB(run_dir, cfg.log.wandb_project, cfg.model_dump(mode="json"))] if cfg.log.wandb else []
        )
        self.progress = run_log.Progress(cfg.train.steps, tokens_per_step, cfg.log.progress, cfg.log.every, start_step)
        self._trace_path = run_dir / "trace.json"
        self._traces: dict[int, list] = {}

    def message(self, text: str) -> None:
        """A line on the console (and in controller.log) between the progress lines."""
        self.progress.message(text)

    def trace(self, step: int, events: list) -> None:
        """A traced step's events, written at once, so a report of the run in progress shows it."""
        self._traces[step] = events
        run_log.write_trace(self._trace_path, self._traces)

    def rewind(self, step: int) -> None:
        """Steps after `step` will be redone: their metric lines go."""
        self.metrics.truncate_after(step)

    def write(self, step: int, record: dict, extra: dict) -> None:
        """`record` (scalars and eval results) to every sink; `extra` (when it was logged, what
        happened before, the batch's CRC, peak bytes per slice) to metrics.jsonl only."""
        self.metrics.write(step, {**record, **extra})
        for board in self.boards:
            board.write(step, record)
            if step % self.every == 0:
                board.flush()
        self.progress.update(step, record)

    def close(self) -> None:
        self.progress.close()
        for board in self.boards:
            board.close()
