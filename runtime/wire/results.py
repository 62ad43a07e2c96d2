"""What a slice's run gives back, and the errors a run ends with: the types both sides of
the control plane share (the executor makes them, runtime/worker/; the control plane and the
in-process cluster hand them to the Trainer, runtime/control/). They live here, below both,
so neither side imports the other.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Event(NamedTuple):
    """One traced interval on a slice; times are wall-clock ns (comparable across processes).
    The one definition: the dry run, the control plane and the run log all use this one."""

    name: str  # a Run's label, "recv <key>" or "send <key>"
    kind: str  # "run" | "recv" | "send"
    start_ns: int
    end_ns: int


class StepResult(NamedTuple):
    fetched: dict[str, tuple[np.ndarray, ...]]
    events: tuple[Event, ...]
    wall_s: float  # time from the step's start to its last fetched array being ready
    # The most receives outstanding at once (posted, their Recv not yet walked) and the most
    # bytes they held at once: what the receive window bounds.
    peak_held: int = 0
    peak_held_bytes: int = 0
    # Traced runs only: the most bytes of the slice's buffers plus its outstanding receives
    # at once, looked at between instructions (what the slice's memory for data peaks at,
    # XLA's temporaries and sends not yet pulled aside).
    peak_bytes: int = 0
    # Executables XLA built in the slice's process during the run (0 once its programs are
    # warm: runtime/worker/compile_cache.py backend_compiles), and the program calls a hot
    # spare warms: {program: [signature]} of each program's first call since it was loaded and
    # of every call that compiled (runtime/worker/programs.py signature).
    compiles: int = 0
    compiled: dict | None = None
    # Of `compiles`, the executables loaded from JAX's persistent compilation cache rather
    # than compiled (a resumed run's or a new worker's first step, on a machine that ran the
    # same programs before: compile_cache.persistent_loads).
    cache_loads: int = 0


class Aborted(RuntimeError):
    """The step was aborted (a peer slice was lost); the slice's buffers are undefined."""


class Progress(NamedTuple):
    """Where a slice's walk stands, for the watchdog: run id, instructions done in it, and
    what it does now ("idle", "run" a program, "recv" waiting for a peer, "fetch")."""

    run: int
    done: int
    doing: str


class StepFailed(RuntimeError):
    """Slice `slice_index` raised while running `instruction` of a step (e.g. "train[12] F2/3",
    "fetch loss/0"); the step was aborted everywhere. Deterministic: replaying it would fail
    the same way, so the Trainer does not recover from it."""

    def __init__(self, slice_index: int, instruction: str, message: str):
        super().__init__(f"slice {slice_index} failed at {instruction}: {message}")
        self.slice_index = slice_index
        self.instruction = instruction
        self.message = message

    def __reduce__(self):
        return StepFailed, (self.slice_index, self.instruction, self.message)
