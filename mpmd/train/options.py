"""The Trainer's option records: what its checkpoint coordinator and its recovery policy are
configured with. One record per part, each rule checked once, here, when the record is made;
the Python API (`mpmd.Trainer(checkpoint=mpmd.Checkpointing(every=50), ...)`) and the
recipe's config sections (`checkpoint.*`, `cluster.on_loss` ...) both build these records, so
a rule lives in one place. Errors name the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math

ON_LOSS = ("replace", "shrink", "auto")
ON_NONFINITE = ("stop", "rewind")
# Why on_nonfinite="skip" (leave the step's update out) cannot be: a slice applies its update
# in the same program as its backward, before its loss and gradient norm reach the controller.
NO_SKIP = (
    "'skip' is not supported: each slice applies a step's update in the same program as its "
    "backward, before the loss and gradient norm reach the controller, so the update cannot be "
    "left out afterwards; use 'rewind' (restore the last committed step and go on) or 'stop'"
)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """Both checkpoint tiers. `every`: steps between persistent (Orbax) checkpoints, 0 = only
    when `Trainer.save` is called (needs the Trainer's run_dir when > 0); `keep`: newest
    committed checkpoints kept on disk; `asynchronous`: saves are written while training goes
    on; `max_failed_saves`: saves that may fail after a failed one before training stops;
    `memory_every`: steps between in-memory snapshots copied to a peer slice, 0 = none;
    `metadata`: JSON-able entries written into every manifest (e.g. a config hash);
    `digests`: record each saved leaf's digest and check it on restore (off only to measure
    what it costs)."""

    every: int = 0
    keep: int = 2
    asynchronous: bool = True
    max_failed_saves: int = 1
    memory_every: int = 0
    metadata: dict = dataclasses.field(default_factory=dict)
    digests: bool = True

    def __post_init__(self):
        if not _is_int(self.every) or self.every < 0:
            raise ValueError(
                f"every must be a non-negative integer (steps between checkpoints; 0: only "
                f"when asked), got {self.every!r}"
            )
        if not _is_int(self.keep) or self.keep < 1:
            raise ValueError(f"keep must be a positive integer (committed checkpoints to keep), got {self.keep!r}")
        if not isinstance(self.asynchronous, bool):
            raise ValueError(f"asynchronous must be True or False, got {self.asynchronous!r}")
        if not _is_int(self.max_failed_saves) or self.max_failed_saves < 0:
            raise ValueError(
                f"max_failed_saves must be a non-negative integer (retries of a failed save), "
                f"got {self.max_failed_saves!r}"
            )
        if not _is_int(self.memory_every) or self.memory_every < 0:
            raise ValueError(
                f"memory_every must be a non-negative integer (steps between in-memory "
                f"snapshots; 0: none), got {self.memory_every!r}"
            )
        if not isinstance(self.digests, bool):
            raise ValueError(f"digests must be True or False, got {self.digests!r}")
        if not isinstance(self.metadata, dict):
            raise ValueError(f"metadata must be a dict of JSON-able values, got {type(self.metadata).__name__}")


@dataclasses.dataclass(frozen=True)
class Recovery:
    """What a lost slice leads to. `on_loss`: replace = a new worker or stop; shrink = go on
    with the same stages on the survivors (back to every slice at a checkpoint once workers
    start again); auto = replace if one comes within `replace_timeout_s`, else shrink.
    `max_restarts`: recoveries within any `restart_window_s` seconds before the run gives up
    (recoveries older than the window stop counting, so a long run that recovers and trains on
    is not charged for them forever; None = the whole run); `slice_memory_bytes`: the most bytes a
    layout on fewer slices may hold on one slice, None = not checked.
    `on_nonfinite`: a step whose loss or gradient norm is not finite is never committed, and
    then stop = the run ends (NonFinite names the step; the last committed step is kept);
    rewind = restore the last committed step and go on (Rewound), once per step: the same
    step non-finite again stops (a deterministic NaN would loop)."""

    on_loss: str = "auto"
    replace_timeout_s: float = 60.0
    max_restarts: int = 3
    restart_window_s: float | None = 3600.0
    slice_memory_bytes: int | None = None
    on_nonfinite: str = "stop"

    def __post_init__(self):
        if self.on_nonfinite == "skip":
            raise ValueError(f"on_nonfinite: {NO_SKIP}")
        if self.on_nonfinite not in ON_NONFINITE:
            raise ValueError(
                f"on_nonfinite must be one of {', '.join(map(repr, ON_NONFINITE))} (a step whose "
                f"loss or gradient norm is not finite: end the run, or restore the last committed "
                f"step and go on), got {self.on_nonfinite!r}"
            )
        if self.on_loss not in ON_LOSS:
            raise ValueError(
                f"on_loss must be one of {', '.join(map(repr, ON_LOSS))} (what to do when a slice "
                f"is lost: replace it, continue on the survivors, or replace if a worker "
                f"comes within replace_timeout_s and else continue on the survivors), got {self.on_loss!r}"
            )
        if (
            not isinstance(self.replace_timeout_s, (int, float))
            or isinstance(self.replace_timeout_s, bool)
            or not 0 <= self.replace_timeout_s < math.inf
        ):
            raise ValueError(
                f"replace_timeout_s must be a finite number of seconds >= 0 (how long a "
                f"replacement is waited for; 0: one try), got {self.replace_timeout_s!r}"
            )
        if not _is_int(self.max_restarts) or self.max_restarts < 0:
            raise ValueError(
                f"max_restarts must be a non-negative integer (recoveries before giving up), got {self.max_restarts!r}"
            )
        if self.restart_window_s is not None and (
            not isinstance(self.restart_window_s, (int, float))
            or isinstance(self.restart_window_s, bool)
            or not 0 < self.restart_window_s < math.inf
        ):
            raise ValueError(
                f"restart_window_s must be a finite number of seconds > 0 (max_restarts counts the "
                f"recoveries within that many seconds) or None (the whole run), "
                f"got {self.restart_window_s!r}"
            )
        if self.slice_memory_bytes is not None and (
            not _is_int(self.slice_memory_bytes) or self.slice_memory_bytes < 1
        ):
            raise ValueError(
                f"slice_memory_bytes must be a positive integer (the bytes a layout on fewer "
                f"slices may use on one slice) or None (not checked), got {self.slice_memory_bytes!r}"
            )
