"""Per-stage checkpoints of a pipeline and recovery after a lost slice.

Each stage's parameters and optimizer state are saved by the slice that holds them, under
`<run_dir>/checkpoints/<step>/stage_<k>/`; the step is committed by its manifest once every
slice has finalized its saves (runtime/checkpoint.py). Saves are asynchronous: a step's
arrays are copied to host memory when it is saved, written while training goes on, and the
manifest follows from a background thread. One save is in flight at a time.
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
import time

from mpmd import names
from runtime.checkpoint import CheckpointStore
from runtime.cluster import WorkerLost

log = logging.getLogger("mpmd")


class Rewound(Exception):
    """A slice was lost and replaced; every slice now holds the state after step `step`.

    The caller rewinds its data to `data_state` (what it passed when that step was saved)
    and goes on: the steps after `step` are replayed, so each update lands exactly once.
    """

    def __init__(self, step: int, data_state, lost: str):
        super().__init__(f"recovered from {lost}; resuming after step {step}")
        self.step = step
        self.data_state = data_state


class StageCheckpoints:
    def __init__(self, run_dir, cluster, placement: tuple[int, ...], partition: dict, keep: int,
                 asynchronous: bool):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer (committed checkpoints to keep), got {keep!r}")
        self.store = CheckpointStore(os.path.abspath(run_dir))   # workers may not share our cwd
        self.cluster = cluster
        self.placement = placement          # stage -> slice: which slice saves which stage
        self.num_slices = max(placement) + 1
        self.partition = partition          # what a restored run must match: stages, placement
        self.keep = keep
        self.asynchronous = asynchronous
        self._commit: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(self.num_slices, thread_name_prefix="mpmd-ckpt")
        self.last_save_s = {}

    def _items(self, step: int, slice_index: int) -> dict[str, list[str]]:
        d = self.store.step_dir(step)
        return {str(d / names.stage_dir(k)): [names.params(k), names.opt_state(k)]
                for k, r in enumerate(self.placement) if r == slice_index}

    def save(self, step: int, data_state, extra: dict) -> None:
        """Snapshot every stage at `step`; commit when all slices finalized their writes."""
        self.wait()
        if step in self.store.committed():
            return       # the same step after a replay: identical state, already committed
        self.store.prepare(step)
        t0 = time.perf_counter()
        slices = range(self.num_slices)
        # One slice after another: Orbax keeps process-wide state, and two saves started at
        # once in one process (the in-process cluster) collide on their temporary directories.
        for r in slices:
            self.cluster.save(r, self._items(step, r))
        manifest = {"partition": self.partition, "data_state": data_state, **extra}
        self.last_save_s = {"snapshot_s": time.perf_counter() - t0}

        def commit():
            t1 = time.perf_counter()
            try:
                list(self._pool.map(self.cluster.wait_saves, slices))   # finalize concurrently
            except Exception as e:   # a slice died while writing: this step stays uncommitted
                log.warning("checkpoint of step %d not committed: %s", step, e)
                return
            self.store.commit(step, manifest)
            self.store.prune(self.keep)
            self.last_save_s["finalize_s"] = time.perf_counter() - t1

        if self.asynchronous:
            self._commit = threading.Thread(target=commit, daemon=True, name=f"mpmd-commit-{step}")
            self._commit.start()
        else:
            commit()

    def wait(self) -> None:
        """Until the save in flight, if any, is committed (or failed)."""
        if self._commit is not None:
            self._commit.join()
            self._commit = None

    def latest(self) -> int | None:
        steps = self.store.committed()
        return steps[-1] if steps else None

    def restore_latest(self):
        """Restore every slice from the newest committed step that restores completely.

        Returns (step, manifest), or None when no step does. A step whose manifest does not
        match this pipeline raises; a damaged step is skipped with a warning naming it.
        """
        self.wait()
        for step in reversed(self.store.committed()):
            manifest = self.store.manifest(step)
            if manifest.get("partition") != self.partition:
                raise ValueError(f"checkpoint step {step} in {self.store.root} was saved by a different "
                                 f"pipeline: {manifest.get('partition')}, this one is {self.partition}")
            try:
                for r in range(self.num_slices):
                    self.cluster.restore(r, self._items(step, r))
            except WorkerLost:
                raise            # the slice is gone, not the checkpoint
            except Exception as e:
                log.warning("skipping checkpoint step %d: %s", step, e)
                continue
            return step, manifest
        return None
