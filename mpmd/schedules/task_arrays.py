"""A schedule's task lists as flat numpy arrays: what a generator builds and what the
validator, simulator and lowering read at scale.

A pipeline of p = 1,024 slices and m = 8,192 microbatches has 16 M (1F1B) to 50 M (ZB-V)
tasks; as one Python object per task that is ~12 GB and minutes to build, as three arrays
(stage int32, microbatch int32, kind int8) it is 9 bytes a task. `TaskArrays` still reads
as what `Schedule.slices` always was, a sequence of per-slice task tuples, but a slice's
`Task`s are made only when someone indexes or iterates it (small schedules, tests, the
renderer); the fast paths use `.stage`, `.microbatch`, `.kind` and `.offsets`.

Kinds are coded F=0, B=1, W=2 (KIND_CODES), so a task's identity (stage, mb, kind) packs
into one integer `identity = (kind * num_stages + stage) * num_microbatches + mb`, the
index the validator and simulator use for per-task tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"
KINDS = (FORWARD, BACKWARD, WEIGHT)
KIND_CODES = {kind: code for code, kind in enumerate(KINDS)}


class Task(NamedTuple):
    stage: int  # global stage index 0..num_stages-1
    microbatch: int
    # "F" forward, "B" backward, "W" weight gradient. In a schedule with split_backward=False
    # "B" is the full backward (input and weight gradients) and there are no "W" tasks; with
    # split_backward=True "B" is the input gradient only and "W" the weight gradient.
    kind: str

    def __str__(self) -> str:
        return f"{self.kind}(stage={self.stage}, mb={self.microbatch})"


class TaskArrays(Sequence):
    """Slice r's tasks are entries offsets[r]:offsets[r+1] of stage / microbatch / kind."""

    __slots__ = ("stage", "microbatch", "kind", "offsets")

    def __init__(self, stage, microbatch, kind, offsets):
        self.stage = np.asarray(stage, dtype=np.int32)
        self.microbatch = np.asarray(microbatch, dtype=np.int32)
        self.kind = np.asarray(kind, dtype=np.int8)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        assert self.stage.shape == self.microbatch.shape == self.kind.shape == (int(self.offsets[-1]),)

    @staticmethod
    def from_slices(slices) -> "TaskArrays":
        """Arrays of any per-slice task lists (Task or (stage, mb, kind) tuples); a kind
        outside F/B/W is coded -1 so the validator can name the task."""
        lengths = [len(tasks) for tasks in slices]
        flat = [task for tasks in slices for task in tasks]
        stage = np.fromiter((t[0] for t in flat), dtype=np.int64, count=len(flat))
        mb = np.fromiter((t[1] for t in flat), dtype=np.int64, count=len(flat))
        kind = np.fromiter((KIND_CODES.get(t[2], -1) for t in flat), dtype=np.int8, count=len(flat))
        # Out-of-range stages or microbatches must survive the int32 cast as out-of-range.
        stage, mb = (np.clip(a, -1, np.iinfo(np.int32).max) for a in (stage, mb))
        return TaskArrays(stage, mb, kind, np.concatenate(([0], np.cumsum(lengths))))

    @property
    def num_tasks(self) -> int:
        return int(self.offsets[-1])

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def slice_of_each(self) -> np.ndarray:
        """The slice each task sits on, int32, aligned with `.stage`."""
        return np.repeat(np.arange(len(self), dtype=np.int32), self.lengths())

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, r):
        if isinstance(r, slice):
            return tuple(self[i] for i in range(*r.indices(len(self))))
        r = range(len(self))[r]
        a, b = int(self.offsets[r]), int(self.offsets[r + 1])
        return tuple(
            Task(s, j, KINDS[k])
            for s, j, k in zip(self.stage[a:b].tolist(), self.microbatch[a:b].tolist(), self.kind[a:b].tolist())
        )

    def __eq__(self, other) -> bool:
        if isinstance(other, TaskArrays):
            return all(
                np.array_equal(a, b)
                for a, b in zip(
                    (self.stage, self.microbatch, self.kind, self.offsets),
                    (other.stage, other.microbatch, other.kind, other.offsets),
                )
            )
        return tuple(self) == other

    __hash__ = None

    def __repr__(self) -> str:
        return f"TaskArrays({len(self)} slices, {self.num_tasks} tasks)"


def as_arrays(slices) -> TaskArrays:
    """`Schedule.slices` as arrays: itself when a generator built it, else converted."""
    return slices if isinstance(slices, TaskArrays) else TaskArrays.from_slices(slices)


def occurrence_rank(codes: np.ndarray) -> np.ndarray:
    """For each entry, how many earlier entries hold the same code: the microbatch of a
    task in a slice whose stages each run their F (and B, and W) in microbatch order.
    One running count per distinct code (a slice has at most 3 x its stages of them)."""
    rank = np.empty(len(codes), dtype=np.int32)
    if not len(codes):
        return rank
    low = codes.min()
    local = (codes - low).astype(np.intp)
    for code in np.flatnonzero(np.bincount(local)):
        hit = local == code
        rank[hit] = np.arange(np.count_nonzero(hit), dtype=np.int32)
    return rank
