"""Per-stage checkpoints of a pipeline and recovery after a lost slice.

Each stage's parameters and optimizer state are saved by the slice that holds them, under
`<run_dir>/checkpoints/<step>/stage_<k>/`; the step is committed by its manifest once every
slice has finalized its saves (runtime/checkpoint.py). Saves are asynchronous: a step's
arrays are copied to host memory when it is saved, written while training goes on, and the
manifest follows from a background thread. One save is in flight at a time.

Restore is all or nothing: every slice reads its part of a step aside (a staged restore)
and every slice switches to it only once all have read theirs; otherwise the next older
committed step is tried. A step that fails is moved aside as damaged once an older one
restores. When committed steps exist but none restores, restore raises CheckpointError
naming each step and why: a run never starts over from step 0 over its own checkpoints.

A save that fails (a full or read-only disk) is retried once with the state at hand, then
raises CheckpointError: training stops after the last committed step instead of computing
steps it cannot keep. What a failed save wrote is removed.
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


class CheckpointError(RuntimeError):
    """The run's checkpoints cannot be used: no committed step restores, or saves keep failing."""


class StageCheckpoints:
    def __init__(self, run_dir, cluster, placement: tuple[int, ...], partition: dict, keep: int,
                 asynchronous: bool, max_failed_saves: int = 1, layouts: dict | None = None):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer (committed checkpoints to keep), got {keep!r}")
        if not isinstance(max_failed_saves, int) or max_failed_saves < 0:
            raise ValueError(f"max_failed_saves must be a non-negative integer (retries of a failed "
                             f"save), got {max_failed_saves!r}")
        self.store = CheckpointStore(os.path.abspath(run_dir))   # workers may not share our cwd
        self.cluster = cluster
        self.placement = placement          # stage -> slice: which slice saves which stage
        self.num_slices = max(placement) + 1
        self.partition = partition          # what a restored run must match: stages, placement
        # {buffer: layout per array} on its slice's mesh: a restore lays the saved arrays out
        # so, whatever mesh saved them (Orbax reads each device's part).
        self.layouts = dict(layouts or {})
        self.keep = keep
        self.asynchronous = asynchronous
        self._commit: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(self.num_slices, thread_name_prefix="mpmd-ckpt")
        self.last_save_s = {}
        self.max_failed_saves = max_failed_saves
        self.failed_saves = 0                        # failed saves in a row
        self._failure: tuple[int, str] | None = None  # (step, why) of a failed save not yet retried

    def _items(self, step: int, slice_index: int) -> dict[str, list[str]]:
        d = self.store.step_dir(step)
        return {str(d / names.stage_dir(k)): [names.params(k), names.opt_state(k)]
                for k, r in enumerate(self.placement) if r == slice_index}

    def save(self, step: int, data_state, extra: dict, wait: bool = False) -> None:
        """Snapshot every stage at `step`; commit when all slices finalized their writes.

        A save that failed before (found here) or fails now while waited for is retried with
        the state at hand until max_failed_saves retries are spent; then CheckpointError."""
        self.wait()
        while True:
            self._check_failures()
            if step in self.store.committed():
                return   # the same step after a replay: identical state, already committed
            self._save(step, data_state, extra)
            if self.asynchronous and not wait:   # committed in the background
                return
            self.wait()
            if self._failure is None:
                return

    def failed(self) -> bool:
        """Whether a save failed and awaits its retry (without waiting for one in flight)."""
        return self._failure is not None and (self._commit is None or not self._commit.is_alive())

    def _check_failures(self) -> None:
        if self._failure is None:
            return
        step, why = self._failure
        if self.failed_saves > self.max_failed_saves:
            last = self.latest()
            raise CheckpointError(
                f"checkpoint of step {step} failed: {why} (after {self.failed_saves - 1} "
                f"retries, max_failed_saves={self.max_failed_saves}); stopped, the last committed "
                f"step is {last if last is not None else 'none'}")
        log.warning("checkpoint of step %d failed (%s); retrying", step, why)
        self._failure = None

    def _failed(self, step: int, error: BaseException) -> None:
        why = _short(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        self.store.discard(step)
        self.failed_saves += 1
        self._failure = (step, why)

    def _save(self, step: int, data_state, extra: dict) -> None:
        t0 = time.perf_counter()
        slices = range(self.num_slices)
        try:
            self.store.prepare(step)
            # One slice after another: Orbax keeps process-wide state, and two saves started at
            # once in one process (the in-process cluster) collide on their temporary directories.
            for r in slices:
                self.cluster.save(r, self._items(step, r))
        except WorkerLost:
            raise
        except Exception as e:   # the controller or a slice could not write (EROFS, ENOSPC, ...)
            self._wait_all(slices)
            self._failed(step, e)
            return
        manifest = {"partition": self.partition, "data_state": data_state, **extra}
        self.last_save_s = {"snapshot_s": time.perf_counter() - t0}

        def commit():
            t1 = time.perf_counter()
            try:
                self._wait_all(slices, raise_first=True)
                self.store.commit(step, manifest)
            except WorkerLost as e:   # a slice died while writing: this step stays uncommitted
                log.warning("checkpoint of step %d not committed: %s", step, e)
                return
            except Exception as e:
                self._failed(step, e)
                return
            self.failed_saves = 0
            try:
                self.store.prune(self.keep)
            except OSError as e:
                log.warning("could not prune old checkpoints: %s", e)
            self.last_save_s["finalize_s"] = time.perf_counter() - t1

        if self.asynchronous:
            self._commit = threading.Thread(target=commit, daemon=True, name=f"mpmd-commit-{step}")
            self._commit.start()
        else:
            commit()

    def _wait_all(self, slices, raise_first: bool = False) -> None:
        """Until every slice's saves are finalized or failed (finalize concurrently); the first
        error, if asked, once all are done: a failed step is removed only when nobody writes."""
        futures = [self._pool.submit(self.cluster.wait_saves, r) for r in slices]
        errors = [f.exception() for f in futures]
        lost = [e for e in errors if isinstance(e, WorkerLost)]
        first = (lost or [e for e in errors if e is not None] or [None])[0]
        if raise_first and first is not None:
            raise first

    def wait(self) -> None:
        """Until the save in flight, if any, is committed (or failed)."""
        if self._commit is not None:
            self._commit.join()
            self._commit = None

    def latest(self) -> int | None:
        steps = self.store.committed()
        return steps[-1] if steps else None

    def restore_latest(self):
        """Restore every slice from the newest committed step that restores on all of them.

        Returns (step, manifest), or None when there is no checkpoint at all. A step whose
        manifest does not match this pipeline raises ValueError; a damaged step is skipped
        with a warning naming it, and moved aside once an older step restored. CheckpointError
        when checkpoints exist but none restores (nothing is moved then).
        """
        self.wait()
        failed = dict(self.store.damaged())   # step -> why
        for step, why in failed.items():
            log.warning("skipping checkpoint step %d: %s", step, why)
        for step in reversed(self.store.committed()):
            manifest = self.store.manifest(step)
            if manifest.get("partition") != self.partition:
                raise ValueError(f"checkpoint step {step} in {self.store.root} was saved by a different "
                                 f"pipeline: {manifest.get('partition')}, this one is {self.partition}")
            why = self._restore_all(step)
            if why is None:
                for bad, bad_why in failed.items():
                    self.store.quarantine(bad, bad_why)
                return step, manifest
            log.warning("skipping checkpoint step %d: %s", step, why)
            failed[step] = why
        if failed:
            steps = "; ".join(f"step {s}: {_short(w)}" for s, w in sorted(failed.items(), reverse=True))
            raise CheckpointError(f"no checkpoint in {self.store.root} can be restored ({steps}); "
                                  f"nothing was trained or changed: move the damaged steps away or "
                                  f"use another run_dir")
        aside = self.store.quarantined()
        if aside:
            raise CheckpointError(f"{self.store.root} holds only checkpoints set aside as damaged "
                                  f"({', '.join(p.name for p in aside)}); refusing to start over "
                                  f"from step 0 over them: remove them or use another run_dir")
        return None

    def _restore_all(self, step: int) -> str | None:
        """Stage `step` on every slice, then switch every slice to it; or switch none and say why."""
        slices = range(self.num_slices)
        try:
            for r in slices:
                items = self._items(step, r)
                layouts = {n: self.layouts[n] for ns in items.values() for n in ns if n in self.layouts}
                self.cluster.restore(r, items, staged=True, layouts=layouts)
        except WorkerLost:
            raise            # the slice is gone, not the checkpoint
        except Exception as e:
            for r in slices:
                self.cluster.finish_restore(r, commit=False)
            return str(e)
        for r in slices:
            self.cluster.finish_restore(r, commit=True)
        return None


def _short(why: str, limit: int = 400) -> str:
    """A reason fit for a one-line message: tensorstore's spec dropped, the middle of a long
    one cut (its start says what failed, its end the OS error)."""
    why = why.split(" [tensorstore_spec=")[0]
    return why if len(why) <= limit else f"{why[:limit // 2]} ... {why[-limit // 2:]}"
